"""Which CPU path a decode-sized matmul takes on this machine, chosen by measurement and remembered per CPU.

The native kernel (``cpu_matmul.cc``) beats XLA's matrix-vector code on the CPUs we measured, but not on
every CPU: where the build falls back to the portable loop (no AVX2), XLA is faster, and on a many-core
machine fewer threads than cores may stream the weights fastest.  So at first use this module measures, once
per machine (CPU model, core count, kernel sources): the thread count for the native kernels, then for each
weight-size class native against XLA, and writes the result to ``<cache>/kernels/choices/<machine>.json``.
Later processes read the file.

What is measured is a dependent chain of ``x · wᵀ`` over ≥ 64 MB of weights of the class's shape (DRAM-bound,
as in a real step), at M = 1 row (a decode step) and M = 5 rows (verifying 4 drafted tokens), scored by their
sum: one path serves a weight matrix at every row count, so a verification row gets the very bits of a decode
row and greedy speculative decoding stays token-exact.  Native wins ties within 3% (it also skips dead rows).

The attention kernel (``cpu_attention.cc``) is measured the same way, once: a chain of layers' attention of
one and of five new rows at a short and a long context, native against XLA's windowed ``model.attend`` (what
a forward runs without it); one path then serves every row count.

``SPECJAX_NATIVE`` overrides the measurement: ``1`` always native, ``0`` never (XLA everywhere); unset or
``auto`` measures.  ``SPECJAX_THREADS=N`` fixes the thread count.
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache_location import cache_dir
from specjax.kernels import native

VERSION = 3
CHAIN_BYTES = 64 << 20          # weights per measured chain: past the last-level cache (32 MB on an EPYC CCX)
ROWS = (1, 5)                   # a decode step and a k = 4 verification
NATIVE_TIE = 1.03               # native is kept unless XLA is more than 3% faster
# Weight-size classes (bytes of one fp32 matrix) and the shape each is measured with: a transformer layer's
# matrices in a small model, where per-call costs show, and large ones (an LM head, a 7B model's layers) that
# only stream.  Two classes keep the first-use measurement to a few seconds (each chain compiles).
CLASSES = (("small", 16 << 20, (1536, 768)), ("large", None, (8192, 1024)))
# Attention: 8 layers of a small model's grouped-query shape (4 kv heads of 4 query heads, head size 64) over a
# 2048-slot buffer, at ~250 and ~1000 cached tokens (the XLA side reads the window bucket covering them).
ATTENTION = {"layers": 8, "K": 4, "G": 4, "E": 64, "S": 2048, "contexts": (250, 1000)}
_STATE: dict = {}
_LOCK = threading.RLock()


def mode() -> str:
  """'native', 'xla' or 'auto' (measure), from ``SPECJAX_NATIVE``."""
  v = os.environ.get("SPECJAX_NATIVE", "auto").strip()
  return {"1": "native", "0": "xla"}.get(v, "auto")


def size_class(N: int, D: int) -> str:
  nbytes = 4 * N * D
  return next(name for name, limit, _ in CLASSES if limit is None or nbytes < limit)


def choices_path() -> Path:
  from specjax.calibrate import machine_tag
  # The kernel path in the name: a path forced with SPECJAX_CPU_ISA is measured on its own.
  return cache_dir() / "kernels" / "choices" / f"{machine_tag()}-{native.source_digest()}-{native.isa()}.json"


def _say(message: str) -> None:
  sys.stderr.write(f"[specjax] {message}\n")
  sys.stderr.flush()


def _load() -> dict:
  path = choices_path()
  try:
    data = json.loads(path.read_text())
    if data.get("version") == VERSION and isinstance(data.get("classes"), dict):
      return data
    _say(f"{path} is from another version: measuring the CPU kernel paths again")
  except FileNotFoundError:
    pass
  except (OSError, ValueError):
    _say(f"{path} is unreadable: measuring the CPU kernel paths again")
  from specjax import machine
  desc = machine.describe()
  desc.pop("kernel_choices", None)
  return {"version": VERSION, "machine": desc, "threads": None, "classes": {}}


def _save(data: dict) -> None:
  path = choices_path()
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(data, indent=2))
  os.replace(tmp, path)                        # a killed process leaves the old file or the new one


def _table() -> dict:
  if "data" not in _STATE:
    _STATE["data"] = _load()
  return _STATE["data"]


# ----------------------------------------------------------------------------------------------------------
# Measuring


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


def set_threads(n: int | None) -> None:
  """Use n threads (caller + helpers) in the native kernels; None: all."""
  if native.available():
    import ctypes
    lib = native._STATE["lib"]
    lib.SpecjaxSetThreads.argtypes = [ctypes.c_int64]
    lib.SpecjaxSetThreads.restype = ctypes.c_int64
    lib.SpecjaxSetThreads(int(n or 0))


def _cores() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def measure_threads() -> dict:
  """Native M = 1 chain time for a few thread counts: 1, a quarter, half and all of the cores."""
  from specjax.kernels import cpu_matmul
  cores = _cores()
  counts = sorted({1, max(1, cores // 4), max(1, cores // 2), cores})
  N, D = CLASSES[0][2]
  ws = _weights(N, D)
  fn = _chain(cpu_matmul.matmul_t_native, len(ws))
  x = jnp.full((1, D), 0.01, jnp.float32)
  result = {}
  for n in counts:                 # the thread count is read on every call: one executable serves all
    set_threads(n)
    result[n] = _median_ms([fn], (ws, x))[0]
  set_threads(None)
  best = min(counts, key=lambda n: (result[n] / (1.03 if n == cores else 1.0), -n))   # ties: more threads
  return {"threads": best, "ms_by_threads": {str(n): t for n, t in result.items()}}


def measure_class(N: int, D: int) -> dict:
  """Native vs XLA for one weight shape, at M = 1 and M = 5, in one interleaved run."""
  from specjax.kernels import cpu_matmul
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
  from specjax import decode, model
  from specjax.kernels import cpu_attention
  L, K, G, E, S = (ATTENTION[k] for k in ("layers", "K", "G", "E", "S"))
  k = jnp.full((L, 1, S, K, E), 0.01, jnp.float32)
  v = jnp.full((L, 1, S, K, E), 0.02, jnp.float32)
  buckets = decode.kv_buckets(S)

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
          o = model.attend(q, k[layer, :, :window], v[layer, :, :window], visible)
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


def measure_all(log=_say) -> dict:
  """Measure every class (and the thread count) now and save; returns the table."""
  with _LOCK:
    data = _table()
    data["classes"] = {}
    data["threads"] = None
    data.pop("attention", None)
    _ensure(log)
    return data


def _ensure(log) -> None:
  """Measure whatever is missing (the thread count, each matmul class, attention) at once.  Runs on a thread
  of its own: the first decision is made while jax traces a model, and work started from inside a trace would
  be staged into it instead of running (jax's trace state is per thread)."""
  data = _table()
  wanted = [c for c in CLASSES if c[0] not in data["classes"]]
  want_attention = "attention" not in data
  if data["threads"] is not None and not wanted and not want_attention:
    set_threads(data["threads"])
    return
  log(f"measuring the CPU kernel paths on this machine (once; remembered in {choices_path().parent}) ...")
  errors: list = []

  def work():
    try:
      t0 = time.perf_counter()
      if data["threads"] is None:
        fixed = os.environ.get("SPECJAX_THREADS")
        data["thread_probe"] = {"fixed_by_env": int(fixed)} if fixed else measure_threads()
        data["threads"] = int(fixed) if fixed else data["thread_probe"]["threads"]
      set_threads(data["threads"])
      for cname, _, (N, D) in wanted:
        data["classes"][cname] = measure_class(N, D)
      if want_attention:
        data["attention"] = measure_attention()
      _save(data)
      said = [f"{c}: {data['classes'][c]['path']}" for c, _, _ in wanted]
      said += [f"attention: {data['attention']['path']}"] if want_attention else []
      log("  " + ", ".join(said) + f"; {data['threads']} thread(s); {time.perf_counter() - t0:.1f}s")
    except Exception as e:   # noqa: BLE001 - reported on the caller's thread
      errors.append(e)

  thread = threading.Thread(target=work, name="specjax-kernel-autotune")
  thread.start()
  thread.join()
  if errors:
    raise errors[0]


# ----------------------------------------------------------------------------------------------------------
# Deciding


def _native_chosen(path_of) -> bool:
  """The rule both decisions share: SPECJAX_NATIVE if set, else the measured path (``path_of(table)``, None
  while unmeasured), measuring everything still missing on the first call of a process."""
  m = mode()
  if m != "auto":
    return m == "native"
  with _LOCK:
    data = _table()
    if path_of(data) is None or "threads_set" not in _STATE:
      _ensure(_say)                # everything still missing at once: one short pause, one line
      _STATE["threads_set"] = True
    return path_of(data) == "native"


def matmul_native(N: int, D: int) -> bool:
  """Whether a decode-sized x · wᵀ with weight [N, D] takes the native kernel here (measured at first use)."""
  name = size_class(N, D)
  return _native_chosen(lambda data: data["classes"].get(name, {}).get("path"))


def attention_native() -> bool:
  """Whether decode-sized attention takes the native kernel here (measured at first use)."""
  return _native_chosen(lambda data: data.get("attention", {}).get("path"))


def summary() -> dict:
  """What is decided so far (for bench JSON and run directories): mode, threads and path per class."""
  if mode() != "auto":
    return {"mode": mode()}
  data = _STATE.get("data") or {}
  paths = {c: v["path"] for c, v in (data.get("classes") or {}).items()}
  if "attention" in data:
    paths["attention"] = data["attention"]["path"]
  return {"mode": "auto", "threads": data.get("threads"), "paths": paths}


def forget() -> None:
  """Drop the in-process table (tests; after the cache was cleared)."""
  with _LOCK:
    _STATE.clear()
    if native.available():
      set_threads(None)
