"""Random weights for the family reference checkpoints, from the tensor names and shapes alone (numpy only:
``scripts/record_family_references.py`` runs it beside transformers, the tests beside specjax, and both get
the same numbers from the same seed)."""
from __future__ import annotations

import numpy as np


def family_tensors(names_shapes: list[tuple[str, list[int]]], seed: int, norm_center: float) -> dict[str, np.ndarray]:
  """name -> float32 array, in the given order: norm weights ``norm_center`` + N(0, 0.1²) (0 for Gemma, whose
  norms multiply by 1 + w; 1 elsewhere), biases N(0, 0.1²), matrices N(0, 1/fan_in)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in names_shapes:
    if "norm" in name:
      x = norm_center + 0.1 * rng.standard_normal(shape)
    elif name.endswith(".bias"):
      x = 0.1 * rng.standard_normal(shape)
    else:
      x = rng.standard_normal(shape) / np.sqrt(shape[-1])
    out[name] = x.astype(np.float32)
  return out
