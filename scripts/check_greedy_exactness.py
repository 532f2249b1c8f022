"""Greedy exactness on the real model: speculative greedy output equals plain greedy output, token for token,
for every drafter, k and tree, over N prompts of the built-in set, on the kernel path this process resolves.
The ``model`` drafter uses the target itself as its separate draft model (there is no smaller model with the
same tokenizer here): every draft is accepted, which checks the separate-model path and the bonus token.

The path comes from the environment, read once at load (specjax/settings.py): the native CPU kernels
(``SPECJAX_NATIVE=1``), XLA only (``SPECJAX_NATIVE=0``), Pallas attention in interpret mode
(``SPECJAX_NATIVE=0 SPECJAX_ATTENTION=pallas``).

  python scripts/check_greedy_exactness.py [--prompts N] [--max-new-tokens T] [--drafters ngram,layerskip,model]
      [--ks 1,2,4,8] [--trees dynamic:8:2,branch:3,2,1] [--dtype float32|bfloat16] [--out FILE]
Prints one JSON object (and writes it to --out): per (drafter, k or tree) the number of prompts checked, how
many matched, and for each prompt that did not, the index of the first new token that differs.
"""
import argparse
import json
import sys
from pathlib import Path

import jax

import specjax
from specjax import machine
from specjax.prompts import load_prompts
from specjax.speculative import registry as drafter_registry


def first_difference(a, b) -> int:
  """The index of the first token where two outputs differ (the shorter's length when one is a prefix)."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--prompts", type=int, default=20)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--ks", default="1,2,4,8")
  ap.add_argument("--trees", default="", help="tree specs decoded with the n-gram drafter, comma-separated "
                                              "(separate specs with ';' when a spec has commas)")
  ap.add_argument("--draft-layers", default="0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20")
  ap.add_argument("--drafters", default="ngram,layerskip,model")
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--out", default=None, help="also write the JSON here")
  args = ap.parse_args()
  m = specjax.load(args.model, dtype=args.dtype)
  backends = m.cfg.backends
  path = {"attention": backends.attention, "native_matmul": sorted(backends.native_matmul)}
  print(f"[exactness] {args.model} {args.dtype}, attention {path['attention']}, native matmul classes "
        f"{path['native_matmul'] or 'none'}", file=sys.stderr, flush=True)
  prompts = load_prompts("specjax-prompts")[:args.prompts]
  base, _ = specjax.generate(m, prompts, max_new_tokens=args.max_new_tokens)
  runs = [(d, dict(k=int(k))) for d in args.drafters.split(",") if d for k in args.ks.split(",") if k]
  trees = [t for t in (args.trees.split(";") if ";" in args.trees else args.trees.split(",")) if t]
  runs += [("ngram", dict(tree=t)) for t in trees]
  results = []
  for drafter, how in runs:
    self_draft = drafter_registry.get(drafter).draft_model     # a draft-model kind drafts with the target itself
    outs, stats = specjax.generate(m, prompts, max_new_tokens=args.max_new_tokens, drafter=drafter,
                                   draft_layers=args.draft_layers, draft=m if self_draft else None, **how)
    diffs = {i: first_difference(a.token_ids, b.token_ids) for i, (a, b) in enumerate(zip(outs, base))
             if a.token_ids != b.token_ids}
    results.append({"drafter": drafter, **how, "prompts": len(prompts), "identical": len(prompts) - len(diffs),
                    "first_difference_at": diffs, "tau": stats["mean_accepted_length"]})
    label = f"k={how['k']}" if "k" in how else f"tree {how['tree']}"
    print(f"[exactness] {drafter} {label}: {len(prompts) - len(diffs)}/{len(prompts)} identical"
          + (f", first differences at new tokens {sorted(diffs.values())}" if diffs else "")
          + f" (tau {stats['mean_accepted_length']:.2f})", file=sys.stderr, flush=True)
  out = {"model": args.model, "dtype": args.dtype, "path": path, "max_new_tokens": args.max_new_tokens,
         "machine": machine.cpu_name(), "cores": machine.cores(),
         "jax": jax.__version__, "results": results,
         "all_identical": all(r["identical"] == r["prompts"] for r in results)}
  text = json.dumps(out)
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
