"""Load a Hugging Face model directory (config.json + *.safetensors + tokenizer files).

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.  Weights may be one
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
from specjax.models.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError
from specjax.models.decoder import Params, params_from_hf_layout

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
QKV_BIAS_ARCHITECTURES = ("Qwen2ForCausalLM",)
INDEX_FILE = "model.safetensors.index.json"

# Hugging Face per-layer tensor suffix -> name used by params_from_hf_layout.
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
}
_BIAS_TENSORS = {"self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
                 "self_attn.v_proj.bias": "v_bias"}


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


def _ids(value: Any) -> tuple[int, ...]:
  """An id or list of ids (HF configs allow both for eos_token_id) as a tuple."""
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


ROPE_TYPES = ("default", "llama3")      # what ``rope_scaling_from_hf`` understands; anything else is refused


def rope_scaling_from_hf(rope_scaling: Mapping[str, Any] | None, where: str) -> RopeScaling | None:
  """``config.json`` ``rope_scaling`` (or transformers 5's ``rope_parameters``) -> RopeScaling: None for
  the default rope, the "llama3" frequency scaling, and a one-line refusal for any other rope type."""
  if not rope_scaling:
    return None
  kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
  if kind in (None, "default"):
    return None
  if kind != "llama3":
    raise CheckpointError(f"{where}: rope type '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})")
  try:
    return RopeScaling(factor=float(rope_scaling["factor"]),
                       low_freq_factor=float(rope_scaling["low_freq_factor"]),
                       high_freq_factor=float(rope_scaling["high_freq_factor"]),
                       original_max_position_embeddings=int(
                           rope_scaling["original_max_position_embeddings"]))
  except KeyError as e:
    raise CheckpointError(f"{where}: llama3 rope_scaling is missing {e}") from e


def rope_from_hf(config: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
  """(rope theta, scaling) in either spelling: transformers 4's ``rope_theta`` and ``rope_scaling``, or
  transformers 5's ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling's own keys in one
  dict).  Both given and different, or parameters per layer type (Gemma 3's local and global rope), are
  refused rather than half read."""
  params = config.get("rope_parameters")
  old_theta, old_scaling = config.get("rope_theta"), config.get("rope_scaling")
  if not params:
    return float(old_theta if old_theta is not None else 10000.0), rope_scaling_from_hf(old_scaling, where)
  if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
    raise CheckpointError(f"{where}: rope_parameters per layer type ({', '.join(map(str, params))}) are not "
                          "supported: one rope for every layer only")
  theta = float(params.get("rope_theta", old_theta if old_theta is not None else 10000.0))
  scaling = rope_scaling_from_hf(params, where)
  if old_theta is not None and float(old_theta) != theta:
    raise CheckpointError(f"{where}: rope_theta {old_theta} and rope_parameters' rope_theta {theta} disagree")
  if old_scaling and rope_scaling_from_hf(old_scaling, where) != scaling:
    raise CheckpointError(f"{where}: rope_scaling and rope_parameters disagree")
  return theta, scaling


def _check_no_window(config: Mapping[str, Any], arch: str, where: str) -> None:
  """Refuse sliding-window attention rather than ignore it (every layer here attends to its whole context):
  Mistral's ``sliding_window`` when shorter than the context, Qwen2's when ``use_sliding_window``."""
  window = config.get("sliding_window")
  if not window:
    return
  if arch == "Qwen2ForCausalLM" and not config.get("use_sliding_window", False):
    return
  context = int(config.get("max_position_embeddings", 2048))
  if int(window) < context:
    raise CheckpointError(f"{where}: sliding-window attention (a window of {window} positions, context "
                          f"{context}) is not supported: past {window} positions the attention would differ "
                          "from the model's")


def config_from_hf(config: Mapping[str, Any], name: str, where: str) -> ModelConfig:
  """A ModelConfig from a parsed Hugging Face ``config.json``."""
  archs = config.get("architectures") or [config.get("model_type", "?")]
  arch = archs[0]
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(f"{where}: architecture '{arch}' is not supported (supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)})")
  _check_no_window(config, arch, where)
  theta, scaling = rope_from_hf(config, where)
  try:
    num_heads = int(config["num_attention_heads"])
    d_model = int(config["hidden_size"])
    head_dim = config.get("head_dim") or d_model // num_heads
    return ModelConfig(
        name=name, vocab_size=int(config["vocab_size"]), num_layers=int(config["num_hidden_layers"]),
        d_model=d_model, num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads), head_dim=int(head_dim),
        ffn_dim=int(config["intermediate_size"]), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch in QKV_BIAS_ARCHITECTURES or bool(config.get("attention_bias", False)),
        max_position=int(config.get("max_position_embeddings", 2048)),
        bos_token_id=None if config.get("bos_token_id") is None else int(config["bos_token_id"]),
        eos_token_ids=_ids(config.get("eos_token_id")))
  except KeyError as e:
    raise CheckpointError(f"{where}: config.json is missing {e}") from e
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{where}: config.json is inconsistent ({e})") from e


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


def _layers(reader: _TensorReader, cfg: ModelConfig) -> list[dict[str, np.ndarray]]:
  names = dict(_LAYER_TENSORS, **(_BIAS_TENSORS if cfg.qkv_bias else {}))
  return [{hf: reader.get(f"model.layers.{i}.{suffix}") for suffix, hf in names.items()}
          for i in range(cfg.num_layers)]


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
  eos = cfg.eos_token_ids + tuple(i for i in _ids(gen_config.get("eos_token_id"))
                                  if i not in cfg.eos_token_ids)
  return Tokenizer.from_file(tok_json, tok_config, chat_template=template, bos_token_id=cfg.bos_token_id,
                             eos_token_ids=eos)


# ----------------------------------------------------------------------------------------------------------
# Entry point


def load_hf_dir(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params, Tokenizer]:
  """Load a Hugging Face checkpoint directory.

  Returns:
    (config, params in ``dtype``, tokenizer); ``config.eos_token_ids`` are the tokenizer's stop ids.
  Raises:
    CheckpointError: a file or tensor is missing or unreadable, or the architecture is unsupported.
  """
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path}: not a directory")
  raw = _read_json(path / "config.json")
  cfg = config_from_hf(raw, path.name, str(path))
  tokenizer = load_hf_tokenizer(path, cfg)
  cfg = cfg.replace(bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None
                    else tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)
  reader = _TensorReader(_shard_map(path))
  try:
    embed = reader.get("model.embed_tokens.weight")
    final_norm = reader.get("model.norm.weight")
    lm_head = None
    if not cfg.tie_embeddings:
      if not reader.has("lm_head.weight"):
        raise CheckpointError(f"{path}: config says tie_word_embeddings=false but the checkpoint is "
                              "missing tensor 'lm_head.weight'")
      lm_head = reader.get("lm_head.weight")
    head_ids = _draft_vocabulary(reader, raw, cfg, lm_head)
    layers = _layers(reader, cfg)
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
