"""Requantizing a GGUF model against taking its blocks over: how much of each quantized tensor does specjax's
requantization (``quant.quantize`` of the dequantized fp32 values) reproduce exactly?

  python scripts/probes/int4_takeover_check.py MODEL_OR_GGUF [--json]

For every 4-bit tensor (Q4_0, Q4_1, Q4_K) the int4 format (asymmetric groups of 32 in Q4_1's byte layout)
could take the blocks over exactly: each group of 32 is ``scale * q + offset`` with q in 0..15.  specjax
instead requantizes the dequantized values to their group's [min, max] in 16 steps, which is exact when the
group uses its lowest and highest level, and moves the values a little otherwise.  This prints, per source
type, the share of groups reproduced exactly and the error of the rest relative to the tensor's RMS (and the
same for Q8_0 under int8's symmetric groups); whether block takeover is worth writing follows from it.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import gguf
import numpy as np

from specjax.measure import provenance
from specjax.models import quant
from specjax.checkpoints import resolve

KINDS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q8_0": "int8"}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("model")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  path = resolve(args.model)
  reader = gguf.GGUFReader(path)
  stats = defaultdict(lambda: {"tensors": 0, "groups": 0, "exact_groups": 0, "max_rel_err": 0.0, "sq_err": 0.0,
                               "sq_ref": 0.0})
  types = defaultdict(int)
  for t in reader.tensors:
    name = t.tensor_type.name
    types[name] += int(np.prod(t.shape))
    if name not in KINDS:
      continue
    w = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32)
    w = w.reshape(-1, w.shape[-1])
    kind = KINDS[name]
    group = 32 if kind == "int4" else quant.GROUPS["int8"]
    back = np.asarray(quant.quantize(kind, w, group).dequantize())
    err = np.abs(back - w).reshape(w.shape[0], -1, group)
    scale = np.sqrt(np.mean(w.astype(np.float64) ** 2)) or 1.0
    s = stats[name]
    s["tensors"] += 1
    s["groups"] += err.shape[0] * err.shape[1]
    s["exact_groups"] += int((err.max(axis=-1) <= 1e-6 * scale).sum())
    s["max_rel_err"] = max(s["max_rel_err"], float(err.max() / scale))
    s["sq_err"] += float((err.astype(np.float64) ** 2).sum())
    s["sq_ref"] += float((w.astype(np.float64) ** 2).sum())
    print(f"{t.name:40s} {name}: {(err.max(axis=-1) <= 1e-6 * scale).mean():.3f} of groups exact", flush=True)
  summary = {name: {"tensors": s["tensors"], "exact_group_share": s["exact_groups"] / s["groups"],
                    "max_err_over_rms": s["max_rel_err"], "rms_err_over_rms": (s["sq_err"] / s["sq_ref"]) ** 0.5,
                    "as": KINDS[name]} for name, s in stats.items()}
  for name, s in summary.items():
    print(f"{name} -> {s['as']}: {s['tensors']} tensors, {100 * s['exact_group_share']:.1f}% of groups exact, "
          f"RMS error {s['rms_err_over_rms']:.2e} of the tensors' RMS (largest {s['max_err_over_rms']:.2e})")
  print("weights by source type: " + ", ".join(f"{k} {v / 1e6:.0f}M" for k, v in sorted(types.items())))
  if args.json:
    print(json.dumps({"machine": provenance.describe(), "model": args.model, "by_type": summary,
                      "weights_by_type": dict(types)}))


if __name__ == "__main__":
  main()
