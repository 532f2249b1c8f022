"""``specjax calibrate``: measure this machine's roofline for the cost model and save it as JSON.

Three probes, each the best of a few repeats:
  bandwidth  the read bandwidth a decoding step can reach: the decode matmul kernel (native on the CPU, else
             XLA) streaming a weight matrix far larger than the caches, one row of x (raw DRAM
             probes are recorded beside it, ``measure_read_bandwidth``);
  matmul     FLOP/s of the decode matmul at 128 rows, best of D = 512 and 1024 (compute-bound: a
             verification or a large batch);
  overlap    how much arithmetic hides behind the memory stream (8 rows over the streamed weight): 1 on
             accelerators, near 0 on a CPU whose cores both stream and compute;
  floor      a step's fixed cost: a tiny model (width 64) decoding one token at two depths, so that the floor
             is a + b · layers (dispatch, the sampling tail, per-kernel launches);
  weights    for each quantized weight type (bf16, int8, int4), the matmul the model runs for it (the native
             kernel where it applies, else XLA's dequantize-and-dot) over a weight that stays in the caches,
             at 1…64 rows: seconds per weight by rows, the compute side of a quantized step in the cost
             model (``DeviceSpec.weight_rates``; the memory side is the bytes of the stored type).

The result is a ``costmodel.DeviceSpec`` named after the machine, saved under the specjax cache
(``calibration/<machine tag>.json``) and reused by later runs on the same machine unless ``--force``.
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache_location, machine, settings
from specjax.models import buffers, config, decode, kv_cache, decoder as model, quant
from specjax.measure import costmodel, provenance
from specjax.kernels import cpu_matmul, cpu_qmatmul, dispatch, native
from specjax.measure import kernel_paths


def measure_read_bandwidth(nbytes: int | None = None, repeats: int = 5) -> dict[str, float]:
  """Best read bandwidth (GB/s) this machine reaches with all its cores, by three streaming kernels.

  The buffer (``settings.probe_bytes()``: 1 GiB unless SPECJAX_PROBE_MB says otherwise) is far larger than the
  last-level cache, so it is DRAM bandwidth that is measured.  Kernels: a BLAS matrix-vector product
  (multi-threaded), a reduction split over one thread per core, and an XLA reduction.  Each is run ``repeats`` times and the best time kept.
  """
  x = np.ones((nbytes or settings.probe_bytes()) // 4, np.float32)
  m = x.reshape(-1, 1024)
  v = np.ones(1024, np.float32)
  cores = machine.cores()
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


def _best_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def _stream_matrix(nbytes: int, D: int = 1024):
  # Random values: pages of identical content may be merged by the host (KSM), which would read from cache.
  return jax.random.normal(jax.random.PRNGKey(0), (nbytes // (4 * D), D), jnp.float32)


def _time_rows(w, M: int, repeats: int) -> float:
  x = jnp.ones((M, w.shape[1]), jnp.float32)
  f = jax.jit(cpu_matmul.matmul_t)
  return _best_seconds(lambda: f(x, w), repeats)


def probe_stream(nbytes: int = 512 << 20, repeats: int = 5) -> float:
  """Bytes/s the decode matmul reaches streaming a [N, 1024] fp32 weight against one row."""
  w = _stream_matrix(nbytes)
  return w.size * 4 / _time_rows(w, 1, repeats)


def probe_matmul(M: int = 128, D: int | tuple[int, ...] = (512, 1024), N: int = 4096, repeats: int = 5) -> float:
  """FLOP/s of the decode matmul at M rows (x[M, D] · w[N, D]ᵀ; compute-bound at this M): the kernel a
  verification or a batch of decode steps runs.  The best over a few widths D: at D = 1024 a 128-row x
  (512 KB) no longer stays in a 512 KB L2 (Zen 3) and the kernel runs ~25% below its peak (114 against
  150 GFLOP/s at D = 512 there), which a roofline should not take for the peak."""
  best = 0.0
  for i, d in enumerate((D,) if isinstance(D, int) else D):
    w = jax.random.normal(jax.random.PRNGKey(1 + i), (N, d), jnp.float32)
    best = max(best, 2 * M * d * N / _time_rows(w, M, repeats))
  return best


def probe_overlap(bandwidth: float, flops: float, rows: int = 8, nbytes: int = 512 << 20,
                  repeats: int = 5) -> float:
  """How much of the arithmetic hides behind the memory stream: a few rows over a weight far larger than the
  caches take max(C, M) + (1 − overlap) · min(C, M)."""
  w = _stream_matrix(nbytes)
  t = _time_rows(w, rows, repeats)
  mem, comp = w.size * 4 / bandwidth, 2 * rows * w.size / flops
  return float(np.clip(1 - (t - max(mem, comp)) / min(mem, comp), 0.0, 1.0))


def probe_weights(kinds=("bf16", "int8", "int4"), rows=(1, 2, 4, 8, 16, 32, 64), N: int = 4096, D: int = 1536,
                  repeats: int = 10) -> dict[str, dict]:
  """Per quantized weight type: the model's matmul for it over an [N, D] weight (12 MB in bf16, 3.5 MB in
  int4: in the last-level cache, so the arithmetic is measured, not the stream) at each of ``rows``, as
  seconds per weight.  A table rather than a fitted line: the kernels change regime with the rows (register
  tiles, then XLA past ``cpu_qmatmul.MAX_ROWS``).  Returns {kind: {"rows": [...], "s_per_weight": [...],
  "ms": {rows: ms}}}."""
  w = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (N, D), jnp.float32))
  backends = dispatch.resolve()
  out = {}
  for kind in kinds:
    qw = quant.quantize(kind, w)
    if backends.activations != "fp32" and backends.native_quant:
      qw = qw.in_tiles()      # the layout a model with integer activations loads (runtime.loaded.load)
    f = jax.jit(lambda x, qw: cpu_qmatmul.qmatmul_t(x, qw, backends=backends))
    ms = {M: _best_seconds(lambda: f(jnp.ones((M, D), jnp.float32), qw), repeats) for M in rows}
    out[kind] = {"rows": [int(M) for M in rows], "s_per_weight": [ms[M] / (N * D) for M in rows],
                 "ms": {int(M): t * 1e3 for M, t in ms.items()}}
  return out


def _tiny_step_seconds(num_layers: int, repeats: int) -> float:
  cfg = config.TINY.replace(name="calib", num_layers=num_layers, d_model=64, num_heads=4, num_kv_heads=2,
                            head_dim=16, ffn_dim=128, vocab_size=256)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  if jax.default_backend() == "cpu":
    params = model.unstack_layers(params)
  cache = kv_cache.init_cache(cfg, 1, 256)
  cache = cache.with_lengths(jnp.full((1,), 64, jnp.int32))
  tok = jnp.zeros((1, 1), jnp.int32)
  pos = jnp.full((1, 1), 64, jnp.int32)

  @jax.jit
  def step(params, cache):
    out = decode.windowed_forward(params, cfg, tok, pos, cache, buckets=buffers.kv_buckets(256))
    return jnp.argmax(out.logits[:, -1], -1), out.cache.k.sum()

  return _best_seconds(lambda: step(params, cache), repeats)


def probe_floor(repeats: int = 30, depths: tuple[int, int] = (2, 32)) -> tuple[float, float]:
  """(a, b): a tiny model's step takes a + b · layers seconds."""
  lo, hi = depths
  t_lo, t_hi = _tiny_step_seconds(lo, repeats), _tiny_step_seconds(hi, repeats)
  b = max((t_hi - t_lo) / (hi - lo), 0.0)
  return max(t_lo - b * lo, 0.0), b


def default_path() -> Path:
  """Per machine and kernel path; integer activations (``SPECJAX_ACTIVATIONS``) measure quantized matmuls
  of their own, so they keep a record of their own."""
  acts = dispatch.activations_choice()
  suffix = "" if acts == "fp32" else f"-activations-{acts}"
  return cache_location.cache_dir() / "calibration" / f"{machine.tag()}-{native.path_name()}{suffix}.json"


def calibrate(path: str | None = None, force: bool = False, log=print, quick: bool = False) -> dict:
  """Measure (or reuse) this machine's spec; returns {"spec": DeviceSpec dict, "probes": ..., "machine": ...}."""
  out = Path(path) if path else default_path()
  if out.is_file() and not force:
    try:
      rec = json.loads(out.read_text(encoding="utf-8"))
      costmodel.DeviceSpec.from_dict(rec["spec"])
      log(f"[calibrate] reusing {out} (--force measures again)")
      if not all(isinstance(r, dict) for r in rec["spec"].get("weight_rates", {}).values()) or not rec[
          "spec"].get("weight_rates"):             # saved before the quantized probe existed: add it
        log("[calibrate] measuring the quantized matmuls it lacks…")
        rates = probe_weights(repeats=3 if quick else 10)
        rec["spec"]["weight_rates"] = {k: {"rows": r["rows"], "s_per_weight": r["s_per_weight"]}
                                       for k, r in rates.items()}
        rec["probes"]["weights"] = rates
        _save(out, rec)
      return rec
    except (ValueError, KeyError, TypeError):
      log(f"[calibrate] {out} is damaged: measuring again")
  kernel_paths.ensure(log=lambda m: log(f"[calibrate] {m}"))   # the probes run the decode kernels
  desc = provenance.describe()
  log(f"[calibrate] {provenance.short(desc)}: bandwidth probe…")
  reps = 2 if quick else 5
  raw = measure_read_bandwidth(nbytes=(256 << 20) if quick else (1 << 30), repeats=reps)
  stream = probe_stream(nbytes=(128 << 20) if quick else (512 << 20), repeats=reps)
  log(f"[calibrate] stream {stream / 1e9:.1f} GB/s (raw DRAM probes best {raw['best']:.1f} GB/s); matmul probe…")
  flops = probe_matmul(repeats=reps)
  overlap = probe_overlap(stream, flops, nbytes=(128 << 20) if quick else (512 << 20), repeats=reps)
  log(f"[calibrate] matmul {flops / 1e9:.1f} GFLOP/s, compute/memory overlap {overlap:.2f}; floor probe…")
  a, b = probe_floor(repeats=10 if quick else 30)
  log(f"[calibrate] floor {a * 1e6:.0f} µs + {b * 1e6:.1f} µs per layer; quantized matmuls…")
  rates = probe_weights(repeats=3 if quick else 10)
  log("[calibrate] quantized matmuls, G weights/s at 1 / 8 / 32 rows: " + ", ".join(
      f"{k} " + " / ".join(f"{1e-9 / t:.0f}" for M, t in zip(r["rows"], r["s_per_weight"]) if M in (1, 8, 32))
      for k, r in rates.items()))
  mem = _memory_bytes()
  spec = costmodel.DeviceSpec(
      name=f"calibrated:{machine.tag()}-{native.path_name()}", peak_flops={"float32": flops}, mem_bandwidth=stream,
      memory_bytes=mem, interconnect_bandwidth=0.0, floor_s=a, floor_per_layer_s=b, overlap=overlap,
      weight_rates={k: {"rows": r["rows"], "s_per_weight": r["s_per_weight"]} for k, r in rates.items()},
      source=f"specjax calibrate on {provenance.short(desc)}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
  rec = {"spec": spec.to_dict(), "machine": desc,
         "probes": {"stream_bytes_per_s": stream, "raw_read_gb_per_s": raw, "matmul_flops": flops,
                    "overlap": overlap,
                    "floor_s": a, "floor_per_layer_s": b, "weights": rates}}
  _save(out, rec)
  log(f"[calibrate] saved {out}")
  return rec


def _save(out: Path, rec: dict) -> None:
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps(rec, indent=2), encoding="utf-8")
  tmp.replace(out)


def load_or_calibrate(device: str | None = None, log=print) -> costmodel.DeviceSpec:
  """The spec to predict with: a published device by name, a calibration file by path, or (None) this
  machine's calibration (measured now if there is none yet)."""
  if device:
    return costmodel.device_spec(device)
  return costmodel.DeviceSpec.from_dict(calibrate(log=log)["spec"])


def _memory_bytes() -> float:
  try:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    return float(np.nan)
