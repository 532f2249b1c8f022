"""Building and loading specjax's native CPU kernels (``*.cc`` in this folder) as XLA FFI targets.

All sources are compiled together, on first use, with the system C++ compiler (``$CXX`` or ``c++``) into one
shared library in the specjax cache, keyed by a hash of the sources, the compiler flags and the jax version.
If no compiler is found or the build fails, a one-line warning goes to stderr and every kernel falls back
to its XLA reference.  ``SPECJAX_NATIVE=0`` disables them; they are used only on the CPU backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax

# FFI target name -> exported handler symbol.
TARGETS = {"specjax_matmul_t": "SpecjaxMatmulT", "specjax_attend_cache": "SpecjaxAttendCache"}
_SOURCES = sorted(Path(__file__).parent.glob("*.cc"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-std=c++20", "-fopenmp-simd", "-fPIC", "-shared", "-w"]
_STATE: dict = {"loaded": None}
_LOCK = threading.Lock()


def _cache_dir() -> Path:
  from specjax.checkpoints.registry import cache_dir
  return cache_dir() / "kernels"


def source_digest() -> str:
  """Hash of the kernel sources, the compiler flags and the jax version (names the built library)."""
  digest = hashlib.sha256(" ".join(_FLAGS).encode() + jax.__version__.encode())
  for src in _SOURCES + _HEADERS:
    digest.update(src.name.encode() + src.read_bytes())
  return digest.hexdigest()[:16]


def _build() -> Path | None:
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if cxx is None:
    print("[specjax] no C++ compiler found: using XLA for matmuls and attention on the CPU (slower decoding)",
          file=sys.stderr)
    return None
  out = _cache_dir() / f"libspecjax_cpu_{source_digest()}.so"
  if out.is_file():
    return out
  print("[specjax] building the native CPU kernels (once per source version)", file=sys.stderr, flush=True)
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    tmp_out = Path(tmp) / out.name
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(tmp_out), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      first = (proc.stderr.strip().splitlines() or ["?"])[0]
      print(f"[specjax] building the native CPU kernels failed ({first}): using XLA", file=sys.stderr)
      return None
    os.replace(tmp_out, out)
  return out


def _wanted() -> bool:
  return os.environ.get("SPECJAX_NATIVE", "1") != "0" and jax.default_backend() == "cpu"


def start_build() -> None:
  """Start building the library on a helper thread (the compiler runs as a subprocess), so that a first run
  compiles the kernels while it loads the model; ``available`` waits for it.  Safe to call repeatedly."""
  with _LOCK:
    if _STATE["loaded"] is not None or "builder" in _STATE or not _wanted():
      return
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_build()), name="specjax-kernel-build", daemon=True)
    _STATE["builder"] = (thread, result)
    thread.start()


def _built_library() -> Path | None:
  start_build()
  thread, result = _STATE["builder"]
  thread.join()
  return result[0] if result else None


def available() -> bool:
  """Build (once) and register every kernel; False when disabled, not on the CPU, or unavailable."""
  if _STATE["loaded"] is not None:
    return _STATE["loaded"]
  ok = False
  if _wanted():
    path = _built_library()
    if path is not None:
      lib = ctypes.cdll.LoadLibrary(str(path))
      for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
      ok = True
  _STATE["loaded"] = ok
  return ok


def require() -> None:
  if not available():
    raise RuntimeError("the native CPU kernels are not available here (SPECJAX_NATIVE=0, not on the CPU, or the "
                       "build failed): call the reference implementation instead")
