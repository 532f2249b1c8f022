"""Prompt lookup where the context repeats itself, the draft model everywhere else.

Each step drafts one chain of k per sequence from one of two sources:

  lookup   the last ``min_match`` tokens occurred earlier in the sequence: propose what followed them
           (``NgramDrafter.candidates``, best occurrence first).  Costs no forward.
  model    otherwise: the draft model's chain (``ModelDrafter``).

When every live sequence has a lookup match the draft model does not run at all (``lax.cond``: a real branch
on device), which is where the gain over the plain model drafter comes from — a code reply that restates its
function stub is drafted for free.  The draft model's cache then falls behind the committed tokens; the next
model step first feeds the missing positions in chunks of ``window`` tokens (``_SyncingModel._root``), the
last chunk ending at the root so that its logits are the root's.  ``HybridState.synced_B`` says how far the
draft cache holds the draft model's K/V of committed tokens.

Chains only: a lookup chain and a model chain have one shape, so the source is chosen per sequence with a
``jnp.where``.  Under sampling the lookup's proposals are point masses: their ``q`` rows are one-hot, so the
acceptance rule (accept x with probability p(x), else resample from p without x) stays exactly the target's
distribution; the choice of source reads only committed tokens, so it cannot bias acceptance.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.models import decode
from specjax.models.kv_cache import KVCache
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import Draft, ModelDrafter, NgramDrafter, _static_draft, _target_vocab


class HybridState(NamedTuple):
  cache: KVCache             # the draft model's KV cache
  synced_B: jax.Array        # cache positions [0, synced) hold the draft model's K/V of committed tokens
  used_model_B: jax.Array    # bool: this step's chain came from the draft model (read by commit)
  lookup_steps_B: jax.Array  # live steps whose chain came from the lookup (statistics)


@dataclasses.dataclass(frozen=True)
class _SyncingModel(ModelDrafter):
  """A ``ModelDrafter`` whose state is a ``HybridState``: its root forward first catches the draft cache up
  with the committed tokens it has not seen (positions synced … length)."""
  window: int = 8

  def _root(self, params, state: HybridState, seq_BxS, lengths_B, last_B):
    in_sync = jnp.all(state.synced_B >= jnp.maximum(lengths_B - 1, 0))
    plain = lambda: ModelDrafter._root(self, params, state.cache, seq_BxS, lengths_B, last_B)[::2]
    logits, cache = jax.lax.cond(in_sync, plain, lambda: self._catch_up(params, state, seq_BxS, lengths_B))
    return logits, None, cache

  def _catch_up(self, params, state: HybridState, seq_BxS, L_B):
    """Feed positions [synced, L] (at least [L-1, L], as the plain root does) in chunks of W; a chunk that
    starts before ``synced`` rewrites known positions with the same tokens.  Returns (root logits [B, V],
    cache with lengths L)."""
    B, S = seq_BxS.shape
    W = max(2, self.window)
    t_W = jnp.arange(W)

    def body(carry):
      cache, synced, logits = carry
      end = jnp.minimum(synced + W - 1, L_B)                 # last position this chunk feeds
      start = jnp.maximum(end - W + 1, 0)
      pos = start[:, None] + t_W[None, :]
      toks = jnp.take_along_axis(seq_BxS, jnp.minimum(pos, S - 1), axis=1)
      out = decode.windowed_forward(params, self.cfg, toks, pos, cache.with_lengths(start), buckets=self.buckets)
      row = jnp.clip(L_B - start, 0, W - 1)
      lg = jnp.take_along_axis(out.logits, row[:, None, None], axis=1)[:, 0]
      lg = _target_vocab(params, lg[:, None])[:, 0]
      logits = jnp.where((end == L_B)[:, None], lg, logits)
      return out.cache, end + 1, logits

    V = params["embed"].shape[0]
    synced0 = jnp.minimum(state.synced_B, jnp.maximum(L_B - 1, 0))
    carry = (state.cache, synced0, jnp.zeros((B, V), jnp.float32))
    cache, _, logits = jax.lax.while_loop(lambda c: jnp.any(c[1] <= L_B), body, carry)
    return logits, cache.with_lengths(L_B)

  def _with_cache(self, state: HybridState, cache: KVCache):
    return state._replace(cache=cache)


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
  """Lookup chain where the last ``min_match`` tokens occurred before, draft-model chain elsewhere (module
  docstring).  ``model`` is the draft model's ``_SyncingModel`` (``hybrid_drafter`` builds it)."""
  model: _SyncingModel
  min_match: int = 3
  occurrences: int = 4
  name: str = "hybrid"
  siblings_without_replacement: bool = True

  @property
  def lookup(self) -> NgramDrafter:
    return NgramDrafter(max_ngram=self.min_match, min_ngram=self.min_match, occurrences=self.occurrences)

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    cache = self.model.init(draft_params, prompt_BxP, prompt_lens_B, max_len)
    B = prompt_BxP.shape[0]
    return HybridState(cache, prompt_lens_B.astype(jnp.int32), jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32))

  def state_bytes_per_seq(self, max_len: int) -> int:
    """The draft model's cache, then synced (int32), used_model (bool), lookup_steps (int32) per sequence."""
    return self.model.state_bytes_per_seq(max_len) + 4 + 1 + 4

  def forwards(self, shape) -> int:
    """Draft forwards of a step that runs the model (an upper bound: a lookup-only step runs none)."""
    return self.model.forwards(shape)

  def propose(self, draft_params, state: HybridState, seq_BxS, lengths_B, last_B, shape, key, sp):
    if not tree_shapes.is_chain(shape):
      raise ValueError(f"the hybrid drafter drafts chains only, got the tree {shape}")
    N = shape.num_nodes
    B = seq_BxS.shape[0]
    if N == 0:
      d = self.model.propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)[1]
      return state._replace(used_model_B=jnp.zeros((B,), bool)), d   # the next model step catches up
    use_B, look = lookup_chain(self.lookup, seq_BxS, lengths_B, last_B, shape, sp,
                               draft_params["embed"].shape[0])

    def with_model(st):
      st, d = self.model.propose(draft_params, st, seq_BxS, lengths_B, last_B, shape, key, sp)
      return st._replace(synced_B=lengths_B + 1), d                   # the root forward wrote [.., L]

    def lookup_only(st):
      return st, look

    st, d = jax.lax.cond(jnp.all(use_B), lookup_only, with_model, state)
    return st._replace(used_model_B=~use_B), pick_chain(use_B, look, d)

  def commit(self, state: HybridState, lengths_B, path_slots_BxD1, new_lengths_B):
    """A model chain's accepted drafts were fed at their positions (all but the k-th): the cache is good up to
    min(new length, length + k); a lookup chain leaves it where the propose left it."""
    D = path_slots_BxD1.shape[1] - 1
    synced = jnp.where(state.used_model_B, jnp.minimum(new_lengths_B, lengths_B + D), state.synced_B)
    live_B = new_lengths_B > lengths_B          # a finished sequence commits nothing: not a step of its own
    return state._replace(cache=state.cache.with_lengths(new_lengths_B), synced_B=synced,
                          lookup_steps_B=state.lookup_steps_B + (live_B & ~state.used_model_B))


def lookup_chain(lookup: NgramDrafter, seq_BxS, lengths_B, last_B, shape, sp, vocab: int):
  """(use_B, the lookup's chain as a Draft): whether each sequence's last ``lookup.min_ngram`` tokens occurred
  before, and the continuation of the best occurrence (valid as far as it is known).  Under sampling its q rows
  are point masses on the proposed tokens (the acceptance rule then accepts x with probability p(x))."""
  B, N = seq_BxS.shape[0], shape.num_nodes
  cand, clen = lookup.candidates(seq_BxS, lengths_B, N)
  look_tok, look_len = cand[:, 0], clen[:, 0]                          # the best occurrence's continuation
  node_1xN = jnp.arange(1, N + 1)[None, :]
  look = _static_draft(shape, jnp.concatenate([last_B[:, None], look_tok], axis=1).astype(jnp.int32),
                       jnp.concatenate([jnp.ones((B, 1), bool), node_1xN <= look_len[:, None]], axis=1))
  if not sp.greedy:
    q = jax.nn.one_hot(look.tokens_BxN1[:, 1:], vocab, dtype=jnp.float32)
    look = look._replace(q_BxN1xV=jnp.concatenate([q, jnp.zeros((B, 1, vocab), jnp.float32)], axis=1))
  return look_len >= 1, look


def pick_chain(use_B, look: Draft, other: Draft) -> Draft:
  """Per sequence, the lookup's chain where ``use_B``, else ``other`` (same chain shape)."""
  B = use_B.shape[0]
  pick = lambda a, b: jnp.where(use_B.reshape((B,) + (1,) * (a.ndim - 1)), a, b)
  q = None if look.q_BxN1xV is None else pick(look.q_BxN1xV, other.q_BxN1xV)
  return Draft(pick(look.tokens_BxN1, other.tokens_BxN1), other.parents_BxN1,
               pick(look.valid_BxN1, other.valid_BxN1), q, None)


def hybrid_drafter(draft_cfg, k: int, *, min_match: int = 3, buckets=None) -> HybridDrafter:
  """The hybrid drafter of a draft model ``draft_cfg`` for chains of ``k`` (catch-up chunks of k + 1, the
  most a lookup step commits)."""
  return HybridDrafter(_SyncingModel(draft_cfg, name="hybrid-model", buckets=buckets, window=k + 1),
                       min_match=min_match)
