"""Which backend runs a decode-sized matmul or an attention: every dispatch rule in one table.

  backend   applies when                                                  reference beside it
  matmul    native  CPU, float32, unsharded, built, measured (or forced)  cpu_matmul.matmul_t_reference
                    faster for the weight's size class (choices.py), and
                    at most MATMUL_NATIVE_MAX_ROWS rows (more rows: by the
                    live-row count at run time)
            xla     otherwise
  attention native  the platform path is "native" (CPU), T <= ATTENTION_NATIVE_MAX_ROWS, float32 queries and
                    cache, unsharded, built, measured (or forced) faster   cpu_attention.attend_cache_reference
            pallas  the platform path is "pallas" (GPU, TPU) and T <= PALLAS_MAX_ROWS
                                                                           tree_attention_reference
            xla     otherwise (prefill-sized blocks, other dtypes): the windowed ``model.attend``

The platform path: "native" on the CPU, "pallas" on GPU and TPU, "xla" elsewhere; ``SPECJAX_ATTENTION``
forces one.  The measured part is read from the stored table (``choices.py``), never measured here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import settings, sharding
from specjax.kernels import choices, native

MATMUL_NATIVE_MAX_ROWS = 256    # measured in the real model's whole forward (experiments/roofline.py, smollm2-135m,
                                # 2-core Zen 4): the native kernel beats XLA's GEMM up to ~256 rows (64 rows: 125 ms
                                # vs 190 ms; 256: 505 vs 540) and loses slightly at 512 (1010 vs 993)
ATTENTION_NATIVE_MAX_ROWS = 64  # a tree verification's rows; prefill-sized blocks go to XLA's matmuls
PALLAS_MAX_ROWS = 64            # decode and verification rows; prefill-sized blocks stay on XLA's matmuls
ATTENTION_PATHS = ("native", "pallas", "xla")


def platform_attention(platform: str | None = None) -> str:
  """"native" | "pallas" | "xla" for ``platform`` (default: jax's default backend); ``SPECJAX_ATTENTION``
  forces one."""
  forced = settings.forced_attention()
  if forced:
    if forced not in ATTENTION_PATHS:
      raise ValueError(f"SPECJAX_ATTENTION={forced!r}: allowed values are {', '.join(ATTENTION_PATHS)}")
    return forced
  platform = (platform or jax.default_backend()).lower()
  if platform == "cpu":
    return "native"
  if platform in ("gpu", "cuda", "rocm", "tpu"):
    return "pallas"
  return "xla"


def native_attention_applies(T: int, q_dtype, cache_dtype) -> bool:
  """Whether the native CPU attention serves T new rows per sequence."""
  return (T <= ATTENTION_NATIVE_MAX_ROWS and q_dtype == jnp.float32 and cache_dtype == jnp.float32
          and not sharding.distributed() and native.available()    # GSPMD cannot split a custom call
          and choices.attention_native())


def attention(T: int, q_dtype, cache_dtype) -> str:
  """The attention a forward of T new rows runs: "native", "pallas" or "xla"."""
  want = platform_attention()
  if want == "native" and native_attention_applies(T, q_dtype, cache_dtype):
    return "native"
  if want == "pallas" and T <= PALLAS_MAX_ROWS:
    return "pallas"
  return "xla"


def native_matmul_applies(x_dtype, w_dtype, N: int, D: int) -> bool:
  """Whether x · wᵀ with a weight [N, D] may take the native CPU kernel (row count aside)."""
  return (x_dtype == jnp.float32 and w_dtype == jnp.float32 and not sharding.distributed() and native.available()
          and choices.matmul_native(N, D))
