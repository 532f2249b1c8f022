"""Forward helpers for decoding: batched prefill and KV-window buckets.

The decode loop itself lives in ``specjax.speculative.engine``: plain autoregressive decoding is its k = 0
case, so baselines and speculation run the same code.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax import model as model_lib
from specjax.config import ModelConfig
from specjax.kv_cache import KVCache

# ----------------------------------------------------------------------------------------------------------
# Reading only the live part of the cache


def kv_buckets(max_len: int, smallest: int = 256) -> tuple[int, ...]:
  """Attention window sizes to compile: powers of two from ``smallest`` up to (and including) max_len."""
  sizes, w = [], smallest
  while w < max_len:
    sizes.append(w)
    w *= 2
  sizes.append(max_len)
  return tuple(sizes)


def windowed_forward(params, cfg: ModelConfig, tokens_BxT, positions_BxT, cache: KVCache,
                     extra_mask_BxTxT=None, buckets: tuple[int, ...] | None = None):
  """``model.forward`` that reads only the smallest bucket of cache slots covering every live sequence.

  Each bucket is compiled once (``lax.switch``), so a step at a short context does not pay for the empty
  slots at the end of a long buffer, and nothing recompiles as sequences grow.
  """
  T = tokens_BxT.shape[1]
  if not buckets or len(buckets) == 1:
    return model_lib.forward(params, cfg, tokens_BxT, positions_BxT, cache, extra_mask_BxTxT,
                             kv_window=buckets[0] if buckets else None)
  need = jnp.max(cache.lengths) + T
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets), need, side="left"), len(buckets) - 1)
  branches = [functools.partial(_forward_window, cfg=cfg, window=w) for w in buckets]
  return jax.lax.switch(index, branches, params, tokens_BxT, positions_BxT, cache, extra_mask_BxTxT)


def _forward_window(params, tokens, positions, cache, extra_mask, *, cfg, window):
  return model_lib.forward(params, cfg, tokens, positions, cache, extra_mask, kv_window=window)


# ----------------------------------------------------------------------------------------------------------
# Prefill


class Prefilled(NamedTuple):
  cache: KVCache           # lengths = prompt lengths
  last_logits_BxV: jax.Array


def prefill(params, cfg: ModelConfig, cache: KVCache, prompt_BxP: jax.Array, prompt_lens_B: jax.Array,
            buckets: tuple[int, ...] | None = None) -> Prefilled:
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
                          head_index_B=prompt_lens_B - 1)
  return Prefilled(out.cache.with_lengths(prompt_lens_B), out.logits[:, 0])
