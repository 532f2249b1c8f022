"""A published drafter's files: its ``config.json`` parsed (``read_config``), and its ``model.safetensors``, its header checked against the tensors its config.json implies
(names and shapes) before any tensor is read, then read; the one-line refusals shared by the published-layout
loaders (a missing file, a pickle in its place, a damaged file, a missing or misshapen tensor)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specjax.checkpoints.pickled import conversion_advice
from specjax.errors import SpecjaxError

WEIGHTS, PICKLE = "model.safetensors", "pytorch_model.bin"


def read_config(path) -> dict | None:
  """The directory's config.json as a dict, or None (missing, unreadable, not an object)."""
  try:
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError):
    return None
  return config if isinstance(config, dict) else None


def checked(path: Path, need: dict, what: str) -> Path:
  """The weights file of the drafter directory ``path`` (``what``: "an EAGLE-3 drafter", ...), its header
  holding every tensor of ``need`` (name -> shape, None: any shape)."""
  from safetensors import SafetensorError, safe_open
  f = path / WEIGHTS
  if not f.is_file():
    if (path / PICKLE).is_file():
      raise SpecjaxError(conversion_advice(path / PICKLE, f))
    raise SpecjaxError(f"{path}: no {WEIGHTS} ({what} directory holds config.json and {WEIGHTS})")
  try:
    with safe_open(str(f), framework="numpy") as h:
      shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
  except (SafetensorError, OSError, ValueError) as e:
    raise SpecjaxError(f"{f} is damaged ({' '.join(str(e).split())})") from e
  for name, shape in need.items():
    if name not in shapes:
      raise SpecjaxError(f"{f} lacks '{name}'" + (": a reduced draft vocabulary needs its d2t map" if name == "d2t"
                                                 else f": not {what} of the layout its config.json describes"))
    if shape is not None and shapes[name] != tuple(shape):
      raise SpecjaxError(f"{f}: '{name}' has shape {shapes[name]}, config.json and the target say {tuple(shape)}")
  return f


def read(f: Path) -> dict[str, np.ndarray]:
  """Every tensor of ``f`` (numpy); a file damaged past its header named in one line."""
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  try:
    return load_file(str(f))
  except (SafetensorError, OSError, ValueError) as e:
    raise SpecjaxError(f"{f} is damaged ({' '.join(str(e).split())})") from e
