"""Weight types: for fp32, bf16, int8 and int4 weights of one model, plain decoding speed (and the fraction of
the read roofline it reaches with the bytes actually read), the verify cost for 1…32 rows and the ceiling it
puts on any drafter (``speculation_ceiling``), speculative speedups on the same prompts, and perplexity on a
fixed text.

The model is loaded at each type as ``--weights`` loads it (quantized from its fp32 weights by
``quant.quantize_params``, once per type for a GGUF model, then mapped from the converted-weight cache), and
every type decodes the same prompts in one run, interleaved prompt by prompt (``bench.time_methods``): the speed ratios
are measured side by side, not across runs.  Greedy outputs of every speculative method are checked against
the same type's plain decoding.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from specjax import api
from specjax.eval import bench
from specjax.measure import costmodel
from specjax.models import quant
from specjax.measure import calibrate
from specjax.speculative import registry as drafter_registry
from experiments.common import pick_prompts
from experiments.roofline import time_forward

# The fixed text perplexity is measured on (this project's own prose, so any model may score it).
TEXT = (
    "Speculative decoding spends arithmetic that a decoding step leaves idle. A small drafter proposes a few "
    "tokens, the large model checks all of them in one pass, and a rejection rule keeps the output exactly "
    "as if the large model had written every token itself. Whether this pays depends on the machine: how "
    "long a draft step takes, how much memory the extra positions need, and above all how many sequences "
    "share each step. When many requests are batched together, the spare arithmetic is gone, and verifying "
    "drafts that will be thrown away costs real time. A scheduler must then decide, step by step, how far "
    "each sequence may speculate. The weights themselves change this picture: stored in eight or four bits "
    "instead of thirty-two, each step reads fewer bytes, runs faster, and reaches the point where arithmetic "
    "rather than memory sets the pace at a smaller batch.")


# Perplexity is also measured with the text fed VERIFY_BLOCK tokens at a time (a verification of k = 4), so that
# the decode-sized kernels compute it (integer activations among them); the other column is one prefill.
VERIFY_BLOCK = 5


def speculation_ceiling(verify_ms_by_rows: dict) -> tuple[float, int] | None:
  """The speedup an oracle drafter would reach on this machine: always right and free, a chain of T - 1
  commits T tokens for one T-row verification, so its speedup is T * t(1) / t(T); the best T of those
  measured.  No real drafter can beat it at these rows (a chain of k verifies k + 1 rows and commits at most
  k + 1 tokens).  Returns (speedup, T), or None without the one-row time or any wider one."""
  t1 = verify_ms_by_rows.get(1)
  wider = [T for T in verify_ms_by_rows if T > 1]
  if not t1 or not wider:
    return None
  best = max(wider, key=lambda T: T * t1 / verify_ms_by_rows[T])
  return best * t1 / verify_ms_by_rows[best], best


def with_weights(m: api.Model, name: str, kind: str) -> api.Model:
  """The model at weight type ``kind``, loaded as ``--weights kind`` loads it (a GGUF model's quantized
  tensors come from the converted-weight cache after the first load).  ``kind`` may name the activations the
  int8/int4 matmuls take, as ``--activations`` does: ``int4+int8``, ``int8+fp32``, ``int4+int8-256``."""
  weights, _, acts = kind.partition("+")
  if kind == "fp32":
    return m
  return api.load(name, dtype="float32", weights=weights, activations=acts or "auto")


def weight_kind(kind: str) -> str:
  """The weight type of a ``kinds`` entry (``int4+int8`` -> ``int4``)."""
  return kind.partition("+")[0]


def weights(model: str = "smollm2-135m", kinds=("fp32", "bf16", "int8", "int4"), prompts: str = "specjax-prompts",
            categories=None, per_category: int | None = 1, limit: int | None = 8, max_new_tokens: int = 64,
            max_len: int = 1024, rows=(1, 2, 4, 8, 16, 32), context: int = 128, verify_repeats: int = 3,
            drafters=(("ngram", 5),), draft: str | None = None, draft_k: int = 4, pairs=(),
            text: str | None = None, repeats: int = 1, device: str | None = None, log=print) -> dict:
  """One table row per weight type; ``drafters`` (name, k) and, with ``draft``, the draft model at the same
  type (``draft_k``) and at each (target type, draft type) of ``pairs`` are timed against plain decoding of
  the same target type on the same prompts.  Beside each measurement, the cost model's prediction for this
  machine (``device``: a published spec or a calibration JSON; default: this machine's calibration, measured
  first if missing): the verify cost for each of ``rows`` and each drafter's speedup from its measured
  acceptance."""
  chosen = pick_prompts(prompts, categories, per_category, limit)
  base = api.load(model, dtype="float32", weights="fp32")
  dbase = api.load(draft, dtype="float32", weights="fp32") if draft else None
  models = {k: with_weights(base, model, k) for k in kinds}
  pairs = [tuple(p) for p in pairs] if dbase is not None else []
  drafts = ({k: with_weights(dbase, draft, k) for k in dict.fromkeys([*kinds, *(d for _, d in pairs)])}
            if dbase is not None else {})
  spec = calibrate.load_or_calibrate(device, log=log)
  batches = bench.make_batches(base, chosen, 1, max_new_tokens, max_len)
  eos = tuple(base.tokenizer.eos_token_ids)
  log(f"[weights] {model}: {', '.join(kinds)}; {len(chosen)} prompts, {max_new_tokens} new tokens")

  methods, owner, plan = [], [], {}     # plan: label → (k, the draft model's config or None, its type)
  for k in kinds:
    mk = models[k]
    ar = bench.autoregressive_method(mk, eos, max_len, 1)
    methods.append(dataclasses.replace(ar, label=f"{k} plain"))
    owner.append(mk)
    specs = [(f"{name} k{kk}", dict(drafter=name, k=kk)) for name, kk in drafters]
    if k in drafts:
      specs.append((f"model k{draft_k}", dict(drafter="model", k=draft_k, draft=drafts[k])))
    specs += [(f"model k{draft_k} draft {dk}", dict(drafter="model", k=draft_k, draft=drafts[dk]))
              for tk, dk in pairs if tk == k and dk != k]
    for name, sp in specs:
      meth = bench.speculative_method(mk, eos, max_len, batch_size=1, **sp)
      methods.append(dataclasses.replace(meth, label=f"{k} {name}"))
      owner.append(mk)
      d, kind = sp.get("draft"), drafter_registry.get(sp["drafter"])
      layers = api.parse_layers(sp.get("draft_layers"), mk.cfg.num_layers) if kind.layers else None
      plan[f"{k} {name}"] = (sp["k"], kind.priced,
                             drafter_registry.draft_config(kind, mk.cfg, None if d is None else d.cfg, layers),
                             weight_kind(k) if d is None else quant.weights_kind(d.params))
  timer = bench.Timer(log)
  for meth, mk in zip(methods, owner):        # warm-up (compiles each method)
    arr, lens, _ = batches[0]
    bench._prefill_and_decode(mk, meth.engine, meth.draft_params, arr, lens, 2, max_len, meth.k_max, timer)
  by_label = dict(zip((m.label for m in methods), owner))
  run = lambda meth, batch: bench.decode_run(by_label[meth.label], meth, batch, max_new_tokens, max_len, timer)
  bw = calibrate.measure_read_bandwidth()["best"]
  timed = bench.time_methods(base, methods, batches, max_new_tokens, max_len, repeats=repeats, log=log,
                             timer=timer, run=run)
  tps = timed["tokens"].sum(axis=(1, 2)) / timed["seconds"].sum(axis=(1, 2))
  tps_of = {m.label: float(t) for m, t in zip(methods, tps)}
  outputs_of = {m.label: o for m, o in zip(methods, timed["outputs"])}
  stats_of = {m.label: (s, c) for m, s, c in zip(methods, timed["stats"], timed["contexts"])}
  fp32_tps = tps_of.get("fp32 plain")
  text = text or TEXT
  ppl_fp32 = api.score(models["fp32"], text).perplexity if "fp32" in models else None

  table = []
  for k in kinds:
    mk = models[k]
    plain = tps_of[f"{k} plain"]
    ppl = api.score(mk, text).perplexity
    ppl_verify = api.score(mk, text, block=VERIFY_BLOCK).perplexity   # what the decode-sized kernels compute
    verify = {T: time_forward(mk, 1, T, context, verify_repeats) * 1e3 for T in rows}
    predicted = {T: costmodel.step_time(spec, mk.cfg, 1, T, context, weights=weight_kind(k)) * 1e3 for T in rows}
    ceiling = speculation_ceiling(verify)
    row = {"weights": k, "weight_bytes": mk.weight_bytes, "bits_per_weight": round(8 * mk.weight_bytes / max(
               1, sum(int(np.prod(x.shape)) for x in _matrices(mk.params))), 2),
           "tokens_per_s": round(plain, 2),
           "speedup_vs_fp32": None if fp32_tps is None else round(plain / fp32_tps, 3),
           "roofline_fraction": round(plain * _bytes_per_step(mk) / (bw * 1e9), 3),
           "perplexity": round(ppl, 4),
           "perplexity_vs_fp32": None if ppl_fp32 is None else round(ppl / ppl_fp32 - 1, 5),
           "perplexity_verify": round(ppl_verify, 4),
           "perplexity_verify_vs_fp32": None if ppl_fp32 is None else round(ppl_verify / ppl_fp32 - 1, 5),
           **{f"verify_ms_T{T}": round(v, 3) for T, v in verify.items()},
           **{f"predicted_verify_ms_T{T}": round(v, 3) for T, v in predicted.items()},
           "oracle_ceiling": None if ceiling is None else round(ceiling[0], 3),
           "oracle_ceiling_rows": None if ceiling is None else ceiling[1]}
    for label, t in tps_of.items():
      if label.startswith(f"{k} ") and label != f"{k} plain":
        name = label[len(k) + 1:]
        same = bench.identical_outputs(outputs_of[f"{k} plain"], outputs_of[label])
        row[f"speedup_{name}"] = round(t / plain, 3)
        pred = _predicted_speedup(spec, mk, weight_kind(k), *plan[label], *stats_of[label])
        row[f"predicted_speedup_{name}"] = None if pred is None else round(pred, 3)
        row[f"identical_{name}"] = f"{same[0]}/{same[1]}"
    table.append(row)
    log(f"[weights] {k}: {plain:.1f} tok/s, ppl {ppl:.3f}, verify T=1 {verify[rows[0]]:.1f} ms"
        + ("" if ceiling is None else f", oracle ceiling {ceiling[0]:.2f}x at {ceiling[1]} rows"))
  return {
      "title": f"weight types: {model}, {len(chosen)} prompts, greedy, {max_new_tokens} new tokens",
      "rows": table,
      "summary": {"read_bandwidth_gbs": bw, "fp32_tokens_per_s": fp32_tps, "device": spec.name,
                  "speedups_vs_fp32": {r["weights"]: r["speedup_vs_fp32"] for r in table},
                  "perplexity_vs_fp32": {r["weights"]: r["perplexity_vs_fp32"] for r in table},
                  "oracle_ceiling": {r["weights"]: r["oracle_ceiling"] for r in table}},
      "plots": [{"file": "tokens_per_s_by_weights.png", "x": "weights", "y": "tokens_per_s",
                 "title": "plain decoding speed by weight type (same prompts, one run)"}],
  }


def _predicted_speedup(spec, mk, kind: str, k: int, priced: bool, draft_cfg, draft_kind: str, stats,
                       contexts) -> float | None:
  """The cost model's speedup for a method with chains of k from its measured acceptance by position, at the
  mean context it decoded at; ``draft_cfg`` None: a drafter without a model (priced as free); None for a
  drafter the model does not price (a hybrid)."""
  if not priced:
    return None
  acc = api.spec_metrics(stats)["acceptance_by_position"]
  ctx = int(np.mean(contexts)) if len(contexts) else 128
  return costmodel.predicted_speedup(spec, mk.cfg, acc, k, 1, ctx, draft_cfg=draft_cfg, weights=kind,
                                     draft_weights=draft_kind)


def _bytes_per_step(m) -> int:
  """Weight bytes a decode step reads: all of them but an untied embedding (of which it reads one row)."""
  if m.cfg.tie_embeddings:
    return m.weight_bytes
  return m.weight_bytes - quant.param_bytes({"embed": m.params["embed"]})


def _matrices(params):
  """Every weight matrix's (unpacked) shape holder: quantized weights and 2-D+ arrays."""
  import jax
  return [x for x in jax.tree_util.tree_leaves(params, is_leaf=quant.is_quantized)
          if quant.is_quantized(x) or x.ndim >= 2]


def plot(result: dict, out_dir) -> None:
  """verify_cost_by_weights.png: the verify step's time against its rows, one colour per weight type, measured
  (solid) and predicted (dashed)."""
  from pathlib import Path

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, r in enumerate(result["rows"]):
    color = f"C{i}"
    for prefix, style, what in (("verify_ms_T", "-o", "measured"), ("predicted_verify_ms_T", "--", "predicted")):
      pts = sorted((int(k[len(prefix):]), v) for k, v in r.items() if k.startswith(prefix))
      if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=f"{r['weights']} {what}")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("rows verified (T)")
  ax.set_ylabel("one forward, ms")
  ax.set_title("verify cost vs rows, batch 1: measured (solid), cost model (dashed)")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(Path(out_dir) / "verify_cost_by_weights.png", dpi=110)
  plt.close(fig)
