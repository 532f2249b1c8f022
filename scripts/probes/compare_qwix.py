"""The XLA path of a quantized matmul — specjax's reference (``QWeight.dequantize`` then a dot, which XLA fuses)
against qwix's weight-only ``dot_general`` on the same weights: is Google's quantization library faster
than the layer written here, on this machine?

  pip install qwix            # not a specjax dependency: this script is the measurement behind not using it
  python scripts/probes/compare_qwix.py [--rows 1,4] [--json]

Per weight type (int8: symmetric groups of 64; int4: asymmetric groups of 32 for specjax, symmetric groups of
32 for qwix, whose zero point is not offered for int4 weights in its dot path) on the 1.5B's w_gate_up
(17920 × 1536) and w_down (1536 × 8960): ms per call (median), and the largest difference of the outputs
from the fp32 product of the dequantized weights (each library against its own dequantization).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.measure import provenance
from specjax.models import quant
from specjax.kernels import cpu_qmatmul


def median_ms(f, *args, repeats=15):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default="1,4")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  try:
    import qwix
  except ImportError:
    raise SystemExit("compare_qwix: qwix is not installed: pip install qwix")
  rng = np.random.default_rng(0)
  out = {"machine": provenance.describe(), "qwix": getattr(qwix, "__version__", "?"), "results": []}
  for N, D in [(17920, 1536), (1536, 8960)]:
    w = jnp.asarray(rng.standard_normal((N, D), np.float32) * 0.02)
    for kind, qtype, tile in [("int8", jnp.int8, 64), ("int4", jnp.int4, 32)]:
      ours = quant.quantize(kind, w)
      theirs = qwix.quantize(w, qtype, tiled_axes={1: tile})
      dims = (((1,), (1,)), ((), ()))
      f_ours = jax.jit(lambda x, q: cpu_qmatmul.qmatmul_t_reference(x, q))
      f_native = jax.jit(lambda x, q: cpu_qmatmul.qmatmul_t_native(x, q))
      f_theirs = jax.jit(lambda x, q: qwix.dot_general(x, q, dims, preferred_element_type=jnp.float32))
      for M in [int(r) for r in args.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((M, D), np.float32))
        ref_ours = np.asarray(x) @ np.asarray(ours.dequantize()).T
        ref_theirs = np.asarray(x) @ np.asarray(qwix.dequantize(theirs)).T
        row = {"shape": [N, D], "weights": kind, "rows": M,
               "specjax_xla_ms": median_ms(f_ours, x, ours), "specjax_native_ms": median_ms(f_native, x, ours),
               "qwix_xla_ms": median_ms(f_theirs, x, theirs),
               "specjax_max_err": float(np.abs(np.asarray(f_ours(x, ours)) - ref_ours).max()),
               "qwix_max_err": float(np.abs(np.asarray(f_theirs(x, theirs)) - ref_theirs).max())}
        out["results"].append(row)
        print(f"{N}x{D} {kind} M={M}: specjax XLA {row['specjax_xla_ms']:.2f} ms, qwix {row['qwix_xla_ms']:.2f} ms, "
              f"specjax native {row['specjax_native_ms']:.2f} ms (max err {row['specjax_max_err']:.1e} / "
              f"{row['qwix_max_err']:.1e})", flush=True)
  if args.json:
    print(json.dumps(out))


if __name__ == "__main__":
  main()
