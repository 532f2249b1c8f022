"""Medusa-1 heads in their published layout: a directory with ``config.json`` (``medusa_num_heads``,
``medusa_num_layers``, optionally ``base_model_name_or_path``, ``hidden_size``, ``vocab_size``) and the heads'
state dict as ``medusa_lm_head.safetensors`` (the ``medusa`` package's ``MedusaModel.medusa_head``: tensor
``{i}.{j}.linear.weight`` [D, D] and ``.bias`` [D] for block j < R of head i, ``{i}.{R}.weight`` [V, D]; a
``medusa_head.`` prefix is accepted).  The older pickled ``medusa_lm_head.pt`` is refused with the one-line
conversion to run where torch is installed."""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.checkpoints.pickled import conversion_advice
from specjax.errors import CheckpointError
from specjax.models.config import ModelConfig
from specjax.speculative.medusa import MedusaConfig

WEIGHTS = "medusa_lm_head.safetensors"
PICKLE = "medusa_lm_head.pt"


def is_medusa_dir(path: str | os.PathLike) -> bool:
  """Whether ``path`` is a directory holding Medusa heads (its config names ``medusa_num_heads``)."""
  cfg = Path(path) / "config.json"
  if not cfg.is_file():
    return False
  try:
    return "medusa_num_heads" in json.loads(cfg.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError):
    return False


def _config(path: Path) -> dict:
  f = path / "config.json"
  if not f.is_file():
    raise CheckpointError(f"{path}: missing config.json (a Medusa directory has config.json with "
                          "medusa_num_heads and medusa_lm_head.safetensors)")
  try:
    return json.loads(f.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{f}: cannot parse JSON ({e})") from e


def _weights_file(path: Path) -> Path:
  f = path / WEIGHTS
  if f.is_file():
    return f
  if (path / PICKLE).is_file():
    raise CheckpointError(conversion_advice(path / PICKLE, f))
  raise CheckpointError(f"{path}: no {WEIGHTS}")


def load_medusa(path: str | os.PathLike, target: ModelConfig) -> tuple[MedusaConfig, dict]:
  """(MedusaConfig, params) of a Medusa directory for ``target``; every shape checked against the target
  before use, a missing tensor named."""
  from safetensors import safe_open
  path = Path(path)
  raw = _config(path)
  try:
    K, R = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path / 'config.json'}: needs integer medusa_num_heads and medusa_num_layers ({e})") from e
  D, V = target.d_model, target.vocab_size
  for key, want in (("hidden_size", D), ("vocab_size", V)):
    if raw.get(key) is not None and int(raw[key]) != want:
      raise CheckpointError(f"{path}: Medusa heads for {key}={raw[key]}, but the target {target.name} has {want}")
  mcfg = MedusaConfig(target=target, num_heads=K, num_layers=R)
  f = _weights_file(path)
  try:
    st = safe_open(f, framework="np")
    names = set(st.keys())
  except Exception as e:
    raise CheckpointError(f"{f}: not a readable safetensors file ({' '.join(str(e).split())})") from e
  prefix = "medusa_head." if any(n.startswith("medusa_head.") for n in names) else ""

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    full = prefix + name
    if full not in names:
      raise CheckpointError(f"{f}: missing tensor '{full}' ({K} heads of {R} blocks, config.json)")
    try:
      x = np.asarray(st.get_tensor(full), np.float32)
    except Exception as e:
      raise CheckpointError(f"{f}: cannot read tensor '{full}' ({' '.join(str(e).split())})") from e
    if x.shape != shape:
      raise CheckpointError(f"{f}: tensor '{full}' has shape {x.shape}, expected {shape} for the target "
                            f"{target.name} (D={D}, V={V})")
    return x

  res_w = np.zeros((K, R, D, D), np.float32)
  res_b = np.zeros((K, R, D), np.float32)
  head = np.zeros((K, V, D), np.float32)
  for i in range(K):
    for j in range(R):
      res_w[i, j] = get(f"{i}.{j}.linear.weight", (D, D))
      res_b[i, j] = get(f"{i}.{j}.linear.bias", (D,))
    head[i] = get(f"{i}.{R}.weight", (V, D))
  return mcfg, {"res_w": jnp.asarray(res_w), "res_b": jnp.asarray(res_b), "head": jnp.asarray(head)}


def save_medusa(path: str | os.PathLike, mcfg: MedusaConfig, params: dict, base_model: str = "") -> Path:
  """Write heads in the published layout (what ``load_medusa`` and the ``medusa`` package read)."""
  from safetensors.numpy import save_file
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  K, R = mcfg.num_heads, mcfg.num_layers
  tensors = {}
  for i in range(K):
    for j in range(R):
      tensors[f"{i}.{j}.linear.weight"] = np.asarray(params["res_w"][i, j], np.float32)
      tensors[f"{i}.{j}.linear.bias"] = np.asarray(params["res_b"][i, j], np.float32)
    tensors[f"{i}.{R}.weight"] = np.asarray(params["head"][i], np.float32)
  save_file(tensors, str(path / WEIGHTS))
  (path / "config.json").write_text(json.dumps({
      "medusa_num_heads": K, "medusa_num_layers": R, "base_model_name_or_path": base_model,
      "hidden_size": mcfg.target.d_model, "vocab_size": mcfg.target.vocab_size}, indent=1))
  return path
