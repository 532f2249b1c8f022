"""What a model family is: ``Family``, and the helpers family modules share."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from specjax.errors import CheckpointError

# Per-layer Hugging Face tensor suffix -> the name ``decoder.params_from_hf_layout`` takes (Llama's layout;
# a family overrides or adds entries in ``Family.layer_tensors``).
LLAMA_LAYER_TENSORS = {
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
BIAS_TENSORS = {"self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
                "self_attn.v_proj.bias": "v_bias"}
QK_NORM_TENSORS = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}


@dataclasses.dataclass(frozen=True)
class Family:
  """How one model family differs from Llama (see the package docstring)."""
  name: str
  architectures: tuple[str, ...]          # Hugging Face ``architectures`` entries
  model_types: tuple[str, ...]            # ``model_type`` values (a config without ``architectures``)
  hf_fields: Callable[[Mapping[str, Any], str], dict[str, Any]]   # (config.json, where) -> ModelConfig fields
  layer_tensors: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(LLAMA_LAYER_TENSORS))
  norm_offset: float = 0.0                # added to every stored norm weight at load (Gemma: 1)
  gguf_archs: tuple[str, ...] = ()        # GGUF ``general.architecture`` values
  default_sliding: Callable[[int, Mapping[str, Any]], list[str]] | None = None   # layer_types when absent


def refuse_unless(config: Mapping[str, Any], key: str, allowed, where: str, what: str = "") -> None:
  """Refuse a config option whose value specjax does not implement (one line: the value and what is)."""
  value = config.get(key)
  if value is None or value in allowed:
    return
  shown = ", ".join(str(a) for a in allowed if a is not None)
  raise CheckpointError(f"{where}: {key}={value!r} is not supported{what} (supported: {shown})")


def activation(config: Mapping[str, Any], key: str, where: str, default: str) -> str:
  """The gated MLP's activation from ``hidden_act``/``hidden_activation``: "silu" or "gelu_tanh"."""
  names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
  value = config.get(key) or default
  if value not in names:
    raise CheckpointError(f"{where}: {key}={value!r} is not supported (supported: {', '.join(names)})")
  return names[value]
