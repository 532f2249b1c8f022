"""A ``ModelConfig`` from a Hugging Face ``config.json``: the fields every family shares (sizes, rope in
transformers 4's ``rope_theta``/``rope_scaling`` or transformers 5's ``rope_parameters``, per layer type where
nested; windows from ``layer_types`` and ``sliding_window``) plus what the family sets.  A value specjax does
not implement is refused in one line naming what is supported, before any weight is read."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from specjax.errors import CheckpointError
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.families import BY_ARCHITECTURE, BY_MODEL_TYPE, supported_architectures
from specjax.models.families.base import Family

ROPE_TYPES = ("default", "llama3", "yarn", "linear")   # what ``rope_scaling_from_hf`` understands
LAYER_TYPES = ("full_attention", "sliding_attention")
TIED_BY_DEFAULT = ("gemma2", "gemma3")                   # families whose config class ties the head by default


def family_of(config: Mapping[str, Any], where: str) -> Family:
  """The family of a config.json, by ``architectures`` (else ``model_type``)."""
  archs = config.get("architectures")
  if archs:
    if archs[0] in BY_ARCHITECTURE:
      return BY_ARCHITECTURE[archs[0]]
    raise CheckpointError(f"{where}: architecture '{archs[0]}' is not supported (supported: "
                          f"{supported_architectures()})")
  kind = config.get("model_type", "?")
  if kind in BY_MODEL_TYPE:
    return BY_MODEL_TYPE[kind]
  raise CheckpointError(f"{where}: model_type '{kind}' is not supported (supported architectures: "
                        f"{supported_architectures()})")


def _yarn_attention_factor(p: Mapping[str, Any], factor: float) -> float | None:
  """YaRN's cos/sin multiplier when the config fixes it (given, or DeepSeek's mscale pair); None: default."""
  if p.get("attention_factor") is not None:
    return float(p["attention_factor"])
  mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
  if mscale and mscale_all:
    def m(scale, s):
      return 1.0 if scale <= 1 else 0.1 * s * math.log(scale) + 1.0
    return m(factor, float(mscale)) / m(factor, float(mscale_all))
  return None


def rope_scaling_from_hf(p: Mapping[str, Any] | None, where: str, max_position: int = 0) -> RopeScaling | None:
  """One rope dict (``rope_scaling``, or ``rope_parameters`` flat or for one layer type) -> RopeScaling: None
  for the default rope, the llama3, yarn or linear scaling, a one-line refusal for any other type."""
  if not p:
    return None
  kind = p.get("rope_type", p.get("type"))
  if kind in (None, "default"):
    return None
  if kind not in ROPE_TYPES:
    raise CheckpointError(f"{where}: rope type '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})")
  if p.get("partial_rotary_factor", 1.0) != 1.0:
    raise CheckpointError(f"{where}: partial_rotary_factor={p['partial_rotary_factor']} is not supported "
                          "(supported: 1.0, RoPE over the whole head)")
  try:
    if kind == "linear":
      return RopeScaling(kind="linear", factor=float(p["factor"]))
    if kind == "llama3":
      return RopeScaling(factor=float(p["factor"]), low_freq_factor=float(p["low_freq_factor"]),
                         high_freq_factor=float(p["high_freq_factor"]),
                         original_max_position_embeddings=int(p["original_max_position_embeddings"]))
    orig = int(p.get("original_max_position_embeddings") or max_position)
    factor = float(p["factor"]) if p.get("factor") is not None else max_position / orig
    return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=orig,
                       beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
                       attention_factor=_yarn_attention_factor(p, factor), truncate=bool(p.get("truncate", True)))
  except KeyError as e:
    raise CheckpointError(f"{where}: {kind} rope scaling is missing {e}") from e


def _theta(p: Mapping[str, Any] | None, fallback) -> float:
  return float((p or {}).get("rope_theta", fallback if fallback is not None else 10000.0))


def rope_from_hf(config: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None, float | None]:
  """(global theta, global scaling, local theta or None) in either spelling: transformers 4's ``rope_theta``,
  ``rope_scaling`` (and Gemma 3's ``rope_local_base_freq``), or transformers 5's ``rope_parameters`` — one
  dict, or one per layer type (``full_attention``, ``sliding_attention``).  Both spellings given and
  different are refused rather than half read; so is a scaled local rope."""
  params = config.get("rope_parameters")
  old_theta, old_scaling = config.get("rope_theta"), config.get("rope_scaling")
  old_local = config.get("rope_local_base_freq")
  max_pos = int(config.get("max_position_embeddings", 2048))
  if not params:
    return (_theta(None, old_theta), rope_scaling_from_hf(old_scaling, where, max_pos),
            None if old_local is None else float(old_local))
  if not isinstance(params, Mapping):
    raise CheckpointError(f"{where}: rope_parameters must be a dict, got {type(params).__name__}")
  nested = any(isinstance(v, Mapping) for v in params.values())
  if nested:
    unknown = sorted(set(params) - set(LAYER_TYPES))
    if unknown:
      raise CheckpointError(f"{where}: rope_parameters for layer type(s) {', '.join(unknown)} are not "
                            f"supported (supported: {', '.join(LAYER_TYPES)})")
    glob, local = params.get("full_attention") or {}, params.get("sliding_attention")
    if local is not None and rope_scaling_from_hf(local, where, max_pos) is not None:
      raise CheckpointError(f"{where}: rope scaling on the sliding-window layers is not supported "
                            "(supported: default rope there)")
    local_theta = None if local is None else _theta(local, old_local)
  else:
    glob, local_theta = params, None if old_local is None else float(old_local)
  theta, scaling = _theta(glob, old_theta), rope_scaling_from_hf(glob, where, max_pos)
  if old_theta is not None and float(old_theta) != theta:
    raise CheckpointError(f"{where}: rope_theta {old_theta} and rope_parameters' rope_theta {theta} disagree")
  if old_scaling and rope_scaling_from_hf(old_scaling, where, max_pos) != scaling:
    raise CheckpointError(f"{where}: rope_scaling and rope_parameters disagree")
  return theta, scaling, local_theta


def layer_windows(config: Mapping[str, Any], family: Family, L: int, where: str,
                  keep_long: bool = False) -> tuple[int, ...]:
  """Each layer's window (0 = global) from ``sliding_window`` and ``layer_types`` (or the family's own rule
  when the list is absent); () when no layer is windowed, or (unless ``keep_long``: the windowed layers have
  their own rope) the window covers the whole context."""
  window = config.get("sliding_window")
  if family.name in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
    window = None                  # Qwen configs carry a window they do not use unless switched on
  if not window:
    return ()
  types = config.get("layer_types") if family.name != "mistral" else None
  if types is None:
    types = family.default_sliding(L, config) if family.default_sliding else ["full_attention"] * L
  if len(types) != L:
    raise CheckpointError(f"{where}: layer_types has {len(types)} entries for {L} layers")
  unknown = sorted(set(types) - set(LAYER_TYPES))
  if unknown:
    raise CheckpointError(f"{where}: layer type(s) {', '.join(unknown)} are not supported (supported: "
                          f"{', '.join(LAYER_TYPES)})")
  W = int(window)
  if W >= int(config.get("max_position_embeddings", 2048)) and not keep_long:
    return ()                      # a window as long as the context: every layer sees everything anyway
  windows = tuple(W if t == "sliding_attention" else 0 for t in types)
  return windows if any(windows) else ()


def ids_of(value: Any) -> tuple[int, ...]:
  """An id or list of ids (HF configs allow both for eos_token_id) as a tuple."""
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


def config_from_hf(config: Mapping[str, Any], name: str, where: str) -> ModelConfig:
  """A ModelConfig from a parsed Hugging Face ``config.json``."""
  family = family_of(config, where)
  theta, scaling, local_theta = rope_from_hf(config, where)
  if config.get("partial_rotary_factor", 1.0) != 1.0:
    raise CheckpointError(f"{where}: partial_rotary_factor={config['partial_rotary_factor']} is not supported "
                          "(supported: 1.0)")
  try:
    num_heads, d_model = int(config["num_attention_heads"]), int(config["hidden_size"])
    L = int(config["num_hidden_layers"])
    fields = family.hf_fields(config, where)
    windows = layer_windows(config, family, L, where, keep_long=local_theta is not None)
    tie = config.get("tie_word_embeddings", family.name in TIED_BY_DEFAULT)
    return ModelConfig(
        name=name, vocab_size=int(config["vocab_size"]), num_layers=L, d_model=d_model, num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or d_model // num_heads), ffn_dim=int(config["intermediate_size"]),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(tie), max_position=int(config.get("max_position_embeddings", 2048)),
        bos_token_id=None if config.get("bos_token_id") is None else int(config["bos_token_id"]),
        eos_token_ids=ids_of(config.get("eos_token_id")), family=family.name, layer_windows=windows,
        local_rope_theta=local_theta if windows else None, **fields)
  except KeyError as e:
    raise CheckpointError(f"{where}: config.json is missing {e} (a Hugging Face config names hidden_size, "
                          "num_hidden_layers, num_attention_heads, intermediate_size and vocab_size: add it)") from e
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{where}: config.json is inconsistent ({e})") from e
