"""Measuring which CPU path a decode-sized matmul and attention take on this machine (once, at load).

What is measured is a dependent chain of ``x · wᵀ`` over ≥ 64 MB of weights of each size class's shape
(``choices.CLASSES``; DRAM-bound, as in a real step), at M = 1 row (a decode step) and M = 5 rows (verifying 4
drafted tokens), scored by their sum: one path serves a weight matrix at every row count.  Native wins ties
within 3% (it also skips dead rows).  The attention kernel is measured the same way: a chain of layers'
attention of one and of five new rows at a short and a long context, native against XLA's windowed
``attention.attend`` (what a forward runs without it).  Before them, the thread count for the native kernels.

``ensure()`` measures what the stored table (``specjax.kernels.choices``) lacks and saves it; ``api.load``
calls it before anything is traced, so no measurement ever starts inside a trace.
"""
from __future__ import annotations

import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import machine, settings
from specjax.models import attention, buffers, decoder as model
from specjax.measure import provenance
from specjax.kernels import choices, cpu_attention, cpu_matmul, native

CHAIN_BYTES = 64 << 20          # weights per measured chain: past the last-level cache (32 MB on an EPYC CCX)
ROWS = (1, 5)                   # a decode step and a k = 4 verification
NATIVE_TIE = 1.03               # native is kept unless XLA is more than 3% faster
# Attention: 8 layers of a small model's grouped-query shape (4 kv heads of 4 query heads, head size 64) over a
# 2048-slot buffer, at ~250 and ~1000 cached tokens (the XLA side reads the window bucket covering them).
ATTENTION = {"layers": 8, "K": 4, "G": 4, "E": 64, "S": 2048, "contexts": (250, 1000)}
_LOCK = threading.Lock()


def _chain(mm, count: int):
  """A jitted dependent chain of `count` products x · wᵀ (each output feeds the next input)."""
  def run(ws, x):
    for w in ws:
      y = mm(x, w)
      x = x + 1e-3 * jnp.tanh(jnp.sum(y, axis=-1, keepdims=True))
    return x
  return jax.jit(run)


def _median_ms(fns, args, rounds: int = 2, calls: int = 3) -> list[float]:
  """Median time of each fn(*args), the fns interleaved so that drift on a shared machine hits all alike."""
  for fn in fns:
    jax.block_until_ready(fn(*args))            # compile and warm up
  times = [[] for _ in fns]
  for _ in range(rounds):
    for i, fn in enumerate(fns):
      for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[i].append(time.perf_counter() - t0)
  return [float(np.median(t)) * 1e3 for t in times]


def _faster(ms: dict) -> str:
  """The path with the smaller summed time; native keeps ties within NATIVE_TIE."""
  return "native" if ms["native"] <= ms["xla"] * NATIVE_TIE else "xla"


def _weights(N: int, D: int) -> list:
  count = max(2, math.ceil(CHAIN_BYTES / (4 * N * D)))
  return [jnp.full((N, D), 0.01 + 1e-4 * i, jnp.float32) for i in range(count)]   # values do not matter


def measure_threads() -> dict:
  """Native M = 1 chain time for a few thread counts: 1, a quarter, half and all of the cores."""
  cores = machine.cores()
  counts = sorted({1, max(1, cores // 4), max(1, cores // 2), cores})
  N, D = choices.CLASSES[0][2]
  ws = _weights(N, D)
  fn = _chain(cpu_matmul.matmul_t_native, len(ws))
  x = jnp.full((1, D), 0.01, jnp.float32)
  result = {}
  for n in counts:                 # the thread count is read on every call: one executable serves all
    choices.set_threads(n)
    result[n] = _median_ms([fn], (ws, x))[0]
  choices.set_threads(None)
  best = min(counts, key=lambda n: (result[n] / (1.03 if n == cores else 1.0), -n))   # ties: more threads
  return {"threads": best, "ms_by_threads": {str(n): t for n, t in result.items()}}


def measure_class(N: int, D: int) -> dict:
  """Native vs XLA for one weight shape, at M = 1 and M = 5, in one interleaved run."""
  ws = _weights(N, D)
  fns = [_chain(cpu_matmul.matmul_t_native, len(ws)), _chain(cpu_matmul.matmul_t_reference, len(ws))]
  ms = {"native": 0.0, "xla": 0.0}
  detail = {}
  for M in ROWS:
    x = jnp.full((M, D), 0.01, jnp.float32)
    t_native, t_xla = _median_ms(fns, (ws, x))
    ms["native"] += t_native
    ms["xla"] += t_xla
    detail[f"M{M}"] = {"native_ms": t_native, "xla_ms": t_xla}
  return {"path": _faster(ms), "shape": [N, D], "chain_bytes": 4 * N * D * len(ws), **detail}


def measure_attention() -> dict:
  """Native vs XLA attention, at 1 and 5 new rows and two contexts, in one interleaved run."""
  L, K, G, E, S = (ATTENTION[k] for k in ("layers", "K", "G", "E", "S"))
  k = jnp.full((L, 1, S, K, E), 0.01, jnp.float32)
  v = jnp.full((L, 1, S, K, E), 0.02, jnp.float32)
  buckets = buffers.kv_buckets(S)

  chains: dict = {}     # the native chain compiles once per T (the context is data), XLA's once per window

  def chain(use_native: bool, window: int, T: int):
    key = (use_native, T, None if use_native else window)
    if key in chains:
      return chains[key]

    def run(q, k, v, lengths, mask):
      def one_layer(layer, q):       # a loop, not unrolled: small programs, quick to compile
        if use_native:
          o = cpu_attention.attend_cache_native(q, k, v, layer, lengths, mask)
        else:
          visible = cpu_attention.visible_slots(lengths, mask, window)
          o = attention.attend(q, k[layer, :, :window], v[layer, :, :window], visible)
        return q + 1e-3 * jnp.tanh(o)
      return jax.lax.fori_loop(0, L, one_layer, q)
    chains[key] = jax.jit(run)
    return chains[key]

  ms = {"native": 0.0, "xla": 0.0}
  detail = {}
  for T in ROWS:
    for ctx in ATTENTION["contexts"]:
      window = next(b for b in buckets if b >= ctx + T)
      args = (jnp.full((1, T, K * G, E), 0.1, jnp.float32), k, v, jnp.asarray([ctx], jnp.int32),
              cpu_attention.causal_mask(1, T))
      t_native, t_xla = _median_ms([chain(True, window, T), chain(False, window, T)], args)
      ms["native"] += t_native
      ms["xla"] += t_xla
      detail[f"T{T}_ctx{ctx}"] = {"native_ms": t_native, "xla_ms": t_xla}
  return {"path": _faster(ms), **detail}


def ensure(log=choices.say) -> dict:
  """Measure whatever the stored table lacks (the thread count, each matmul class, attention) at once, save
  it and return the table.  Nothing to do where the kernels are not built, where ``SPECJAX_NATIVE`` forces a
  path, or where everything is stored.  Called at load, outside any trace (``api.load``, ``calibrate``)."""
  if choices.mode() != "auto" or not native.available():
    return choices.table()
  with _LOCK:
    data = choices.table()
    wanted = choices.missing()
    if not wanted:
      return data
    log(f"measuring the CPU kernel paths on this machine (once; remembered in {choices.choices_path().parent}) ...")
    t0 = time.perf_counter()
    if data["threads"] is None:
      fixed = settings.fixed_threads()
      data["thread_probe"] = {"fixed_by_env": fixed} if fixed else measure_threads()
      data["threads"] = fixed or data["thread_probe"]["threads"]
    choices.set_threads(data["threads"])
    for cname, _, (N, D) in choices.CLASSES:
      if cname in wanted:
        data["classes"][cname] = measure_class(N, D)
    if "attention" in wanted:
      data["attention"] = measure_attention()
    if data.get("machine") is None:
      desc = provenance.describe()
      desc.pop("kernel_choices", None)
      data["machine"] = desc
    choices.save(data)
    said = [f"{c}: {data['classes'][c]['path']}" for c, _, _ in choices.CLASSES if c in wanted]
    said += [f"attention: {data['attention']['path']}"] if "attention" in wanted else []
    log("  " + ", ".join(said) + f"; {data['threads']} thread(s); {time.perf_counter() - t0:.1f}s")
    return data
