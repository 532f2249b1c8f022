"""Speed at temperature 0 and 1, the two settings papers print: for each prompt set and each temperature, one
paired run of plain decoding and every drafter on the same prompts (each prompt batch sampled from its own key,
the same for every method), giving the speedup with its bootstrap interval, τ and α per row.

At T = 0 a row also says whether its outputs equal plain decoding's; at T = 1 they differ by design (the
distribution is the target's, tests/speculative/test_lossless_trees.py and friends prove it), so only the speeds,
τ and α are comparable."""
from __future__ import annotations

from specjax import api
from specjax.errors import SpecjaxError
from specjax.eval import bench
from specjax.models.sampling import SamplingParams
from specjax.speculative import registry as drafter_registry
from experiments.common import prompt_set_batches


def _spec(method: dict, loaded: dict, m, weights: str) -> tuple[str, dict]:
  """(label, ``speculative_method`` keywords) for one method dict; a draft model named by ``draft`` is loaded
  once and shared by every row that names it."""
  spec = dict(method)
  label = spec.pop("label", spec.get("drafter"))
  draft = spec.get("draft")
  if draft is not None and drafter_registry.get(spec.get("drafter")).draft_model:
    if draft not in loaded:
      loaded[draft] = api.load(draft, dtype=str(m.dtype), weights=weights)
    spec["draft"] = loaded[draft]
  return label, spec


def _row(prompt_set: str, temperature: float, label: str, ar: dict, r: dict) -> dict:
  greedy = temperature == 0.0
  return {"prompts": prompt_set, "temperature": temperature, "method": label,
          "setting": f"{prompt_set} T={temperature:g}",
          "ar_tokens_per_s": round(ar["ar_tokens_per_s"], 2), "tokens_per_s": round(r["spec_tokens_per_s"], 2),
          "speedup": round(r["speedup"], 3), "speedup_median": r.get("speedup_median"),
          "speedup_ci95": r.get("speedup_ci95"), "mean_accepted_length": round(r["mean_accepted_length"], 3),
          "acceptance_rate": round(r["acceptance_rate"], 3),
          "acceptance_by_position": [round(a, 3) for a in r["acceptance_by_position"]],
          "draft_ms": round(r["draft_ms"], 1), "verify_ms": round(r["verify_ms"], 1),
          "outputs_identical": (f"{r['outputs_identical']}/{r['outputs_compared']}" if greedy else
                                "sampled (differs by design)")}


def sampled_speed(model: str = "qwen2.5-coder-1.5b", prompt_sets=(), methods=(), temperatures=(0.0, 1.0),
                  top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128, max_len: int = 1024,
                  weights: str = "auto", seed: int = 0, repeats: int = 1, log=print) -> dict:
  """``prompt_sets``: dicts {"name", "prompts" (a file by path), and optionally "categories", "per_category",
  "limit"}.  ``methods``: dicts {"label", "drafter", and ``speculative_method`` settings: "k", "tree", "draft" (a
  model name or path for ``model``, a trained drafter's directory for ``eagle``), "verify", ...}.  Every method of
  a prompt set and temperature runs in one paired run with plain decoding at that temperature."""
  if not prompt_sets or not methods:
    raise SpecjaxError("sampled_speed needs prompt_sets and methods (see configs/sampled_speed.gin)")
  m, rows, loaded = None, [], {}
  for ps in prompt_sets:
    m, batches, chosen = prompt_set_batches(ps, m, model, max_new_tokens, max_len, weights, log)
    labelled = [_spec(meth, loaded, m, weights) for meth in methods]
    for t in temperatures:
      sampling = SamplingParams(temperature=float(t), top_k=top_k, top_p=top_p)
      log(f"[sampled_speed] {ps['name']} at T={t:g}: {len(chosen)} prompts, {len(labelled)} methods paired with "
          "plain decoding")
      ar, results = bench.compare(m, batches, [s for _, s in labelled], max_new_tokens=max_new_tokens,
                                  max_len=max_len, eos_ids=tuple(m.tokenizer.eos_token_ids), repeats=repeats,
                                  log=log, sampling=sampling, seed=seed)
      rows += [_row(ps["name"], float(t), label, ar, r) for (label, _), r in zip(labelled, results)]
      log(f"[sampled_speed] {ps['name']} at T={t:g}: plain {ar['ar_tokens_per_s']:.2f} tok/s")
  return {"title": f"speed at T = {', '.join(f'{t:g}' for t in temperatures)}: {model} ({weights} weights), "
                   f"{max_new_tokens} new tokens, batch 1, paired", "rows": rows,
          "summary": {"model": model, "weights": weights, "temperatures": [float(t) for t in temperatures],
                      "top_p": top_p, "top_k": top_k, "seed": seed,
                      "methods": [label for label, _ in labelled] if rows else []},
          "plots": [{"file": "speedup.png", "x": "setting", "y": "speedup", "group": "method", "kind": "bar",
                     "title": "speedup vs plain decoding at the same temperature (paired)"},
                    {"file": "tau.png", "x": "setting", "y": "mean_accepted_length", "group": "method",
                     "kind": "bar", "title": "mean accepted length τ"}]}
