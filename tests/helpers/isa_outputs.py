"""Outputs of the native kernels on fixed inputs, for every instruction-set path the library can run here.

  python -m tests.helpers.isa_outputs OUT.npz

tests/kernels/test_cpu_isa_emulated.py runs this once with the real library and once with the SIMD-emulating one
(SPECJAX_EMULATE_SIMD=1) and compares the two bit for bit, path by path: the check that the emulation computes
what the hardware computes, so that the AVX-512 path's tests under emulation mean something.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import quant
from specjax.kernels import cpu_attention, cpu_matmul, cpu_qdot, cpu_qmatmul, native


def _inputs():
  r = np.random.default_rng(2024)
  mats = []
  for M, N, D in [(1, 70, 101), (2, 70, 101), (3, 64, 576), (5, 37, 100), (7, 45, 17), (16, 96, 64)]:
    mats.append((jnp.asarray(r.standard_normal((M, D)), jnp.float32),
                 jnp.asarray(r.standard_normal((N, D)), jnp.float32)))
  atts = []
  for E, S, T in [(16, 61, 1), (64, 61, 5), (64, 600, 1), (128, 600, 5), (24, 61, 3)]:
    B, K, G = 2, 2, 3
    q = jnp.asarray(r.normal(size=(B, T, K * G, E)), jnp.float32)
    k = jnp.asarray(r.normal(size=(1, B, S, K, E)) * 2, jnp.float32)
    v = jnp.asarray(r.normal(size=(1, B, S, K, E)), jnp.float32)
    lengths = jnp.asarray([S - T, min(300, S - T)], jnp.int32)
    mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    mask &= (r.random((B, T, T)) < 0.6) | np.eye(T, dtype=bool)[None]
    atts.append((q, k, v, lengths, jnp.asarray(mask)))
  quants = []
  for kind, (M, N, D) in [("bf16", (3, 37, 101)), ("int8", (5, 45, 96)), ("int8", (3, 20, 128)), ("int4", (2, 70, 128)),
                          ("int4", (7, 9, 64)), ("int8", (9, 48, 96)), ("int4", (3, 32, 192))]:
    quants.append((jnp.asarray(r.standard_normal((M, D)), jnp.float32),
                   quant.quantize(kind, r.standard_normal((N, D)).astype(np.float32), 64 if D == 128 else 32)))
  return mats, atts, quants


def outputs() -> dict[str, np.ndarray]:
  """{'<path>/matmul/<i>' or '<path>/attention/<i>': output} for each path the library can run."""
  if not native.available():
    raise SystemExit("the native CPU kernels are not available here")
  mats, atts, quants = _inputs()
  mm = jax.jit(cpu_matmul.matmul_t_native)
  qmm = jax.jit(cpu_qmatmul.qmatmul_t_native)
  att = jax.jit(cpu_attention.attend_cache_native)
  out = {}
  best = native.detected_isa()
  for path in native.ISAS[:native.ISAS.index(best) + 1]:
    assert native.set_isa(path) == path
    for i, (x, w) in enumerate(mats):
      out[f"{path}/matmul/{i}"] = np.asarray(mm(x, w))
    for i, (q, k, v, lengths, mask) in enumerate(atts):
      out[f"{path}/attention/{i}"] = np.asarray(att(q, k, v, 0, lengths, mask))
    for i, (x, w) in enumerate(quants):
      out[f"{path}/qmatmul/{i}"] = np.asarray(qmm(x, w))
      if cpu_qdot.applies(w):
        for xblock in (32, 256):
          out[f"{path}/qdot{xblock}/{i}"] = np.asarray(cpu_qdot.qdot_t_native(x, w, xblock=xblock))
          if quant.tiles_apply(w):
            out[f"{path}/qdot{xblock}-tiles/{i}"] = np.asarray(cpu_qdot.qdot_t_native(x, w.in_tiles(), xblock=xblock))
  native.set_isa(best)
  return out


if __name__ == "__main__":
  np.savez(sys.argv[1], **outputs())
