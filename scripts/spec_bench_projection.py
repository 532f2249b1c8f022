"""The cost model against Spec-Bench's A100 leaderboard for Vicuna-7B (greedy, fp16, batch 1), row by row.

  python scripts/spec_bench_projection.py [--json]

Reads the two configs (tests/data/vicuna-7b, tests/data/vicuna-68m: config.json alone), refits the eager
regime's two floors to the seven rows (``published.fit_eager``), and prints, for each method given its published
τ: the speedup the a100-sxm-80gb spec predicts with the compiled-program (xla) floors, with the stored eager
floors (``devices.EAGER_*``, fitted to these same rows), and with floors fitted to the other six rows (leave one
out: an error on a row the fit never saw); then the fits with the roofline's overlap at 0 (stored) and at 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def report() -> dict:
  from specjax.checkpoints import load_config
  from specjax.measure import costmodel, devices, published
  target, draft = (load_config(ROOT / "tests" / "data" / n) for n in ("vicuna-7b", "vicuna-68m"))
  rows = published.spec_bench_vicuna7b(target, draft)
  a100 = costmodel.DEVICES[published.SPEC_BENCH_DEVICE]
  eager = costmodel.in_regime(a100, "eager")
  xla = published.predict(rows, a100, target)
  fitted = published.predict(rows, eager, target)
  loo = published.leave_one_out(rows, eager, target)
  table = [{"method": r.method, "tau": r.tau, "published": r.speedup, "verify_rows": r.verify_rows,
            "draft_forwards": sum(p.times for p in r.passes), "xla": x["predicted"],
            "xla_error": x["error"], "eager": f["predicted"], "eager_error": f["error"],
            "held_out": h["predicted"], "held_out_error": h["error"], "shape": r.shape}
           for r, x, f, h in zip(rows, xla, fitted, loo)]
  fits = {}
  for overlap in (0.0, 1.0):
    spec = dataclasses.replace(eager, overlap=overlap)
    a, b = published.fit_eager(rows, spec, target)
    err = [p["error"] for p in published.predict(
        rows, dataclasses.replace(spec, floor_s=a, floor_per_layer_s=b, iteration_floor_s=a), target)]
    fits[f"overlap_{overlap:g}"] = {"floor_ms": a * 1e3, "floor_per_layer_ms": b * 1e3,
                                    "median_abs_error": float(np.median(np.abs(err))),
                                    "max_abs_error": float(np.max(np.abs(err)))}
  summary = lambda key: {"median_abs_error": float(np.median([abs(r[key]) for r in table])),   # noqa: E731
                         "max_abs_error": float(max(abs(r[key]) for r in table))}
  return {"source": published.SPEC_BENCH_SOURCE, "device": a100.name, "context": published.SPEC_BENCH_CONTEXT,
          "stored_floor_ms": devices.EAGER_FLOOR_S * 1e3,
          "stored_floor_per_layer_ms": devices.EAGER_FLOOR_PER_LAYER_S * 1e3,
          "plain_step_ms_eager": costmodel.step_time(eager, target, 1, 1, published.SPEC_BENCH_CONTEXT,
                                                     "float16") * 1e3,
          "rows": table, "xla": summary("xla_error"), "eager": summary("eager_error"),
          "held_out": summary("held_out_error"), "fits": fits}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  out = report()
  if ap.parse_args().json:
    print(json.dumps(out, indent=1))
    return
  print(f"{out['source']}; {out['device']} spec, context {out['context']}; eager floors "
        f"{out['stored_floor_ms']:.3f} ms + {out['stored_floor_per_layer_ms']:.3f} ms per layer "
        f"(plain Vicuna-7B step {out['plain_step_ms_eager']:.1f} ms)")
  print(f"{'method':10s} {'τ':>5s} {'rows':>4s} {'drafts':>6s} {'published':>9s} {'xla':>13s} {'eager':>13s} "
        f"{'held out':>13s}")
  for r in out["rows"]:
    cell = lambda key: f"{r[key]:.2f} ({100 * r[key + '_error']:+.1f}%)"   # noqa: E731
    print(f"{r['method']:10s} {r['tau']:5.2f} {r['verify_rows']:4d} {r['draft_forwards']:6g} {r['published']:8.2f}x "
          f"{cell('xla'):>13s} {cell('eager'):>13s} {cell('held_out'):>13s}")
  for key in ("xla", "eager", "held_out"):
    print(f"{key}: median |error| {100 * out[key]['median_abs_error']:.1f}%, worst "
          f"{100 * out[key]['max_abs_error']:.1f}%")
  for name, f in out["fits"].items():
    print(f"fit with {name}: {f['floor_ms']:.3f} ms + {f['floor_per_layer_ms']:.3f} ms/layer, median "
          f"{100 * f['median_abs_error']:.1f}%, worst {100 * f['max_abs_error']:.1f}%")


if __name__ == "__main__":
  main()
