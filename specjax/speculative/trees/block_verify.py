"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro and Suresh, "Block Verification
Accelerates Speculative Decoding", 2024): a lossless rule that judges a drafted chain as a whole.

Token-wise rejection sampling stops at the first rejected draft.  Block verification keeps a running weight
ρ_i = min(1, ρ_{i-1} · p_i(x_i) / q_i(x_i)) (ρ_0 = 1) over the chain x_1..x_k, and accepts the prefix of length
τ = the largest i in 0..k whose coin η_i ≤ h_i, where

  h_i = Z_i / (Z_i + 1 - ρ_i)     for i < k,    Z_i = Σ_x max(0, ρ_i · p_{i+1}(x) - q_{i+1}(x))
  h_k = ρ_k                       (h_0 = 1: τ is at least 0)

so a later position can rescue an earlier one whose own ratio was low.  The next token is drawn from the
target's p_{k+1} after a fully accepted chain (the bonus), else from the residual max(0, ρ_τ · p_{τ+1} -
q_{τ+1}), normalised.  The output is distributed exactly as sampling from the target (the paper's Theorem 1;
tests/speculative/test_block_verify.py checks it with a χ² test that catches a variant without the rescue), and
the expected number of accepted tokens is at least token-wise verification's (Theorem 2; the same test file
measures both).  At temperature 0 it accepts exactly what greedy acceptance accepts.

Here p_i is the target's (filtered) distribution at the position of draft i — ``target_logits[:, i - 1]`` —
and q_i the distribution draft i was drawn from — ``q[:, i - 1]`` (a deterministic drafter, ``q`` None: a point
mass on its token).  Chains only: the rule is defined for one drafted sequence; a tree's siblings have no
joint weight in it (``rule`` refuses a tree).  Invalid chain nodes (a drafter that drafted fewer than k) end
the chain: their h is 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import sampling, sampling_rows
from specjax.speculative.trees.device import Tree, TreeAcceptance


def _residual(rho_B, p_BxV, q_BxV):
  """max(0, ρ·p - q) [B, V] and its mass Z [B]."""
  r = jnp.maximum(rho_B[:, None] * p_BxV - q_BxV, 0.0)
  return r, jnp.sum(r, axis=-1)


def accept_block(tree: Tree, target_logits_BxN1xV: jax.Array, q_BxN1xV: jax.Array | None, key: jax.Array,
                 sp: sampling.SamplingParams, broken: str | None = None) -> TreeAcceptance:
  """Block verification of a chain (node i's parent is node i - 1).  ``broken`` names a deliberately wrong
  variant, kept so tests can show they catch it: "no_rescue" stops at the first failed coin, as token-wise
  verification stops at its first rejection (on the micro pair of tests/speculative/test_block_verify.py it accepts half
  as much and χ² rejects it at p < 1e-20)."""
  B, N1, V = target_logits_BxN1xV.shape
  k = N1 - 1
  p_all = sampling.probs(target_logits_BxN1xV, sp)                        # [B, N1, V]
  tokens = jnp.maximum(tree.tokens_BxN1[:, 1:], 0)                          # x_1..x_k [B, k]
  if q_BxN1xV is None:
    q_all = jax.nn.one_hot(tree.tokens_BxN1[:, 1:], V, dtype=p_all.dtype)   # q_i: a point mass on x_i
    q_all = jnp.concatenate([q_all, jnp.zeros_like(q_all[:, :1])], axis=1)   # [B, N1, V]; q_{k+1} unused
  else:
    q_all = jnp.concatenate([q_BxN1xV[:, :k], jnp.zeros_like(q_BxN1xV[:, :1])], axis=1)
  # The chain ends at its first invalid node: live_B drafts.
  valid = tree.valid_BxN1[:, 1:] & (tree.parents_BxN1[:, 1:] == jnp.arange(k)[None])
  live_B = jnp.sum(jnp.cumprod(valid.astype(jnp.int32), axis=1), axis=1)
  # ρ_i for i = 0..k: the running weight, capped at 1.
  p_x = jnp.take_along_axis(p_all[:, :k], tokens[..., None], axis=-1)[..., 0]     # p_i(x_i) [B, k]
  q_x = jnp.take_along_axis(q_all[:, :k], tokens[..., None], axis=-1)[..., 0]
  ratio = jnp.where(q_x > 0, p_x / jnp.where(q_x > 0, q_x, 1.0), 0.0)

  def step(rho, r):
    rho = jnp.minimum(rho * r, 1.0)
    return rho, rho
  _, rhos = jax.lax.scan(step, jnp.ones((B,), p_all.dtype), ratio.T)
  rho_BxN1 = jnp.concatenate([jnp.ones((B, 1), p_all.dtype), rhos.T], axis=1)     # ρ_0..ρ_k
  # Z_i for i = 0..k-1 (positions i + 1 = 1..k), then h_i.
  _, Z_BxN1 = _residual(rho_BxN1.reshape(-1), p_all.reshape(-1, V), q_all.reshape(-1, V))
  Z_BxN1 = Z_BxN1.reshape(B, N1)
  denom = Z_BxN1 + 1.0 - rho_BxN1
  h = jnp.where(denom > 0, Z_BxN1 / jnp.where(denom > 0, denom, 1.0), 1.0)
  i = jnp.arange(N1)[None]
  h = jnp.where(i < live_B[:, None], h, jnp.where(i == live_B[:, None], rho_BxN1, 0.0))
  key_u, key_s = sampling_rows.split(key, 2)
  u_BxN1 = sampling_rows.uniform(key_u, (B, N1))
  take = (u_BxN1 < h).at[:, 0].set(True)
  if broken == "no_rescue":
    take = jnp.cumprod(take.astype(jnp.int32), axis=1).astype(bool)
  tau = jnp.max(jnp.where(take, i, 0), axis=1).astype(jnp.int32)                # the accepted length
  # The next token: the bonus after a whole chain, else the residual at τ (weighted by ρ_τ).
  rows = jnp.arange(B)
  p_next, q_next = p_all[rows, tau], q_all[rows, tau]
  res, mass = _residual(rho_BxN1[rows, tau], p_next, q_next)
  res = res / jnp.where(mass > 0, mass, 1.0)[:, None]
  dist = jnp.where(((tau == live_B) | (mass <= 0))[:, None], p_next, res)
  logits = jnp.where(dist > 0, jnp.log(jnp.maximum(dist, 1e-38)), -jnp.inf)
  nxt = sampling_rows.categorical(key_s, logits)
  accepted = jnp.take_along_axis(tree.anc_BxN1xN1, tau[:, None, None], axis=1)[:, 0]
  return TreeAcceptance(tau, nxt, accepted)
