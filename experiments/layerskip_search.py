"""Pick the layers of a layer-skip self-drafter by measurement: τ, draft and verify cost, and the speedup
each candidate subset predicts (and achieves) on the same prompts."""
from __future__ import annotations

from specjax.eval import bench
from experiments.common import pick_prompts, setup


def default_candidates(num_layers: int) -> list[tuple[int, ...]]:
  """First-L prefixes, and the full stack with one contiguous block of middle/late layers skipped."""
  L = num_layers
  cands = [tuple(range(n)) for n in sorted({L // 6, L // 4, L // 3, L // 2, 2 * L // 3}) if n > 0]
  for frac_start, frac_len in [(0.5, 0.25), (0.4, 0.4), (0.33, 0.5), (0.25, 0.5), (0.6, 0.3)]:
    a, n = int(L * frac_start), max(1, int(L * frac_len))
    cands.append(tuple(i for i in range(L) if not a <= i < a + n))
  return list(dict.fromkeys(cands))


def describe(layers: tuple[int, ...], num_layers: int) -> str:
  """A short label: 'first 5' for a prefix, else the skipped ranges, e.g. 'skip 15-21'."""
  layers = tuple(layers)
  if layers == tuple(range(len(layers))):
    return f"first {len(layers)}"
  skipped = [i for i in range(num_layers) if i not in layers]
  runs, start = [], None
  for i in skipped + [None]:
    if start is None:
      start = prev = i
    elif i is not None and i == prev + 1:
      prev = i
    else:
      runs.append(f"{start}" if start == prev else f"{start}-{prev}")
      start = prev = i
  return "skip " + ",".join(runs)


def layerskip_search(model: str = "smollm2-135m", prompts: str = "specjax-prompts", categories=None,
                     per_category: int | None = 1, limit: int | None = None, k: int = 3,
                     max_new_tokens: int = 48, max_len: int = 2048, candidates=None, repeats: int = 1,
                     log=print) -> dict:
  chosen = pick_prompts(prompts, categories, per_category, limit)
  m, _, batches = setup(model, chosen, 1, max_new_tokens, max_len, log=log)
  eos = tuple(m.tokenizer.eos_token_ids)
  subsets = [tuple(layers) for layers in (candidates or default_candidates(m.cfg.num_layers))]
  specs = [{"drafter": "layerskip", "k": k, "draft_layers": list(layers)} for layers in subsets]
  log(f"[layerskip_search] {len(subsets)} subsets, interleaved with plain decoding prompt by prompt")
  ar, results = bench.compare(m, batches, specs, max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=eos,
                              repeats=repeats, log=log)
  rows = []
  for layers, r in zip(subsets, results):
    rows.append({"subset": describe(layers, m.cfg.num_layers), "layers": len(layers),
                 "skipped": [i for i in range(m.cfg.num_layers) if i not in layers],
                 "k": k, "mean_accepted_length": r["mean_accepted_length"],
                 "acceptance_rate": r["acceptance_rate"], "draft_ms": r["draft_ms"], "verify_ms": r["verify_ms"],
                 "predicted_speedup": r["predicted_speedup"], "speedup": r["speedup"],
                 "speedup_median": r["speedup_median"], "speedup_ci95": r["speedup_ci95"],
                 "draft_layers": list(layers)})
  rows.sort(key=lambda r: -r["speedup"])
  best = rows[0]
  return {"title": f"layer-skip search: {model}, k={k}, {len(chosen)} prompts",
          "rows": rows,
          "summary": {"best_draft_layers": best["draft_layers"], "best_speedup": best["speedup"],
                      "best_tau": best["mean_accepted_length"], "ar_tokens_per_s": ar["ar_tokens_per_s"]},
          "plots": [{"file": "layerskip_tau.png", "x": "subset", "y": "mean_accepted_length", "kind": "bar",
                     "title": "τ by draft layer subset", "xlabel": "draft layers"},
                    {"file": "layerskip_speedup.png", "x": "subset", "y": "speedup", "kind": "bar",
                     "title": "measured speedup by draft layer subset", "xlabel": "draft layers"}]}
