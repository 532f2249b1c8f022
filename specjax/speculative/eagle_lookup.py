"""Prompt lookup where the context repeats itself, a trained feature drafter (EAGLE head) everywhere else.

The head's twin of ``hybrid`` (lookup, else a draft model).  Each step drafts one chain of k per sequence:

  lookup   the last ``min_match`` tokens occurred earlier in the sequence: the continuation of the best
           occurrence (``hybrid.lookup_chain``);
  head     otherwise: the head's chain (``EagleDrafter``), one one-row forward per depth.

Unlike the draft model, the head cannot skip a step and catch up later from tokens alone: it reads the target's
feature of every committed token, and the engine hands it only the last step's accepted path.  So the head's
root forward runs every step — it feeds the pending tokens with their target features, one multi-row forward of
one layer — and when every live sequence has a lookup match (a ``lax.cond``) only that forward runs: no head row
at the root and none of the chain's k - 1 one-row forwards.

Chains only (a lookup chain and a head chain have one shape, chosen per sequence with a ``jnp.where``).  Under
sampling the lookup's proposals are point masses, so the acceptance rule keeps the target's distribution; the
choice of source reads only committed tokens.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import NgramDrafter
from specjax.speculative.eagle import EagleDrafter, EagleState
from specjax.speculative.hybrid import lookup_chain, pick_chain


@struct.dataclass
class EagleLookupState:
  head: EagleState            # the head's cache and pending target features
  used_lookup_B: jax.Array    # bool: this step's chain came from the lookup (read by commit)
  lookup_steps_B: jax.Array   # live steps whose chain came from the lookup (statistics; ``bench`` reads it)


@dataclasses.dataclass(frozen=True)
class EagleLookupDrafter(EagleDrafter):
  """Lookup chain where the last ``min_match`` tokens occurred before, the head's chain elsewhere (module
  docstring).  A sequential head only."""
  min_match: int = 3
  occurrences: int = 4
  name: str = "eagle-hybrid"

  @property
  def lookup(self) -> NgramDrafter:
    return NgramDrafter(max_ngram=self.min_match, min_ngram=self.min_match, occurrences=self.occurrences)

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len, target_features_BxPxF=None):
    head = super().init(draft_params, prompt_BxP, prompt_lens_B, max_len, target_features_BxPxF)
    B = prompt_BxP.shape[0]
    return EagleLookupState(head, jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32))

  def state_bytes_per_seq(self, max_len: int) -> int:
    """The head's state, then used_lookup (bool) and lookup_steps (int32) per sequence."""
    return super().state_bytes_per_seq(max_len) + 1 + 4

  def propose(self, draft_params, state: EagleLookupState, seq_BxS, lengths_B, last_B, shape, key, sp):
    if shape.num_nodes and not tree_shapes.is_chain(shape):
      raise ValueError(f"the eagle-hybrid drafter drafts chains only, got the tree {shape}")
    B = seq_BxS.shape[0]
    if shape.num_nodes == 0:
      head, d = super().propose(draft_params, state.head, seq_BxS, lengths_B, last_B, shape, key, sp)
      return state.replace(head=head, used_lookup_B=jnp.zeros((B,), bool)), d
    if shape.max_depth > self.max_depth:
      raise ValueError(f"EAGLE drafter built for depth {self.max_depth}, chain has depth {shape.max_depth}")
    use_B, look = lookup_chain(self.lookup, seq_BxS, lengths_B, last_B, shape, sp, self.ecfg.target.vocab_size)

    def with_head(_):
      root = self._root(draft_params, state.head, seq_BxS, lengths_B, last_B)
      return self._grow(draft_params, state.head, root, last_B, shape, key, sp)

    def lookup_only(_):     # the root forward still feeds the pending features, without its head row
      _, _, cache = self._root(draft_params, state.head, seq_BxS, lengths_B, last_B, head=False)
      return self._with_cache(state.head, cache), look

    head, d = jax.lax.cond(jnp.all(use_B), lookup_only, with_head, None)
    return state.replace(head=head, used_lookup_B=use_B), pick_chain(use_B, look, d)

  def commit(self, state: EagleLookupState, lengths_B, path_slots_BxD1, new_lengths_B, path_features_BxD1xF=None):
    """The head's commit (it keeps the root's entry and queues the accepted path's target features, whichever
    source drafted it), and the lookup-step count."""
    head = super().commit(state.head, lengths_B, path_slots_BxD1, new_lengths_B, path_features_BxD1xF)
    live_B = new_lengths_B > lengths_B
    return EagleLookupState(head, state.used_lookup_B, state.lookup_steps_B + (live_B & state.used_lookup_B))
