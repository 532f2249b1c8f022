"""Model families as data over one decoder.

A family says only how it differs from Llama: which Hugging Face architectures and GGUF architectures it is,
what its ``config.json`` sets in ``ModelConfig``'s family fields (``hf_fields``), which extra per-layer
tensors it stores and under which names (``layer_tensors``), and what its norm weights are offset by
(Gemma's ``1 + w``).  ``hf_config.config_from_hf`` reads the parts every family shares (sizes, rope in both
spellings, windows from ``layer_types``) and asks the family for the rest; anything neither understands is
refused in one line, never ignored.

Families: llama (Llama 2/3.x), mistral, qwen2 (Qwen2/2.5), qwen3 (dense), gemma2, gemma3 (text).
"""
from __future__ import annotations

from specjax.models.families.base import Family
from specjax.models.families import gemma2, gemma3, llama, mistral, qwen2, qwen3

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY,
                                gemma3.FAMILY)
BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}


def supported_architectures() -> str:
  return ", ".join(a for f in FAMILIES for a in f.architectures)
