"""Token ids of greedy generations on the real models, to show that a refactor changes no behaviour.

Run it once on the commit before a change and once after, then compare:

  python scripts/token_ids_snapshot.py --out before.json       # (on the old checkout: PYTHONPATH=<old tree>)
  python scripts/token_ids_snapshot.py --out after.json
  python scripts/token_ids_snapshot.py --compare before.json after.json

It decodes the project's built-in prompts (the first ``--prompts``, default 20) for ``--tokens`` new tokens
with no drafter, prompt lookup and a draft model, on SmolLM2-135M (its draft model is itself) and on the coder
pair (Qwen2.5-Coder-1.5B with its 0.5B draft), in float32, batch 1.  Greedy speculative decoding reproduces
plain greedy decoding, so besides before == after it also reports whether every drafter agrees with ``none``.
It uses only ``specjax.api`` calls that the code base has kept across the refactor (``load``, ``generate``,
``load_prompts``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

DRAFTERS = ("none", "ngram", "model")
MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b")


def snapshot(models, drafters, n_prompts: int, tokens: int) -> dict:
  from specjax import api
  try:
    from specjax.prompts import load_prompts       # the package root since the floor plan
  except ImportError:                                # older checkouts kept it elsewhere
    from specjax.api import load_prompts
  prompts = load_prompts("specjax-prompts", limit=n_prompts)
  out = {"prompts": [p.question_id for p in prompts], "runs": {}}
  for name in models:
    m = api.load(name, dtype="float32")
    # The draft model drafter runs SmolLM2 as its own draft; the coder pair's is the catalog's 0.5B (None).
    draft_for = {"model": m if name == "smollm2-135m" else None}
    for drafter in drafters:
      t0 = time.perf_counter()
      gens, stats = api.generate(m, prompts, max_new_tokens=tokens, drafter=drafter, k=4,
                                 draft=draft_for.get(drafter))
      out["runs"][f"{name}/{drafter}"] = [g.token_ids for g in gens]
      print(f"{name:20s} {drafter:6s} {time.perf_counter() - t0:6.1f} s  tau={stats.get('tau', 0):.2f}",
            flush=True)
  return out


def compare(a_path: str, b_path: str) -> int:
  a, b = (json.load(open(p)) for p in (a_path, b_path))
  bad = 0
  for run, ids in a["runs"].items():
    other = b["runs"].get(run)
    same = other == ids
    n_diff = sum(x != y for x, y in zip(ids, other or []))
    print(f"{run:30s} {'identical' if same else f'DIFFERENT ({n_diff} of {len(ids)} prompts)'}")
    bad += not same
  for run in b["runs"]:
    model = run.split("/")[0]
    if run in b["runs"] and f"{model}/none" in b["runs"] and b["runs"][run] != b["runs"][f"{model}/none"]:
      print(f"  note: {run} differs from {model}/none")
  print("all identical" if not bad else f"{bad} runs differ")
  return 1 if bad else 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", help="write the snapshot here (JSON)")
  ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  ap.add_argument("--prompts", type=int, default=20)
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--drafters", default=",".join(DRAFTERS))
  args = ap.parse_args(argv)
  if args.compare:
    return compare(*args.compare)
  if not args.out:
    ap.error("give --out FILE or --compare BEFORE AFTER")
  snap = snapshot(args.models.split(","), args.drafters.split(","), args.prompts, args.tokens)
  with open(args.out, "w") as f:
    json.dump(snap, f)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
