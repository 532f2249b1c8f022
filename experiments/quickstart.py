"""Quickstart: plain decoding vs each drafter on the default real model and the built-in prompt set."""
from __future__ import annotations

from specjax import api
from specjax.eval import bench
from experiments.common import pick_prompts, setup


def quickstart(model: str = "smollm2-135m", prompts: str = "specjax-prompts", categories=None,
               per_category: int = 1, max_new_tokens: int = 64, max_len: int = 2048, dtype: str = "auto",
               drafters=("ngram", "layerskip"), k: int = 4, ngram: int = 3, draft_layers=None,
               draft: str | None = None, ngram_caps=api.DEFAULT_NGRAM_CAPS, repeats: int = 1,
               mesh: str | None = None, log=print) -> dict:
  """Greedy chat replies to ``per_category`` prompts of each category: plain decoding and each drafter on
  the same prompts in the same run, interleaved prompt by prompt (τ, α, speedup with its median and
  interval); plus the replies themselves.  ``mesh`` ('DATAxMODEL'): everything sharded over that many
  devices (docs/guides/multi-device.md)."""
  chosen = pick_prompts(prompts, categories, per_category)
  m, d, batches = setup(model, chosen, 1, max_new_tokens, max_len, dtype=dtype, draft=draft, mesh=mesh, log=log)
  eos = tuple(m.tokenizer.eos_token_ids)
  outputs, _ = api.generate(m, chosen, max_new_tokens=max_new_tokens, max_len=max_len)
  specs = [{"drafter": name, "k": k, "ngram": ngram, "draft_layers": draft_layers, "ngram_caps": ngram_caps}
           for name in drafters]
  ar, results = bench.compare(m, batches, specs, max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=eos,
                              draft=d, repeats=repeats, log=log)
  rows = [{"method": "autoregressive", "tokens_per_s": ar["ar_tokens_per_s"], "speedup": 1.0,
           "mean_accepted_length": 1.0, "acceptance_rate": None,
           "roofline_fraction": ar["roofline_fraction"]}]
  for name, r in zip(drafters, results):
    rows.append({"method": f"{name} (k={k})", "tokens_per_s": r["spec_tokens_per_s"], "speedup": r["speedup"],
                 "speedup_median": r["speedup_median"], "speedup_ci95": r["speedup_ci95"],
                 "mean_accepted_length": r["mean_accepted_length"], "acceptance_rate": r["acceptance_rate"],
                 "predicted_speedup": r["predicted_speedup"], "efficiency": r["efficiency"]})
  return {
      "title": f"quickstart: {model}, {len(chosen)} prompts, greedy, {max_new_tokens} new tokens, batch 1"
               + (f", {mesh} mesh" if mesh else ""),
      "rows": rows,
      "summary": {"ar_tokens_per_s": ar["ar_tokens_per_s"], "roofline_fraction": ar["roofline_fraction"],
                  "read_bandwidth_gbs": ar["read_bandwidth_gbs"]},
      "outputs": [{"question_id": o.question_id, "category": p.category, "prompt": p.text, "reply": o.text}
                  for o, p in zip(outputs, chosen)],
      "plots": [{"file": "speedup.png", "x": "method", "y": "speedup", "kind": "bar",
                 "title": "speedup over plain decoding (same prompts, same run)"}],
  }
