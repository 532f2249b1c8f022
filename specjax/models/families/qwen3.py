"""Qwen3 (dense): RMSNorm over each head's q and k before RoPE; no q/k/v biases (unless attention_bias)."""
from __future__ import annotations

from specjax.models.families.base import BIAS_TENSORS, LLAMA_LAYER_TENSORS, QK_NORM_TENSORS, Family, activation
from specjax.models.families.qwen2 import qwen_sliding


def hf_fields(config, where):
  return {"qk_norm": True, "qkv_bias": bool(config.get("attention_bias", False)),
          "activation": activation(config, "hidden_act", where, "silu")}


FAMILY = Family(name="qwen3", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",), hf_fields=hf_fields,
                layer_tensors={**LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS, **BIAS_TENSORS}, gguf_archs=("qwen3",),
                default_sliding=qwen_sliding)
