"""Greedy exactness on the real model: speculative greedy output equals plain greedy output, token for token,
for every drafter and k, over N prompts of the built-in set.  The ``model`` drafter uses the target itself as
its separate draft model (there is no smaller model with the same tokenizer here): every draft is accepted,
which checks the separate-model path and the bonus token.

  python scripts/check_greedy_exactness.py [--prompts N] [--max-new-tokens T] [--drafters ngram,layerskip,model]
Prints one JSON object: per (drafter, k) the number of prompts checked and how many matched.
"""
import argparse
import json
import sys

import specjax
from specjax.prompts import load_prompts


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--prompts", type=int, default=20)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--ks", default="1,2,4,8")
  ap.add_argument("--draft-layers", default="0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20")
  ap.add_argument("--drafters", default="ngram,layerskip,model")
  args = ap.parse_args()
  m = specjax.load(args.model)
  prompts = load_prompts("specjax-prompts")[:args.prompts]
  base, _ = specjax.generate(m, prompts, max_new_tokens=args.max_new_tokens)
  results = []
  for drafter in args.drafters.split(","):
    for k in [int(x) for x in args.ks.split(",")]:
      outs, stats = specjax.generate(m, prompts, max_new_tokens=args.max_new_tokens, drafter=drafter, k=k,
                                     draft_layers=args.draft_layers, draft=m if drafter == "model" else None)
      same = sum(a.token_ids == b.token_ids for a, b in zip(outs, base))
      results.append({"drafter": drafter, "k": k, "prompts": len(prompts), "identical": same,
                      "tau": stats["mean_accepted_length"]})
      print(f"[exactness] {drafter} k={k}: {same}/{len(prompts)} identical (tau {stats['mean_accepted_length']:.2f})",
            file=sys.stderr, flush=True)
  print(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens, "results": results,
                    "all_identical": all(r["identical"] == r["prompts"] for r in results)}))


if __name__ == "__main__":
  main()
