"""Load a Hugging Face model directory (config.json + *.safetensors + tokenizer files).

Supported architectures: those of ``specjax.models.families`` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3
text); the config is read by ``families.hf_config``.  Weights may be one
``model.safetensors`` or sharded (``model.safetensors.index.json`` maps tensor names to shard files; without
an index every ``*.safetensors`` file in the directory is read).  Tensors are read with the ``safetensors``
library's numpy framework and assembled by ``specjax.models.decoder.params_from_hf_layout``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.checkpoints.tokenizer import Tokenizer
from specjax.models import families
from specjax.models.config import ModelConfig
from specjax.models.families.base import Family
from specjax.models.families.hf_config import config_from_hf, ids_of
from specjax.errors import CheckpointError
from specjax.models.decoder import Params, params_from_hf_layout

INDEX_FILE = "model.safetensors.index.json"

# ----------------------------------------------------------------------------------------------------------
# JSON files


def _read_json(path: Path, required: bool = True) -> dict | None:
  if not path.is_file():
    if required:
      raise CheckpointError(f"{path.parent}: missing {path.name}")
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: cannot parse JSON ({e})") from e


# ----------------------------------------------------------------------------------------------------------
# Weights


def _shard_map(path: Path) -> dict[str, Path]:
  """Tensor name -> shard file, from the index json or by listing every *.safetensors file."""
  from safetensors import safe_open

  index = _read_json(path / INDEX_FILE, required=False)
  if index is not None:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{path / INDEX_FILE}: has no 'weight_map'")
    missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if missing:
      raise CheckpointError(f"{path}: shard files named in {INDEX_FILE} are missing: {', '.join(missing)}")
    return {name: path / f for name, f in weight_map.items()}
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors weight files")
  mapping = {}
  for f in files:
    try:
      with safe_open(f, framework="np") as st:
        mapping.update({k: f for k in st.keys()})
    except Exception as e:
      raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
  return mapping


class _TensorReader:
  """Reads named tensors across shards, opening each shard once."""

  def __init__(self, shard_map: Mapping[str, Path]):
    self._map = shard_map
    self._open: dict[Path, Any] = {}

  def has(self, name: str) -> bool:
    return name in self._map

  def get(self, name: str) -> np.ndarray:
    from safetensors import safe_open

    if name not in self._map:
      raise CheckpointError(f"checkpoint is missing tensor '{name}'")
    f = self._map[name]
    try:
      if f not in self._open:
        self._open[f] = safe_open(f, framework="np")
      return np.asarray(self._open[f].get_tensor(name), dtype=np.float32)
    except CheckpointError:
      raise
    except Exception as e:
      detail = " ".join(str(e).split())
      raise CheckpointError(f"{f}: cannot read tensor '{name}' ({type(e).__name__}: {detail})") from e


def _layers(reader: _TensorReader, cfg: ModelConfig, family: Family) -> list[dict[str, np.ndarray]]:
  """Each layer's tensors in ``params_from_hf_layout``'s naming (the family's norm offset added)."""
  names = {k: v for k, v in family.layer_tensors.items()
           if (cfg.qkv_bias or not k.endswith(".bias")) and (cfg.qk_norm or v not in ("q_norm", "k_norm"))}
  return [{name: _norm_offset(reader.get(f"model.layers.{i}.{suffix}"), name, family)
           for suffix, name in names.items()} for i in range(cfg.num_layers)]


def _norm_offset(x: np.ndarray, name: str, family: Family) -> np.ndarray:
  """A norm weight as the multiplier itself: Gemma stores w and multiplies by 1 + w."""
  return x + np.float32(family.norm_offset) if family.norm_offset and "norm" in name else x


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


def load_hf_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer:
  """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json eos ids)."""
  tok_json = path / "tokenizer.json"
  if not tok_json.is_file():
    raise CheckpointError(f"{path}: missing tokenizer.json (specjax reads fast-tokenizer files only)")
  tok_config = _read_json(path / "tokenizer_config.json", required=False) or {}
  template_file = path / "chat_template.jinja"
  template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
  gen_config = _read_json(path / "generation_config.json", required=False) or {}
  eos = cfg.eos_token_ids + tuple(i for i in ids_of(gen_config.get("eos_token_id"))
                                  if i not in cfg.eos_token_ids)
  return Tokenizer.from_file(tok_json, tok_config, chat_template=template, bos_token_id=cfg.bos_token_id,
                             eos_token_ids=eos)


# ----------------------------------------------------------------------------------------------------------
# Entry point


def read_hf_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
  """(ModelConfig, the parsed config.json) of a Hugging Face directory from its config.json alone: what the cost
  model needs, with no tokenizer and no weights in the directory."""
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path}: not a directory")
  raw = _read_json(path / "config.json")
  return config_from_hf(raw, path.name, str(path)), raw


def load_hf_dir(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params, Tokenizer]:
  """Load a Hugging Face checkpoint directory.

  Returns:
    (config, params in ``dtype``, tokenizer); ``config.eos_token_ids`` are the tokenizer's stop ids.
  Raises:
    CheckpointError: a file or tensor is missing or unreadable, or the architecture is unsupported.
  """
  path = Path(path)
  cfg, raw = read_hf_config(path)
  family = families.BY_NAME[cfg.family]
  tokenizer = load_hf_tokenizer(path, cfg)
  cfg = cfg.replace(bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None
                    else tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)
  reader = _TensorReader(_shard_map(path))
  try:
    embed = reader.get("model.embed_tokens.weight")
    final_norm = _norm_offset(reader.get("model.norm.weight"), "norm", family)
    lm_head = None
    if not cfg.tie_embeddings:
      if not reader.has("lm_head.weight"):
        raise CheckpointError(f"{path}: config says tie_word_embeddings=false but the checkpoint is "
                              "missing tensor 'lm_head.weight'")
      lm_head = reader.get("lm_head.weight")
    head_ids = _draft_vocabulary(reader, raw, cfg, lm_head)
    layers = _layers(reader, cfg, family)
  except CheckpointError as e:
    msg = str(e)
    raise CheckpointError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
  try:
    params = params_from_hf_layout(cfg, embed, final_norm, layers, lm_head, dtype)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from e
  if head_ids is not None:
    params["head_ids"] = jnp.asarray(head_ids, jnp.int32)
  return cfg, params, tokenizer


def _draft_vocabulary(reader: _TensorReader, config: Mapping[str, Any], cfg: ModelConfig, lm_head):
  """A draft model with a reduced head (config ``draft_vocab_size`` Vr, EAGLE-3's convention): its
  ``d2t`` [Vr] target ids, checked against ``lm_head`` [Vr, D]; None for an ordinary checkpoint, whose
  ``lm_head`` must be [V, D]."""
  Vr = config.get("draft_vocab_size")
  D, V = cfg.d_model, cfg.vocab_size
  if Vr is None or int(Vr) == V:
    if lm_head is not None and tuple(lm_head.shape) != (V, D):
      raise CheckpointError(f"tensor 'lm_head.weight' has shape {tuple(lm_head.shape)}, expected {(V, D)}")
    return None
  Vr = int(Vr)
  if lm_head is None or not reader.has("d2t"):
    raise CheckpointError(f"config says draft_vocab_size={Vr} but the checkpoint lacks an untied "
                          "'lm_head.weight' or the 'd2t' map (draft row -> target token id)")
  d2t = np.asarray(reader.get("d2t")).astype(np.int64)
  if tuple(lm_head.shape) != (Vr, D) or d2t.shape != (Vr,):
    raise CheckpointError(f"draft_vocab_size={Vr} but 'lm_head.weight' is {tuple(lm_head.shape)} and 'd2t' "
                          f"{d2t.shape}: expected {(Vr, D)} and {(Vr,)}")
  if d2t.min() < 0 or d2t.max() >= V or len(np.unique(d2t)) != Vr:
    raise CheckpointError(f"'d2t' must hold {Vr} distinct target ids in [0, {V})")
  return d2t
