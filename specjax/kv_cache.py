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

from specjax.config import ModelConfig


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
