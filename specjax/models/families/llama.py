"""Llama 2 and 3.x (3.2: tied embeddings; 3.1+: llama3 rope scaling, read by ``hf_config``)."""
from __future__ import annotations

from specjax.models.families.base import Family, activation, refuse_unless


def hf_fields(config, where):
  refuse_unless(config, "mlp_bias", (False,), where)
  refuse_unless(config, "pretraining_tp", (1,), where, " (split weights)")
  return {"qkv_bias": bool(config.get("attention_bias", False)),
          "activation": activation(config, "hidden_act", where, "silu")}


FAMILY = Family(name="llama", architectures=("LlamaForCausalLM",), model_types=("llama",), hf_fields=hf_fields,
                gguf_archs=("llama",))
