"""x · wᵀ for a quantized weight (``quant.QWeight``): the native CPU kernel (``cpu_qmatmul.cc``), or the
reference that dequantizes, then multiplies (plain XLA: what accelerators and prefill-sized inputs run, with
the dequantization fused into the dot's operand).

The native kernel reads the compact weight and widens it in registers, so a decode step reads 2 (bf16),
~3.8 (int8) or ~5.3 (int4) times fewer bytes than in fp32.  It takes fp32 activations, at most ``MAX_ROWS`` rows
(more rows: by the live-row count at run time, as ``cpu_matmul``) of at most
``dispatch.QUANT_NATIVE_MAX_TOKENS`` new tokens per sequence (``group``; a prefill block goes to XLA, which widens
the weight once, where this kernel widens it again for every 4 rows of x), and its gradient (for x only: quantized weights
are frozen) goes through the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.kernels import cpu_matmul, cpu_qdot, dispatch, native
from specjax.kernels import qformat as quant

MAX_ROWS = dispatch.MATMUL_NATIVE_MAX_ROWS
TARGETS = {"bf16": "specjax_qmatmul_bf16", "int8": "specjax_qmatmul_int8", "int4": "specjax_qmatmul_int4"}


def qmatmul_t_reference(x_MxD: jax.Array, w: quant.QWeight, live=None, group: int = 1) -> jax.Array:
  """Dequantize w to x's dtype, then ``cpu_matmul.matmul_t_reference``."""
  return cpu_matmul.matmul_t_reference(x_MxD, w.dequantize(x_MxD.dtype), live, group)


def _call(kind: str, x_MxD, data, scale, offset, rows_2):
  native.require()
  M, N = x_MxD.shape[0], data.shape[0]
  out = jax.ShapeDtypeStruct((M, N), jnp.float32)
  if kind == "bf16":      # the bf16 buffer itself (a bitcast to u16 would be a copy on XLA:CPU)
    return jax.ffi.ffi_call(TARGETS[kind], out)(x_MxD, data, rows_2)
  if kind == "int8":
    return jax.ffi.ffi_call(TARGETS[kind], out)(x_MxD, data, scale, rows_2)
  return jax.ffi.ffi_call(TARGETS[kind], out)(x_MxD, data, scale, offset, rows_2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _native(kind, x_MxD, data, scale, offset, rows_2, group):
  return _call(kind, x_MxD, data, scale, offset, rows_2)


def _native_fwd(kind, x_MxD, data, scale, offset, rows_2, group):
  return _call(kind, x_MxD, data, scale, offset, rows_2), (x_MxD, data, scale, offset, rows_2)


def _native_bwd(kind, group, res, dy_MxN):   # for x only: a quantized weight is frozen
  x_MxD, data, scale, offset, rows_2 = res
  w_NxD = quant.dequantize(kind, data, scale, group, jnp.float32, offset)
  return cpu_matmul.frozen_weight_dx(x_MxD, w_NxD, rows_2, dy_MxN), None, None, None, None


_native.defvjp(_native_fwd, _native_bwd)


def qmatmul_t_native(x_MxD: jax.Array, w: quant.QWeight, live=None, group: int = 1) -> jax.Array:
  """The C++ kernel (fp32 x).  ``live``/``group`` as ``cpu_matmul.matmul_t_native``."""
  M = x_MxD.shape[0]
  rows = jnp.asarray([M, M], jnp.int32) if live is None else jnp.concatenate(
      [jnp.asarray([group], jnp.int32), jnp.atleast_1d(jnp.asarray(live, jnp.int32))])
  w = w.in_rows()      # this kernel reads rows (a tiled weight is put back, at a copy's cost: dispatch avoids it)
  return _native(w.kind, x_MxD, w.data, w.scale, w.offset, rows, w.group)


def qmatmul_t(x_MxD: jax.Array, w: quant.QWeight, live=None, group: int = 1,
              backends: dispatch.Backends | None = None) -> jax.Array:
  """x · dequantize(w)ᵀ: the native kernel when it applies, else the reference (``dispatch.py``; a weight in
  16-row tiles only has the integer-dot kernel, and otherwise takes the reference).  ``group``:
  the new tokens per sequence (rows come in groups of it).  With integer activations (``backends.activations``)
  decode-sized calls take ``cpu_qdot``: its kernel on the CPU, its int8-dot reference on an accelerator."""
  backends = backends or dispatch.resolve()
  xblock = cpu_qdot.ACTIVATIONS[backends.activations] if cpu_qdot.applies(w) else None
  if xblock and dispatch.native_quant_applies(backends, x_MxD.dtype, group):
    return cpu_matmul.by_rows(x_MxD.shape[0], live, group,
                              lambda lv: cpu_qdot.qdot_t_native(x_MxD, w, lv, group, xblock),
                              lambda lv: qmatmul_t_reference(x_MxD, w, lv, group))
  if xblock and group <= dispatch.QUANT_NATIVE_MAX_TOKENS and not native.available():
    return cpu_qdot.qdot_t_reference(x_MxD, w, live, group, xblock).astype(x_MxD.dtype)   # an accelerator
  if dispatch.native_quant_applies(backends, x_MxD.dtype, group) and not w.tiled:
    return cpu_matmul.by_rows(x_MxD.shape[0], live, group, lambda lv: qmatmul_t_native(x_MxD, w, lv, group),
                              lambda lv: qmatmul_t_reference(x_MxD, w, lv, group))
  return qmatmul_t_reference(x_MxD, w, live, group)
