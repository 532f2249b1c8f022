"""Synthetic acceptance: each drafted token of a chain accepted with probability α, whatever the drafter and
the target say (vLLM's synthetic sampler does the same).  Not lossless, and not meant to be: it fixes τ at
Σ_{i=1..k} α^i (for chains the drafter fills) so that the system's cost at a chosen acceptance — the drafter's
k forwards or lookups, the verification of k + 1 rows, the commit — is measured on this machine and set
against the cost model's prediction, independent of how good a drafter is.  The token after the accepted
prefix comes from the target (its argmax when greedy, else a draw from its filtered p), so the text stays
the target's where nothing was forced.  Chains only; ``bench --synthetic-alpha A``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import sampling, sampling_rows
from specjax.speculative.trees.device import Tree, TreeAcceptance


def accept_synthetic(tree: Tree, target_logits_BxN1xV: jax.Array, key: jax.Array, sp: sampling.SamplingParams,
                     alpha: float) -> TreeAcceptance:
  """The chain's valid prefix, each node kept with probability ``alpha`` until the first one that is not."""
  B, N1, _ = target_logits_BxN1xV.shape
  k = N1 - 1
  valid = tree.valid_BxN1[:, 1:] & (tree.parents_BxN1[:, 1:] == jnp.arange(k)[None])
  key_u, key_s = sampling_rows.split(key, 2)
  keep = valid & (sampling_rows.uniform(key_u, (B, k)) < alpha)
  tau = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
  p_next = sampling.probs(target_logits_BxN1xV, sp)[jnp.arange(B), tau]
  nxt = sampling_rows.categorical(key_s, jnp.where(p_next > 0, jnp.log(jnp.maximum(p_next, 1e-38)), -jnp.inf))
  accepted = jnp.take_along_axis(tree.anc_BxN1xN1, tau[:, None, None], axis=1)[:, 0]
  return TreeAcceptance(tau, nxt, accepted)
