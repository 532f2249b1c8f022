"""The quantized matmuls on a decode step's worth of weights: every layer matrix of a model shape (default the
Qwen2.5-Coder-1.5B: 28 layers of w_qkv, wo, w_gate_up, w_down, 1.31 G weights), random, in each weight type,
timed as one chain of native kernel calls for M = 1, 2, 4, 8 rows of x.

  python scripts/probes/bench_qmatmul.py [--kinds fp32,bf16,int8,int4] [--rows 1,2,4,8] [--layers 28] [--json]

A kind may name the activations too: ``int4+int8`` (or ``int8+int8-256``) runs the integer-dot kernel
(cpu_qdot.cc: x quantized to int8 with 32- or 256-column scales) instead of the fp32-activation one; a
``/tiles`` after it (``int4+int8/tiles``) gives that kernel the weights in 16-row tiles, the layout a model
with integer activations loads them in (cpu_qdot_tiles.cc).

Prints ms per pass, G weights/s and GB/s of weight bytes read, and each type's ratio over fp32 at one row:
the ceiling that plain decoding at that type can reach over fp32 on this machine (the rest of a step —
attention, norms, the head — comes on top).  Medians of repeated passes; compare within one run.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.measure import provenance
from specjax.kernels import cpu_matmul, cpu_qdot, cpu_qmatmul, native
from specjax.kernels import qformat

SHAPES_15B = dict(D=1536, qkv=2048, F=8960)


def layer_shapes(D, qkv, F):
  return [(qkv, D), (D, D), (2 * F, D), (D, F)]


def random_weight(kind, N, D, rng):
  if kind == "fp32":
    return jnp.asarray(rng.standard_normal((N, D), np.float32) * 0.02)
  if kind == "bf16":
    return qformat.QWeight(jnp.asarray((rng.standard_normal((N, D), np.float32) * 0.02).astype(jnp.bfloat16)),
                           None, "bf16")
  G = qformat.GROUPS[kind]
  scale = jnp.asarray(rng.uniform(1e-3, 2e-3, (N, D // G)).astype(np.float32))
  if kind == "int8":
    return qformat.QWeight(jnp.asarray(rng.integers(-127, 128, (N, D), dtype=np.int8)), scale, "int8", G)
  offset = jnp.asarray(rng.uniform(-0.02, -0.01, (N, D // G)).astype(np.float32))
  return qformat.QWeight(jnp.asarray(rng.integers(0, 256, (N, D // 2), dtype=np.uint8)), scale, "int4", G,
                         offset)


def nbytes(w):
  return w.nbytes if isinstance(w, qformat.QWeight) else w.size * w.dtype.itemsize


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kinds", default="fp32,bf16,int8,int4")
  ap.add_argument("--rows", default="1,2,4,8")
  ap.add_argument("--layers", type=int, default=28)
  ap.add_argument("--repeats", type=int, default=9)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  native.require()
  rng = np.random.default_rng(0)
  shapes = layer_shapes(**SHAPES_15B) * args.layers
  rows = [int(r) for r in args.rows.split(",")]
  results = {"machine": provenance.describe(), "layers": args.layers, "kinds": {}}
  for spec in args.kinds.split(","):
    kind, _, acts = spec.partition("+")
    acts, _, layout = acts.partition("/")
    ws = [random_weight(kind, N, D, rng) for N, D in shapes]
    if layout == "tiles":
      ws = [w.in_tiles() for w in ws]
    total = sum(nbytes(w) for w in ws)
    weights = sum(N * D for N, D in shapes)
    mm = cpu_matmul.matmul_t_native if kind == "fp32" else cpu_qmatmul.qmatmul_t_native
    if acts:
      xblock = cpu_qdot.ACTIVATIONS[acts]
      mm = lambda x, w, xblock=xblock: cpu_qdot.qdot_t_native(x, w, xblock=xblock)   # noqa: E731
    kind = spec

    @jax.jit
    def run(ws, xs):
      return [jnp.sum(mm(xs[w.shape[1]], w)) for w in ws]

    out = {"bytes": total, "weights": weights, "rows": {}}
    for M in rows:
      xs = {D: jnp.asarray(rng.standard_normal((M, D)), jnp.float32) for D in {d for _, d in shapes}}
      jax.block_until_ready(run(ws, xs))
      times = []
      for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(ws, xs))
        times.append(time.perf_counter() - t0)
      ms = float(np.median(times)) * 1e3
      out["rows"][M] = {"ms": ms, "gweights_s": weights / ms / 1e6, "gbs": total / ms / 1e6}
      print(f"{kind:9s} M={M:2d} {ms:8.2f} ms  {weights / ms / 1e6:6.1f} G weights/s  {total / ms / 1e6:6.1f} GB/s",
            flush=True)
    results["kinds"][kind] = out
    del ws
  if "fp32" in results["kinds"]:
    base = results["kinds"]["fp32"]["rows"]
    for kind, out in results["kinds"].items():
      out["vs_fp32"] = {M: base[M]["ms"] / r["ms"] for M, r in out["rows"].items() if M in base}
      print(f"{kind:9s} vs fp32: " + "  ".join(f"M={M} {v:.2f}x" for M, v in out["vs_fp32"].items()))
  if args.json:
    print(json.dumps(results))


if __name__ == "__main__":
  main()
