"""Acceptance vs k: τ, α and speedup for each drafter and k = 1..8, against plain decoding on the same prompts."""
from __future__ import annotations

from specjax import api
from specjax.eval import bench
from experiments.common import pick_prompts, setup


def acceptance_vs_k(model: str = "smollm2-135m", prompts: str = "specjax-prompts", categories=None,
                    per_category: int | None = 1, limit: int | None = None,
                    drafters=("ngram", "layerskip"), ks=(1, 2, 3, 4, 5, 6, 7, 8), max_new_tokens: int = 64,
                    max_len: int = 2048, ngram: int = 3, draft_layers=None, draft: str | None = None,
                    ngram_caps=api.DEFAULT_NGRAM_CAPS, repeats: int = 1, log=print) -> dict:
  chosen = pick_prompts(prompts, categories, per_category, limit)
  m, d, batches = setup(model, chosen, 1, max_new_tokens, max_len, draft=draft, log=log)
  eos = tuple(m.tokenizer.eos_token_ids)
  settings = [(name, k) for name in drafters for k in ks]
  specs = [{"drafter": name, "k": k, "ngram": ngram, "draft_layers": draft_layers, "ngram_caps": ngram_caps}
           for name, k in settings]
  log(f"[acceptance_vs_k] {len(specs)} settings, interleaved with plain decoding prompt by prompt")
  ar, results = bench.compare(m, batches, specs, max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=eos,
                              draft=d, repeats=repeats, log=log)
  rows = [{"drafter": "none", "k": 0, "tokens_per_s": ar["ar_tokens_per_s"], "speedup": 1.0,
           "mean_accepted_length": 1.0, "acceptance_rate": 0.0}]
  for (name, k), r in zip(settings, results):
    rows.append({"drafter": name, "k": k, "tokens_per_s": r["spec_tokens_per_s"], "speedup": r["speedup"],
                 "speedup_median": r["speedup_median"], "speedup_ci95": r["speedup_ci95"],
                 "mean_accepted_length": r["mean_accepted_length"], "acceptance_rate": r["acceptance_rate"],
                 "predicted_speedup": r["predicted_speedup"], "efficiency": r["efficiency"],
                 "draft_ms": r["draft_ms"], "verify_ms": r["verify_ms"],
                 "acceptance_by_position": [round(a, 3) for a in r["acceptance_by_position"]]})
  spec_rows = rows[1:]                       # rows[0] is plain decoding
  best = max(spec_rows, key=lambda r: r["speedup"]) if spec_rows else rows[0]
  return {
      "title": f"acceptance vs k: {model}, {len(chosen)} prompts, greedy, {max_new_tokens} new tokens",
      "rows": rows,
      "summary": {"ar_tokens_per_s": ar["ar_tokens_per_s"], "ar_step_ms": ar["ar_step_ms"],
                  "best": {k_: best[k_] for k_ in ("drafter", "k", "speedup", "mean_accepted_length")}},
      "plots": [{"file": "tau_vs_k.png", "x": "k", "y": "mean_accepted_length", "group": "drafter",
                 "title": "mean accepted length τ vs k"},
                {"file": "speedup_vs_k.png", "x": "k", "y": "speedup", "group": "drafter",
                 "title": "measured speedup vs k (same prompts, same run)"},
                {"file": "alpha_vs_k.png", "x": "k", "y": "acceptance_rate", "group": "drafter",
                 "title": "acceptance rate α vs k"}],
  }
