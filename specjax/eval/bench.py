"""Measuring decode speed: speculative vs plain decoding, paired prompt by prompt, and the memory roofline.

Decode is bandwidth-bound: a step must stream every weight once plus the KV entries of the live context.
``roofline_tokens_per_s = batch × read_bandwidth ÷ (weight bytes + live KV bytes)`` is the speed no
implementation can beat on this machine; ``roofline_fraction`` is how close a measured speed comes.  The
bandwidth is probed before and after the decode runs (both reported).

Every method (plain decoding, each drafter setting) decodes each prompt back to back with the others, the
order rotated from prompt to prompt (``specjax.measure.paired``), so a slowdown of the shared machine lands on both
sides of each prompt's speedup; ``repeats`` runs the whole interleaved set again for a median and a spread.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Any, NamedTuple

import jax
import numpy as np

from specjax.eval.part_times import Timer, time_draft_and_verify
from specjax.models import buffers
from specjax.models.sampling import SamplingParams
from specjax.parallel import distributed
from specjax.measure import provenance
from specjax.measure import paired as paired_lib
from specjax.api import (AUTO_MAX_LEN_LIMIT, DEFAULT_NGRAM_CAPS, Model, check_fits, check_memory,
                         run_batch, encode_prompts, on_mesh, resolve_tree, spec_metrics)
from specjax.errors import SpecjaxError
from specjax.models.kv_cache import cache_bytes
from specjax.measure import calibrate, projection
from specjax.measure.devices import published_spec
from specjax.prompts import Prompt
from specjax.runtime.builder import DecodeSpec, build
from specjax.speculative import registry as drafter_registry


def kv_bytes_per_token(m: Model) -> int:
  return cache_bytes(m.cfg, batch_size=1, max_len=1)   # k and v of one position, fp32 cache


def batch_key(seed: int, arr) -> jax.Array:
  """The PRNG key of a prompt batch under sampling: from ``seed`` and the batch's tokens, so that every method
  samples a prompt from the same key, and each prompt batch from its own."""
  tokens_crc = zlib.crc32(np.ascontiguousarray(arr).tobytes()) & 0x7FFFFFFF
  return jax.random.fold_in(jax.random.PRNGKey(seed), tokens_crc)


def _prefill_and_decode(m: Model, engine, draft_params, arr, lens, max_new: int, max_len: int, k_max: int,
                        timer: Timer, seed: int = 0):
  """Prefill (timed apart), then the decode loop alone, timed: (decode seconds, final state)."""
  B = arr.shape[0]
  run = run_batch(m, engine, draft_params, arr, lens, np.full((B,), max_new, np.int32),
                  np.full((B,), k_max, np.int32), batch_key(seed, arr), max_len,
                  log=lambda msg: timer.log(f"[bench] {msg}"))
  timer.compile_s += run.compile_s
  timer.prefill_s += run.prefill_s
  timer.decode_s += run.decode_s
  return run.decode_s, run.result


@dataclasses.dataclass
class Method:
  """One way to decode in a comparison: plain decoding, or a drafter with its settings."""
  label: str
  engine: Any
  draft_params: Any
  k_max: int
  settings: dict
  seed: int = 0          # under sampling: each prompt batch's key comes from it (``batch_key``)


AR_LABEL = "autoregressive"     # plain decoding's method name (bench --outputs, eval-code)


def autoregressive_method(m: Model, eos_ids, max_len: int, batch_size: int | None = None,
                          sampling: SamplingParams = SamplingParams(), seed: int = 0) -> Method:
  d = build(m, DecodeSpec(sampling=sampling), eos_ids=eos_ids, max_len=max_len, batch_size=batch_size)
  return Method(AR_LABEL, d.engine, (), 0, {"drafter": "none", "k": 0}, seed)


def speculative_method(m: Model, eos_ids, max_len: int, *, drafter: str, k: int = 4, ngram: int = 3,
                       draft_layers=None, draft: Model | None = None, ngram_caps=DEFAULT_NGRAM_CAPS,
                       tree=None, acceptance=None, batch_size: int | None = None,
                       index_tokens: int | None = None, head_weights: str | None = None,
                       sampling: SamplingParams = SamplingParams(), verify: str = "tokenwise",
                       seed: int = 0, synthetic_alpha: float | None = None) -> Method:
  """A drafter setting; ``tree`` (a spec such as ``branch:4,2`` or ``sequoia:16``, with ``acceptance`` for
  sequoia) replaces the chain of ``k`` by a token tree of N nodes.  With ``batch_size`` its memory bill must
  fit the device.  ``head_weights``: a trained head's weight type (default the target's).  ``sampling`` and
  ``verify``: the sampling settings and the rule for sampled drafts (``DecodeSpec``); ``synthetic_alpha``:
  each draft kept with that probability instead (not lossless: the system's cost at a chosen acceptance)."""
  ds = DecodeSpec(drafter=drafter, k=k, tree=tree, acceptance=acceptance, ngram=ngram, ngram_caps=ngram_caps,
                  draft_layers=draft_layers, index_tokens=index_tokens, head_weights=head_weights,
                  sampling=sampling, verify=verify, synthetic_alpha=synthetic_alpha)
  d = build(m, ds, eos_ids=eos_ids, max_len=max_len, draft=draft, batch_size=batch_size)
  settings, label = d.settings(), d.label
  if verify != "tokenwise":
    settings, label = {**settings, "verify": verify}, f"{label} verify={verify}"
  if synthetic_alpha is not None:
    settings, label = {**settings, "synthetic_alpha": synthetic_alpha}, f"{label} synthetic α={synthetic_alpha:g}"
  return Method(label, d.engine, d.draft_params, d.k_max, settings, seed)


class Run(NamedTuple):
  seconds: float        # the decode loop alone
  tokens: int           # tokens it produced (after each sequence's first, which prefill samples)
  stats: Any            # SpecStats
  contexts: list        # mean context length of each live sequence
  new_tokens: list = []  # each live sequence's generated tokens (the first, from prefill, included)
  lookup_steps: int | None = None   # hybrid drafter: live steps whose chain came from prompt lookup


def decode_run(m: Model, method: Method, batch, max_new: int, max_len: int, timer: Timer) -> Run:
  """Prefill one batch, then time its decode loop alone."""
  arr, lens, live = batch
  t, res = _prefill_and_decode(m, method.engine, method.draft_params, arr, lens, max_new, max_len,
                               method.k_max, timer, method.seed)
  num_new = distributed.to_host(res.num_new_B)[:live]
  seq = distributed.to_host(res.seq_BxS)
  lookups = getattr(res.draft, "lookup_steps_B", None)
  return Run(max(t, 1e-9), int(np.sum(np.maximum(num_new - 1, 0))), res.stats,
             [float(l + n / 2) for l, n in zip(lens[:live], num_new)],
             [seq[b, lens[b]:lens[b] + num_new[b]].tolist() for b in range(live)],
             None if lookups is None else int(np.sum(distributed.to_host(lookups)[:live])))


def time_methods(m: Model, methods: list[Method], batches, max_new: int, max_len: int, *, repeats: int = 1,
                 paired: bool = True, log=print, timer: Timer | None = None, run=None) -> dict:
  """Decode every batch with every method, ``repeats`` times, in ``paired.schedule`` order (each prompt by
  every method back to back, the order rotated), after one short warm-up run of each method (which also
  compiles it).  ``run(method, batch) -> Run`` replaces the real decoding in tests.

  Returns seconds and tokens as [M, R, P] arrays, each method's SpecStats summed over the first repeat
  (greedy runs repeat exactly), the live contexts, and each method's generated tokens per batch (first
  repeat; ``outputs[i][p]`` = one token list per live sequence)."""
  timer = timer or Timer(log)
  M, R, P = len(methods), repeats, len(batches)
  if run is None:
    run = lambda method, batch: decode_run(m, method, batch, max_new, max_len, timer)   # noqa: E731
    for method in methods:          # warm-up: compile, then a couple of steps of each
      arr, lens, _ = batches[0]
      _prefill_and_decode(m, method.engine, method.draft_params, arr, lens, 2, max_len, method.k_max, timer,
                          method.seed)
  seconds, tokens = np.zeros((M, R, P)), np.zeros((M, R, P), np.int64)
  stats, contexts, lookups = [None] * M, [[] for _ in range(M)], [None] * M
  outputs: list = [[None] * P for _ in range(M)]
  order = paired_lib.schedule(M, P, R, paired)
  learned = [method.draft_params for method in methods]
  for n, (r, p, i) in enumerate(order):
    # A learning drafter (suffix) sees the earlier prompt batches of the same repeat, never a later one
    # and never an earlier repeat of this batch (that would copy the answer it is timed on).
    if p == 0:
      learned[i] = methods[i].draft_params
    method = dataclasses.replace(methods[i], draft_params=learned[i])
    res = run(method, batches[p])
    if res.new_tokens and drafter_registry.learns(getattr(method.engine, "drafter", None)):
      arr, lens, _ = batches[p]
      learned[i] = drafter_registry.absorb(
          method.engine.drafter, learned[i],
          [np.asarray(arr[b, :lens[b]]).tolist() + list(res.new_tokens[b]) for b in range(len(res.new_tokens))])
    seconds[i, r, p], tokens[i, r, p] = res.seconds, res.tokens
    if r == 0:
      stats[i] = res.stats if stats[i] is None else jax.tree_util.tree_map(lambda a, b: a + b, stats[i],
                                                                         res.stats)
      contexts[i] += res.contexts
      outputs[i][p] = list(res.new_tokens)
      if res.lookup_steps is not None:
        lookups[i] = (lookups[i] or 0) + res.lookup_steps
    if P > 1 and (n + 1) % M == 0:
      log(f"[bench] repeat {r + 1}/{R}, prompt batch {p + 1}/{P}: "
          + ", ".join(f"{methods[j].label} {tokens[j, r, p] / seconds[j, r, p]:.1f} tok/s" for j in range(M)
                      if seconds[j, r, p]))
  return {"seconds": seconds, "tokens": tokens, "stats": stats, "contexts": contexts, "outputs": outputs,
          "lookup_steps": lookups}


def identical_outputs(plain: list, other: list) -> tuple[int, int]:
  """(sequences whose tokens equal plain decoding's, sequences compared) over every batch: greedy
  speculative decoding must reproduce plain greedy decoding token for token."""
  pairs = [(a, b) for pa, pb in zip(plain, other) if pa is not None and pb is not None
           for a, b in zip(pa, pb)]
  return sum(a == b for a, b in pairs), len(pairs)


def make_batches(m: Model, prompts: list[Prompt], batch_size: int, max_new: int, max_len: int,
                 chat: bool | None = None):
  """Prompts (chat-templated where the model has a template; ``chat``) in batches, each padded to its own prompt bucket (as ``generate`` does): the
  decode loop is one executable per engine whatever the padding, and only prefill is compiled per bucket,
  so short prompts are not prefilled at the longest one's length."""
  encoded = encode_prompts(m, prompts, chat)
  check_fits([len(e) for e in encoded], max_new, max_len)
  batches = []
  for s in range(0, len(encoded), batch_size):
    chunk = encoded[s:s + batch_size]
    arr, lens = buffers.pad_batch(chunk, batch_size)
    batches.append((arr, lens, len(chunk)))
  return batches


def _roofline(m: Model, batch_size: int, kv_bytes: float, bandwidth_gbs: float) -> float:
  """Tokens/s if a step moved exactly the weights and the live KV bytes at ``bandwidth_gbs``."""
  return batch_size * bandwidth_gbs * 1e9 / (m.weight_bytes + kv_bytes)


def projected_on(device: str, m: Model, method: Method, metrics: dict, draft: Model | None, B: int,
                 context: float, lookup_share: float | None = None) -> dict:
  """The run's τ (and a chain's per-position acceptance) on a published device spec: its verify rows and its
  drafter's forwards priced there, in each implementation regime (``measure.projection``)."""
  kind = drafter_registry.get(method.settings["drafter"])
  dcfg = drafter_registry.draft_config(kind, m.cfg, draft.cfg if kind.draft_model and draft is not None else None,
                                       method.settings.get("draft_layers"))
  chain = str(method.settings.get("tree", "")).startswith("chain:")
  return projection.project_measured(
      device, m.cfg, metrics["mean_accepted_length"], method.k_max, method.engine.drafter.forwards(method.engine.shape),
      dcfg, acceptance=metrics["acceptance_by_position"] if chain else None, draft_share=1.0 - (lookup_share or 0.0),
      B=B, context=int(context), weights=m.weights,
      draft_weights=draft.weights if kind.draft_model and draft is not None else method.settings.get("head_weights"))


def _bandwidth(given: dict | None, when: str, log) -> dict:
  """The read bandwidth given, else measured now (before or after decoding)."""
  if given is not None:
    return given
  log(f"[bench] measuring read bandwidth ({when} decoding)")
  return calibrate.measure_read_bandwidth()


def compare(m: Model, batches, specs: list[dict], *, max_new_tokens: int, max_len: int, eos_ids,
            draft: Model | None = None, repeats: int = 1, paired: bool = True, bandwidth: dict | None = None,
            log=print, timer: Timer | None = None, project: str | None = None,
            sampling: SamplingParams = SamplingParams(), seed: int = 0) -> tuple[dict, list[dict]]:
  """Plain decoding and each speculative setting in ``specs`` (``speculative_method`` keyword dicts, e.g.
  ``{"drafter": "ngram", "k": 5}``, ``{"drafter": "ngram", "tree": "branch:2,2"}`` or, with its own
  ``draft``, ``{"drafter": "eagle", "k": 5, "draft": DIR}``) on the same batches,
  interleaved prompt by prompt (``paired``), ``repeats`` times; the read bandwidth probed before and after.

  Returns (autoregressive results with the roofline, one result dict per spec): totals as before (tokens/s
  over all runs, speedup = ratio of totals), the paired statistics of ``paired.summarize``, acceptance
  metrics, and the speedup predicted from τ and the draft and verify costs timed alone; with ``project`` (a
  published device spec's name) also what the cost model predicts there (``projected_on``).  ``sampling``:
  every method samples with these settings (each prompt batch from its own key, ``batch_key(seed, …)``, the
  same for every method); a spec may carry ``verify``."""
  timer = timer or Timer(log)
  batch_size = batches[0][0].shape[0]
  methods = [autoregressive_method(m, eos_ids, max_len, batch_size, sampling, seed)] + [   # each refused if
      speculative_method(m, eos_ids, max_len, batch_size=batch_size,                     # it cannot fit
                         **{"draft": draft, "sampling": sampling, "seed": seed, **sp}) for sp in specs]
  bw_before = _bandwidth(bandwidth, "before", log)
  timed = time_methods(m, methods, batches, max_new_tokens, max_len, repeats=repeats, paired=paired, log=log,
                       timer=timer)
  bw_after = _bandwidth(bandwidth, "after", log)
  secs, toks = timed["seconds"], timed["tokens"]
  ar_tps = float(toks[0].sum() / secs[0].sum())
  ar_iters = max(1, int(distributed.to_host(timed["stats"][0].iterations)))
  ar_step_s = float(secs[0, 0].sum()) / ar_iters                     # repeat 0: the stats' repeat
  mean_context = float(np.mean(timed["contexts"][0]))
  best_bw = max(bw_before["best"], bw_after["best"])
  kv_bytes = batch_size * mean_context * kv_bytes_per_token(m)
  roofline = _roofline(m, batch_size, kv_bytes, best_bw)
  ar = {
      "repeats": repeats, "paired": paired,
      "ar_tokens_per_s": ar_tps, "ar_step_ms": ar_step_s * 1e3, "ar_decode_tokens": int(toks[0, 0].sum()),
      "ar_tokens_per_s_spread": paired_lib.spread(toks[0], secs[0]),
      "weight_bytes": m.weight_bytes, "kv_bytes_live_mean": kv_bytes,
      "read_bandwidth_gbs": best_bw,
      "read_bandwidth_gbs_before": bw_before["best"], "read_bandwidth_gbs_after": bw_after["best"],
      "read_bandwidth_by_kernel_gbs": {k_: v for k_, v in bw_before.items() if k_ != "best"},
      "roofline_tokens_per_s": roofline, "roofline_fraction": ar_tps / roofline,
      "roofline_fraction_before": ar_tps / _roofline(m, batch_size, kv_bytes, bw_before["best"]),
      "roofline_fraction_after": ar_tps / _roofline(m, batch_size, kv_bytes, bw_after["best"]),
  }
  results = []
  for i, method in enumerate(methods[1:], start=1):
    metrics = spec_metrics(timed["stats"][i])
    arr0, lens0, _ = batches[0]
    t_draft, t_by_width = time_draft_and_verify(m, method.engine, method.draft_params, arr0, lens0, max_len,
                                                timer=timer)
    steps = np.asarray(metrics["verify_rows_steps"], np.float64)   # iterations by live verification rows
    t_verify = float(np.dot(steps, [t_by_width[w] for w in range(1, method.k_max + 2)]) / max(1.0, steps.sum()))
    tau = metrics["mean_accepted_length"]
    predicted = tau * ar_step_s / (t_draft + t_verify)
    stats = paired_lib.summarize(secs[0], toks[0], secs[i], toks[i])
    same, compared = identical_outputs(timed["outputs"][0], timed["outputs"][i])
    results.append({"method": method.label, "outputs_identical": same, "outputs_compared": compared,
        **method.settings, "spec_tokens_per_s": float(toks[i].sum() / secs[i].sum()), **stats, **metrics,
        "draft_ms": t_draft * 1e3, "verify_ms": t_verify * 1e3,
        "verify_ms_full": t_by_width[method.k_max + 1] * 1e3,     # all N+1 rows live: the tree's cost
        "verify_ms_by_rows": {str(w): t * 1e3 for w, t in t_by_width.items()},
        "spec_iteration_ms": float(secs[i, 0].sum()) / max(1, metrics["iterations"]) * 1e3,
        "predicted_speedup": predicted, "efficiency": stats["speedup"] / predicted})
    if timed["lookup_steps"][i] is not None:    # hybrid: the share of live steps drafted by lookup, no forward
      live_steps = float(np.sum(distributed.to_host(timed["stats"][i].verify_steps_B)))
      results[-1]["lookup_step_share"] = timed["lookup_steps"][i] / max(live_steps, 1.0)
    if project:
      results[-1]["projected"] = projected_on(project, m, method, metrics, draft, batch_size, mean_context,
                                              results[-1].get("lookup_step_share"))
    same_text = (f"output identical to plain decoding for {same}/{compared} sequences"
                 if sampling.greedy and "synthetic_alpha" not in method.settings else
                 f"α {metrics.get('acceptance_rate', float('nan')):.3f} (sampled or synthetic: outputs differ from plain "
                 "decoding's by design)")
    log(f"[bench] {method.label}: speedup {stats['speedup']:.3f} (median {stats['speedup_median']:.3f}, 95% CI "
        f"{stats['speedup_ci95'][0]:.3f}-{stats['speedup_ci95'][1]:.3f}), τ {tau:.3f}; {same_text}")
  ar["outputs"] = timed["outputs"]
  return ar, results


def _generations(m: Model, prompts: list[Prompt], labels: list[str], outputs: list) -> list:
  """Each method's output for each prompt (first repeat): {method, question_id, text, token_ids}."""
  rows = []
  for label, per_batch in zip(labels, outputs):
    flat = [toks for batch in per_batch for toks in (batch or [])]
    for prompt, toks in zip(prompts, flat):
      rows.append({"method": label, "question_id": prompt.question_id, "text": m.tokenizer.decode(toks),
                   "token_ids": toks})
  return rows


def bench(m: Model, prompts: list[Prompt], *, batch_size: int = 1, max_new_tokens: int = 128,
          max_len: int | None = None, drafter: str = "none", k: int = 4, ngram: int = 3, draft_layers=None,
          draft: Model | None = None, ignore_eos: bool = False, bandwidth: dict | None = None,
          ngram_caps=DEFAULT_NGRAM_CAPS, repeats: int = 1, paired: bool = True, tree=None, acceptance=None,
          mesh=None, index_tokens: int | None = None, head_weights: str | None = None, log=print,
          chat: bool | None = None, project: str | None = None, temperature: float = 0.0, top_k: int = 0,
          top_p: float = 1.0, verify: str | list[str] = "tokenwise", seed: int = 0,
          synthetic_alpha: float | None = None) -> dict:
  """Autoregressive decoding — and, with a drafter, speculative decoding of each prompt right after or
  before it — next to the machine's measured memory roofline.  Greedy by default; prefill excluded from every
  speed.
  ``chat``: prompts through the chat template (None: when the model has one; ``api.encode_prompts``).
  ``mesh`` ('DATAxMODEL' or a jax Mesh): both methods run sharded over it (``api.on_mesh``).  ``project``: a
  published device spec's name; each speculative result also gives the speedup predicted there (``projected``).
  ``temperature``/``top_k``/``top_p``: every method samples (``seed``: each prompt batch's key derives from it
  and the batch, the same for every method); ``verify``: the rule for sampled drafts (tokenwise or block), or
  a list of them, each a method of the same paired run.  ``synthetic_alpha``: each draft kept with that
  probability (``acceptance.SyntheticAcceptance``: the system's cost at a chosen τ, not lossless)."""
  kind = drafter_registry.get(drafter)
  try:
    sp = SamplingParams(temperature, top_k, top_p)
  except ValueError as e:
    raise SpecjaxError(str(e)) from e
  if project is not None:
    published_spec(project)            # an unknown name fails before any decoding
  if repeats < 1:
    raise SpecjaxError(f"--repeats must be >= 1, got {repeats}")
  if mesh is not None:
    m = on_mesh(m, mesh)
    if draft is not None:
      draft = on_mesh(draft, m.mesh)
  trees = list(tree) if isinstance(tree, (list, tuple)) else [tree]
  # With several trees one acceptance vector serves the static ones (a dynamic tree has no use for it).
  acc_for = lambda t: None if len(trees) > 1 and str(t).startswith("dynamic") else acceptance  # noqa: E731
  choices = [resolve_tree(t, acc_for(t), drafter=drafter, max_len=max_len or AUTO_MAX_LEN_LIMIT)
             for t in trees]          # a bad tree fails before any decoding
  nodes = max([c.num_nodes if c else k for c in choices]) if kind.speculates else 0
  if max_len is None:                 # buffers sized to the request (buffers.buffer_length)
    longest = max(len(e) for e in encode_prompts(m, prompts, chat))
    max_len = buffers.buffer_length(longest, max_new_tokens, nodes)
  # A batch whose buffers cannot fit is refused with the bill before any prompt is batched or compiled.
  check_memory(m, max_len, nodes, batch_size, draft.cfg if kind.draft_model and draft is not None else None)
  t_start = time.perf_counter()
  timer = Timer(log)
  if batch_size > len(prompts):   # fill a large batch by cycling the prompt set
    prompts = [prompts[i % len(prompts)] for i in range(batch_size)]
  batches = make_batches(m, prompts, batch_size, max_new_tokens, max_len, chat)
  eos = () if ignore_eos else tuple(m.tokenizer.eos_token_ids)
  log(f"[bench] {len(prompts)} prompts in {len(batches)} batch(es) of {batch_size}, {repeats} repeat(s), "
      f"{'paired' if paired else 'blocked'}")
  result = {"model": m.source, "batch_size": batch_size, "max_new_tokens": max_new_tokens, "max_len": max_len,
            "prompts": len(prompts), "dtype": str(m.dtype), "weights": m.weights,
            "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
            "backend": jax.default_backend(), "ignore_eos": ignore_eos, "machine": provenance.describe(),
            "mesh": None if m.mesh is None else "x".join(map(str, m.mesh.devices.shape))}
  log(f"[bench] machine: {provenance.short(result['machine'])}")
  specs = [] if not kind.speculates else [
      {"drafter": drafter, "k": k, "ngram": ngram, "draft_layers": draft_layers, "ngram_caps": ngram_caps,
       "tree": t, "acceptance": acc_for(t), "index_tokens": index_tokens, "head_weights": head_weights,
       "verify": v, "synthetic_alpha": synthetic_alpha}
      for t in trees for v in ([verify] if isinstance(verify, str) else verify)]
  ar, spec_results = compare(m, batches, specs, max_new_tokens=max_new_tokens, max_len=max_len, eos_ids=eos,
                             draft=draft, repeats=repeats, paired=paired, bandwidth=bandwidth, log=log,
                             timer=timer, project=project, sampling=sp, seed=seed)
  outputs = ar.pop("outputs")
  result["generations"] = _generations(m, prompts, [AR_LABEL] + [r["method"] for r in spec_results],
                                       outputs)
  result.update(ar)
  if spec_results:
    result.update(spec_results[0])     # one drafter setting: its keys at the top level, as always
  if len(spec_results) > 1:
    result["methods"] = spec_results  # several trees compared in the same run
  wall = time.perf_counter() - t_start
  load_s = m.load_s + getattr(draft, "load_s", 0.0)
  result.update(load_s=load_s, **timer.as_dict(), bench_s=wall)
  result["machine"] = provenance.describe()    # again: now with the kernel paths the run actually took
  log(f"[bench] {wall:.1f}s after loading: compile {timer.compile_s:.1f}s "
      f"({100 * timer.compile_s / max(wall, 1e-9):.0f}%), prefill {timer.prefill_s:.1f}s, "
      f"decode {timer.decode_s:.1f}s; loading took {load_s:.1f}s")
  return result
