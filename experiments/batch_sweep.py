"""Batch sweep: where speculation stops paying, predicted and measured, and how each scheduling policy does
under load (``specjax.serving``).

Part 1, the crossover: for each batch size B of ``batches``, B requests at once (EOS ignored, so the batch
stays full) decoded plainly and with a fixed k; measured speedup(B) = speculative ÷ plain tokens/s.  The cost
model predicts the same ratio from the calibrated machine, the acceptance per position and the rows per
sequence the B = 1 run measured.  crossover = the smallest B whose speedup is below 1.

Part 2, the load sweep: one Poisson trace per offered load (requests/s), replayed in real time by the
continuous-batching engine under each policy (same trace, same compiled engines): throughput, time to first
token and inter-token latency.
"""
from __future__ import annotations

import jax
import numpy as np

from specjax import api
from specjax.models import buffers
from specjax.measure import costmodel
from specjax.measure import calibrate
from specjax.speculative import registry as drafter_registry
from specjax.serving import batcher as bt, buckets as bk, factory, policies as pol, trace as trace_lib
from experiments.common import pick_prompts

POLICY_LABELS = {"never": "never (k=0)", "always": "always (fixed k)", "off-above": "off above batch",
                 "adaptive": "adaptive", "goodput": "goodput-optimal"}


def _requests(encoded, trace, ignore_eos=False):
  return [bt.Request(encoded[i % len(encoded)], t["max_tokens"], rid=i, arrival=t["arrival"])
          for i, t in enumerate(trace)]


def _position_acceptance(state) -> list[float]:
  st = state.stats
  acc, reach = np.asarray(st.pos_accepted_D, float), np.asarray(st.pos_reached_D, float)
  return [float(a / r) if r else 0.0 for a, r in zip(acc, reach)]


def _decode_rate(history, tokens: int) -> float:
  """Tokens per second of decoding: committed tokens over the seconds of the steps (admission prefill, which
  the cost model's step does not include, is left out)."""
  return tokens / max(sum(h.seconds for h in history), 1e-9)


def crossover(m, spec, encoded, drafter: str, k: int, batches, max_new: int, max_len: int, log, draft=None,
              **dkw) -> dict:
  """The same ``len(encoded)`` requests at every B (B slots, the rest queued; EOS ignored, so every request
  decodes max_new tokens), plainly and with k: decode speed ratio per B, and the cost model's prediction
  from the acceptance per position and the rows per sequence measured at the smallest B (plus, with a draft
  model, its k forwards per step: ``costmodel.draft_time``)."""
  rows, acc_B1, rows_per_seq = [], None, None
  for B in batches:
    spec_eng = factory.make_batcher(m, drafter=drafter, policy="fixed", k=k, slots=B, max_len=max_len, eos_ids=(),
                                    draft=draft, **dkw)
    spec_eng.warmup(max(len(e) for e in encoded))
    # Plain decoding without any drafter: at k = 0 a model drafter's batcher still runs the draft forward that
    # keeps its cache in step (to switch speculation back on), which plain decoding does not pay.
    plain_eng = spec_eng if draft is None else factory.make_batcher(m, drafter="none", policy="fixed", k=0,
                                                                    slots=B, max_len=max_len, eos_ids=())
    if plain_eng is not spec_eng:
      plain_eng.warmup(max(len(e) for e in encoded))
    res = {}
    for label, eng, policy in (("plain", plain_eng, pol.FixedK(0)), ("spec", spec_eng, pol.FixedK(k))):
      eng.policy = policy
      eng.history.clear()
      before = jax.device_get(eng.state.stats)       # the state is donated at each step
      reqs = _requests(encoded, [{"arrival": 0.0, "max_tokens": max_new}] * len(encoded))
      rep = eng.run(reqs)
      res[label] = {"rate": _decode_rate(eng.history, rep["tokens"]), "steps": len(eng.history),
                    "live": sum(h.live for h in eng.history), "tokens": rep["tokens"]}
      if label == "spec" and B == batches[0]:
        after = jax.device_get(eng.state.stats)
        # α_j = P(position j accepted | position j − 1 accepted), a position the drafter left empty counting
        # as not accepted (n-gram lookup often drafts fewer than k): then τ(k) = 1 + Σ_j Π α is the measured τ.
        acc = np.asarray(after.pos_accepted_D, float) - np.asarray(before.pos_accepted_D, float)
        steps = float(np.sum(np.asarray(after.verify_steps_B) - np.asarray(before.verify_steps_B)))
        prev = np.concatenate([[steps], acc[:k - 1]])
        acc_B1 = [float(a / p) if p else 0.0 for a, p in zip(acc[:k], prev)]
        rows_per_seq = sum(h.rows for h in eng.history) / max(res[label]["live"], 1)
    measured = res["spec"]["rate"] / res["plain"]["rate"]
    rows.append({"B": B, "plain_tokens_per_s": res["plain"]["rate"], "spec_tokens_per_s": res["spec"]["rate"],
                 "speedup_measured": measured,
                 "tau_measured": res["spec"]["tokens"] / max(res["spec"]["live"], 1)})
    log(f"[batch_sweep] B={B}: plain {res['plain']['rate']:.1f} tok/s, k={k} {res['spec']['rate']:.1f} tok/s "
        f"(decode steps only): speedup {measured:.2f}, τ {rows[-1]['tau_measured']:.2f}")
  ctx = int(np.mean([len(e) for e in encoded]) + max_new / 2)
  for r in rows:
    B = r["B"]
    t_plain = costmodel.ragged_step_time(spec, m.cfg, [1] * B, [ctx] * B)
    t_spec = costmodel.ragged_step_time(spec, m.cfg, [rows_per_seq] * B, [ctx] * B)
    if draft is not None:     # a draft model's own forwards (n-gram lookup is free; layer-skip is in rows)
      t_spec += costmodel.draft_time(spec, draft.cfg, B, k, ctx, str(m.dtype))
    r["speedup_predicted"] = costmodel.expected_accepted(acc_B1, k) * t_plain / t_spec
  cross_m = next((r["B"] for r in rows if r["speedup_measured"] < 1), None)
  cross_p = next((r["B"] for r in rows if r["speedup_predicted"] < 1), None)
  return {"rows": rows, "acceptance_by_position": acc_B1, "rows_per_sequence": rows_per_seq,
          "tau_predicted_from_acceptance": costmodel.expected_accepted(acc_B1, k),
          "crossover_batch_measured": cross_m, "crossover_batch_predicted": cross_p}


def batch_sweep(model: str = "smollm2-135m", prompts: str = "specjax-prompts", categories=None,
                drafter: str = "ngram", k: int = 4, buckets=(0, 1, 2, 4, 8), slots: int = 16,
                batches=(1, 2, 4, 8, 16, 32), rates=(0.5, 1.0, 2.0, 4.0, 8.0, 16.0), requests: int = 32,
                max_new_tokens: int = 64, policies=("never", "always", "off-above", "adaptive", "goodput"),
                max_batch: int = 4, seed: int = 0, device: str | None = None, run_crossover: bool = True,
                crossover_requests: int = 32, draft: str | None = None, trees=(), weights: str = "auto",
                log=print) -> dict:
  """``draft``: the draft model for ``drafter = 'model'`` (default: the registry's draft for ``model``).
  ``trees``: token-tree specs served as buckets beside the chains: the goodput policy chooses among them too,
  and each runs alone as a fixed policy ("tree SPEC") on the same traces.  ``weights``: as ``--weights``."""
  spec = calibrate.load_or_calibrate(device, log=log)
  m = api.load(model, weights=weights)
  draft_model = drafter_registry.get(drafter).draft_model
  if draft_model:
    from specjax.checkpoints import catalog as registry
    draft = draft or registry.default_draft(model)
    if not draft:
      from specjax.errors import SpecjaxError
      raise SpecjaxError(f"batch_sweep.drafter = '{drafter}' needs batch_sweep.draft ('{model}' has no registry draft)")
  d = api.load(draft, weights=weights) if draft_model else None
  if d is not None:
    api.check_same_vocabulary(m, d)
  chosen = pick_prompts(prompts, categories)
  encoded = [m.tokenizer.encode_chat(p.text) for p in chosen]
  tree_b = [bk.tree_bucket(t, drafter, buffers.AUTO_MAX_LEN_LIMIT) for t in trees]
  nodes = max([max(buckets)] + [t.nodes for t in tree_b])
  max_len = buffers.buffer_length(max(len(e) for e in encoded), max_new_tokens, nodes + 1)
  out = {"title": f"batch sweep: {model}, {drafter}, {len(chosen)} prompts, {max_new_tokens} new tokens"}
  if run_crossover:
    reqs = [encoded[i % len(encoded)] for i in range(crossover_requests)]
    cross = crossover(m, spec, reqs, drafter, k, list(batches), max_new_tokens, max_len, log, draft=d)
    out.update({"crossover_rows": cross["rows"], "crossover_batch_measured": cross["crossover_batch_measured"],
                "crossover_batch_predicted": cross["crossover_batch_predicted"],
                "acceptance_by_position": cross["acceptance_by_position"],
                "rows_per_sequence": cross["rows_per_sequence"],
                "tau_predicted_from_acceptance": cross["tau_predicted_from_acceptance"]})
    log(f"[batch_sweep] crossover: predicted {cross['crossover_batch_predicted']}, measured "
        f"{cross['crossover_batch_measured']}")
  if not rates:
    out.update({"rows": out.get("crossover_rows", []), "summary": {}, "plots": []})
    return out
  eng = factory.make_batcher(m, drafter=drafter, policy="goodput", k=k, buckets=buckets, slots=slots,
                             max_len=max_len, spec=spec, max_batch=max_batch, draft=d, trees=tuple(trees))
  log(f"[batch_sweep] load sweep: {slots} slots, warm-up {eng.warmup(max(len(e) for e in encoded)):.1f}s")
  goodput = eng.policy
  make = {"never": lambda: pol.FixedK(0), "always": lambda: pol.FixedK(k),
          "off-above": lambda: pol.OffAboveBatch(k, max_batch), "adaptive": lambda: pol.AcceptanceAdaptive(buckets),
          "goodput": lambda: goodput}
  for t in tree_b:                       # each tree alone: the fixed choice goodput must match or beat
    make[f"tree {t.key}"] = (lambda t=t: pol.FixedK(t.key, t.nodes))
  rows = []
  for rate in rates:
    trace = trace_lib.poisson([str(i) for i in range(len(encoded))], rate, requests, seed, max_new_tokens)
    for name in list(policies) + [f"tree {t.key}" for t in tree_b]:
      eng.policy = make[name]()
      eng.history.clear()
      rep = eng.run(_requests(encoded, trace))
      rows.append({"policy": name, "rate": rate, "tokens_per_s": rep["tokens_per_s"],
                   "itl_p50_ms": 1e3 * (rep["itl_s"]["p50"] or 0), "itl_p90_ms": 1e3 * (rep["itl_s"]["p90"] or 0),
                   "ttft_p50_ms": 1e3 * (rep["ttft_s"]["p50"] or 0), "mean_k": rep["mean_k"],
                   "mean_live": rep["mean_live"], "served": rep["served"],
                   **({"bucket_share": rep["bucket_share"]} if "bucket_share" in rep else {})})
      log(f"[batch_sweep] rate {rate}/s {name:10s}: {rep['tokens_per_s']:.1f} tok/s, itl p50 "
          f"{rows[-1]['itl_p50_ms']:.1f} ms, mean k {rep['mean_k']:.2f}, mean live {rep['mean_live']:.1f}"
          + (f", buckets {rep['bucket_share']}" if "bucket_share" in rep else ""))
  summary = {}
  for rate in rates:
    by = {r["policy"]: r["tokens_per_s"] for r in rows if r["rate"] == rate}
    if {"never", "always", "goodput"} <= by.keys():
      fixed = {p: v for p, v in by.items() if p in ("never", "always") or p.startswith("tree ")}
      best = max(fixed.values())
      summary[str(rate)] = {"goodput_vs_best_fixed": by["goodput"] / best,
                            "goodput_beats_both": by["goodput"] > best,
                            **({"best_fixed": max(fixed, key=fixed.get)} if tree_b else {})}
  out.update({"rows": rows, "summary": summary, "slots": slots, "spec": spec.to_dict(),
              "plots": [{"file": "throughput_vs_load.png", "x": "rate", "y": "tokens_per_s", "group": "policy",
                         "title": "throughput vs offered load (requests/s)"},
                        {"file": "itl_vs_load.png", "x": "rate", "y": "itl_p50_ms", "group": "policy",
                         "title": "inter-token latency p50 (ms) vs offered load"}]})
  return out


def plot(result: dict, out_dir) -> None:
  """Measured and predicted speedup vs batch, the crossover marked."""
  rows = result.get("crossover_rows")
  if not rows:
    return
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  B = [r["B"] for r in rows]
  ax.plot(B, [r["speedup_measured"] for r in rows], "o-", label="measured")
  ax.plot(B, [r["speedup_predicted"] for r in rows], "s--", label="predicted (cost model)")
  ax.axhline(1.0, color="k", lw=0.8)
  for key, style in (("crossover_batch_predicted", ":"), ("crossover_batch_measured", "-.")):
    if result.get(key):
      ax.axvline(result[key], ls=style, color="gray", label=key.replace("_", " "))
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch B")
  ax.set_ylabel("speculative ÷ plain tokens/s")
  ax.set_title("where speculation stops paying")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_dir / "crossover.png", dpi=120)
  plt.close(fig)
