"""Batched prefill and on-device autoregressive decoding (one jitted ``lax.while_loop``).

Shapes are static per (B, P, S): B sequences, prompts right-padded to P, a cache of S slots.  How many tokens to
generate, which prompts, and when each sequence stops are data, so decoding more tokens or calling again with
the same shapes compiles nothing new.

The sequence buffer ``seq_BxS`` holds each prompt followed by its generated tokens; the KV cache holds all but
the newest token of each sequence (``cache.lengths[b] + 1`` tokens are known).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax import model as model_lib
from specjax import sampling
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
  out = model_lib.forward(params, cfg, prompt_BxP, positions, cache, kv_window=window)
  last = jnp.take_along_axis(out.logits, (prompt_lens_B - 1)[:, None, None], axis=1)[:, 0]
  return Prefilled(out.cache.with_lengths(prompt_lens_B), last)


# ----------------------------------------------------------------------------------------------------------
# The decode loop


@struct.dataclass
class DecodeState:
  cache: KVCache
  seq_BxS: jax.Array        # prompt + generated tokens
  last_B: jax.Array         # newest token (not yet in the cache)
  num_new_B: jax.Array      # generated tokens per sequence
  done_B: jax.Array         # finished (EOS or max_new_tokens)
  key: jax.Array
  steps: jax.Array          # target forwards run in the loop (scalar)


class DecodeResult(NamedTuple):
  seq_BxS: jax.Array
  prompt_lens_B: jax.Array
  num_new_B: jax.Array
  steps: jax.Array
  cache: KVCache


def _is_eos(tok_B, eos_ids: tuple[int, ...]):
  if not eos_ids:
    return jnp.zeros(tok_B.shape, bool)
  return jnp.isin(tok_B, jnp.asarray(eos_ids, jnp.int32))


def _append(seq_BxS, index_B, tok_B, live_B):
  B, S = seq_BxS.shape
  index_B = jnp.where(live_B, index_B, S)   # out of range: dropped
  return seq_BxS.at[jnp.arange(B), index_B].set(tok_B, mode="drop")


def init_decode(params, cfg: ModelConfig, cache: KVCache, prompt_BxP, prompt_lens_B, max_new_B, key,
                sp: sampling.SamplingParams, eos_ids: tuple[int, ...],
                buckets: tuple[int, ...] | None) -> DecodeState:
  """Prefill and sample the first new token."""
  B, P = prompt_BxP.shape
  S = cache.max_len
  pre = prefill(params, cfg, cache, prompt_BxP, prompt_lens_B, buckets)
  key, sub = jax.random.split(key)
  tok_B = sampling.sample(pre.last_logits_BxV, sub, sp)
  live_B = max_new_B > 0
  seq = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompt_BxP)
  seq = jnp.where(jnp.arange(S)[None, :] < prompt_lens_B[:, None], seq, 0)
  seq = _append(seq, prompt_lens_B, tok_B, live_B)
  num_new = live_B.astype(jnp.int32)
  done = ~live_B | _is_eos(tok_B, eos_ids) | (num_new >= max_new_B)
  return DecodeState(cache=pre.cache, seq_BxS=seq, last_B=tok_B, num_new_B=num_new, done_B=done, key=key,
                     steps=jnp.zeros((), jnp.int32))


def decode_step(params, cfg: ModelConfig, state: DecodeState, max_new_B, sp: sampling.SamplingParams,
                eos_ids: tuple[int, ...], buckets: tuple[int, ...] | None) -> DecodeState:
  """One autoregressive step for every sequence that is not done."""
  cache = state.cache
  out = windowed_forward(params, cfg, state.last_B[:, None], cache.lengths[:, None], cache,
                         buckets=buckets)
  key, sub = jax.random.split(state.key)
  tok_B = sampling.sample(out.logits[:, 0], sub, sp)
  live_B = ~state.done_B
  lengths = jnp.where(live_B, cache.lengths + 1, cache.lengths)
  seq = _append(state.seq_BxS, lengths, tok_B, live_B)
  num_new = state.num_new_B + live_B.astype(jnp.int32)
  done = state.done_B | (live_B & (_is_eos(tok_B, eos_ids) | (num_new >= max_new_B)))
  return DecodeState(cache=out.cache.with_lengths(lengths), seq_BxS=seq,
                     last_B=jnp.where(live_B, tok_B, state.last_B), num_new_B=num_new, done_B=done, key=key,
                     steps=state.steps + 1)


@functools.partial(jax.jit, static_argnames=("cfg", "sp", "eos_ids", "buckets"), donate_argnames=("cache",))
def generate(params, cache: KVCache, prompt_BxP, prompt_lens_B, max_new_B, key, *, cfg: ModelConfig,
             sp: sampling.SamplingParams, eos_ids: tuple[int, ...] = (),
             buckets: tuple[int, ...] | None = None) -> DecodeResult:
  """Prefill then decode until every sequence hit EOS or its ``max_new_B`` — all on device.

  The caller guarantees ``prompt_lens_B + max_new_B <= cache.max_len`` (``specjax.api`` checks it).
  """
  state = init_decode(params, cfg, cache, prompt_BxP, prompt_lens_B, max_new_B, key, sp, eos_ids, buckets)
  state = jax.lax.while_loop(
      lambda s: ~jnp.all(s.done_B),
      lambda s: decode_step(params, cfg, s, max_new_B, sp, eos_ids, buckets),
      state)
  return DecodeResult(state.seq_BxS, prompt_lens_B, state.num_new_B, state.steps, state.cache)
