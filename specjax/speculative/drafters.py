"""Drafters: propose k_max tokens per sequence (with their draft distributions), then follow the commit.

Interface (frozen dataclasses: static, hashable; parameters and state are pytrees passed in and returned):

  init(draft_params, prompt_BxP, prompt_lens_B, max_len)                 -> state
  propose(draft_params, state, seq_BxS, lengths_B, last_B, K, key, sp)  -> (state, tokens_BxK, q_BxKxV | None,
                                                                           limit_B)
  commit(state, new_lengths_B)                                           -> state

``lengths_B`` is the target cache's committed length: ``seq_BxS[:, :lengths+1]`` is known and
``seq[b, lengths[b]] == last_B[b]`` is the newest token, not yet in any cache.  ``q`` is None for deterministic
drafters (one-hot) and when sampling is greedy (acceptance never reads it).  ``limit_B`` caps how many of
the K proposals are real (an n-gram drafter may find fewer); the engine masks the rest.

  NoDrafter     k = 0: plain autoregressive decoding through the same step.
  ModelDrafter  a small model with its own KV cache (a separate draft model, or the target's own layers
                for layer-skip self-speculation).
  NgramDrafter  prompt lookup on device: match the last n tokens earlier in the sequence, propose what followed.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import decode, sampling
from specjax import model as model_lib
from specjax.config import ModelConfig
from specjax.kv_cache import KVCache, init_cache


def _full(B, K):
  return jnp.full((B,), K, jnp.int32)


@dataclasses.dataclass(frozen=True)
class NoDrafter:
  name: str = "none"

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    return ()

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, K, key, sp):
    B = seq_BxS.shape[0]
    return state, jnp.zeros((B, K), jnp.int32), None, jnp.zeros((B,), jnp.int32)

  def commit(self, state, new_lengths_B):
    return state


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """Autoregressive drafting with a small model that shares the target's tokenizer.

  Each propose feeds [seq[len-1], last] as its first (T=2) forward, which re-writes the slot of the token
  before ``last``: that slot is missing when every draft of the previous round was accepted, and rewriting it
  otherwise is harmless.  So k proposals cost k draft forwards and the draft cache needs no extra bookkeeping.
  """
  cfg: ModelConfig
  name: str = "model"
  buckets: tuple[int, ...] | None = None

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    cache = init_cache(self.cfg, prompt_BxP.shape[0], max_len, jnp.float32)
    return decode.prefill(draft_params, self.cfg, cache, prompt_BxP, prompt_lens_B, self.buckets).cache

  def _forward(self, params, tokens_BxT, cache: KVCache):
    T = tokens_BxT.shape[1]
    pos = cache.lengths[:, None] + jnp.arange(T)[None, :]
    return decode.windowed_forward(params, self.cfg, tokens_BxT, pos, cache, buckets=self.buckets)

  def propose(self, draft_params, state: KVCache, seq_BxS, lengths_B, last_B, K, key, sp):
    B = seq_BxS.shape[0]
    if K == 0:
      return state, jnp.zeros((B, 0), jnp.int32), None, _full(B, 0)
    prev_B = jnp.take_along_axis(seq_BxS, jnp.maximum(lengths_B - 1, 0)[:, None], axis=1)[:, 0]
    cache = state.with_lengths(jnp.maximum(lengths_B - 1, 0))
    out = self._forward(draft_params, jnp.stack([prev_B, last_B], axis=1), cache)
    keys = jax.random.split(key, K)

    def draw(logits_BxV, k):
      tok = sampling.sample(logits_BxV, k, sp)
      q = None if sp.greedy else jax.nn.softmax(sampling.filtered_logits(logits_BxV, sp), axis=-1)
      return tok, q

    tok, q = draw(out.logits[:, 1], keys[0])

    def body(carry, k):
      cache, tok = carry
      o = self._forward(draft_params, tok[:, None], cache)
      nxt, q = draw(o.logits[:, 0], k)
      return (o.cache, nxt), (nxt, q)

    (cache, _), (rest_KxB, rest_q) = jax.lax.scan(body, (out.cache, tok), keys[1:])
    tokens = jnp.concatenate([tok[:, None], rest_KxB.T], axis=1)
    probs = None if sp.greedy else jnp.concatenate([q[:, None], jnp.swapaxes(rest_q, 0, 1)], axis=1)
    return cache, tokens, probs, _full(B, K)

  def commit(self, state: KVCache, new_lengths_B):
    return state.with_lengths(new_lengths_B)


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup: an earlier occurrence of the last n tokens (n = max_ngram down to min_ngram) proposes
  the tokens that followed it — the most recent occurrence followed by K known tokens, else the earliest.

  ``match_caps[i]`` caps the proposals after a match of only i + 1 tokens (longer matches propose K): short
  matches are rarely right (on summarization, a 1-token match's first draft is accepted ~1 time in 4, a
  3-token match's 7 in 10), and the engine verifies only as many slots as some sequence drafted, so not
  drafting them saves most of a verification's extra cost.
  """
  max_ngram: int = 3
  min_ngram: int = 1
  match_caps: tuple[int, ...] = ()
  name: str = "ngram"

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    return ()

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, K, key, sp):
    B, S = seq_BxS.shape
    if K == 0:
      return state, jnp.zeros((B, 0), jnp.int32), None, _full(B, 0)
    L_B = lengths_B                                   # index of the newest known token
    i_S = jnp.arange(S)
    found_B = jnp.zeros((B,), bool)
    start_B = jnp.zeros((B,), jnp.int32)              # where the continuation begins
    cap_B = jnp.zeros((B,), jnp.int32)                # proposals allowed by the length of the match
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      match = jnp.ones((B, S), bool)
      for j in range(n):
        want_B = jnp.take_along_axis(seq_BxS, jnp.maximum(L_B - n + 1 + j, 0)[:, None], axis=1)
        shifted = jnp.roll(seq_BxS, -j, axis=1)       # shifted[:, i] = seq[:, i + j]
        match &= shifted == want_B
      # The occurrence must end before the newest token and the suffix must exist.
      ok = match & (i_S[None, :] + n - 1 < L_B[:, None]) & (L_B[:, None] >= n - 1)
      # Prefer the most recent occurrence followed by K known tokens; else the earliest (longest follow-up).
      full = ok & (i_S[None, :] + n + K - 1 <= L_B[:, None])
      i_recent = jnp.max(jnp.where(full, i_S[None, :], -1), axis=1)
      i_first = jnp.min(jnp.where(ok, i_S[None, :], S), axis=1)
      i_best = jnp.where(i_recent >= 0, i_recent, jnp.where(i_first < S, i_first, -1))
      hit = (i_best >= 0) & ~found_B
      start_B = jnp.where(hit, i_best + n, start_B)
      cap_B = jnp.where(hit, self.match_caps[n - 1] if n <= len(self.match_caps) else K, cap_B)
      found_B |= hit
    idx_BxK = start_B[:, None] + jnp.arange(K)[None, :]
    tokens = jnp.take_along_axis(seq_BxS, jnp.minimum(idx_BxK, S - 1), axis=1)
    available = jnp.clip(L_B + 1 - start_B, 0, K)     # only tokens already known can be proposed
    limit = jnp.where(found_B, jnp.minimum(available, cap_B), 0).astype(jnp.int32)
    return state, tokens, None, limit

  def commit(self, state, new_lengths_B):
    return state


def layer_subset(params, layers: tuple[int, ...]):
  """The target's own parameters restricted to ``layers`` (shared arrays, no copy in the list layout)."""
  stacked = params["layers"]
  if isinstance(stacked, (list, tuple)):
    sub = [stacked[i] for i in layers]
  else:
    idx = jnp.asarray(layers)
    sub = jax.tree_util.tree_map(lambda x: x[idx], stacked)
  return {**params, "layers": sub}
