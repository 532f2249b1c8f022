"""Building and loading specjax's native CPU kernels (``*.cc`` in this folder) as XLA FFI targets.

All sources are compiled together, on first use, with the system C++ compiler (``$CXX`` or ``c++``) into one
shared library in the specjax cache (or ``$SPECJAX_KERNEL_DIR``), keyed by a hash of the sources, the compiler
flags and the jax version.
If no compiler is found or the build fails, a one-line warning goes to stderr and every kernel falls back
to its XLA reference.  ``SPECJAX_NATIVE=0`` disables them; they are used only on the CPU backend.

``SPECJAX_EMULATE_SIMD=1`` (for tests) builds a separate library whose AVX2 and AVX-512 paths take their
intrinsics from SIMDe's portable C (the ``simde-py`` package of the ``[test]`` extra; see isa.h): every path
then runs, slowly, on any x86-64 CPU, so the AVX-512 code is tested on a machine without AVX-512.
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
from specjax import settings
from specjax.cache_location import kernel_dir

# FFI target name -> exported handler symbol.
TARGETS = {"specjax_matmul_t": "SpecjaxMatmulT", "specjax_attend_cache": "SpecjaxAttendCache",
           "specjax_qmatmul_bf16": "SpecjaxQMatmulBf16", "specjax_qmatmul_int8": "SpecjaxQMatmulInt8",
           "specjax_qmatmul_int4": "SpecjaxQMatmulInt4", "specjax_qdot_int8": "SpecjaxQDotInt8",
           "specjax_qdot_int4": "SpecjaxQDotInt4"}
_SOURCES = sorted(Path(__file__).parent.glob("*.cc"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# No -march=native: the library is built for its architecture's baseline, and each fast path (AVX-512F,
# AVX2+FMA) is a function compiled for its own target and chosen at run time from the CPU's features
# (isa.h), so a library built on one machine never runs an instruction another machine lacks.  No contraction
# of a product and a sum into one FMA unless the source says fma: a path's bits are then what its source
# says, whatever the compiler and the target, and the SIMD emulation (below) reproduces them exactly.
_FLAGS = ["-O3", "-std=c++20", "-ffp-contract=off", "-fopenmp-simd", "-fPIC", "-shared", "-w"]
ISAS = ("portable", "avx2", "avx512")     # SpecjaxKernelIsa() values 0, 1, 2
_STATE: dict = {"loaded": None}
_LOCK = threading.Lock()


def emulating() -> bool:
  """True when this process builds the SIMD-emulating test library (``SPECJAX_EMULATE_SIMD=1``)."""
  return settings.emulate_simd()


def _defining_flags() -> list[str]:
  """The flags that decide what is built (they name the library; the headers' install path does not)."""
  return [*_FLAGS, "-DSPECJAX_EMULATE_SIMD"] if emulating() else list(_FLAGS)


def _flags() -> list[str]:
  if not emulating():
    return _defining_flags()
  try:
    import simde_py
  except ImportError as e:
    raise RuntimeError("SPECJAX_EMULATE_SIMD=1 needs SIMDe's headers: pip install simde-py (part of the [test] "
                       "extra), or unset SPECJAX_EMULATE_SIMD") from e
  return [*_defining_flags(), f"-I{simde_py.get_include()}"]


def _cache_dir() -> Path:
  return kernel_dir()


def _say(message: str) -> None:
  """One line on stderr in a single write (the build runs on a helper thread: a line must not interleave
  with the main thread's output)."""
  sys.stderr.write(f"[specjax] {message}\n")
  sys.stderr.flush()


def source_digest() -> str:
  """Hash of the kernel sources, the compiler flags and the jax version (names the built library)."""
  digest = hashlib.sha256(" ".join(_defining_flags()).encode() + jax.__version__.encode())
  for src in _SOURCES + _HEADERS:
    digest.update(src.name.encode() + src.read_bytes())
  return digest.hexdigest()[:16]


def _library_path() -> Path:
  return _cache_dir() / f"libspecjax_cpu_{source_digest()}.so"


def _compiler() -> str | None:
  return settings.compiler() or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _build() -> Path | None:
  cxx = _compiler()
  if cxx is None:
    return None
  try:
    flags = _flags()
  except RuntimeError as e:
    _say(f"{e}: using XLA")
    return None
  out = _library_path()
  if out.is_file():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    tmp_out = Path(tmp) / out.name
    cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(tmp_out), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      first = (proc.stderr.strip().splitlines() or ["?"])[0]
      _say(f"building the native CPU kernels failed ({first}): using XLA")
      return None
    os.replace(tmp_out, out)
  return out


def _wanted() -> bool:
  return settings.native_wanted() and jax.default_backend() == "cpu"


def start_build() -> None:
  """Start building the library on a helper thread (the compiler runs as a subprocess), so that a first run
  compiles the kernels while it loads the model; ``available`` waits for it.  Safe to call repeatedly."""
  with _LOCK:
    if _STATE["loaded"] is not None or "builder" in _STATE or not _wanted():
      return
    if not _library_path().is_file():   # said here, on the caller's thread, so it never lands after an error
      if _compiler() is None:
        _say("no C++ compiler found: using XLA for matmuls and attention on the CPU (slower decoding)")
      else:
        _say("building the native CPU kernels (once per source version)")
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
      for fn in (lib.SpecjaxKernelIsa, lib.SpecjaxSetIsa, lib.SpecjaxDetectedIsa, lib.SpecjaxQDotPath):
        fn.restype = ctypes.c_int32
      _STATE["lib"] = lib
      ok = True
  _STATE["loaded"] = ok
  forced = settings.forced_isa()
  if ok and forced:          # after "loaded" is set: set_isa checks availability itself
    set_isa(forced)
  return ok


def require() -> None:
  if not available():
    raise RuntimeError("the native CPU kernels are not available here (SPECJAX_NATIVE=0, not on the CPU, or the "
                       "build failed): call the reference implementation instead")


# ----------------------------------------------------------------------------------------------------------
# Instruction-set paths


def isa() -> str | None:
  """The path the kernels take on this CPU ('avx512', 'avx2' or 'portable'); None without the kernels."""
  if not available():
    return None
  return ISAS[_STATE["lib"].SpecjaxKernelIsa()]


def path_name() -> str:
  """'native-avx2' (the kernels' instruction set; '-emulated' under SIMD emulation), or 'xla' without them."""
  if not available():
    return "xla"
  return f"native-{isa()}" + ("-emulated" if emulating() else "")


QDOT_PATHS = ("portable", "avx2", "avx512-vnni")   # SpecjaxQDotPath() values (cpu_qdot.cc)


def qdot_path() -> str | None:
  """The integer-dot kernel's path under the active instruction set ('avx512-vnni', 'avx2', 'portable'); None
  without the native kernels.  (AVX-512 without VNNI takes the AVX2 path.)"""
  if not available():
    return None
  return QDOT_PATHS[_STATE["lib"].SpecjaxQDotPath()]


def detected_isa() -> str | None:
  """The best path this CPU supports (what ``isa`` is unless forced lower)."""
  if not available():
    return None
  return ISAS[_STATE["lib"].SpecjaxDetectedIsa(0)]


def set_isa(name: str) -> str:
  """Force a path (``SPECJAX_CPU_ISA`` does this at load): never above what the CPU supports — asking for
  more gives the best available.  Returns the path now in use.  Compiled executables need not change: the
  kernels read the choice on every call."""
  if name not in ISAS:
    raise ValueError(f"unknown kernel path {name!r}: choose one of {', '.join(ISAS)}")
  require()
  return ISAS[_STATE["lib"].SpecjaxSetIsa(ISAS.index(name))]


def pretend_cpu_without_features(on: bool) -> str:
  """Make the kernels' feature check report no vector extensions (as on a CPU older than the one the library
  was built on) and re-pick the path; ``False`` restores the real check.  For tests."""
  require()
  best = _STATE["lib"].SpecjaxDetectedIsa(1 if on else 0)
  return ISAS[_STATE["lib"].SpecjaxSetIsa(best)]
