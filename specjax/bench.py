"""Measuring decode speed against the machine's own memory roofline.

Decode is bandwidth-bound: a step must stream every weight once plus the KV entries of the live context.
``roofline_tokens_per_s = batch × read_bandwidth ÷ (weight bytes + live KV bytes)`` is the speed no
implementation can beat on this machine; ``roofline_fraction`` is how close a measured speed comes.
"""
from __future__ import annotations

import time
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decode, sampling
from specjax import speculative as spec
from specjax.api import (DEFAULT_NGRAM_CAPS, Model, build_drafter, check_fits, compile_generate, encode_prompts,
                         make_engine, pad_batch, parse_layers, spec_metrics)
from specjax.kv_cache import cache_bytes, init_cache
from specjax.prompts import Prompt


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
  """Best read bandwidth (GB/s) this machine reaches with all its cores, by three streaming kernels.

  The buffer (1 GiB by default) is far larger than the last-level cache, so it is DRAM bandwidth that is
  measured.  Kernels: a BLAS matrix-vector product (multi-threaded), a reduction split over one thread per
  core, and an XLA reduction.  Each is run ``repeats`` times and the best time kept.
  """
  x = np.ones(nbytes // 4, np.float32)
  m = x.reshape(-1, 1024)
  v = np.ones(1024, np.float32)
  cores = os.cpu_count() or 1
  parts = np.array_split(m, cores * 4)

  def best(fn) -> float:
    fn()
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    return x.nbytes / min(times) / 1e9

  results = {"blas_matvec": best(lambda: m @ v)}
  with ThreadPoolExecutor(cores) as pool:
    results["threaded_sum"] = best(lambda: list(pool.map(lambda a: a.sum(), parts)))
  xj = jnp.asarray(x)
  jsum = jax.jit(jnp.sum)
  results["xla_sum"] = best(lambda: jsum(xj).block_until_ready())
  del xj
  results["best"] = max(results.values())
  return results


def kv_bytes_per_token(m: Model) -> int:
  return cache_bytes(m.cfg, batch_size=1, max_len=1)   # k and v of one position, fp32 cache


class Timer:
  """Where a benchmark's wall time went: compiling (or reading executables from the compilation cache),
  prefill, and the timed decode loops."""

  def __init__(self, log=print):
    self.compile_s = self.prefill_s = self.decode_s = 0.0
    self.log = log

  def as_dict(self) -> dict:
    return {"compile_s": self.compile_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s}


def _compiled(m: Model, engine, draft_params, arr, max_len: int, timer: Timer):
  init_fn, loop_fn, seconds = compile_generate(m, engine, arr.shape[0], arr.shape[1], max_len, draft_params,
                                               log=lambda msg: timer.log(f"[bench] {msg}"))
  timer.compile_s += seconds
  return init_fn, loop_fn


def _prefill_and_decode(m: Model, engine, draft_params, arr, lens, max_new: int, max_len: int, k_max: int,
                        timer: Timer):
  """Prefill (timed apart), then the decode loop alone, timed: (decode seconds, final state)."""
  B = arr.shape[0]
  init_fn, loop_fn = _compiled(m, engine, draft_params, arr, max_len, timer)
  t0 = time.perf_counter()
  state = init_fn(m.prefill_params, draft_params, init_cache(m.cfg, B, max_len),
                  *jax.device_put((arr, lens, np.full((B,), max_new, np.int32))), jax.random.PRNGKey(0))
  k_active = jax.device_put(np.full((B,), k_max, np.int32))
  jax.block_until_ready((state, k_active))
  t1 = time.perf_counter()
  res = loop_fn(m.exec_params, draft_params, state, k_active)
  jax.block_until_ready(res.seq_BxS)
  t2 = time.perf_counter()
  timer.prefill_s += t1 - t0
  timer.decode_s += t2 - t1
  return t2 - t1, res


def time_decode(m: Model, engine, draft_params, batches, max_new: int, max_len: int, k_max: int,
                repeats: int = 1, log=print, timer: Timer | None = None) -> dict:
  """Decode time over all batches, prefill excluded: each batch is prefilled, then the on-device loop that
  produces the tokens after the first is timed alone (the same executables as ``generate``).  A first short
  run on the first batch compiles both (or reads them from the compilation cache) and warms up."""
  timer = timer or Timer(log)
  arr0, lens0, _ = batches[0]
  _prefill_and_decode(m, engine, draft_params, arr0, lens0, 2, max_len, k_max, timer)
  decode_s, tokens, stats, contexts = 0.0, 0, None, []
  for bi, (arr, lens, live) in enumerate(batches):
    runs = [_prefill_and_decode(m, engine, draft_params, arr, lens, max_new, max_len, k_max, timer)
            for _ in range(repeats)]
    t_all, res = min(runs, key=lambda r: r[0])
    num_new = np.asarray(res.num_new_B)[:live]
    decode_s += max(t_all, 1e-9)
    tokens += int(np.sum(np.maximum(num_new - 1, 0)))
    contexts += [float(l + n / 2) for l, n in zip(lens[:live], num_new)]
    stats = res.stats if stats is None else jax.tree_util.tree_map(lambda a, b: a + b, stats, res.stats)
    if len(batches) > 1:
      log(f"[bench] {engine.drafter.name} k={k_max}: batch {bi + 1}/{len(batches)}")
  return {"decode_s": decode_s, "tokens": tokens, "tokens_per_s": tokens / decode_s, "stats": stats,
          "mean_context": float(np.mean(contexts))}


def time_draft_and_verify(m: Model, engine, draft_params, arr, lens, max_len: int,
                          repeats: int = 9, timer: Timer | None = None) -> tuple[float, dict[int, float]]:
  """Measured cost of one propose (all k_max draft tokens) and of one verify forward with 1, ..., k_max+1 live
  rows, each timed alone (median), from the state right after prefill.  Caches are donated and fed back, as
  in the loop, so no timing includes a copy of a KV buffer."""
  timer = timer or Timer()
  B = arr.shape[0]
  K = engine.k_max
  init_fn, _ = _compiled(m, engine, draft_params, arr, max_len, timer)
  state = init_fn(m.prefill_params, draft_params, init_cache(m.cfg, B, max_len),
                  *jax.device_put((arr, lens, np.full((B,), 2, np.int32))), jax.random.PRNGKey(0))
  lengths = state.cache.lengths

  @functools.partial(jax.jit, donate_argnums=(1,))
  def propose(dp, draft_state, seq_BxS, last_B):
    new_state, toks, _, _ = engine.drafter.propose(dp, draft_state, seq_BxS, lengths, last_B, K,
                                                   jax.random.PRNGKey(1), engine.sp)
    return new_state, toks

  @functools.partial(jax.jit, donate_argnums=(1,))
  def verify(tp, cache, last_B, rows):
    toks = jnp.concatenate([last_B[:, None], jnp.zeros((B, K), jnp.int32)], axis=1)
    pos = lengths[:, None] + jnp.arange(K + 1)[None, :]
    out = decode.windowed_forward(tp, engine.cfg, toks, pos, cache.with_lengths(lengths),
                                  buckets=engine.buckets, live_T=rows)
    return out.cache, out.logits

  seq, last = state.seq_BxS, state.last_B
  t0 = time.perf_counter()
  propose_c = propose.lower(draft_params, state.draft, seq, last).compile() if K else None
  verify_c = verify.lower(m.exec_params, state.cache, last, jnp.int32(1)).compile()
  timer.compile_s += time.perf_counter() - t0

  def median(fn, carry):
    times = []
    for i in range(repeats + 1):
      t0 = time.perf_counter()
      carry, out = fn(carry)
      jax.block_until_ready(out)
      if i:                        # the first call warms up
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), carry

  t_draft = median(lambda c: propose_c(draft_params, c, seq, last), state.draft)[0] if K else 0.0
  t_verify, cache = {}, state.cache
  for w in range(1, K + 2):
    t_verify[w], cache = median(lambda c, w=w: verify_c(m.exec_params, c, last, jnp.int32(w)), cache)
  return t_draft, t_verify


def make_batches(m: Model, prompts: list[Prompt], batch_size: int, max_new: int, max_len: int):
  """Chat-templated prompts in batches, each padded to its own prompt bucket (as ``generate`` does): the
  decode loop is one executable per engine whatever the padding, and only prefill is compiled per bucket,
  so short prompts are not prefilled at the longest one's length."""
  encoded = encode_prompts(m, prompts)
  check_fits([len(e) for e in encoded], max_new, max_len)
  batches = []
  for s in range(0, len(encoded), batch_size):
    chunk = encoded[s:s + batch_size]
    arr, lens = pad_batch(chunk, batch_size)
    batches.append((arr, lens, len(chunk)))
  return batches


def measure_autoregressive(m: Model, batches, *, max_new_tokens: int, max_len: int, eos_ids,
                           bandwidth: dict | None = None, log=print, timer: Timer | None = None) -> dict:
  """Plain decoding speed over ``batches`` and the memory roofline it is compared with."""
  sp = sampling.SamplingParams()
  batch_size = batches[0][0].shape[0]
  engine = make_engine(m, spec.NoDrafter(), 0, sp, eos_ids, max_len)
  ar = time_decode(m, engine, (), batches, max_new_tokens, max_len, 0, log=log, timer=timer)
  ar_step_s = ar["decode_s"] / max(1, int(np.asarray(ar["stats"].iterations)))
  if bandwidth is None:
    log("[bench] measuring read bandwidth")
    bandwidth = measure_read_bandwidth()
  kv_bytes = batch_size * ar["mean_context"] * kv_bytes_per_token(m)
  roofline = batch_size * bandwidth["best"] * 1e9 / (m.weight_bytes + kv_bytes)
  return {
      "ar_tokens_per_s": ar["tokens_per_s"], "ar_step_ms": ar_step_s * 1e3, "ar_decode_tokens": ar["tokens"],
      "weight_bytes": m.weight_bytes, "kv_bytes_live_mean": kv_bytes,
      "read_bandwidth_gbs": bandwidth["best"],
      "read_bandwidth_by_kernel_gbs": {k_: v for k_, v in bandwidth.items() if k_ != "best"},
      "roofline_tokens_per_s": roofline, "roofline_fraction": ar["tokens_per_s"] / roofline,
  }


def measure_speculative(m: Model, batches, ar: dict, *, drafter: str, k: int, max_new_tokens: int,
                        max_len: int, eos_ids, ngram: int = 3, draft_layers=None, draft: Model | None = None,
                        ngram_caps=DEFAULT_NGRAM_CAPS, log=print, timer: Timer | None = None) -> dict:
  """Speculative decoding speed over the same batches, its acceptance metrics, and the speedup predicted
  from the measured τ and the measured costs of one draft round and one verify forward (at each
  verification width, weighted by how often the loop used it)."""
  sp = sampling.SamplingParams()
  batch_size = batches[0][0].shape[0]
  d_obj, d_params, k_max = build_drafter(m, drafter, k=k, ngram=ngram, draft_layers=draft_layers, draft=draft,
                                         max_len=max_len, ngram_caps=ngram_caps)
  engine = make_engine(m, d_obj, k_max, sp, eos_ids, max_len)
  sd = time_decode(m, engine, d_params, batches, max_new_tokens, max_len, k_max, log=log, timer=timer)
  metrics = spec_metrics(sd["stats"])
  arr0, lens0, _ = batches[0]
  t_draft, t_by_width = time_draft_and_verify(m, engine, d_params, arr0, lens0, max_len, timer=timer)
  steps = np.asarray(metrics["verify_rows_steps"], np.float64)   # iterations by live verification rows
  t_verify = float(np.dot(steps, [t_by_width[w] for w in range(1, k_max + 2)]) / max(1.0, steps.sum()))
  tau = metrics["mean_accepted_length"]
  predicted = tau * ar["ar_step_ms"] / 1e3 / (t_draft + t_verify)
  speedup = sd["tokens_per_s"] / ar["ar_tokens_per_s"]
  out = {"drafter": drafter, "k": k_max, "spec_tokens_per_s": sd["tokens_per_s"], "speedup": speedup,
         **metrics, "draft_ms": t_draft * 1e3, "verify_ms": t_verify * 1e3,
         "verify_ms_by_rows": {str(w): t * 1e3 for w, t in t_by_width.items()},
         "spec_iteration_ms": sd["decode_s"] / max(1, metrics["iterations"]) * 1e3,
         "predicted_speedup": predicted, "efficiency": speedup / predicted}
  if drafter == "layerskip":
    out["draft_layers"] = list(parse_layers(draft_layers, m.cfg.num_layers))
  return out


def bench(m: Model, prompts: list[Prompt], *, batch_size: int = 1, max_new_tokens: int = 128,
          max_len: int = 2048, drafter: str = "none", k: int = 4, ngram: int = 3, draft_layers=None,
          draft: Model | None = None, ignore_eos: bool = False, bandwidth: dict | None = None,
          ngram_caps=DEFAULT_NGRAM_CAPS, log=print) -> dict:
  """Autoregressive decoding — and, with a drafter, speculative decoding on the same prompts — in one run,
  next to the machine's measured memory roofline.  Greedy; prefill excluded from every speed."""
  t_start = time.perf_counter()
  timer = Timer(log)
  if batch_size > len(prompts):   # fill a large batch by cycling the prompt set
    prompts = [prompts[i % len(prompts)] for i in range(batch_size)]
  batches = make_batches(m, prompts, batch_size, max_new_tokens, max_len)
  eos = () if ignore_eos else tuple(m.tokenizer.eos_token_ids)
  log(f"[bench] {len(prompts)} prompts in {len(batches)} batch(es) of {batch_size}")
  result = {"model": m.source, "batch_size": batch_size, "max_new_tokens": max_new_tokens, "max_len": max_len,
            "prompts": len(prompts), "dtype": str(jax.tree_util.tree_leaves(m.params)[0].dtype),
            "backend": jax.default_backend(), "ignore_eos": ignore_eos}
  if bandwidth is None:
    t0 = time.perf_counter()
    log("[bench] measuring read bandwidth")
    bandwidth = measure_read_bandwidth()
    result["bandwidth_s"] = time.perf_counter() - t0
  result.update(measure_autoregressive(m, batches, max_new_tokens=max_new_tokens, max_len=max_len,
                                       eos_ids=eos, bandwidth=bandwidth, log=log, timer=timer))
  if drafter != "none":
    result.update(measure_speculative(m, batches, result, drafter=drafter, k=k, max_new_tokens=max_new_tokens,
                                      max_len=max_len, eos_ids=eos, ngram=ngram, draft_layers=draft_layers,
                                      draft=draft, ngram_caps=ngram_caps, log=log, timer=timer))
  wall = time.perf_counter() - t_start
  load_s = m.load_s + (draft.load_s if draft is not None else 0.0)
  result.update(load_s=load_s, **timer.as_dict(), bench_s=wall)
  log(f"[bench] {wall:.1f}s after loading: compile {timer.compile_s:.1f}s "
      f"({100 * timer.compile_s / max(wall, 1e-9):.0f}%), prefill {timer.prefill_s:.1f}s, "
      f"decode {timer.decode_s:.1f}s; loading took {load_s:.1f}s")
  return result
