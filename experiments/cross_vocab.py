"""Drafting across tokenizers: draft models of other tokenizers (SmolLM2-135M, Gemma 3 270M) against the target's
own sibling (Qwen2.5-Coder-0.5B) and prompt lookup, for Qwen2.5-Coder-1.5B — one paired run per prompt set, every
method interleaved with plain decoding prompt by prompt.  Each row says τ, α, the speedup (totals and the paired
median with its interval) and, for a draft of another tokenizer, the mapped share of both vocabularies and of the
target's greedy output (the tokens such a draft could have proposed)."""
from __future__ import annotations

from specjax import api
from specjax.errors import SpecjaxError
from specjax.eval import bench
from experiments.common import prompt_set_batches


def _output_share(outputs, target_ids) -> float | None:
  """The share of plain decoding's output tokens that a draft of this map could propose."""
  mapped = set(int(t) for t in target_ids)
  toks = [t for batch in outputs for seq in (batch or []) for t in seq]
  return round(sum(t in mapped for t in toks) / len(toks), 4) if toks else None


def _row(prompt_set: str, label: str, r: dict, vm, outputs) -> dict:
  row = {"prompts": prompt_set, "method": label, "mean_accepted_length": round(r["mean_accepted_length"], 3),
         "acceptance_rate": round(r["acceptance_rate"], 3), "speedup": round(r["speedup"], 3),
         "speedup_median": r.get("speedup_median"), "speedup_ci95": r.get("speedup_ci95"),
         "tokens_per_s": round(r["spec_tokens_per_s"], 2), "draft_ms": round(r["draft_ms"], 1),
         "verify_ms": round(r["verify_ms"], 1), "outputs_identical": f"{r['outputs_identical']}/{r['outputs_compared']}",
         "acceptance_by_position": [round(a, 3) for a in r["acceptance_by_position"]]}
  if vm is not None:
    row.update(width=vm.width, mapped_tokens=vm.mapped, target_share=round(vm.target_share, 4), draft_share=round(vm.draft_share, 4),
               output_share=_output_share(outputs, vm.target_ids))
  return row


def cross_vocab(model: str = "qwen2.5-coder-1.5b", prompt_sets=(), drafts=(), k: int = 4, ngram_k: int = 5,
                max_new_tokens: int = 128, max_len: int = 1024, weights: str = "auto", repeats: int = 1,
                log=print) -> dict:
  """``prompt_sets``: dicts {"name", "prompts" (a file by path), and optionally "categories", "per_category",
  "limit"}, each its own paired run.  ``drafts``: dicts {"label", "draft" (a model name or path), and
  optionally "width" (a draft of another tokenizer: draft tokens each target token is read as)}, each a chain
  of ``k`` through ``--drafter model`` (across tokenizers where its tokenizer is another); prompt lookup
  (chain of ``ngram_k``) runs beside them."""
  if not prompt_sets or not drafts:
    raise SpecjaxError("cross_vocab needs prompt_sets and drafts (see configs/cross_vocab.gin)")
  m = None
  rows, loaded = [], {}
  for ps in prompt_sets:
    m, batches, chosen = prompt_set_batches(ps, m, model, max_new_tokens, max_len, weights, log)
    for d in drafts:           # a draft read at another width is a model of its own (its own map)
      key = (d["draft"], d.get("width"))
      if key not in loaded:
        loaded[key] = api.load(d["draft"], dtype=str(m.dtype), weights=weights)
        if d.get("width") is not None:
          api.vocabulary_map(m, loaded[key], api.drafter_registry.get("model"), width=d["width"])
    specs = [{"drafter": "model", "k": k, "draft": loaded[d["draft"], d.get("width")]} for d in drafts]
    specs.append({"drafter": "ngram", "k": ngram_k})
    labels = [d["label"] for d in drafts] + [f"n-gram k={ngram_k}"]
    log(f"[cross_vocab] {ps['name']}: {len(chosen)} prompts, {len(specs)} methods paired with plain decoding")
    ar, results = bench.compare(m, batches, specs, max_new_tokens=max_new_tokens, max_len=max_len,
                                eos_ids=tuple(m.tokenizer.eos_token_ids), repeats=repeats, log=log)
    plain_outputs = ar["outputs"][0]
    for label, d, r in zip(labels, list(drafts) + [None], results):
      draft = loaded[d["draft"], d.get("width")] if d is not None else None
      vm = None if draft is None else api.vocabulary_map(m, draft, api.drafter_registry.get("model"))
      rows.append(_row(ps["name"], label, r, vm, plain_outputs))
    log(f"[cross_vocab] {ps['name']}: plain {ar['ar_tokens_per_s']:.2f} tok/s")
  return {"title": f"drafting across tokenizers for {model}: chain k={k}, greedy, {max_new_tokens} new tokens, "
                   "batch 1", "rows": rows,
          "summary": {"model": model, "k": k, "ngram_k": ngram_k, "weights": weights},
          "plots": [{"file": "tau.png", "x": "prompts", "y": "mean_accepted_length", "group": "method", "kind": "bar",
                     "title": "mean accepted length τ"},
                    {"file": "speedup.png", "x": "prompts", "y": "speedup", "group": "method", "kind": "bar",
                     "title": "speedup vs plain decoding (paired)"}]}
