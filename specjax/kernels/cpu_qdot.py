"""x · wᵀ for int8 and int4 weights on integer dot products: x quantized to int8 per 32-column block, each
block's products summed exactly in int32, then scaled (``cpu_qdot.cc`` says why and how).

  quantize_activations(x, xblock)   x [M, D] -> int8 [M, D] and the x scale of each 32-column block [M, D/32]:
                                    one scale per ``xblock`` columns (32, 64 or 256: coarser, cheaper)
  qdot_t_reference(x, w, ...)       XLA: the same integers, as an int8 x int8 dot accumulated in int32
                                    (``preferred_element_type``) per block, then the float scales: what an
                                    accelerator runs, and the kernel's reference
  qdot_t_native(x, w, ...)          the C++ kernel (fp32 x), ``live``/``group`` as ``cpu_matmul``; a weight in
                                    16-row tiles (``QWeight.in_tiles``, made at load) takes its tiled kernel
                                    (``cpu_qdot_tiles.cc``: 8 rows of x cost little more than one), with the
                                    bits of the portable path in rows

``ACTIVATIONS`` names the choices a model makes (``dispatch.Backends.activations``): "fp32" keeps the present
kernel (``cpu_qmatmul``: fp32 activations against widened weights); "int8", "int8-64" and "int8-256" take this
one with 32-, 64- or 256-column x scales.  A row's result does not depend on the other rows of the call, so greedy
speculative decoding stays token-exact; the numbers differ from fp32 activations by the activation rounding
(docs/BENCHMARKS.md measures perplexity).  The gradient, for x only, goes through the dequantized weight.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.kernels import cpu_matmul, dispatch, native
from specjax.kernels import qformat as quant

ACTIVATIONS = dispatch.ACTIVATIONS    # name -> columns per x scale (None: fp32 activations)
TARGETS = {"int8": "specjax_qdot_int8", "int4": "specjax_qdot_int4"}
KINDS = tuple(TARGETS)
BLOCK = 32          # columns per integer block sum
PATHS = native.QDOT_PATHS   # SpecjaxQDotPath() values


def applies(w: quant.QWeight) -> bool:
  """Whether ``w`` has a format this kernel reads (int8 or int4 with D a multiple of 32)."""
  return w.kind in KINDS and w.shape[-1] % BLOCK == 0


def quantize_activations(x_MxD: jax.Array, xblock: int = 32) -> tuple[jax.Array, jax.Array]:
  """int8 [M, D] = round(x · 127 / amax) with amax = max |x| over each ``xblock`` columns (the last block may
  be short), and each 32-column block's scale amax / 127 [M, D/32] (the kernel's exact integers)."""
  M, D = x_MxD.shape
  pad = -D % xblock
  blocks = jnp.pad(x_MxD.astype(jnp.float32), ((0, 0), (0, pad))).reshape(M, -1, xblock)
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
  q = jnp.round(blocks * inv).astype(jnp.int8).reshape(M, -1)[:, :D]
  sx = jnp.repeat((amax / 127.0)[..., 0], xblock // BLOCK, axis=1)[:, :D // BLOCK]
  return q, sx


def qdot_t_reference(x_MxD: jax.Array, w: quant.QWeight, live=None, group: int = 1, xblock: int = 32) -> jax.Array:
  """x · dequantize(w)ᵀ with x quantized (``quantize_activations``): int32 block sums from an int8 dot, then
  Σ_b isum · sx · scale (int4: nibbles - 8, and (offset + 8 scale) · Σx per group with x's own fp32 sums).
  fp32 out."""
  M, D = x_MxD.shape
  N = w.shape[-2]
  w = w.in_rows()
  qx, sx = quantize_activations(x_MxD, xblock)
  # int4: the nibbles centred (nibble - 8), the 8 moved into the exact offset term (cpu_qdot.cc says why)
  qw = quant.unpack_int4(w.data).astype(jnp.int8) - 8 if w.kind == "int4" else w.data
  isum_MxNxB = jnp.einsum("mbk,nbk->mnb", qx.reshape(M, D // BLOCK, BLOCK), qw.reshape(N, D // BLOCK, BLOCK),
                          preferred_element_type=jnp.int32)
  sw_NxB = jnp.repeat(w.scale, w.group // BLOCK, axis=-1)
  y = jnp.einsum("mnb,mb,nb->mn", isum_MxNxB.astype(jnp.float32), sx, sw_NxB)
  if w.kind == "int4":
    xsum = x_MxD.astype(jnp.float32).reshape(M, D // w.group, w.group).sum(-1)
    y = y + xsum @ (w.offset + 8 * w.scale).T
  return y if live is None else jnp.where(cpu_matmul._live_mask(M, live, group), y, 0)


def _call(kind: str, x_MxD, data, scale, offset, rows_2, xblock: int, tiled: bool):
  native.require()
  out = jax.ShapeDtypeStruct((x_MxD.shape[0], data.shape[0]), jnp.float32)
  args = (x_MxD, data, scale, rows_2) if kind == "int8" else (x_MxD, data, scale, offset, rows_2)
  return jax.ffi.ffi_call(TARGETS[kind], out)(*args, xblock=xblock, tiled=tiled)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6, 7, 8))
def _native(kind, x_MxD, data, scale, offset, rows_2, group, xblock, tiled):
  return _call(kind, x_MxD, data, scale, offset, rows_2, xblock, tiled)


def _native_fwd(kind, x_MxD, data, scale, offset, rows_2, group, xblock, tiled):
  return _call(kind, x_MxD, data, scale, offset, rows_2, xblock, tiled), (x_MxD, data, scale, offset, rows_2)


def _native_bwd(kind, group, xblock, tiled, res, dy_MxN):   # straight through the rounding of x; w is frozen
  x_MxD, data, scale, offset, rows_2 = res
  w_NxD = quant.QWeight(data, scale, kind, group, offset, tiled).dequantize(jnp.float32)
  return cpu_matmul.frozen_weight_dx(x_MxD, w_NxD, rows_2, dy_MxN), None, None, None, None


_native.defvjp(_native_fwd, _native_bwd)


def qdot_t_native(x_MxD: jax.Array, w: quant.QWeight, live=None, group: int = 1, xblock: int = 32) -> jax.Array:
  """The C++ kernel (fp32 x, int8 or int4 w); dead rows come out zero."""
  M = x_MxD.shape[0]
  rows = jnp.asarray([M, M], jnp.int32) if live is None else jnp.concatenate(
      [jnp.asarray([group], jnp.int32), jnp.atleast_1d(jnp.asarray(live, jnp.int32))])
  return _native(w.kind, x_MxD, w.data, w.scale, w.offset, rows, w.group, xblock, w.tiled)


def path() -> str | None:
  """The kernel's path under the active instruction set ('avx512-vnni', 'avx2', 'portable'); None without the
  native kernels.  (The AVX-512 instruction set without VNNI takes the AVX2 path.)"""
  return native.qdot_path()
