"""Which backend runs a decode-sized matmul or an attention: every dispatch rule in one table.

  backend   applies when                                                  reference beside it
  matmul    native  CPU, float32, unsharded, built, measured (or forced)  cpu_matmul.matmul_t_reference
                    faster for the weight's size class (choices.py), and
                    at most MATMUL_NATIVE_MAX_ROWS rows (more rows: by the
                    live-row count at run time)
            xla     otherwise
  qmatmul   native  CPU, float32 activations, unsharded, built, at most   cpu_qmatmul.qmatmul_t_reference
  (int8, int4 weights, activations "int8" or "int8-256": the integer-dot kernel cpu_qdot, its reference
  cpu_qdot.qdot_t_reference; on an accelerator that reference itself, an int8 dot accumulated in int32)
  (bf16,            QUANT_NATIVE_MAX_TOKENS new tokens per sequence (a
  int8,             decode step or a verification, not a prefill block),
  int4 weights)     at most MATMUL_NATIVE_MAX_ROWS rows (more: by live
                    rows); not measured per size: XLA's alternative widens
                    the whole matrix to fp32 on every call, reading it
                    twice over
            xla     otherwise: dequantize fused into the dot (accelerators, prefill-sized blocks, a mesh)
  attention native  the platform path is "native" (CPU), T <= ATTENTION_NATIVE_MAX_ROWS, float32 queries and
                    cache, unsharded, built, measured (or forced) faster   cpu_attention.attend_cache_reference
            pallas  the platform path is "pallas" (GPU, TPU) and T <= PALLAS_MAX_ROWS
                                                                           tree_attention_reference
            xla     otherwise (prefill-sized blocks, other dtypes): the windowed ``attention.attend``

The platform path: "native" on the CPU, "pallas" on GPU and TPU, "xla" elsewhere; ``SPECJAX_ATTENTION``
forces one.  The measured part is read from the stored table (``choices.py``), never measured here.

What does not depend on a call's shapes (the platform, whether the native kernels are built and measured
faster, the mesh) is resolved once, when a model is loaded (``runtime.loaded.load``, ``on_mesh``), into a
``Backends`` that rides in the model's static config (``ModelConfig.backends``): a forward reads it and only
adds the rules on its own row count and dtypes.  A config built by hand (tests, a trainer's bare config)
carries none; its forward resolves one when traced, from the mesh passed to ``sharding.use``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from specjax import settings
from specjax.kernels import choices, native

MATMUL_NATIVE_MAX_ROWS = 256    # measured in the real model's whole forward (experiments/roofline.py, smollm2-135m,
                                # 2-core Zen 4): the native kernel beats XLA's GEMM up to ~256 rows (64 rows: 125 ms
                                # vs 190 ms; 256: 505 vs 540) and loses slightly at 512 (1010 vs 993)
ATTENTION_NATIVE_MAX_ROWS = 64  # a tree verification's rows; prefill-sized blocks go to XLA's matmuls
# The same boundary for quantized weights: the native kernel is built for few rows (it takes x 4 rows at a time
# and widens each weight again for every 4), so a prefill block is better widened once for XLA's GEMM.  Measured
# (Intel Xeon model 207, 2 cores, a ~210-token prompt, prefill + 1 token): SmolLM2 int4 1.47 -> 0.54 s, int8
# 0.89 -> 0.53, bf16 1.00 -> 0.52; Qwen2.5-Coder-1.5B int4 9.2 -> 4.4 s.  Decode and verification (at most 64
# tokens a sequence) keep the native kernel, so their bits still agree.
QUANT_NATIVE_MAX_TOKENS = ATTENTION_NATIVE_MAX_ROWS
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


@dataclasses.dataclass(frozen=True)
class Backends:
  """The backends a model's decode-sized ops may take here, resolved once (hashable: part of a static config).

  attention      "native" (the C++ kernel is built and measured faster), "pallas" or "xla": what a forward of
                 few rows runs (more rows, other dtypes: XLA, by the rules below)
  native_matmul  the weight-size classes (``choices.CLASSES``) whose few-row matmuls take the C++ kernel
  native_quant   whether few-row matmuls with quantized weights (``quant.QWeight``) take the C++ kernel
  activations    what int8/int4 weights multiply in few-row matmuls: "fp32" activations, or "int8" /
                 "int8-256" (quantized per call, integer dot products: ``cpu_qdot``)
  mesh           the mesh the parameters are sharded over (None: one device); the native kernels step aside
                 on a mesh of several devices (GSPMD cannot split a custom call) and Pallas attention runs
                 per shard
  """
  attention: str = "xla"
  native_matmul: frozenset = frozenset()
  mesh: Any = None
  native_quant: bool = False
  activations: str = "fp32"

  @property
  def distributed(self) -> bool:
    return self.mesh is not None and math.prod(self.mesh.shape.values()) > 1


# What int8/int4 weights multiply in few-row matmuls: name -> columns per x scale (None: fp32 activations,
# ``cpu_qmatmul``; otherwise x quantized to int8 on integer dot products, ``cpu_qdot``).
ACTIVATIONS = {"fp32": None, "int8": 32, "int8-64": 64, "int8-256": 256}
DEFAULT_ACTIVATIONS = "fp32"
# Where the integer-dot kernel runs on AVX-512 VNNI, "auto" means int8: measured there (docs/BENCHMARKS.md,
# "16-row tiles": the 1.5B at int8 and int4 on an Intel Xeon) it verifies 4 rows for 1.16-1.19x one row against
# 1.34-1.90x with fp32 activations, decodes one row within 1-5% of them, and keeps perplexity within 1% of
# fp32.  Elsewhere (AVX2 only, measured on a Zen 3 before the tiled kernel) fp32 stays the default.
VNNI_DEFAULT_ACTIVATIONS = "int8"


def default_activations() -> str:
  """What ``--activations auto`` means without ``SPECJAX_ACTIVATIONS``: int8 where the integer-dot kernel runs
  on AVX-512 VNNI, else fp32."""
  return VNNI_DEFAULT_ACTIVATIONS if native.qdot_path() == "avx512-vnni" else DEFAULT_ACTIVATIONS


def check_activations(asked: str | None = None) -> None:
  """A bad name (``asked``, or ``SPECJAX_ACTIVATIONS`` behind "auto") fails here, before anything loads or
  builds."""
  from specjax.errors import SpecjaxError
  name = asked if asked not in (None, "auto") else settings.activations()
  if name is not None and name not in ACTIVATIONS:
    raise SpecjaxError(f"unknown activations '{name}': use one of auto, {', '.join(ACTIVATIONS)}")


def activations_choice(asked: str | None = None) -> str:
  """``asked`` ("auto" or None: ``SPECJAX_ACTIVATIONS``, else ``default_activations()``), checked."""
  check_activations(asked)
  return asked if asked not in (None, "auto") else (settings.activations() or default_activations())


def resolve(mesh=None, platform: str | None = None, activations: str | None = None) -> Backends:
  """The ``Backends`` of a model on ``mesh`` (None: one device) on ``platform`` (default: jax's backend), from
  ``SPECJAX_ATTENTION``/``SPECJAX_NATIVE`` and the stored choice table (read, never measured);
  ``activations`` as ``activations_choice`` (on a CPU without the native kernels: fp32)."""
  platform = (platform or jax.default_backend()).lower()
  on_mesh = mesh is not None and math.prod(mesh.shape.values()) > 1
  native_ok = platform == "cpu" and not on_mesh and native.available()
  attention_path = platform_attention(platform)
  if attention_path == "native" and not (native_ok and choices.attention_native()):
    attention_path = "xla"
  classes = frozenset(name for name, _, (N, D) in choices.CLASSES if native_ok and choices.matmul_native(N, D))
  native_quant = native_ok and choices.mode() != "xla"
  acts = activations_choice(activations)
  if platform == "cpu" and not native_quant:
    acts = "fp32"    # XLA:CPU's int8 dot is no faster than its fp32 one: integer activations buy nothing there
  return Backends(attention=attention_path, native_matmul=classes, mesh=mesh, native_quant=native_quant,
                  activations=acts)


def native_attention_applies(backends: Backends, T: int, q_dtype, cache_dtype) -> bool:
  """Whether the native CPU attention serves T new rows per sequence."""
  return (backends.attention == "native" and T <= ATTENTION_NATIVE_MAX_ROWS and q_dtype == jnp.float32
          and cache_dtype == jnp.float32)


def attention(backends: Backends, T: int, q_dtype, cache_dtype, softcap: bool = False) -> str:
  """The attention a forward of T new rows runs: "native", "pallas" or "xla" (the native kernel has no
  logit soft-cap: a model that caps its scores (Gemma 2) takes XLA there)."""
  if not softcap and native_attention_applies(backends, T, q_dtype, cache_dtype):
    return "native"
  if backends.attention == "pallas" and T <= PALLAS_MAX_ROWS:
    return "pallas"
  return "xla"


def skips_dead_rows(backends: Backends, dtype) -> bool:
  """Whether a forward on this path leaves the rows that do not matter uncomputed (a finished sequence, an
  idle serving slot, the draft slots a sequence did not fill): only the native CPU matmul skips them, given
  the live-row counts.  Everywhere else (XLA, Pallas, bf16, a mesh) every row of the compiled shape is
  computed and then zeroed, so a scheduler must price every row."""
  return (not backends.distributed and bool(backends.native_matmul)
          and jnp.dtype(dtype) == jnp.float32)


def native_quant_applies(backends: Backends, x_dtype, tokens: int = 1) -> bool:
  """Whether x · wᵀ with a quantized weight, ``tokens`` new tokens a sequence, may take the native CPU kernel
  (the total row count aside): not a prefill block (more than ``QUANT_NATIVE_MAX_TOKENS``)."""
  return backends.native_quant and x_dtype == jnp.float32 and tokens <= QUANT_NATIVE_MAX_TOKENS


def native_matmul_applies(backends: Backends, x_dtype, w_dtype, N: int, D: int) -> bool:
  """Whether x · wᵀ with a weight [N, D] may take the native CPU kernel (row count aside)."""
  return (x_dtype == jnp.float32 and w_dtype == jnp.float32
          and choices.size_class(N, D) in backends.native_matmul)
