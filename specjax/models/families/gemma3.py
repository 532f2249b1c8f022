"""Gemma 3 (text): Gemma 2's layout plus q/k norms, five local layers (window, rope base 10k, unscaled) per
global one (base 1M, its own scaling), no soft-caps by default."""
from __future__ import annotations

from specjax.models.families.base import QK_NORM_TENSORS, Family
from specjax.models.families.gemma2 import GEMMA_LAYER_TENSORS, gemma_fields

LOCAL_ROPE_THETA = 10000.0       # transformers' default rope_local_base_freq (not in GGUF metadata either)
SLIDING_PATTERN = 6              # every sixth layer global


def hf_fields(config, where):
  return {**gemma_fields(config, where), "qk_norm": True}


def gemma3_sliding(L, config):
  pattern = int(config.get("sliding_window_pattern", config.get("_sliding_window_pattern", SLIDING_PATTERN)))
  return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]


FAMILY = Family(name="gemma3", architectures=("Gemma3ForCausalLM",), model_types=("gemma3_text",),
                hf_fields=hf_fields, layer_tensors={**GEMMA_LAYER_TENSORS, **QK_NORM_TENSORS}, norm_offset=1.0,
                gguf_archs=("gemma3",), default_sliding=gemma3_sliding)
