"""Every environment variable specjax reads, in one place (a leaf: nothing of specjax is imported here).

Each is read when asked for, not at import, so a test (or a caller) that changes the environment is followed.

  SPECJAX_CACHE          where downloads, converted weights, kernels and executables live
                         (else $XDG_CACHE_HOME/specjax, else ~/.cache/specjax)
  SPECJAX_KERNEL_DIR     where the native kernel library is built and found (else $SPECJAX_CACHE/kernels): one
                         build shared by several caches
  SPECJAX_NATIVE         1: the native CPU kernels everywhere they apply; 0: never (XLA only, and they are not
                         built); unset or auto: the choice measured on this machine (kernels/choices.py)
  SPECJAX_THREADS        a fixed thread count for the native kernels (else measured)
  SPECJAX_CPU_ISA        force a lower kernel path: avx512, avx2 or portable
  SPECJAX_EMULATE_SIMD   1: build the kernels with emulated vector intrinsics (tests of every path on any x86)
  CXX                    the C++ compiler for the native kernels (else c++, g++ or clang++ on PATH)
  SPECJAX_ATTENTION      force the attention path: native, pallas or xla
  SPECJAX_ACTIVATIONS    what int8/int4 weights multiply in decode-sized matmuls: fp32 activations, or int8
                         (int8-256: one x scale per 256 columns) on integer dot products (kernels/cpu_qdot.py);
                         unset: int8 where the integer-dot kernel runs on AVX-512 VNNI, else fp32
                         (kernels/dispatch.default_activations)
  SPECJAX_COMPILE_CACHE  0: no persistent compilation cache
  SPECJAX_PROBE_MB       the read-bandwidth probe's buffer in MiB (default 1024: far past the last-level cache);
                         the test suite makes it small, as its rooflines are never read
  SPECJAX_WEIGHT_CACHE   0: no converted-weight cache (every load converts again)
  SPECJAX_HUGE_PAGES     1: on the CPU, the weights a decode step reads copied into 2 MB pages at load
                         (runtime/huge_pages.py: faster decoding, a copy of the model in memory)
  SPECJAX_DEBUG          set: the CLI shows tracebacks instead of one-line errors
  SPECJAX_COORDINATOR, SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID, SPECJAX_DISTRIBUTED
                         multi-process runs (distributed.py)
"""
from __future__ import annotations

import os
from pathlib import Path


def get(name: str, default: str | None = None) -> str | None:
  """The raw value of any variable (for the few that pass values through: PATH to a subprocess)."""
  return os.environ.get(name, default)


def cache_root() -> Path:
  if os.environ.get("SPECJAX_CACHE"):
    return Path(os.environ["SPECJAX_CACHE"]).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME")
  return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specjax"


def kernel_dir() -> Path | None:
  raw = os.environ.get("SPECJAX_KERNEL_DIR", "").strip()
  return Path(raw).expanduser() if raw else None


def native_wanted() -> bool:
  """False only under SPECJAX_NATIVE=0 (then the kernels are neither built nor used)."""
  return os.environ.get("SPECJAX_NATIVE", "1").strip() != "0"


def activations() -> str | None:
  """SPECJAX_ACTIVATIONS, or None when unset (validated by kernels/dispatch.py)."""
  return os.environ.get("SPECJAX_ACTIVATIONS", "").strip() or None


def native_mode() -> str:
  """'native' (SPECJAX_NATIVE=1), 'xla' (0) or 'auto' (unset or anything else: the measured choice)."""
  return {"1": "native", "0": "xla"}.get(os.environ.get("SPECJAX_NATIVE", "auto").strip(), "auto")


def fixed_threads() -> int | None:
  raw = os.environ.get("SPECJAX_THREADS", "").strip()
  return int(raw) if raw else None


def forced_isa() -> str | None:
  return os.environ.get("SPECJAX_CPU_ISA") or None


def emulate_simd() -> bool:
  return os.environ.get("SPECJAX_EMULATE_SIMD", "0") == "1"


def compiler() -> str | None:
  return os.environ.get("CXX") or None


def forced_attention() -> str:
  return os.environ.get("SPECJAX_ATTENTION", "").strip()


def probe_bytes() -> int:
  """The read-bandwidth probe's buffer (``calibrate.measure_read_bandwidth``): 1 GiB unless SPECJAX_PROBE_MB."""
  raw = os.environ.get("SPECJAX_PROBE_MB", "").strip()
  return max(1, int(raw)) << 20 if raw else 1 << 30


def compile_cache_wanted() -> bool:
  return os.environ.get("SPECJAX_COMPILE_CACHE", "1") != "0"


def weight_cache_wanted() -> bool:
  return os.environ.get("SPECJAX_WEIGHT_CACHE", "1") != "0"


def huge_pages_wanted() -> bool:
  return os.environ.get("SPECJAX_HUGE_PAGES", "0").strip() == "1"


def debug() -> bool:
  return bool(os.environ.get("SPECJAX_DEBUG"))


def environment() -> dict[str, str]:
  """A copy of the whole environment (distributed.py picks its variables from it; tests pass their own)."""
  return dict(os.environ)
