"""Gemma 2: norms before and after attention and the MLP (weights stored as w, applied as 1 + w), GeGLU,
embeddings times sqrt(D), ``query_pre_attn_scalar`` for the score scale, attention and final logits soft-capped,
local (windowed) and global layers alternating."""
from __future__ import annotations

import math

from specjax.models.families.base import LLAMA_LAYER_TENSORS, Family, activation, refuse_unless

# Gemma's per-layer norms: input (before attention), post-attention (its output), pre- and post-feed-forward.
GEMMA_LAYER_TENSORS = {
    **{k: v for k, v in LLAMA_LAYER_TENSORS.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm",   # the norm before the MLP
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def gemma_fields(config, where) -> dict:
  """What Gemma 2 and 3 share."""
  refuse_unless(config, "use_bidirectional_attention", (False,), where, " (an encoder's attention)")
  D = int(config["hidden_size"])
  E = int(config.get("head_dim") or D // int(config["num_attention_heads"]))
  scalar = config.get("query_pre_attn_scalar")
  cap_attn, cap_final = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
  return {"sandwich_norms": True, "embed_scale": math.sqrt(D),
          "activation": activation(config, "hidden_activation", where, "gelu_pytorch_tanh"),
          "query_scale": None if scalar is None or float(scalar) == E else float(scalar) ** -0.5,
          "attn_softcap": None if cap_attn is None else float(cap_attn),
          "final_softcap": None if cap_final is None else float(cap_final),
          "qkv_bias": bool(config.get("attention_bias", False))}


FAMILY = Family(name="gemma2", architectures=("Gemma2ForCausalLM",), model_types=("gemma2",),
                hf_fields=gemma_fields, layer_tensors=GEMMA_LAYER_TENSORS, norm_offset=1.0, gguf_archs=("gemma2",),
                default_sliding=lambda L, config: ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                   for i in range(L)])
