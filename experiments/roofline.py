"""Roofline: the real model's measured step time over a grid of batch B × new rows T, against the calibrated
cost model's prediction (``specjax.measure.costmodel``).

Each point times one target forward of B sequences × T new tokens at a fixed committed context, exactly the
forward a decoding or verification step runs (native kernels on the CPU, the KV buffer donated so nothing is
copied), the median of ``repeats`` after a warm-up.  Error = predicted ÷ measured − 1.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import api
from specjax.models import buffers, decode, kv_cache
from specjax.measure import costmodel
from specjax.measure import calibrate


def time_forward(m: api.Model, B: int, T: int, context: int, repeats: int = 5) -> float:
  """Median seconds of one forward of B × T new tokens after ``context`` committed ones."""
  S = buffers.round_up_bucket(context + T + 1, 64)
  cfg = m.cfg
  buckets = buffers.kv_buckets(S)

  def fwd(params, cache, tokens, positions):
    out = decode.windowed_forward(params, cfg, tokens, positions, cache, buckets=buckets)
    return out.cache, out.logits[:, :, 0]

  f = jax.jit(fwd, donate_argnums=(1,))
  cache = kv_cache.init_cache(cfg, B, S)
  lengths = np.full((B,), context, np.int32)     # host array: a fresh buffer each call (the cache is donated)
  tokens = jax.device_put(np.random.default_rng(B * 100 + T).integers(3, cfg.vocab_size, (B, T)).astype(np.int32))
  positions = jax.device_put(np.broadcast_to(context + np.arange(T, dtype=np.int32), (B, T)).copy())
  times = []
  for i in range(repeats + 1):
    cache = cache.with_lengths(lengths)
    t0 = time.perf_counter()
    cache, logits = f(m.exec_params, cache, tokens, positions)
    jax.block_until_ready(logits)
    if i:                      # the first call compiles
      times.append(time.perf_counter() - t0)
  return statistics.median(times)


def roofline(model: str = "smollm2-135m", batches=(1, 2, 4, 8, 16, 32), rows=(1, 2, 4, 8, 16),
             context: int = 128, repeats: int = 5, device: str | None = None, recalibrate: bool = False,
             log=print) -> dict:
  """Measure step time over batches × rows and compare with the cost model (``device``: a published spec
  name or a calibration JSON; default: this machine's calibration, measured first if missing)."""
  if device:
    spec = costmodel.device_spec(device)
    probes = None
  else:
    rec = calibrate.calibrate(force=recalibrate, log=log)
    spec, probes = costmodel.DeviceSpec.from_dict(rec["spec"]), rec.get("probes")
  m = api.load(model)
  out_rows = []
  for B in batches:
    for T in rows:
      measured = time_forward(m, B, T, context, repeats)
      b = costmodel.breakdown(spec, m.cfg, B, T, context)
      err = b["predicted_s"] / measured - 1
      out_rows.append({"B": B, "T": T, "rows": B * T, "context": context, "measured_ms": measured * 1e3,
                       "predicted_ms": b["predicted_s"] * 1e3, "compute_ms": b["compute_s"] * 1e3,
                       "memory_ms": b["memory_s"] * 1e3, "floor_ms": b["floor_s"] * 1e3, "bound": b["bound"],
                       "intensity": b["intensity"], "error": err,
                       "tokens_per_s_measured": B * T / measured})
      log(f"[roofline] B={B:>2} T={T:>2}: measured {measured * 1e3:8.2f} ms, predicted "
          f"{b['predicted_s'] * 1e3:8.2f} ms ({b['bound']}-bound), error {err:+.1%}")
  errs = [abs(r["error"]) for r in out_rows]
  summary = {"median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
             "ridge_flop_per_byte": spec.ridge("float32"), "spec": spec.to_dict(), "probes": probes}
  log(f"[roofline] median |error| {summary['median_abs_error']:.1%}, worst {summary['max_abs_error']:.1%}")
  return {"title": f"roofline: {model}, context {context}, fp32", "rows": out_rows, "summary": summary,
          **summary, "plots": []}


def plot(result: dict, out_dir) -> None:
  """Measured points against the predicted curve: step time vs B for each T (log-log), and the error."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["rows"]
  Ts = sorted({r["T"] for r in rows})
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, T in enumerate(Ts):
    sel = sorted((r for r in rows if r["T"] == T), key=lambda r: r["B"])
    c = f"C{i}"
    ax.plot([r["B"] for r in sel], [r["measured_ms"] for r in sel], "o", color=c, label=f"T={T} measured")
    ax.plot([r["B"] for r in sel], [r["predicted_ms"] for r in sel], "-", color=c, alpha=0.7)
    ax2.plot([r["B"] for r in sel], [100 * r["error"] for r in sel], "o-", color=c, label=f"T={T}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("batch B")
  ax.set_ylabel("step time (ms)")
  ax.set_title(f"measured (dots) vs predicted (lines), context {result['rows'][0]['context']}")
  ax.legend(fontsize=7, ncol=2)
  ax.grid(alpha=0.3, which="both")
  ax2.axhline(0, color="k", lw=0.8)
  for lim in (-15, 15):
    ax2.axhline(lim, color="gray", ls="--", lw=0.8)
  ax2.set_xscale("log", base=2)
  ax2.set_xlabel("batch B")
  ax2.set_ylabel("predicted ÷ measured − 1 (%)")
  ax2.set_title(f"error: median |e| {result['median_abs_error']:.1%}, worst {result['max_abs_error']:.1%}")
  ax2.legend(fontsize=7)
  ax2.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_dir / "roofline.png", dpi=120)
  plt.close(fig)
