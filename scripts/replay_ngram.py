"""Replay n-gram prompt lookup offline on greedy outputs: τ and predicted speedup for each k and match cap.

  python scripts/replay_ngram.py --prompts FILE [--category summarization] [--limit N] [--ks 3,4,5,6,8]
         [--caps none,1:3,1:2,2:3,0:3,1:5] [--json]

Greedy speculative decoding commits exactly the greedy output, so running the drafter over that output gives
the τ a real run measures — for every drafter setting, from one plain generation per prompt.  The drafter is
the engine's own ``NgramDrafter.propose`` inside the engine's own step stages (``speculative.replay``: jitted,
all prompts at once, only the tokens known at each step).  A step that drafts r - 1 tokens costs a verification with r live rows;
those costs are measured on the model (``bench.time_draft_and_verify``, at the median prompt), and
``predicted_speedup`` = τ × cost(1 row) ÷ mean cost(rows of each step).  Caps are written ``1:3`` (at most 1
draft after a 1-token match, 3 after a 2-token one) or ``none``.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import specjax
from specjax import api
from specjax.eval import bench
from specjax.models import buffers, sampling
from specjax import speculative as spec
from specjax.prompts import load_prompts
from specjax.speculative import replay as rp


def parse_caps(text: str) -> tuple[int, ...]:
  return () if text == "none" else tuple(int(c) for c in text.split(":"))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--prompts", default="specjax-prompts")
  ap.add_argument("--category", default=None)
  ap.add_argument("--limit", type=int, default=None)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--ngram", type=int, default=3)
  ap.add_argument("--ks", default="3,4,5,6,8")
  ap.add_argument("--caps", default="none,1:3,1:2,2:3,0:3,0:2,1:5")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()

  m = specjax.load(args.model)
  prompts = load_prompts(args.prompts, [args.category] if args.category else None, limit=args.limit)
  encoded = api.encode_prompts(m, prompts)
  outs, _ = specjax.generate(m, prompts, max_new_tokens=args.max_new_tokens, progress=True)
  P = np.array([len(e) for e in encoded])
  ends = P + np.array([len(o.token_ids) for o in outs])
  seq = np.zeros((len(prompts), int(ends.max()) + max(map(int, args.ks.split(","))) + 1), np.int32)
  for i, (e, o) in enumerate(zip(encoded, outs)):
    seq[i, :ends[i]] = e + o.token_ids

  ks = [int(k) for k in args.ks.split(",")]
  K = max(ks)
  median = int(np.argsort(P)[len(P) // 2])
  arr, lens = buffers.pad_batch([encoded[median]], 1)
  engine = api.make_engine(m, spec.NgramDrafter(args.ngram), K, sampling.SamplingParams(), (), 2048)
  _, t_rows = bench.time_draft_and_verify(m, engine, (), arr, lens, 2048)
  print("[replay] verify ms by live rows: " + ", ".join(f"{r}: {t * 1e3:.1f}" for r, t in t_rows.items()),
        file=sys.stderr)

  greedy = sampling.SamplingParams()
  known = rp.record(m.params, m.cfg, seq, P, ends, greedy)      # greedy n-gram: the tokens alone, no forward
  results = []
  for k in ks:
    for caps_text in args.caps.split(","):
      drafter = spec.NgramDrafter(args.ngram, match_caps=parse_caps(caps_text))
      stats = rp.replay(api.make_engine(m, drafter, k, greedy, (), seq.shape[1]), m.params, (), known).stats
      tau = rp.tau(stats)
      by_rows = np.asarray(stats.verify_rows_N1, np.float64)        # steps with 1, 2, ... live rows
      rows = np.arange(1, len(by_rows) + 1)
      mean_cost = float(np.dot(by_rows, [t_rows[r] for r in rows]) / by_rows.sum())
      results.append({"k": k, "caps": caps_text, "tau": tau, "steps": int(by_rows.sum()),
                      "mean_rows": float(np.dot(by_rows, rows) / by_rows.sum()),
                      "predicted_speedup": tau * t_rows[1] / mean_cost})
      r = results[-1]
      print(f"[replay] k={k} caps={caps_text:>5}: tau {tau:.3f}, mean rows {r['mean_rows']:.2f}, "
            f"predicted speedup {r['predicted_speedup']:.3f}", file=sys.stderr, flush=True)
  if args.json:
    print(json.dumps({"model": args.model, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "verify_ms_by_rows": {str(r): t * 1e3 for r, t in t_rows.items()}, "results": results},
                     indent=2))


if __name__ == "__main__":
  main()
