"""The cost model's speedup beside the measured one, for every chain of a ``specjax bench --json`` result.

  python scripts/cost_vs_measured.py BENCH.json [--device h200 | calibration.json] [--draft-model NAME]

For each chain method of the bench (the top-level one, or each of ``methods``) it predicts the speedup with
``costmodel.predicted_speedup`` on this machine's calibration (``specjax calibrate``; or ``--device``), the
method's measured per-position acceptance, the run's mean context and the draft model's config (the
registry's draft of the bench's model by default, for ``--drafter model``; none for n-gram), and prints
measured, predicted and the relative error. Trees are listed without a prediction (the model prices chains).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def predictions(bench: dict, device=None, draft_model: str | None = None, log=print) -> list[dict]:
  from specjax.models import config
  from specjax.measure import memory
  from specjax.measure import calibrate
  from specjax.checkpoints import catalog as registry
  from specjax.speculative import registry as drafter_registry
  cfg = config.PRESETS.get(bench["model"])
  if cfg is None:
    raise SystemExit(f"{bench['model']}: only registry models with a preset config are supported here")
  spec = calibrate.load_or_calibrate(device, log=log)
  methods = bench.get("methods") or [bench]
  context = int(bench["kv_bytes_live_mean"] / max(1, bench["batch_size"]) / memory.kv_bytes_per_token(cfg))
  from experiments.coder_pair import cost_model_speedup
  rows = []
  for r in methods:
    kind = drafter_registry.get(r["drafter"])
    dname = draft_model or (registry.default_draft(bench["model"]) if kind.draft_model else None)
    pred = cost_model_speedup(spec, cfg, r, context, bench.get("dtype", "float32"),
                              config.PRESETS.get(dname) if dname else None)
    rows.append({"method": r.get("method", f"{r['drafter']} {r.get('tree') or 'chain:' + str(r['k'])}"),
                 "measured": r["speedup"], "measured_median": r.get("speedup_median"), "cost_model": pred,
                 "error": None if pred is None else pred / r["speedup"] - 1.0,
                 "tau": r["mean_accepted_length"], "device": spec.name, "context": context})
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("bench_json")
  ap.add_argument("--device", default=None, help="a published spec or a calibration JSON (default: this machine)")
  ap.add_argument("--draft-model", default=None)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  bench = json.loads(Path(args.bench_json).read_text())
  rows = predictions(bench, args.device, args.draft_model, log=lambda m: print(m, file=sys.stderr))
  if args.json:
    print(json.dumps(rows))
    return 0
  for r in rows:
    pred = "—" if r["cost_model"] is None else f"{r['cost_model']:.3f} ({100 * r['error']:+.1f}%)"
    print(f"{r['method']:28s} τ {r['tau']:.2f}  measured {r['measured']:.3f}  cost model {pred}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
