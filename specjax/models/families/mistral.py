"""Mistral (v0.1's sliding window on every layer; later versions set none)."""
from __future__ import annotations

from specjax.models.families.base import Family, activation


def hf_fields(config, where):
  return {"activation": activation(config, "hidden_act", where, "silu")}


FAMILY = Family(name="mistral", architectures=("MistralForCausalLM",), model_types=("mistral",),
                hf_fields=hf_fields, default_sliding=lambda L, config: ["sliding_attention"] * L)
