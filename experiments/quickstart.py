"""Quickstart: decode the built-in prompt set on the default real model and report speed per category."""
from __future__ import annotations

import collections

from specjax import api
from specjax.prompts import load_prompts


def quickstart(model: str = "smollm2-135m", prompts: str = "specjax-prompts",
               categories: list[str] | None = None, per_category: int = 2, max_new_tokens: int = 64,
               batch_size: int = 1, max_len: int = 2048, dtype: str = "float32", log=print) -> dict:
  """Greedy chat replies to ``per_category`` prompts of each category; tokens/s per category."""
  selected = load_prompts(prompts, categories)
  by_cat: dict[str, list] = collections.defaultdict(list)
  for p in selected:
    if len(by_cat[p.category]) < per_category:
      by_cat[p.category].append(p)
  chosen = [p for ps in by_cat.values() for p in ps]
  log(f"[quickstart] {len(chosen)} prompts from {len(by_cat)} categories on {model}")
  m = api.load(model, dtype=dtype)
  outputs, stats = api.generate(m, chosen, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                max_len=max_len, progress=True)
  # Per-category speed: time per token is the same loop for all, so report tokens and a shared rate
  rows = []
  for cat, ps in by_cat.items():
    ids = {p.question_id for p in ps}
    outs = [o for o in outputs if o.question_id in ids]
    rows.append({"category": cat, "prompts": len(outs),
                 "mean_prompt_tokens": sum(o.prompt_tokens for o in outs) / len(outs),
                 "mean_new_tokens": sum(len(o.token_ids) for o in outs) / len(outs),
                 "method": "autoregressive", "sample": outs[0].text[:60].replace("\n", " ")})
  rows.append({"category": "all", "prompts": len(outputs), "method": "autoregressive",
               "mean_new_tokens": stats["new_tokens"] / len(outputs), "tokens_per_s": stats["tokens_per_s"],
               "mean_prompt_tokens": stats["prompt_tokens"] / len(outputs)})
  return {
      "title": f"quickstart: {model}, greedy, {max_new_tokens} new tokens, batch {batch_size}",
      "rows": rows,
      "summary": {"tokens_per_s": stats["tokens_per_s"], "new_tokens": stats["new_tokens"],
                  "decode_s": stats["decode_s"], "compile_s": stats["compile_s"]},
      "outputs": [{"question_id": o.question_id, "text": o.text} for o in outputs],
      "plots": [{"file": "new_tokens_by_category.png", "x": "category", "y": "mean_new_tokens",
                 "kind": "bar", "title": "mean reply length by category"}],
  }
