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
                     head_index_B=None, attn_prefix_BxTxD=None):
  """``model.forward`` whose attention reads only the smallest bucket of cache slots covering every live
  sequence (see ``model.forward``'s ``kv_buckets``; ``live_T``, the region mask and slots as there)."""
  return model_lib.forward(params, cfg, tokens_BxT, positions_BxT, cache, extra_mask_BxTxT,
                           kv_buckets=buckets, live_T=live_T, region_mask_BxTxU=region_mask_BxTxU,
                           slots_BxT=slots_BxT, feature_layers=feature_layers,
                           inputs_embeds_BxTxD=inputs_embeds_BxTxD, head_index_B=head_index_B,
                           attn_prefix_BxTxD=attn_prefix_BxTxD)


# ----------------------------------------------------------------------------------------------------------
# Prefill


class Prefilled(NamedTuple):
  cache: KVCache           # lengths = prompt lengths
  last_logits_BxV: jax.Array
  features: jax.Array | None = None   # [B, P, F] with ``feature_layers`` (see ``model.forward``)


# Prompts longer than this are prefilled in chunks (a ``lax.scan``): one chunk's activations and attention
# scores at a time, and a sliding-window layer reads its window plus the chunk, not the whole prompt.
PREFILL_CHUNK = 2048


def prefill_chunk(P: int) -> int:
  """The chunk a prompt bucket of P tokens is prefilled in: P itself up to ``PREFILL_CHUNK``, else the largest
  power of two ≤ ``PREFILL_CHUNK`` dividing P (prompt buckets past 256 are multiples of a power of two)."""
  if P <= PREFILL_CHUNK:
    return P
  C = PREFILL_CHUNK
  while P % C:
    C //= 2
  return C


def prefill(params, cfg: ModelConfig, cache: KVCache, prompt_BxP: jax.Array, prompt_lens_B: jax.Array,
            buckets: tuple[int, ...] | None = None, feature_layers=None) -> Prefilled:
  """Run right-padded prompts through the model from an empty cache: in one forward, or past
  ``PREFILL_CHUNK`` tokens in chunks of C (``prefill_chunk``), each attending to the chunks before it.

  Padding positions are computed but never committed: the cache length is set to each prompt's length, so
  later steps overwrite those slots.
  """
  B, P = prompt_BxP.shape
  C = prefill_chunk(P)
  if C < P:
    return _prefill_chunked(params, cfg, cache, prompt_BxP, prompt_lens_B, C, feature_layers)
  cache = cache.with_lengths(jnp.zeros((B,), jnp.int32))
  positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  window = None
  if buckets:
    window = next((w for w in buckets if w >= P), buckets[-1])
  out = model_lib.forward(params, cfg, prompt_BxP, positions, cache, kv_window=window,
                          head_index_B=prompt_lens_B - 1, feature_layers=feature_layers)
  return Prefilled(out.cache.with_lengths(prompt_lens_B), out.logits[:, 0], out.features)


def _prefill_chunked(params, cfg: ModelConfig, cache: KVCache, prompt_BxP, prompt_lens_B, C: int,
                     feature_layers) -> Prefilled:
  """``prefill`` in P / C chunks (a scan): chunk i writes slots [iC, (i+1)C) and attends over the smallest of
  the window buckets C, 2C, 4C, …, P covering them.  Each sequence's logits come from the chunk holding its
  last prompt token."""
  B, P = prompt_BxP.shape
  n = P // C
  buckets = tuple(sorted({min(C << j, P) for j in range(n.bit_length() + 1)}))
  last_B = prompt_lens_B - 1
  chunks_NxBxC = prompt_BxP.reshape(B, n, C).transpose(1, 0, 2)

  def chunk(cache_i, xs):
    i, tokens_BxC = xs
    start = i * C
    positions = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
    out = model_lib.forward(params, cfg, tokens_BxC, positions, cache_i.with_lengths(jnp.full((B,), start)),
                            kv_window=P, kv_buckets=buckets, head_index_B=jnp.clip(last_B - start, 0, C - 1),
                            feature_layers=feature_layers)
    return out.cache, (out.logits[:, 0], out.features)

  cache = cache.with_lengths(jnp.zeros((B,), jnp.int32))
  cache, (logits_NxBxV, feats) = jax.lax.scan(chunk, cache, (jnp.arange(n, dtype=jnp.int32), chunks_NxBxC))
  logits_BxV = logits_NxBxV[last_B // C, jnp.arange(B)]          # the chunk holding each last prompt token
  features = None if feats is None else feats.transpose(1, 0, 2, 3).reshape(B, P, -1)
  return Prefilled(cache.with_lengths(prompt_lens_B), logits_BxV, features)
