"""Pallas kernels for specjax: tree attention over the layered KV cache (GPU via Triton, TPU via Mosaic,
CPU in interpret mode), with its XLA reference and the attention-path dispatch rule."""
from specjax.kernels.pallas.tree_attention import (
    ATTENTION_ENV,
    ATTENTION_PATHS,
    attention_path,
    tree_attention,
    tree_attention_reference,
)

__all__ = ["ATTENTION_ENV", "ATTENTION_PATHS", "attention_path", "tree_attention", "tree_attention_reference"]
