"""Time to first token at each weight type: prefill of one prompt plus one new token, per weight type.

  python scripts/probes/prefill_by_weights.py [--model smollm2-135m] [--kinds fp32,bf16,int8,int4] [--repeat 12]
                                       [--runs 5]

The prompt is a fixed English sentence repeated ``--repeat`` times (12: ~210 tokens). Each type is loaded
in turn, warmed up once (compiles), then timed ``--runs`` times with ``api.generate(..., max_new_tokens=1)``.
It prints the minimum and median seconds. docs/benchmarks-log.md ("Quantized weights", the Intel model 207
section) used it to choose dispatch.QUANT_NATIVE_MAX_TOKENS: a prefill block of a quantized model goes to
XLA's dot, and decode and verification stay on the native kernel.
"""
from __future__ import annotations

import argparse
import statistics
import time

from specjax import api

SENTENCE = "The quick brown fox jumps over the lazy dog and then writes a poem about it."


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--kinds", default="fp32,bf16,int8,int4")
  ap.add_argument("--repeat", type=int, default=12, help="times the sentence is repeated in the prompt")
  ap.add_argument("--runs", type=int, default=5)
  args = ap.parse_args()
  prompt = " ".join([SENTENCE] * args.repeat)
  for kind in args.kinds.split(","):
    m = api.load(args.model, weights=kind)
    api.generate(m, [prompt], max_new_tokens=1, ignore_eos=True)     # compile
    times = []
    for _ in range(args.runs):
      t0 = time.perf_counter()
      api.generate(m, [prompt], max_new_tokens=1, ignore_eos=True)
      times.append(time.perf_counter() - t0)
    print(f"{args.model} {kind:5s} prefill + 1 token: min {min(times):.3f} s, median {statistics.median(times):.3f} s",
          flush=True)


if __name__ == "__main__":
  main()
