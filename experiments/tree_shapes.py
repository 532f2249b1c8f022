"""Token-tree shapes vs node budget: for each budget N, a chain, a branching tree, the Sequoia-optimal tree and
a dynamic tree of N draft nodes, each against plain decoding on the same prompts in the same run (paired).

Reports τ (mean accepted length), the measured verify cost with all N+1 rows live, the speedup, and for static
trees the τ the Sequoia model predicts from the acceptance vector (measured first, on the same prompts, by
the code of ``specjax acceptance-vector``; written into the run directory as ``acceptance_vector.json``).
With ``acceptance_depths`` > 1 the measurement is a depth-conditioned table (``tree_shapes`` module doc):
shape ``sequoia`` is then optimal for the table and ``sequoia_flat`` for its first row alone (the
position-independent model of the Sequoia paper), so the two can be compared.
The hardware-aware Sequoia choice N* (``tree_shapes.choose_budget``: predicted τ over the measured cost of a
step, draft + verify at N+1 rows) is reported next to the best measured N.
"""
from __future__ import annotations

from specjax import api
from specjax.eval import bench
from specjax.errors import SpecjaxError
from specjax.measure import calibrate
from specjax.speculative import registry as drafter_registry
from specjax.speculative.trees import specs as shapes_lib
from experiments.common import pick_prompts, setup

SHAPES = ("chain", "branch", "sequoia", "sequoia_flat", "dynamic")


def branch_widths(n: int) -> tuple[int, ...]:
  """``branch:`` widths of a tree with at most n nodes: w chains sharing the root (w = 1 below 2 nodes, 2
  below 16, 4 from 16 on), each n // w deep — exactly n nodes when w divides n."""
  w = 1 if n < 2 else 2 if n < 16 else 4
  return (w,) + (1,) * (n // w - 1)


def tree_spec(shape: str, n: int, sequoia_depth: int | None = None, dynamic_top_k: int = 4) -> str:
  """The ``--tree`` text of a shape with a budget of n draft nodes."""
  if shape == "chain":
    return f"chain:{n}"
  if shape == "branch":
    return "branch:" + ",".join(map(str, branch_widths(n)))
  if shape in ("sequoia", "sequoia_flat"):
    return f"sequoia:{n}" + (f":{sequoia_depth}" if sequoia_depth else "")
  if shape == "dynamic":
    return f"dynamic:{n}:{dynamic_top_k}"
  raise SpecjaxError(f"unknown tree shape '{shape}' in tree_shapes.shapes: use {', '.join(SHAPES)}")


def _check(shapes, budgets, drafter: str) -> None:
  kind = drafter_registry.get(drafter)
  if not (kind.speculates and kind.trees):
    raise SpecjaxError(f"tree_shapes.drafter is '{drafter}': trees need one of {', '.join(drafter_registry.TREE_NAMES)}")
  for s in shapes:
    tree_spec(s, 1)
  if not budgets or any(not isinstance(n, int) or n < 1 for n in budgets):
    raise SpecjaxError(f"tree_shapes.budgets must be node counts >= 1, got {list(budgets or [])}")


def _row(shape: str, budget: int, r: dict, ar: dict) -> dict:
  return {"shape": shape, "budget": budget, "nodes": r["nodes"], "tree": r["tree"],
          "depth": len(r["acceptance_by_depth"]), "mean_accepted_length": r["mean_accepted_length"],
          "predicted_mean_accepted_length": r.get("predicted_mean_accepted_length"),
          "verify_ms_full": r["verify_ms_full"], "verify_ms": r["verify_ms"], "draft_ms": r["draft_ms"],
          "speedup": r["speedup"], "speedup_median": r["speedup_median"], "speedup_ci95": r["speedup_ci95"],
          "predicted_speedup": r["predicted_speedup"], "tokens_per_s": r["spec_tokens_per_s"],
          "ar_tokens_per_s": ar["ar_tokens_per_s"], "ar_step_ms": ar["ar_step_ms"],
          "acceptance_by_depth": [round(a, 3) for a in r["acceptance_by_depth"]]}


def sequoia_choice(acc, rows: list[dict], max_depth: int | None) -> dict | None:
  """N* = argmax predicted τ / (draft + verify at N+1 rows, measured) over the Sequoia rows, next to the N
  whose Sequoia tree measured fastest."""
  seq = [r for r in rows if r["shape"] == "sequoia"]
  if acc is None or not seq:
    return None
  cost_s = {r["nodes"]: (r["draft_ms"] + r["verify_ms_full"]) / 1e3 for r in seq}
  n_star, table = shapes_lib.choose_budget(acc, cost_s, max_depth)
  ar_step_s = sum(r["ar_step_ms"] for r in seq) / len(seq) / 1e3
  best = max(seq, key=lambda r: r["speedup"])
  return {"n_star": n_star, "best_measured_nodes": best["nodes"], "best_measured_speedup": best["speedup"],
          "table": [{"nodes": n, "predicted_tau": tau, "cost_ms": c * 1e3,
                     "predicted_speedup": tau * ar_step_s / c} for n, tau, c, _ in table]}


def tree_shapes(model: str = "smollm2-135m", prompts: str = "specjax-prompts", categories=("summarization",),
                per_category: int | None = None, limit: int | None = None, budgets=(2, 4, 8, 16, 32),
                shapes=SHAPES, drafter: str = "ngram", ngram: int = 3, ngram_caps=api.DEFAULT_NGRAM_CAPS,
                draft_layers=None, draft: str | None = None, max_new_tokens: int = 64, max_len: int = 2048,
                ranks: int = 8, acceptance_depths: int = 1, sequoia_depth: int | None = None,
                dynamic_top_k: int = 4, repeats: int = 1, log=print) -> dict:
  shapes, budgets = tuple(shapes), tuple(budgets)
  _check(shapes, budgets, drafter)
  for n in budgets:     # every tree fits the buffer: fail before loading anything
    api.resolve_tree(tree_spec("chain", n), drafter=drafter, max_len=max_len)
  chosen = pick_prompts(prompts, categories, per_category, limit)
  m, d, batches = setup(model, chosen, 1, max_new_tokens, max_len, draft=draft, log=log)
  eos = tuple(m.tokenizer.eos_token_ids)
  drafter_kw = {"drafter": drafter, "ngram": ngram, "ngram_caps": ngram_caps, "draft_layers": draft_layers}
  measured = None
  if {"sequoia", "sequoia_flat"} & set(shapes):
    log(f"[tree_shapes] measuring the acceptance vector ({ranks} ranks, {acceptance_depths} depth(s)) on the "
        "same prompts")
    measured = api.acceptance_vector(m, chosen, ranks=ranks, depths=acceptance_depths,
                                     max_new_tokens=max_new_tokens, max_len=max_len, draft=d, **drafter_kw)
    for i, row in enumerate(measured.get("acceptance_table", [measured["acceptance_vector"]])):
      log(f"[tree_shapes] acceptance vector, depth {i + 1}: " + " ".join(f"{a:.3f}" for a in row))
  acc = measured.get("acceptance_table", measured["acceptance_vector"]) if measured else None
  # Every static tree gets the table (for predicted τ); sequoia_flat is built from the depth-1 row alone.
  acc_by_shape = {"dynamic": None, "sequoia_flat": measured["acceptance_vector"] if measured else None}
  bandwidth = calibrate.measure_read_bandwidth()        # once: only the roofline uses it
  rows = []
  for n in budgets:
    trees = [(s, tree_spec(s, n, sequoia_depth, dynamic_top_k)) for s in shapes]
    specs = [{**drafter_kw, "tree": t, "acceptance": acc_by_shape.get(s, acc)} for s, t in trees]
    log(f"[tree_shapes] N = {n}: {', '.join(t for _, t in trees)}, interleaved with plain decoding")
    ar, results = bench.compare(m, batches, specs, max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=eos,
                                draft=d, repeats=repeats, bandwidth=bandwidth, log=log)
    rows += [_row(s, n, r, ar) for (s, _), r in zip(trees, results)]
  choice = sequoia_choice(acc, rows, sequoia_depth)
  if choice:
    log(f"[tree_shapes] hardware-aware Sequoia budget N* = {choice['n_star']}; best measured Sequoia N = "
        f"{choice['best_measured_nodes']} (speedup {choice['best_measured_speedup']:.3f})")
  best = max(rows, key=lambda r: r["speedup"])
  return {
      "title": f"tree shapes: {model}, {drafter}, {len(chosen)} prompts, greedy, {max_new_tokens} new tokens",
      "rows": rows,
      "summary": {"best": {k: best[k] for k in ("shape", "tree", "nodes", "speedup", "mean_accepted_length")},
                  "sequoia_choice": choice, "acceptance_vector": acc},
      "files": {"acceptance_vector.json": measured} if measured else {},
      "plots": [{"file": "tau_vs_nodes.png", "x": "nodes", "y": "mean_accepted_length", "group": "shape",
                 "title": "mean accepted length τ vs draft nodes N"},
                {"file": "speedup_vs_nodes.png", "x": "nodes", "y": "speedup", "group": "shape",
                 "title": "measured speedup vs draft nodes N (same prompts, same run)"},
                {"file": "verify_ms_vs_nodes.png", "x": "nodes", "y": "verify_ms_full", "group": "shape",
                 "title": "verify forward with N+1 rows (ms)"}],
  }
