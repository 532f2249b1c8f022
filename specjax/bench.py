"""Measuring decode speed against the machine's own memory roofline.

Decode is bandwidth-bound: a step must stream every weight once plus the KV entries of the live context.
``roofline_tokens_per_s = batch × read_bandwidth ÷ (weight bytes + live KV bytes)`` is the speed no
implementation can beat on this machine; ``roofline_fraction`` is how close a measured speed comes.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.api import Model, check_fits, compiled_generate, encode_prompts, pad_batch
from specjax.kv_cache import init_cache
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
  cfg = m.cfg
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4   # k and v, fp32 cache


def time_generate(m: Model, arr, lens, max_new: int, max_len: int, sp, repeats: int = 2) -> float:
  """Best wall time of one compiled decode loop producing ``max_new`` tokens per sequence (EOS ignored)."""
  B = arr.shape[0]
  fn, _ = compiled_generate(m, B, arr.shape[1], max_len, sp, ())
  best = float("inf")
  for _ in range(repeats):
    cache = init_cache(m.cfg, B, max_len)
    args = (jnp.asarray(arr), jnp.asarray(lens), jnp.full((B,), max_new, jnp.int32), jax.random.PRNGKey(0))
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    res = fn(m.exec_params, cache, *args)
    jax.block_until_ready(res.seq_BxS)
    best = min(best, time.perf_counter() - t0)
  return best


def bench_autoregressive(m: Model, prompts: list[Prompt], batch_size: int = 1, max_new_tokens: int = 128,
                         max_len: int = 2048, temperature: float = 0.0, bandwidth: dict | None = None,
                         log=print) -> dict:
  """Autoregressive decode speed at one batch size, next to the measured roofline, in one run.

  The per-step time is taken from two runs of the same compiled loop (``max_new_tokens`` and 1 new token:
  the difference removes prefill), so it is the steady-state decode speed.
  """
  sp = sampling.SamplingParams(temperature=temperature)
  rows = [prompts[i % len(prompts)] for i in range(batch_size)]
  encoded = encode_prompts(m, rows)
  check_fits([len(e) for e in encoded], max_new_tokens, max_len)
  arr, lens = pad_batch(encoded, batch_size)
  log(f"[bench] batch {batch_size}: compiling and timing {max_new_tokens} new tokens "
      f"(prompt tokens {lens.tolist() if batch_size <= 4 else int(lens.mean())})")
  compiled_generate(m, batch_size, arr.shape[1], max_len, sp, ())
  t_one = time_generate(m, arr, lens, 1, max_len, sp)
  t_all = time_generate(m, arr, lens, max_new_tokens, max_len, sp)
  step_s = (t_all - t_one) / (max_new_tokens - 1)
  ar_tokens_per_s = batch_size / step_s
  if bandwidth is None:
    log("[bench] measuring read bandwidth")
    bandwidth = measure_read_bandwidth()
  bw = bandwidth["best"] * 1e9
  weight_bytes = m.weight_bytes
  mean_context = float(np.mean(lens)) + max_new_tokens / 2
  kv_bytes = batch_size * mean_context * kv_bytes_per_token(m)
  roofline = batch_size * bw / (weight_bytes + kv_bytes)
  return {
      "model": m.source, "batch_size": batch_size, "max_new_tokens": max_new_tokens, "max_len": max_len,
      "dtype": str(jax.tree_util.tree_leaves(m.params)[0].dtype),
      "backend": jax.default_backend(),
      "prompt_tokens_mean": float(np.mean(lens)),
      "ar_step_ms": step_s * 1e3,
      "ar_tokens_per_s": ar_tokens_per_s,
      "prefill_plus_first_token_s": t_one,
      "weight_bytes": weight_bytes,
      "kv_bytes_live_mean": kv_bytes,
      "read_bandwidth_gbs": bandwidth["best"],
      "read_bandwidth_by_kernel_gbs": {k: v for k, v in bandwidth.items() if k != "best"},
      "roofline_tokens_per_s": roofline,
      "roofline_fraction": ar_tokens_per_s / roofline,
  }
