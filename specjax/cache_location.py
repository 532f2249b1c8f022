"""Where specjax keeps what it downloads, converts and compiles (one small module with no imports from the rest
of specjax, so kernels, checkpoints and the compile cache can all ask without importing each other).

  ``$SPECJAX_CACHE``, else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``; inside it:
    models/     downloaded model files         converted/  weights converted once to safetensors
    kernels/    the native CPU kernel library  xla/        JAX's persistent compilation cache
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
  """``$SPECJAX_CACHE``, else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``."""
  if os.environ.get("SPECJAX_CACHE"):
    return Path(os.environ["SPECJAX_CACHE"]).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME")
  base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
  return base / "specjax"
