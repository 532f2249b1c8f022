"""Cross-tokenizer drafting: a draft model with another tokenizer drafts for the target through a vocabulary map
made once at load (``checkpoints/vocab_map.py``: the tokens whose bytes are one token in both vocabularies,
and each target token spelled in draft tokens).

  proposals  the draft's logits restricted to the mapped tokens and scattered to their target ids, every other
             target token at ``MASK_VALUE`` (probability exactly 0): greedy takes the best mapped token, and
             under sampling q over the target's vocabulary is the draft's distribution renormalized on the
             mapped tokens, zero elsewhere, so the target's rejection rule stays lossless whatever the draft.
  context    the draft reads the target's tokens in its own spelling: a target token is 1..W draft tokens
             (``pieces``), so the draft's cache has its own length (``cache.lengths``, in draft tokens) and
             its own positions; it never reads a target id.

Each propose first feeds what the draft has not read — the root's W pieces, after the previous step's deepest
accepted draft when that was a leaf never fed (``pending_B``; a drafted token is a mapped one, one piece) — in
one forward of 1 + W rows, compacted to the front; the root's draft distribution is that forward's last real
row.  Tree nodes are then fed as ``ModelDrafter`` feeds them (drafted tokens are mapped: one draft token each)
at the slots after the root's last piece, and ``commit`` keeps the accepted path's entries but the leaf, as
``ModelDrafter`` keeps them.  A prompt of P tokens is prefilled as its pieces ([B, W·P], compacted; the draft's
BOS first when its tokenizer adds one), and the draft's cache holds W·S + 1 slots for a target buffer of S.

Parameters: ``{"model": the draft's params, "map": map_params(vocab map)}``:
  draft_of [V]                    each target token's draft token where it is mapped, else -1
  pieces [V, W], counts [V]       each target token's draft spelling and its length (1..W)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models import buffers, decode
from specjax.models.attention import MASK_VALUE
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, cache_bytes, compact, init_cache
from specjax.speculative.drafters import CACHE_DTYPE, ModelDrafter


def map_params(vocab_map) -> dict:
  """A ``vocab_map.VocabMap`` as device arrays (the drafter's ``params["map"]``)."""
  draft_of = np.full((vocab_map.target_vocab,), -1, np.int32)
  draft_of[np.asarray(vocab_map.target_ids)] = np.asarray(vocab_map.draft_ids)
  as_i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)
  return {"draft_of": as_i32(draft_of), "pieces": as_i32(vocab_map.pieces_VxW),
          "counts": as_i32(vocab_map.piece_counts_V)}


def build(draft_cfg: ModelConfig, draft_params, vocab_map, target_cfg: ModelConfig, buckets=None):
  """(drafter, draft params) of a draft model reading and proposing through ``vocab_map``."""
  if vocab_map.target_vocab != target_cfg.vocab_size or vocab_map.draft_vocab != draft_cfg.vocab_size:
    raise ValueError(f"a vocabulary map from {vocab_map.target_vocab} to {vocab_map.draft_vocab} tokens does not "
                     f"fit a target of {target_cfg.vocab_size} and a draft of {draft_cfg.vocab_size}")
  drafter = CrossVocabDrafter(draft_cfg, buckets=buckets, width=vocab_map.width, draft_bos=vocab_map.draft_bos)
  return drafter, {"model": draft_params, "map": map_params(vocab_map)}


def to_target_logits(map_, logits_BxTxVd: jax.Array) -> jax.Array:
  """Draft logits over the target's vocabulary: a mapped target token's is its draft token's, every other
  target token's ``MASK_VALUE`` (probability exactly 0 after softmax).  A gather, one per target token."""
  draft_of = map_["draft_of"]
  picked = jnp.take(logits_BxTxVd.astype(jnp.float32), jnp.maximum(draft_of, 0), axis=-1)
  return jnp.where(draft_of >= 0, picked, MASK_VALUE)


def front_compact(ids_BxT: jax.Array, valid_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The valid ids moved to the front of each row, in order ([B, T]; the rest are filler), and their count."""
  T = ids_BxT.shape[1]
  t = jnp.arange(T)[None, :]
  order = jnp.argsort(jnp.where(valid_BxT, t, t + T), axis=1)
  return jnp.take_along_axis(ids_BxT, order, axis=1), jnp.sum(valid_BxT, axis=1).astype(jnp.int32)


@struct.dataclass
class CrossVocabState:
  cache: KVCache          # the draft's cache; ``lengths`` counts draft tokens whose entries are final
  pending_B: jax.Array    # bool: the target token before the root is not in the cache yet (a leaf never fed)


@dataclasses.dataclass(frozen=True)
class CrossVocabDrafter(ModelDrafter):
  """A draft model of another tokenizer (``ModelDrafter``'s trees; ``cfg`` is the draft's)."""
  width: int = 2                 # W: draft tokens a target token is read as, at most
  draft_bos: int = -1            # put before the prompt's pieces (-1: none)
  name: str = "model"

  def draft_slots(self, max_len: int) -> int:
    """The draft cache's slots for a target buffer of ``max_len``: every target token read as W pieces, + BOS."""
    return self.width * max_len + 1

  def state_bytes_per_seq(self, max_len: int) -> int:
    return cache_bytes(self.cfg, 1, self.draft_slots(max_len), CACHE_DTYPE) + 4 + 1

  def _buckets(self, cache: KVCache) -> tuple[int, ...]:
    return buffers.kv_buckets(cache.max_len)

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    B, P = prompt_BxP.shape
    map_, W = draft_params["map"], self.width
    pieces = map_["pieces"][prompt_BxP].reshape(B, P * W)
    live = (jnp.arange(W)[None, None, :] < map_["counts"][prompt_BxP][:, :, None]) & \
        (jnp.arange(P)[None, :, None] < prompt_lens_B[:, None, None])
    live = live.reshape(B, P * W)
    if self.draft_bos >= 0:
      pieces = jnp.concatenate([jnp.full((B, 1), self.draft_bos, jnp.int32), pieces], axis=1)
      live = jnp.concatenate([jnp.ones((B, 1), bool), live], axis=1)
    width = buffers.prompt_bucket(pieces.shape[1])          # a length prefill's chunking divides well
    pad = width - pieces.shape[1]
    tokens, lens = front_compact(jnp.pad(pieces, ((0, 0), (0, pad))), jnp.pad(live, ((0, 0), (0, pad))))
    cache = init_cache(self.cfg, B, self.draft_slots(max_len), CACHE_DTYPE)
    cache = decode.prefill(draft_params["model"], self.cfg, cache, tokens, lens, self._buckets(cache)).cache
    return CrossVocabState(cache=cache, pending_B=jnp.zeros((B,), bool))

  def propose(self, draft_params, state: CrossVocabState, seq_BxS, lengths_B, last_B, shape, key, sp):
    if shape.num_nodes == 0:            # nothing to draft: the draft still reads the root (its cache keeps up)
      cache = self._root(draft_params, state, seq_BxS, lengths_B, last_B)[2]
      return super().propose(draft_params, state.replace(cache=cache), seq_BxS, lengths_B, last_B, shape, key, sp)
    return super().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)

  def _root(self, params, state: CrossVocabState, seq_BxS, lengths_B, last_B):
    """Feed [the pending leaf's piece; the root's pieces] (compacted): the root's draft logits over the target's
    vocabulary, and the cache with ``lengths`` just before the root's last piece (the tree's slot 0)."""
    map_, W = params["map"], self.width
    prev_B = jnp.take_along_axis(seq_BxS, jnp.maximum(lengths_B - 1, 0)[:, None], axis=1)[:, 0]
    ids = jnp.concatenate([map_["pieces"][prev_B, :1], map_["pieces"][last_B]], axis=1)          # [B, 1 + W]
    live = jnp.concatenate([state.pending_B[:, None],
                            jnp.arange(W)[None, :] < map_["counts"][last_B][:, None]], axis=1)
    tokens, count_B = front_compact(ids, live)
    cache = state.cache
    pos = cache.lengths[:, None] + jnp.arange(1 + W)[None, :]
    out = decode.windowed_forward(params["model"], self.cfg, tokens, pos, cache, buckets=self._buckets(cache),
                                  head_index_B=count_B - 1)
    logits = to_target_logits(map_, out.logits[:, 0])
    return logits, None, out.cache.with_lengths(cache.lengths + count_B - 1)

  def _extend(self, params, cache: KVCache, tokens_BxW, depth: int, slots_BxW, mask_BxWxU, parent_feat_BxWxF):
    """Tree nodes (target ids of mapped tokens: one draft token each) at their slots after the root."""
    pos = jnp.broadcast_to(cache.lengths[:, None] + depth, tokens_BxW.shape)
    draft_tokens = params["map"]["pieces"][tokens_BxW, 0]
    out = decode.windowed_forward(params["model"], self.cfg, draft_tokens, pos, cache,
                                  buckets=self._buckets(cache), region_mask_BxTxU=mask_BxWxU,
                                  slots_BxT=slots_BxW)
    return (to_target_logits(params["map"], out.logits), None,
            out.cache.with_lengths(cache.lengths))

  def _with_cache(self, state: CrossVocabState, cache: KVCache) -> CrossVocabState:
    return state.replace(cache=cache)

  def commit(self, state: CrossVocabState, lengths_B, path_slots_BxD1, new_lengths_B):
    """Keep the root and the accepted drafts but the deepest (a leaf may never have been fed: the next
    propose feeds it first).  A row that committed nothing is finished; its state no longer matters."""
    n_B = jnp.clip(new_lengths_B - lengths_B - 1, 0, path_slots_BxD1.shape[1] - 1)
    base = state.cache.lengths
    cache = compact(state.cache, base, path_slots_BxD1).with_lengths(base + jnp.maximum(n_B, 1))
    return CrossVocabState(cache=cache, pending_B=n_B >= 1)
