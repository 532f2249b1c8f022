"""JAX's persistent compilation cache under the specjax cache directory, on by default, and compile accounting.

A second process running the same command reads its executables back instead of compiling them:

  <cache>/xla/<machine tag>/      jax's own file cache (keyed by jax on the HLO, the compile options and the
                                  jax/jaxlib version)

The machine tag (``machine.tag()``) names what jax's key leaves out but an executable depends on: the CPU (model and ISA flags:
an executable compiled for AVX-512 must not run where there is none) or the accelerator kind, and the build
of the native CPU kernels that executables call by name.  The kernels are registered before the cache is
switched on, so an executable read back from it always finds its FFI targets.

Off with ``SPECJAX_COMPILE_CACHE=0``, ``--no-compile-cache`` on the command line, or ``enable(False)``.

``CompileLog`` counts what jax reports through ``jax.monitoring`` (backend compiles, persistent-cache hits and
misses) so that callers can say where time went: "compiled in 2.1 s" or "read from the compilation cache".
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import jax
from specjax import machine, settings
from specjax.kernels import native
from specjax.cache_location import cache_dir

_STATE: dict = {"dir": None, "listening": False}
_COUNTS = {"requests": 0, "request_s": 0.0, "cache_hits": 0, "cache_misses": 0}
_LOCK = threading.Lock()


def wanted() -> bool:
  return settings.compile_cache_wanted()


def _key() -> str:
  """The machine's tag, and on the CPU the native kernels' build (executables call them by name)."""
  if jax.default_backend() != "cpu":
    return machine.tag()
  return f"{machine.tag()}-{native.source_digest() if native.available() else 'xla-only'}"


def enable(on: bool | None = None) -> Path | None:
  """Switch the persistent compilation cache on or off; ``None`` keeps an earlier explicit choice, else follows
  ``SPECJAX_COMPILE_CACHE`` (on unless it is 0).

  Returns its directory, or None when off.  Registers the native CPU kernels first (building them if needed).
  """
  _listen()
  if on is None:   # the default: what the environment says, unless a caller chose explicitly before
    on = _STATE.get("chosen", wanted())
  else:
    _STATE["chosen"] = on
  if not on:
    jax.config.update("jax_enable_compilation_cache", False)
    _STATE["dir"] = None
    return None
  path = cache_dir() / "xla" / _key()
  if _STATE["dir"] == path:
    return path
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    print(f"[specjax] cannot use the compilation cache at {path} ({e}): compiling without it",
          file=sys.stderr, flush=True)
    return enable(False)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)   # keep every executable we compile
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  from jax.experimental.compilation_cache import compilation_cache
  compilation_cache.reset_cache()     # re-initialised at the next compile, at this directory
  _STATE["dir"] = path
  return path


def directory() -> Path | None:
  return _STATE["dir"]


# ----------------------------------------------------------------------------------------------------------
# Compile accounting


def _on_event(event: str, **kwargs) -> None:
  with _LOCK:
    if event == "/jax/compilation_cache/cache_hits":
      _COUNTS["cache_hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
      _COUNTS["cache_misses"] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":   # a compile, or a read from the cache
    with _LOCK:
      _COUNTS["requests"] += 1
      _COUNTS["request_s"] += duration


def _listen() -> None:
  if not _STATE["listening"]:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _STATE["listening"] = True


def counts() -> dict:
  """Totals so far in this process: executables requested from XLA (``requests``, and the seconds they
  took), of which read back from the persistent cache (``cache_hits``) and really compiled (``compiled``)."""
  _listen()
  with _LOCK:
    c = dict(_COUNTS)
  c["compiled"] = c["requests"] - c["cache_hits"]
  return c


def since(before: dict) -> dict:
  """``counts()`` now minus ``before``."""
  now = counts()
  return {k: now[k] - before[k] for k in now}


def describe(delta: dict) -> str:
  """'compiled 2', 'read 2 from the compilation cache' or 'nothing compiled' for a ``since()`` result."""
  parts = []
  if delta["compiled"]:
    parts.append(f"compiled {delta['compiled']}")
  if delta["cache_hits"]:
    parts.append(f"read {delta['cache_hits']} from the compilation cache")
  return ", ".join(parts) or "nothing compiled"


def count_hit(seconds: float) -> None:
  """Count an executable read back from specjax's own store (``stored_executables``) as a cache hit."""
  with _LOCK:
    _COUNTS["requests"] += 1
    _COUNTS["cache_hits"] += 1
    _COUNTS["request_s"] += seconds
