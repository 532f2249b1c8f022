"""Preallocated, fixed-shape KV cache.

Layout (written once, here):
  k, v     [L, B, S, K, E]   L layers, B sequences, S = max_len slots, K kv heads, E head dim
  lengths  [B] int32         committed (visible) slots per sequence

Slots at or past ``lengths[b]`` are never attended to as committed context.  A forward over T new tokens
writes them at slots ``lengths[b] .. lengths[b]+T-1``; the caller then decides how many of those to commit
(all of them for prefill and plain decoding, accepted+1 for a speculative step).  Nothing is reallocated:
rejected slots are simply left behind the length and overwritten later.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.config import ModelConfig


@struct.dataclass
class KVCache:
  k: jax.Array        # [L, B, S, K, E]
  v: jax.Array        # [L, B, S, K, E]
  lengths: jax.Array  # [B] int32

  @property
  def max_len(self) -> int:  # S
    return self.k.shape[2]

  @property
  def batch_size(self) -> int:  # B
    return self.k.shape[1]

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return self.replace(lengths=lengths.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
  shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 lengths=jnp.zeros((batch_size,), jnp.int32))


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> int:
  return 2 * cfg.num_layers * batch_size * max_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def compact(cache: KVCache, base_B: jax.Array, src_BxD: jax.Array) -> KVCache:
  """Move tree entries into place after acceptance: slot base + d ← slot base + src[b, d] for every d with
  src ≥ 0 (the accepted root-to-leaf path), in every layer.  Fixed shapes, on device; on a donated buffer
  XLA updates it in place.  Sources are read before anything is written, so a path may overlap itself."""
  B, D = src_BxD.shape
  b_idx = jnp.arange(B)[:, None]
  S = cache.max_len
  src = jnp.clip(base_B[:, None] + jnp.maximum(src_BxD, 0), 0, S - 1)
  dst = jnp.where(src_BxD >= 0, base_B[:, None] + jnp.arange(D)[None, :], S)      # S: dropped
  k_new = cache.k[:, b_idx, src]                                                    # [L, B, D, K, E]
  v_new = cache.v[:, b_idx, src]
  return cache.replace(k=cache.k.at[:, b_idx, dst].set(k_new, mode="drop"),
                       v=cache.v.at[:, b_idx, dst].set(v_new, mode="drop"))
