"""A native CPU kernel for the few-row matmuls of decoding: y[M, N] = x[M, D] · w[N, D]ᵀ.

``matmul_t`` calls the C++ kernel in ``cpu_matmul.cc`` through the XLA FFI when it is available, else the
reference ``matmul_t_reference`` (plain XLA).  The kernel is built on first use with the system C++
compiler (``$CXX`` or ``c++``) into the specjax cache, keyed by a hash of its source, the compiler flags and
the jax version; if no compiler is found or the build fails, a one-line warning goes to stderr and XLA is used.

Set ``SPECJAX_NATIVE=0`` to disable it, ``SPECJAX_CPU_THREADS`` to size its thread pool (default: all cores).
It is used only on the CPU backend, for float32, when M ≤ ``MAX_ROWS`` (larger M is compute-bound, where
XLA's GEMM is the better choice), and it has no gradient: training uses the reference path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

MAX_ROWS = 16
TARGET = "specjax_matmul_t"
_SOURCE = Path(__file__).with_name("cpu_matmul.cc")
_FLAGS = ["-O3", "-march=native", "-std=c++20", "-fopenmp-simd", "-fPIC", "-shared", "-w"]
_STATE: dict = {"loaded": None}


def matmul_t_reference(x_MxD: jax.Array, w_NxD: jax.Array) -> jax.Array:
  return jnp.einsum("md,nd->mn", x_MxD, w_NxD, preferred_element_type=jnp.float32).astype(x_MxD.dtype)


def _cache_dir() -> Path:
  from specjax.checkpoints.registry import cache_dir
  return cache_dir() / "kernels"


def _build() -> Path | None:
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if cxx is None:
    print("[specjax] no C++ compiler found: using XLA matmuls on the CPU (slower decoding)", file=sys.stderr)
    return None
  src = _SOURCE.read_bytes()
  tag = hashlib.sha256(src + " ".join(_FLAGS).encode() + jax.__version__.encode()).hexdigest()[:16]
  out = _cache_dir() / f"libspecjax_cpu_{tag}.so"
  if out.is_file():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    tmp_out = Path(tmp) / out.name
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(tmp_out), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      first = (proc.stderr.strip().splitlines() or ["?"])[0]
      print(f"[specjax] building the CPU matmul kernel failed ({first}): using XLA matmuls", file=sys.stderr)
      return None
    os.replace(tmp_out, out)
  return out


def available() -> bool:
  """Build (once) and register the kernel; False when disabled or unavailable."""
  if _STATE["loaded"] is not None:
    return _STATE["loaded"]
  ok = False
  if os.environ.get("SPECJAX_NATIVE", "1") != "0" and jax.default_backend() == "cpu":
    path = _build()
    if path is not None:
      lib = ctypes.cdll.LoadLibrary(str(path))
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecjaxMatmulT), platform="cpu")
      ok = True
  _STATE["loaded"] = ok
  return ok


@jax.custom_vjp
def matmul_t_native(x_MxD: jax.Array, w_NxD: jax.Array) -> jax.Array:
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
