"""A native CPU kernel for the few-row matmuls of decoding: y[M, N] = x[M, D] · w[N, D]ᵀ.

``matmul_t`` calls the C++ kernel in ``cpu_matmul.cc`` through the XLA FFI when it is available (built on first
use, see ``native.py``), else the reference ``matmul_t_reference`` (plain XLA).  It runs on XLA's intra-op
thread pool.  It is used only on the CPU backend, for float32, when M ≤ ``MAX_ROWS`` (larger M is
compute-bound, where XLA's GEMM is the better choice); its gradient goes through the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels import native

MAX_ROWS = 32   # XLA's GEMM catches up at ~40-48 rows here (scripts/bench_kernels.py)
TARGET = "specjax_matmul_t"
available = native.available


def matmul_t_reference(x_MxD: jax.Array, w_NxD: jax.Array) -> jax.Array:
  return jnp.einsum("md,nd->mn", x_MxD, w_NxD, preferred_element_type=jnp.float32).astype(x_MxD.dtype)


@jax.custom_vjp
def matmul_t_native(x_MxD: jax.Array, w_NxD: jax.Array) -> jax.Array:
  native.require()
  M, N = x_MxD.shape[0], w_NxD.shape[0]
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, N), jnp.float32))(x_MxD, w_NxD)


def _native_fwd(x_MxD, w_NxD):
  return matmul_t_native(x_MxD, w_NxD), (x_MxD, w_NxD)


def _native_bwd(res, dy_MxN):   # gradients through plain XLA: training never needs the fast path
  x_MxD, w_NxD = res
  return dy_MxN @ w_NxD, dy_MxN.T @ x_MxD


matmul_t_native.defvjp(_native_fwd, _native_bwd)


def matmul_t(x_MxD: jax.Array, w_NxD: jax.Array) -> jax.Array:
  """x · wᵀ: the native kernel when it applies, else the reference."""
  if (x_MxD.dtype == jnp.float32 and w_NxD.dtype == jnp.float32 and x_MxD.shape[0] <= MAX_ROWS
      and available()):
    return matmul_t_native(x_MxD, w_NxD)
  return matmul_t_reference(x_MxD, w_NxD)
