"""Decode speed with the weights in 2 MB pages (SPECJAX_HUGE_PAGES=1) against the memory-mapped weights, paired.

  python scripts/probes/huge_pages_ab.py [--model qwen2.5-coder-1.5b] [--weights int4] [--tokens 256] [--pairs 8]

Loads the model twice in one process — as it loads by default, and with SPECJAX_HUGE_PAGES=1 (runtime/huge_pages.py)
— then times ``api.generate`` of the same prompt (greedy, EOS ignored; the prompt's prefill included) with
the two alternating, the order swapped every pair.  Prints each side's tok/s and the median of the paired
ratios.  Both models stay resident: the fp32 1.5B needs ~15 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from specjax import api
from specjax.measure import provenance

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="qwen2.5-coder-1.5b")
  ap.add_argument("--weights", default="int4")
  ap.add_argument("--tokens", type=int, default=256)
  ap.add_argument("--pairs", type=int, default=8)
  args = ap.parse_args()
  os.environ.pop("SPECJAX_HUGE_PAGES", None)
  mapped = api.load(args.model, dtype="float32", weights=args.weights)
  os.environ["SPECJAX_HUGE_PAGES"] = "1"
  t0 = time.perf_counter()
  huge = api.load(args.model, dtype="float32", weights=args.weights)
  load_huge_s = time.perf_counter() - t0
  os.environ.pop("SPECJAX_HUGE_PAGES")
  models = {"mapped": mapped, "huge_pages": huge}
  for m in models.values():
    api.generate(m, [PROMPT], max_new_tokens=8)
  tps = {k: [] for k in models}
  for p in range(args.pairs):
    for name in (("mapped", "huge_pages") if p % 2 == 0 else ("huge_pages", "mapped")):
      t0 = time.perf_counter()
      api.generate(models[name], [PROMPT], max_new_tokens=args.tokens, ignore_eos=True)
      tps[name].append(args.tokens / (time.perf_counter() - t0))
      print(f"[huge-pages] pair {p + 1}/{args.pairs}: {name} {tps[name][-1]:.2f} tok/s", flush=True)
  ratio = float(np.median(np.array(tps["huge_pages"]) / np.array(tps["mapped"])))
  print(json.dumps({"model": args.model, "weights": args.weights, "tokens": args.tokens, "pairs": args.pairs,
                    "load_with_huge_pages_s": round(load_huge_s, 2),
                    "tokens_per_s": {k: round(float(np.median(v)), 3) for k, v in tps.items()},
                    "paired_ratio_median": round(ratio, 4), "machine": provenance.describe()}))


if __name__ == "__main__":
  main()
