"""What the server's per-request sampling costs a decoding step: the continuous batcher in process, with the
same requests decoded by a batcher whose (greedy) setting is compiled in, by a per-request batcher with greedy
requests, and by a per-request batcher with a mix of settings.

  python scripts/probes/per_request_cost.py [--model smollm2-135m] [--requests 16] [--max-tokens 64]
      [--modes fixed,greedy,temperature,mixed]

Modes: ``fixed`` greedy compiled in; ``greedy`` per-request, all greedy; ``temperature`` ½ greedy, ½ T 0.7;
``mixed`` ¼ each of greedy, T 0.7, T 1.0 top-p 0.9, T 0.8 top-k 20 (each request seeded).

Prints one JSON line per mode: tokens, wall seconds, tok/s, steps and seconds per step.
"""
import argparse
import json
import time

from specjax import api
from specjax.models import sampling
from specjax.prompts import load_prompts
from specjax.serving import batcher as bt, factory

MIXES = {"fixed": None, "greedy": [None],
         "temperature": [None, sampling.SamplingParams(0.7)],
         "mixed": [None, sampling.SamplingParams(0.7), sampling.SamplingParams(1.0, 0, 0.9),
                   sampling.SamplingParams(0.8, 20)]}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--requests", type=int, default=16)
  ap.add_argument("--max-tokens", type=int, default=64)
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--modes", default="fixed,greedy,temperature,mixed")
  args = ap.parse_args()
  m = api.load(args.model)
  enc = [m.tokenizer.encode_chat(p.text) for p in load_prompts("specjax-prompts", None)][:args.requests]
  for mode in args.modes.split(","):
    mix = MIXES[mode]
    eng = factory.make_batcher(m, drafter="ngram", policy="fixed", k=args.k, slots=args.slots, max_len=1024,
                               per_request=mix is not None)
    eng.warmup(max(len(e) for e in enc))
    reqs = [bt.Request(e, args.max_tokens, rid=i, seed=i, sampling=mix[i % len(mix)] if mix else None)
            for i, e in enumerate(enc)]
    t0 = time.perf_counter()
    rep = eng.run(reqs)
    dt = time.perf_counter() - t0
    print(json.dumps({"mode": mode, "tokens": rep["tokens"], "wall_s": round(dt, 2),
                      "tok_s": round(rep["tokens"] / dt, 2), "steps": rep["steps"],
                      "s_per_step": round(dt / rep["steps"], 4)}), flush=True)


if __name__ == "__main__":
  main()
