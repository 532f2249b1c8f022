"""Acceptance rules: given the target's logits over k_max+1 positions and k_max drafted tokens, decide how
many drafts survive per sequence and which token follows them (the correction or the bonus token).

  GreedyAcceptance      accept while the draft equals the target's argmax; output identical to greedy decoding.
  SpeculativeSampling   accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample
                        from normalise(max(0, p_i - q_i)); if all k_active drafts survive, sample the bonus
                        token from p_{k_active}.  p and q are the *filtered* distributions (temperature, top-k,
                        top-p via ``sampling.filtered_logits``), so the output is distributed exactly as plain
                        sampling with the same settings.  A deterministic drafter passes q = None (one-hot).

Slots at or past ``k_active[b]`` are masked: never accepted, whatever they hold.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax import sampling
from specjax.model import MASK_VALUE


class Acceptance(NamedTuple):
  num_accepted_B: jax.Array     # int32 in [0, k_active]
  next_token_B: jax.Array       # int32: the correction (after a rejection) or bonus token
  accepted_BxK: jax.Array       # bool: draft i was accepted (i < num_accepted)
  reached_BxK: jax.Array        # bool: draft i was live and examined (i <= num_accepted, i < k_active)


def _leading_true(ok_BxK: jax.Array) -> jax.Array:
  return jnp.sum(jnp.cumprod(ok_BxK.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _stats(n_B, k_active_B, K):
  i_K = jnp.arange(K)[None, :]
  return i_K < n_B[:, None], (i_K <= n_B[:, None]) & (i_K < k_active_B[:, None])


@dataclasses.dataclass(frozen=True)
class GreedyAcceptance:
  """Accept the longest prefix of drafts equal to the target's argmax."""

  def __call__(self, target_logits_BxK1xV, draft_BxK, draft_probs_BxKxV, k_active_B, key, sp):
    del draft_probs_BxKxV, key, sp
    K = draft_BxK.shape[1]
    best_BxK1 = jnp.argmax(target_logits_BxK1xV, axis=-1).astype(jnp.int32)
    live = jnp.arange(K)[None, :] < k_active_B[:, None]
    n = _leading_true((draft_BxK == best_BxK1[:, :K]) & live)
    nxt = jnp.take_along_axis(best_BxK1, n[:, None], axis=1)[:, 0]
    return Acceptance(n, nxt, *_stats(n, k_active_B, K))


@dataclasses.dataclass(frozen=True)
class SpeculativeSampling:
  """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with filtered p and q."""

  def __call__(self, target_logits_BxK1xV, draft_BxK, draft_probs_BxKxV, k_active_B, key, sp):
    B, K = draft_BxK.shape
    V = target_logits_BxK1xV.shape[-1]
    p = jax.nn.softmax(sampling.filtered_logits(target_logits_BxK1xV.reshape(B * (K + 1), V), sp),
                       axis=-1).reshape(B, K + 1, V)
    key_u, key_s = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :K], draft_BxK[..., None], axis=-1)[..., 0]
    if draft_probs_BxKxV is None:           # deterministic drafter: q is one-hot at the draft
      q_d = jnp.ones_like(p_d)
    else:
      q_d = jnp.take_along_axis(draft_probs_BxKxV, draft_BxK[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_u, (B, K))
    live = jnp.arange(K)[None, :] < k_active_B[:, None]
    n = _leading_true((u * q_d < p_d) & live)  # u < p/q, without dividing by q

    # Where to sample from: the residual at the first rejection, or p itself for the bonus token.
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]                    # [B, V]
    idx = jnp.minimum(n, K - 1)[:, None, None] if K else None
    if K == 0:
      residual = p_n
    else:
      if draft_probs_BxKxV is None:
        d_n = jnp.take_along_axis(draft_BxK, idx[..., 0], axis=1)[:, 0]
        q_n = jax.nn.one_hot(d_n, V, dtype=p.dtype)
      else:
        q_n = jnp.take_along_axis(draft_probs_BxKxV, idx, axis=1)[:, 0]
      residual = jnp.maximum(p_n - q_n, 0.0)
      rejected = n < k_active_B
      mass = jnp.sum(residual, axis=-1, keepdims=True)
      residual = jnp.where(rejected[:, None] & (mass > 0), residual, p_n)
    logits = jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), MASK_VALUE)
    nxt = jax.random.categorical(key_s, logits, axis=-1).astype(jnp.int32)
    return Acceptance(n, nxt, *_stats(n, k_active_B, K))


def rule_for(sp: sampling.SamplingParams):
  return GreedyAcceptance() if sp.greedy else SpeculativeSampling()
