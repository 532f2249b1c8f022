"""Where specjax keeps what it downloads, converts and compiles (one small module that imports only ``settings``, so kernels, checkpoints and the compile cache can all ask without importing each other).

  ``$SPECJAX_CACHE``, else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``; inside it:
    models/     downloaded model files         converted/  weights converted once to safetensors
    kernels/    the native CPU kernel library  xla/        JAX's persistent compilation cache
"""
from __future__ import annotations

from pathlib import Path

from specjax import settings


def cache_dir() -> Path:
  """``$SPECJAX_CACHE``, else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``."""
  return settings.cache_root()


def kernel_dir() -> Path:
  """Where the native kernel library lives: ``$SPECJAX_KERNEL_DIR`` (one build shared by several caches),
  else ``kernels/`` in the cache."""
  return settings.kernel_dir() or cache_dir() / "kernels"
