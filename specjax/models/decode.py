"""Forward helpers for decoding: batched prefill and KV-window buckets.

The decode loop itself lives in ``specjax.speculative.engine``: plain autoregressive decoding is its k = 0
case, so baselines and speculation run the same code.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.models import decoder as model_lib
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache

# ----------------------------------------------------------------------------------------------------------
# Reading only the live part of the cache


def windowed_forward(params, cfg: ModelConfig, tokens_BxT, positions_BxT, cache: KVCache,
                     extra_mask_BxTxT=None, buckets: tuple[int, ...] | None = None, live_T=None,
                     region_mask_BxTxU=None, slots_BxT=None, feature_layers=None, inputs_embeds_BxTxD=None,
                     head_index_B=None):
  """``model.forward`` whose attention reads only the smallest bucket of cache slots covering every live
  sequence (see ``model.forward``'s ``kv_buckets``; ``live_T``, the region mask and slots as there)."""
  return model_lib.forward(params, cfg, tokens_BxT, positions_BxT, cache, extra_mask_BxTxT,
                           kv_buckets=buckets, live_T=live_T, region_mask_BxTxU=region_mask_BxTxU,
                           slots_BxT=slots_BxT, feature_layers=feature_layers,
                           inputs_embeds_BxTxD=inputs_embeds_BxTxD, head_index_B=head_index_B)


# ----------------------------------------------------------------------------------------------------------
# Prefill


class Prefilled(NamedTuple):
  cache: KVCache           # lengths = prompt lengths
  last_logits_BxV: jax.Array
  features: jax.Array | None = None   # [B, P, F] with ``feature_layers`` (see ``model.forward``)


def prefill(params, cfg: ModelConfig, cache: KVCache, prompt_BxP: jax.Array, prompt_lens_B: jax.Array,
            buckets: tuple[int, ...] | None = None, feature_layers=None) -> Prefilled:
  """Run right-padded prompts through the model in one forward starting from an empty cache.

  Padding positions are computed but never committed: the cache length is set to each prompt's length, so
  later steps overwrite those slots.
  """
  B, P = prompt_BxP.shape
  cache = cache.with_lengths(jnp.zeros((B,), jnp.int32))
  positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  window = None
  if buckets:
    window = next((w for w in buckets if w >= P), buckets[-1])
  out = model_lib.forward(params, cfg, prompt_BxP, positions, cache, kv_window=window,
                          head_index_B=prompt_lens_B - 1, feature_layers=feature_layers)
  return Prefilled(out.cache.with_lengths(prompt_lens_B), out.logits[:, 0], out.features)
