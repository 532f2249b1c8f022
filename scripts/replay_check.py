"""Offline replay against the engine on a real model: τ replayed from recorded outputs vs τ decoded.

  python scripts/replay_check.py --model qwen2.5-coder-1.5b --weights int8 --prompts FILE --limit 4 \\
      --max-new-tokens 64 --method "ngram k=4" --method "model k=4" --method "model tree=branch:2,2,1" \\
      --method "model tree=dynamic:8:2:4" [--temperature 1 --replays 20] [--json]

For each method (a drafter name, then ``key=value`` decode settings: k, tree, draft, ngram, draft_layers) it
decodes the prompts speculatively (batch 1, ``specjax.generate``) and replays the same run offline
(``speculative.replay``): greedy from plain decoding's output (decoded depth + 1 tokens past the budget, so the
last step is known), every counter compared; sampled (``--temperature``, chains) over the engine's own outputs,
``--replays`` times with other keys — the engine's τ is one draw of that distribution, so the script prints
the replay's mean and standard deviation and z = (engine − mean) / sd of the total step count.  Only the
drafter runs during replay; the target runs once per prompt, teacher-forced, when a feature drafter or
sampling needs its features or probabilities.
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import numpy as np

import specjax
from specjax import api
from specjax.prompts import load_prompts


def parse_method(text: str) -> dict:
  drafter, *pairs = text.split()
  out = {"drafter": drafter}
  for p in pairs:
    key, _, value = p.partition("=")
    out[key] = int(value) if value.isdigit() else value
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--weights", default="auto")
  ap.add_argument("--draft", default=None, help="the draft model for 'model' methods (default: the registry's)")
  ap.add_argument("--prompts", default="specjax-prompts")
  ap.add_argument("--category", action="append", default=None)
  ap.add_argument("--limit", type=int, default=4)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--method", action="append", default=None)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--replays", type=int, default=20)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  methods = [parse_method(t) for t in (args.method or ["ngram k=4"])]

  m = specjax.load(args.model, weights=args.weights)
  draft = None
  if any(api.drafter_registry.get(x["drafter"]).draft_model and "draft" not in x for x in methods):
    draft = specjax.load(args.draft, weights=args.weights) if args.draft else api.default_draft_model(m)
  prompts = load_prompts(args.prompts, args.category, limit=args.limit)
  encoded = api.encode_prompts(m, prompts)
  M = args.max_new_tokens
  rows = []
  for meth in methods:
    settings = dict(meth)
    dr = settings.get("draft", draft)
    ds = api.decode_spec(temperature=args.temperature, top_p=args.top_p, **{k: v for k, v in settings.items()
                                                                           if k != "draft"})
    d = api.build(m, ds, eos_ids=tuple(m.tokenizer.eos_token_ids), prompt_lens=list(map(len, encoded)),
                  max_new_tokens=M, batch_size=1, draft=dr)
    label = d.label
    outs, stats = specjax.generate(m, prompts, spec_=ds, max_new_tokens=M, max_len=d.max_len, draft=dr,
                                   seed=args.seed)
    tau_engine = stats["mean_accepted_length"]
    if ds.sampling.greedy:
      plain, _ = specjax.generate(m, prompts, max_new_tokens=M + d.engine.depth + 1, max_len=d.max_len)
      same = sum(o.token_ids == p.token_ids[:len(o.token_ids)] for o, p in zip(outs, plain))
      knowns = api.record_outputs(m, d, encoded, [p.token_ids for p in plain])
      got = api.spec_metrics(api.replay_recorded(m, d, encoded, knowns, M))
      row = {"method": label, "sampled": False, "tau_engine": tau_engine, "tau_replay": got["mean_accepted_length"],
             "alpha_engine": stats["acceptance_rate"], "alpha_replay": got["acceptance_rate"],
             "steps_engine": stats["iterations"], "steps_replay": got["iterations"],
             "outputs_equal_plain": f"{same}/{len(outs)}"}
    else:
      knowns = api.record_outputs(m, d, encoded, [o.token_ids for o in outs])
      draws = [api.spec_metrics(api.replay_recorded(m, d, encoded, knowns, M, key=jax.random.PRNGKey(1000 + r)))
               for r in range(args.replays)]
      taus = np.array([g["mean_accepted_length"] for g in draws])
      steps = np.array([g["iterations"] for g in draws], np.float64)
      z = (stats["iterations"] - steps.mean()) / max(steps.std(ddof=1), 1e-9)
      row = {"method": label, "sampled": True, "tau_engine": tau_engine, "tau_replay": float(taus.mean()),
             "tau_replay_sd": float(taus.std(ddof=1)), "steps_engine": stats["iterations"],
             "steps_replay_mean": float(steps.mean()), "steps_replay_sd": float(steps.std(ddof=1)), "z": float(z),
             "replays": args.replays}
    rows.append(row)
    print(f"[replay_check] {json.dumps(row)}", file=sys.stderr, flush=True)
  if args.json:
    print(json.dumps({"model": args.model, "weights": args.weights, "prompts": len(prompts), "max_new_tokens": M,
                      "temperature": args.temperature, "top_p": args.top_p, "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
