"""Every drafter × every prompt category: τ and speedup, each row its own paired run against plain decoding
on that category's prompts (the table of the draft-training issue)."""
from __future__ import annotations

import itertools

from specjax import api
from specjax.eval import bench
from specjax.speculative import registry as drafter_registry
from experiments.common import pick_prompts


def spread(prompts, n: int):
  """At most ``n`` prompts, taken in turn from each category among them (so 'mt_bench' gives a column of
  MT-bench's eight categories alike), each category's in file order."""
  by_cat: dict = {}
  for p in prompts:
    by_cat.setdefault(p.category, []).append(p)
  out = [p for group in itertools.zip_longest(*by_cat.values()) for p in group if p is not None]
  return out[:n]


def drafter_table(model: str = "smollm2-135m", prompts: str = "specjax-prompts",
                  categories=("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                              "humanities", "translation", "summarization", "qa"),
                  per_category: int = 4, drafters=({"label": "ngram", "drafter": "ngram", "k": 5},),
                  max_new_tokens: int = 128, max_len: int = 2048, repeats: int = 1, log=print) -> dict:
  """``categories``: one table column each (a Spec-Bench group such as ``mt_bench`` counts as one), with
  ``per_category`` prompts spread over its sub-categories.  ``drafters``: dicts with a ``label`` and
  ``speculative_method`` settings (``drafter``, ``k``, ``tree``, ``draft``: a model name/path for ``model``,
  a trained drafter's directory for ``eagle``, ...)."""
  m = api.load(model)
  eos = tuple(m.tokenizer.eos_token_ids)
  loaded = {}
  rows = []
  for cat in categories:
    chosen = spread(pick_prompts(prompts, [cat]), per_category)
    batches = bench.make_batches(m, chosen, 1, max_new_tokens, max_len)
    for spec in drafters:
      spec = dict(spec)
      label = spec.pop("label", spec.get("drafter"))
      draft = spec.pop("draft", None)
      if drafter_registry.get(spec.get("drafter")).draft_model and draft is not None:
        draft = loaded.setdefault(draft, api.load(draft))
      log(f"[drafter_table] {cat}: {label} ({len(chosen)} prompts)")
      ar, (r,) = bench.compare(m, batches, [spec], max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=eos,
                               draft=draft, repeats=repeats, log=log)
      rows.append({"category": cat, "drafter": label, "prompts": len(chosen),
                   "ar_tokens_per_s": round(ar["ar_tokens_per_s"], 2),
                   "tokens_per_s": round(r["spec_tokens_per_s"], 2), "speedup": round(r["speedup"], 3),
                   "speedup_median": r.get("speedup_median"), "mean_accepted_length": round(
                       r["mean_accepted_length"], 3),
                   "acceptance_by_position": [round(a, 3) for a in r["acceptance_by_position"]],
                   "draft_ms": r.get("draft_ms"), "verify_ms": r.get("verify_ms")})
  return {"title": f"drafters × categories: {model}, greedy, {max_new_tokens} new tokens, batch 1",
          "rows": rows, "summary": {"drafters": [d.get("label", d.get("drafter")) for d in drafters]},
          "plots": [{"file": "speedup.png", "x": "category", "y": "speedup", "group": "drafter", "kind": "bar",
                     "title": "speedup vs plain decoding, per category (paired, same run per row)"},
                    {"file": "tau.png", "x": "category", "y": "mean_accepted_length", "group": "drafter",
                     "kind": "bar", "title": "mean accepted length τ per category"}]}
