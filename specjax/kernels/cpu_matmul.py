"""A native CPU kernel for the few-row matmuls of decoding: y[M, N] = x[M, D] · w[N, D]ᵀ.

``matmul_t`` calls the C++ kernel in ``cpu_matmul.cc`` through the XLA FFI when it is available (built on first
use, see ``native.py``), else the reference ``matmul_t_reference`` (plain XLA).  It splits the work over the
caller and a few helper threads (``parallel.h``).  It is used only on the CPU backend, for float32, for weight sizes where it measured faster than XLA on this
machine (``choices.py``), when M ≤ ``MAX_ROWS`` (larger M is
compute-bound, where XLA's GEMM is the better choice; with a live-row count, the choice is made on the
number of live rows at run time); its gradient goes through the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels import dispatch, native

MAX_ROWS = dispatch.MATMUL_NATIVE_MAX_ROWS
TARGET = "specjax_matmul_t"
available = native.available


def _live_mask(M: int, live, group: int) -> jax.Array:
  """[M, 1] bool: rows r with r % group < live (rows come in groups of ``group``, the first ``live`` matter;
  ``live`` is one count, or one per group [M / group])."""
  live = jnp.asarray(live)
  per_row = live if live.ndim == 0 else jnp.repeat(live, group, total_repeat_length=M)
  return (jnp.arange(M) % group < per_row)[:, None]


def frozen_weight_dx(x_MxD, w_NxD, rows_2, dy_MxN):
  """The gradient for x of a native x · wᵀ whose weight is frozen (a quantized one, ``w_NxD`` dequantized),
  given the kernel's rows argument [group, live...]: dead rows get none."""
  live = rows_2[1] if rows_2.shape[0] == 2 else rows_2[1:]
  dy_MxN = jnp.where(_live_mask(x_MxD.shape[0], live, rows_2[0]), dy_MxN, 0)
  return (dy_MxN @ w_NxD).astype(x_MxD.dtype)


PAD_ROWS = 4   # below fp32, fewer rows are computed as this many (matmul_t_reference)


def matmul_t_reference(x_MxD: jax.Array, w_NxD: jax.Array, live=None, group: int = 1) -> jax.Array:
  """x · wᵀ by XLA, accumulated in fp32, in x's dtype.

  Below fp32, fewer than ``PAD_ROWS`` rows are computed as ``PAD_ROWS`` (zero rows added, then dropped):
  XLA:CPU picks its kernel by the row count, and a row's reduction order differs between them — a one-row
  matrix-vector kernel on every CPU measured, and on an Intel Xeon with AVX-512 BF16 and AMX (family 6
  model 167) two rows against three or more — and after rounding to bf16 the difference flips greedy
  argmaxes: plain decoding at batch 1 (one row) and its speculative verification (k + 1 rows) then disagree
  (docs/benchmarks-log.md, "Greedy exactness on every path").  From 4 rows on, every row count measured (up to
  80) gives a row the same bits on both machines; and XLA:CPU's bf16 matrix-vector kernel is several times
  slower than the GEMM anyway.  fp32 keeps the one-row kernel: there it is the faster one, and its
  differences (~1e-7 relative) have flipped no token in the measured runs."""
  M = x_MxD.shape[0]
  if M < PAD_ROWS and x_MxD.dtype != jnp.float32:
    y = jnp.einsum("md,nd->mn", jnp.pad(x_MxD, ((0, PAD_ROWS - M), (0, 0))), w_NxD,
                   preferred_element_type=jnp.float32)[:M].astype(x_MxD.dtype)
  else:
    y = jnp.einsum("md,nd->mn", x_MxD, w_NxD, preferred_element_type=jnp.float32).astype(x_MxD.dtype)
  if live is None:
    return y
  return jnp.where(_live_mask(x_MxD.shape[0], live, group), y, 0)


@jax.custom_vjp
def _native(x_MxD: jax.Array, w_NxD: jax.Array, rows_2: jax.Array) -> jax.Array:
  native.require()
  M, N = x_MxD.shape[0], w_NxD.shape[0]
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, N), jnp.float32))(x_MxD, w_NxD, rows_2)


def _native_fwd(x_MxD, w_NxD, rows_2):
  return _native(x_MxD, w_NxD, rows_2), (x_MxD, w_NxD, rows_2)


def _native_bwd(res, dy_MxN):   # gradients through plain XLA: training never needs the fast path
  x_MxD, w_NxD, rows_2 = res
  dy_MxN = jnp.where(_live_mask(x_MxD.shape[0], rows_2[1], rows_2[0]), dy_MxN, 0)
  return dy_MxN @ w_NxD, dy_MxN.T @ x_MxD, None


_native.defvjp(_native_fwd, _native_bwd)


def matmul_t_native(x_MxD: jax.Array, w_NxD: jax.Array, live=None, group: int = 1) -> jax.Array:
  """The C++ kernel.  With ``live`` (a traced count, or one count per group [M / group]), rows come in groups
  of ``group`` and only the first ``live`` rows of each group are computed; the others come out zero at no
  cost (padded draft slots, finished sequences)."""
  M = x_MxD.shape[0]
  rows = jnp.asarray([M, M], jnp.int32) if live is None else jnp.concatenate(
      [jnp.asarray([group], jnp.int32), jnp.atleast_1d(jnp.asarray(live, jnp.int32))])
  return _native(x_MxD, w_NxD, rows)


def matmul_t(x_MxD: jax.Array, w_NxD: jax.Array, live=None, group: int = 1,
             backends: dispatch.Backends | None = None) -> jax.Array:
  """x · wᵀ: the native kernel when it applies (``backends``: what the model was loaded with; None: resolved
  now, for one device), else the reference.  ``live``/``group``: rows r with r % group ≥ live are padding and
  come out zero (the native kernel skips them)."""
  backends = backends or dispatch.resolve()
  if dispatch.native_matmul_applies(backends, x_MxD.dtype, w_NxD.dtype, *w_NxD.shape):    # the rule: dispatch.py
    return by_rows(x_MxD.shape[0], live, group, lambda lv: matmul_t_native(x_MxD, w_NxD, lv, group),
                   lambda lv: matmul_t_reference(x_MxD, w_NxD, lv, group))
  return matmul_t_reference(x_MxD, w_NxD, live, group)


def by_rows(M: int, live, group: int, native_fn, reference_fn):
  """``native_fn(live)`` for at most ``MAX_ROWS`` rows, else ``reference_fn(live)`` (XLA's GEMM is the better
  choice for many rows) — but with a live-row count, many rows may be few live ones (finished sequences, idle
  serving slots): then the count decides at run time."""
  if M <= MAX_ROWS:
    return native_fn(live)
  if live is None:
    return reference_fn(live)
  live = jnp.asarray(live, jnp.int32)
  total = jnp.clip(live, 0, group) * (M // group) if live.ndim == 0 else jnp.sum(jnp.clip(live, 0, group))
  return jax.lax.cond(total <= MAX_ROWS, lambda: native_fn(live), lambda: reference_fn(live))
