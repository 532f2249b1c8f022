"""Qwen2 / Qwen2.5: biases on q, k and v; a sliding window (with ``use_sliding_window``) on the layers from
``max_window_layers`` on."""
from __future__ import annotations

from specjax.models.families.base import BIAS_TENSORS, LLAMA_LAYER_TENSORS, Family, activation


def hf_fields(config, where):
  return {"qkv_bias": True, "activation": activation(config, "hidden_act", where, "silu")}


def qwen_sliding(L, config):
  """Qwen's rule when ``layer_types`` is absent: windowed from ``max_window_layers`` on, if switched on."""
  if not config.get("use_sliding_window", False):
    return ["full_attention"] * L
  first = int(config.get("max_window_layers", L))
  return ["sliding_attention" if i >= first else "full_attention" for i in range(L)]


FAMILY = Family(name="qwen2", architectures=("Qwen2ForCausalLM",), model_types=("qwen2",), hf_fields=hf_fields,
                layer_tensors={**LLAMA_LAYER_TENSORS, **BIAS_TENSORS}, gguf_archs=("qwen2",),
                default_sliding=qwen_sliding)
