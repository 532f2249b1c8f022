"""The coder pair: Qwen2.5-Coder-1.5B verified against drafts of its 0.5B sibling and of the framework's other
drafters, all paired against plain decoding on the same code tasks in one run.

Methods (each a row; ``group`` and ``x`` place it in the plots):
  model chain k        the 0.5B drafts a chain of k = 1..8
  model sequoia N      the Sequoia-optimal tree of N nodes for the pair's acceptance table (measured first on the
                       same prompts, ``api.acceptance_vector`` with ``acceptance_depths`` depths)
  model dynamic N      a tree chosen every step from the 0.5B's scores (EAGLE-2 style), N nodes
  ngram chain k / trie prompt lookup as a chain, and as a trie merging several earlier continuations
  suffix chain k       suffix decoding over the earlier requests and this one (``suffix_ks``)
  layerskip k          the target's own first layers as the draft
  hybrid chain k       prompt lookup where the last ``hybrid_match`` tokens occurred before, the 0.5B elsewhere
                       (``speculative.hybrid``)
  LABEL chain k / LABEL dynamic N   each trained feature drafter in ``heads`` ({label: directory}, e.g. the
                       sequential head of configs/eagle_qwen_coder.gin and its parallel twin) as a chain of each
                       of ``head_ks`` (a parallel head: those within its positions) and as each of ``head_trees``
  LABEL+lookup chain k a sequential head with prompt lookup where the last ``hybrid_match`` tokens repeat
                       (``speculative.eagle_lookup``), for each of ``head_hybrid_ks``
  model@W chain k      the 0.5B at each weight type W of ``draft_weights`` (e.g. int8 beside an fp32 target);
                       ``head_weights`` likewise sets the trained heads' type (default: the target's)

Beside each chain's measured speedup stands the cost model's prediction (``costmodel.predicted_speedup`` on
this machine's calibration, ``specjax calibrate``, with the measured per-position acceptance and the draft's
config), and every row says whether its outputs equal plain decoding's token for token.
"""
from __future__ import annotations

import numpy as np

from specjax import api
from specjax.eval import bench
from specjax.measure import costmodel
from specjax.models import quant
from specjax.errors import SpecjaxError
from specjax.speculative import registry as drafter_registry
from experiments.common import pick_prompts, setup


def method_specs(ks=(1, 2, 3, 4, 5, 6, 7, 8), sequoia_budgets=(), dynamic_budgets=(), dynamic_top_k: int = 2,
                 dynamic_depth: int = 8, ngram_ks=(), ngram_trees=(), ngram_caps=api.DEFAULT_NGRAM_CAPS,
                 layerskip_ks=(), draft_layers=None, acceptance=None, hybrid_ks=(),
                 hybrid_match: int = 3, heads=None, head_ks=(), head_trees=(),
                 head_hybrid_ks=(), head_weights: str | None = None,
                 extra_drafts=None, suffix_ks=()) -> list[tuple[str, int, dict]]:
  """(group, x, ``bench.speculative_method`` keywords) for every method of the comparison.  ``extra_drafts``
  ({weight type: the draft model loaded at it}): the 0.5B's chains again at each of those types."""
  out: list[tuple[str, int, dict]] = [("model chain", k, {"drafter": "model", "k": k}) for k in ks]
  out += [(f"model@{w} chain", k, {"drafter": "model", "k": k, "draft": dw})
          for w, dw in (extra_drafts or {}).items() for k in ks]
  if sequoia_budgets and acceptance is None:
    raise SpecjaxError("coder_pair: sequoia trees need the measured acceptance table (acceptance_depths >= 1)")
  out += [("model sequoia", n, {"drafter": "model", "tree": f"sequoia:{n}", "acceptance": acceptance})
          for n in sequoia_budgets]
  out += [("model dynamic", n, {"drafter": "model", "tree": f"dynamic:{n}:{dynamic_top_k}:{min(n, dynamic_depth)}"})
          for n in dynamic_budgets]
  out += [("ngram chain", k, {"drafter": "ngram", "k": k, "ngram_caps": ngram_caps}) for k in ngram_ks]
  for tree in ngram_trees:
    n = api.resolve_tree(tree, drafter="ngram", max_len=api.AUTO_MAX_LEN_LIMIT).num_nodes
    out.append(("ngram trie", n, {"drafter": "ngram", "tree": tree, "ngram_caps": ngram_caps}))
  out += [("suffix chain", k, {"drafter": "suffix", "k": k}) for k in suffix_ks]
  out += [("layerskip", k, {"drafter": "layerskip", "k": k, "draft_layers": draft_layers}) for k in layerskip_ks]
  out += [("hybrid chain", k, {"drafter": "hybrid", "k": k, "ngram": hybrid_match}) for k in hybrid_ks]
  hw = {} if head_weights is None else {"head_weights": head_weights}
  for label, path in (heads or {}).items():
    from specjax.checkpoints import drafter_io
    positions = int(drafter_io.read_config(path).get("parallel_positions", 0))
    out += [(f"{label} chain", k, {"drafter": "eagle", "k": k, "draft": path, **hw})
            for k in head_ks if not positions or k <= positions]
    for tree in head_trees:
      n = api.resolve_tree(tree, drafter="eagle", max_len=api.AUTO_MAX_LEN_LIMIT).num_nodes
      out.append((f"{label} {tree.split(':')[0]}", n, {"drafter": "eagle", "tree": tree, "draft": path, **hw}))
    if not positions:          # lookup where the last hybrid_match tokens repeat, the (sequential) head elsewhere
      out += [(f"{label}+lookup chain", k, {"drafter": "eagle-hybrid", "k": k, "ngram": hybrid_match, "draft": path,
                                            **hw})
              for k in head_hybrid_ks]
  return out


def cost_model_speedup(device, cfg, r: dict, context: int, dtype: str, draft_cfg=None,
                       weights: str = "fp32", draft_weights: str | None = None) -> float | None:
  """The cost model's speedup for a bench result ``r`` that drafted a chain (None for a tree, which the model
  does not price): the draft model's forwards for ``model``, the target's first layers for ``layerskip``,
  nothing for ``ngram``; the chain's measured acceptance per position."""
  kind = drafter_registry.get(r["drafter"])
  if not (r.get("tree") or f"chain:{r['k']}").startswith("chain:") or not kind.priced:
    return None                # (a hybrid's steps mix free lookups and model drafts: not a chain the model prices)
  layers = api.parse_layers(r["draft_layers"], cfg.num_layers) if kind.layers else None
  dcfg = drafter_registry.draft_config(kind, cfg, draft_cfg, layers)
  return costmodel.predicted_speedup(device, cfg, r["acceptance_by_position"], r["k"], 1, context, dtype, dcfg,
                                     weights=weights, draft_weights=draft_weights)


def by_category(speedup_by_prompt, categories) -> dict:
  """The median per-prompt speedup within each prompt category (Spec-Bench's translation, qa, ...; MT-bench's
  eight), in the order the categories first appear.  ``speedup_by_prompt``: one ratio per prompt (batch 1)."""
  if len(speedup_by_prompt) != len(categories):
    raise ValueError(f"{len(speedup_by_prompt)} per-prompt speedups for {len(categories)} prompts")
  out = {}
  for c in dict.fromkeys(categories):
    out[c] = round(float(np.median([s for s, c_ in zip(speedup_by_prompt, categories) if c_ == c])), 4)
  return out


def _row(group: str, x: int, r: dict, predicted_cm: float | None, categories=None) -> dict:
  err = None if predicted_cm is None else predicted_cm / r["speedup"] - 1.0
  several = len(set(categories or ())) > 1           # categories to split the speedup by
  return {"group": group, "x": x, "method": r["method"], "k": r["k"], "tree": r.get("tree"),
          "mean_accepted_length": r["mean_accepted_length"], "acceptance_rate": r["acceptance_rate"],
          "speedup": r["speedup"], "speedup_median": r["speedup_median"], "speedup_ci95": r["speedup_ci95"],
          "tokens_per_s": r["spec_tokens_per_s"], "draft_ms": r["draft_ms"], "verify_ms": r["verify_ms"],
          "predicted_speedup": r["predicted_speedup"], "cost_model_speedup": predicted_cm,
          "cost_model_error": err, "outputs_identical": r["outputs_identical"],
          "outputs_compared": r["outputs_compared"],
          "acceptance_by_position": [round(a, 3) for a in r["acceptance_by_position"]],
          **({"lookup_step_share": r["lookup_step_share"]} if "lookup_step_share" in r else {}),
          **({"speedup_by_category": by_category(r["speedup_by_prompt"], categories)}
             if several and "speedup_by_prompt" in r else {})}


def coder_pair(model: str = "qwen2.5-coder-1.5b", draft: str = "qwen2.5-coder-0.5b", prompts: str = "",
               categories=None, per_category: int | None = None, limit: int | None = 20, max_new_tokens: int = 256, max_len: int = 1024,
               ks=(1, 2, 3, 4, 5, 6, 7, 8), sequoia_budgets=(8, 16, 32), dynamic_budgets=(4, 8, 16, 32),
               dynamic_top_k: int = 2, dynamic_depth: int = 8, acceptance_ranks: int = 4,
               acceptance_depths: int = 4, ngram_ks=(5,), ngram_trees=("branch:2,1,1,1",),
               ngram_caps=api.DEFAULT_NGRAM_CAPS, layerskip_ks=(3,), draft_layers=14, hybrid_ks=(5, 7),
               hybrid_match: int = 3, heads=None, head_ks=(3, 4, 5, 6), head_trees=(), head_hybrid_ks=(),
               head_weights: str | None = None, draft_weights=(), device: str | None = None, repeats: int = 1,
               weights: str = "auto", activations: str = "auto", suffix_ks=(), log=print) -> dict:
  if not prompts:
    raise SpecjaxError("coder_pair.prompts is not set: bind it to a HumanEval JSONL by path, e.g. "
                       "--gin-binding \"coder_pair.prompts = '../shared/data/humaneval/HumanEval_0-99.jsonl'\"")
  chosen = pick_prompts(prompts, categories, per_category, limit)
  m, d, batches = setup(model, chosen, 1, max_new_tokens, max_len, draft=draft, weights=weights,
                        activations=activations, log=log)
  api.check_same_vocabulary(m, d)
  extra = {}
  for w in draft_weights:      # the 0.5B again at other weight types (``model@int8 chain`` rows)
    log(f"[coder_pair] loading the draft {draft} again with {w} weights")
    extra[w] = api.load(draft, dtype=str(m.dtype), weights=w, activations=activations)
  eos = tuple(m.tokenizer.eos_token_ids)
  measured = None
  if sequoia_budgets:
    log(f"[coder_pair] measuring the pair's acceptance table ({acceptance_ranks} ranks, {acceptance_depths} "
        "depths) on the same prompts")
    measured = api.acceptance_vector(m, chosen, drafter="model", draft=d, ranks=acceptance_ranks,
                                     depths=acceptance_depths, max_new_tokens=max_new_tokens, max_len=max_len)
  acc = measured.get("acceptance_table", measured["acceptance_vector"]) if measured else None
  methods = method_specs(ks, sequoia_budgets, dynamic_budgets, dynamic_top_k, dynamic_depth, ngram_ks,
                         ngram_trees, ngram_caps, layerskip_ks, draft_layers, acc, hybrid_ks, hybrid_match,
                         heads=dict(heads or {}), head_ks=head_ks, head_trees=head_trees,
                         head_hybrid_ks=head_hybrid_ks, head_weights=head_weights, extra_drafts=extra,
                         suffix_ks=suffix_ks)
  log(f"[coder_pair] {len(methods)} methods, interleaved with plain decoding prompt by prompt")
  ar, results = bench.compare(m, batches, [s for _, _, s in methods], max_new_tokens=max_new_tokens,
                              max_len=max_len, eos_ids=eos, draft=d, repeats=repeats, log=log)
  from specjax.measure import calibrate
  spec = calibrate.load_or_calibrate(device, log=log)
  dtype = str(m.dtype)
  context = int(ar["kv_bytes_live_mean"] / bench.kv_bytes_per_token(m))
  rows = [{"group": "plain", "x": 0, "method": "autoregressive", "k": 0, "mean_accepted_length": 1.0,
           "speedup": 1.0, "tokens_per_s": ar["ar_tokens_per_s"]}]
  head_groups = tuple(f"{label} " for label in dict(heads or {}))
  for (group, x, s), r in zip(methods, results):
    # (the cost model prices a head as a one-layer model over the full vocabulary, one forward per token:
    # neither a reduced head nor a parallel one; their rows carry only the measured speedup)
    dw = s["draft"].weights if isinstance(s.get("draft"), api.Model) else None
    cm = None if group.startswith(head_groups) else cost_model_speedup(spec, m.cfg, r, context, dtype, d.cfg,
                                                                       quant.weights_kind(m.params), dw)
    rows.append(_row(group, x, r, cm, [p.category for p in chosen]))
  spec_rows = rows[1:]
  best = max(spec_rows, key=lambda r: r["speedup"])
  best_by_group = {g: max((r for r in spec_rows if r["group"] == g), key=lambda r: r["speedup"])["method"]
                   for g in dict.fromkeys(r["group"] for r in spec_rows)}
  chains = [r for r in spec_rows if r["cost_model_error"] is not None]
  return {
      "title": f"coder pair: {model} with {draft}, {len(chosen)} tasks, greedy, {max_new_tokens} new tokens"
               + ("" if weights == "auto" else f", {weights} weights"),
      "rows": rows,
      "summary": {"ar_tokens_per_s": ar["ar_tokens_per_s"], "ar_step_ms": ar["ar_step_ms"],
                  "mean_context": context, "device": spec.name,
                  "best": {k_: best[k_] for k_ in ("method", "speedup", "mean_accepted_length")},
                  "best_by_group": best_by_group,
                  "max_cost_model_error": max((abs(r["cost_model_error"]) for r in chains), default=None),
                  "all_outputs_identical": all(r["outputs_identical"] == r["outputs_compared"] for r in spec_rows),
                  "acceptance_table": acc},
      "files": {"acceptance_table.json": measured} if measured else {},
  }


def plot(result: dict, out_dir) -> None:
  """τ and speedup vs k (chains, the cost model's prediction dashed beside the measurement) and vs N (trees)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from pathlib import Path

  rows = [r for r in result["rows"] if r["group"] != "plain"]
  groups = list(dict.fromkeys(r["group"] for r in rows))
  for kind, is_tree, xlabel in (("k", False, "drafted tokens k"), ("nodes", True, "tree nodes N")):
    mine = [g for g in groups if (("sequoia" in g or "dynamic" in g or "trie" in g) == is_tree)]
    if not mine:
      continue
    fig, (ax_tau, ax_sp) = plt.subplots(1, 2, figsize=(11, 4))
    for g in mine:
      pts = sorted((r["x"], r["mean_accepted_length"], r["speedup"], r.get("cost_model_speedup"))
                   for r in rows if r["group"] == g)
      xs = [p[0] for p in pts]
      ax_tau.plot(xs, [p[1] for p in pts], "o-", label=g)
      line, = ax_sp.plot(xs, [p[2] for p in pts], "o-", label=f"{g} (measured)")
      cm = [(p[0], p[3]) for p in pts if p[3] is not None]
      if cm:
        ax_sp.plot([c[0] for c in cm], [c[1] for c in cm], "x--", color=line.get_color(),
                   label=f"{g} (cost model)")
    ax_sp.axhline(1.0, color="grey", lw=0.8)
    ax_tau.set(xlabel=xlabel, ylabel="mean accepted length τ", title="τ")
    ax_sp.set(xlabel=xlabel, ylabel="speedup vs plain decoding", title="speedup (same prompts, same run)")
    ax_tau.legend(fontsize=8)
    ax_sp.legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(out_dir) / f"tau_speedup_vs_{kind}.png", dpi=110)
    plt.close(fig)
