"""Distillation losses: the draft (q) learns the target (p), position by position.

Every loss takes logits (any leading shape, written N here, vocabulary V last) and a mask over the leading
shape, and returns the masked mean over positions (the mask may be bool or float weights; a position whose
weight is 0 never contributes, even if its logits are garbage).  Log-probabilities are computed in float32.

Excluded tokens (logits such as ``-1e30`` or ``attention.MASK_VALUE`` = -0.7·float32 max) have probability 0 and
contribute 0·log 0 = 0; the losses and their gradients stay finite as long as the divergence itself is finite
(KL(p‖q) is infinite where p > 0 and q = 0, and comes out huge, not nan).  All functions are jit-able; ``kind``
and ``beta`` are static.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

KINDS = ("fkl", "rkl", "jsd", "tvd")


def _weights(mask_N, shape) -> jax.Array:
  w_N = jnp.asarray(mask_N).astype(jnp.float32)
  if w_N.shape != shape:
    raise ValueError(f"mask has shape {w_N.shape}, the positions have shape {shape}")
  return w_N


def masked_mean(x_N: jax.Array, mask_N: jax.Array) -> jax.Array:
  """Weighted mean of ``x`` over positions with mask > 0 (0 when there are none); nan-safe where masked."""
  w_N = _weights(mask_N, x_N.shape)
  total = jnp.sum(jnp.where(w_N > 0, x_N, 0.0) * w_N)
  count = jnp.sum(w_N)
  return total / jnp.where(count > 0, count, 1.0)


def _log_probs(logits_NxV: jax.Array, w_N: jax.Array) -> jax.Array:
  """float32 log-softmax; masked positions get zero logits so nothing there can make a nan (nor its grad)."""
  x = logits_NxV.astype(jnp.float32)
  x = jnp.where((w_N > 0)[..., None], x, 0.0)
  return jax.nn.log_softmax(x, axis=-1)


def _kl_terms(logp_NxV: jax.Array, logq_NxV: jax.Array) -> jax.Array:
  """Per-position KL(p‖q) = Σ p (log p − log q), with 0·log 0 = 0 (the difference is dropped where p = 0)."""
  p = jnp.exp(logp_NxV)
  diff = jnp.where(p > 0, logp_NxV - logq_NxV, 0.0)
  return jnp.sum(p * diff, axis=-1)


def _per_position(kind: str, logp_NxV: jax.Array, logq_NxV: jax.Array, beta: float) -> jax.Array:
  if kind == "fkl":
    return _kl_terms(logp_NxV, logq_NxV)
  if kind == "rkl":
    return _kl_terms(logq_NxV, logp_NxV)
  if kind == "jsd":
    if not 0.0 < beta < 1.0:
      raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
    # log m = log(β p + (1−β) q), exact where either side is excluded (logaddexp of a huge negative).
    logm = jnp.logaddexp(jnp.log(beta) + logp_NxV, jnp.log1p(-beta) + logq_NxV)
    return beta * _kl_terms(logp_NxV, logm) + (1.0 - beta) * _kl_terms(logq_NxV, logm)
  if kind == "tvd":
    return 0.5 * jnp.sum(jnp.abs(jnp.exp(logp_NxV) - jnp.exp(logq_NxV)), axis=-1)
  raise ValueError(f"unknown divergence {kind!r}: choose one of {', '.join(KINDS)}")


def divergence_per_position(kind: str, p_logits_NxV: jax.Array, q_logits_NxV: jax.Array, *,
                            beta: float = 0.5, mask_N: jax.Array | None = None) -> jax.Array:
  """Divergence at every position, shape N (see ``divergence``); masked positions are 0."""
  if kind not in KINDS:
    raise ValueError(f"unknown divergence {kind!r}: choose one of {', '.join(KINDS)}")
  if p_logits_NxV.shape != q_logits_NxV.shape:
    raise ValueError(f"target logits {p_logits_NxV.shape} and draft logits {q_logits_NxV.shape} differ in shape")
  shape = p_logits_NxV.shape[:-1]
  w_N = jnp.ones(shape, jnp.float32) if mask_N is None else _weights(mask_N, shape)
  d_N = _per_position(kind, _log_probs(p_logits_NxV, w_N), _log_probs(q_logits_NxV, w_N), beta)
  return jnp.where(w_N > 0, d_N, 0.0)


def divergence(kind: str, p_logits_NxV: jax.Array, q_logits_NxV: jax.Array, mask_N: jax.Array, *,
               beta: float = 0.5) -> jax.Array:
  """Masked mean divergence between the target p and the draft q, both given as logits.

  kind: "fkl" KL(p‖q), "rkl" KL(q‖p), "jsd" β·KL(p‖m) + (1−β)·KL(q‖m) with m = βp + (1−β)q,
  "tvd" ½ Σ|p − q| (1 − tvd is the acceptance rate of speculative sampling).
  """
  return masked_mean(divergence_per_position(kind, p_logits_NxV, q_logits_NxV, beta=beta, mask_N=mask_N),
                     mask_N)


def cross_entropy(labels_N: jax.Array, q_logits_NxV: jax.Array, mask_N: jax.Array) -> jax.Array:
  """Masked mean of −log q(label); labels at masked positions are ignored (any value, e.g. −1)."""
  w_N = _weights(mask_N, q_logits_NxV.shape[:-1])
  logq_NxV = _log_probs(q_logits_NxV, w_N)
  labels_N = jnp.where(w_N > 0, labels_N, 0).astype(jnp.int32)
  nll_N = -jnp.take_along_axis(logq_NxV, labels_N[..., None], axis=-1)[..., 0]
  return masked_mean(nll_N, w_N)


def smooth_l1(pred_NxD: jax.Array, target_NxD: jax.Array, mask_N: jax.Array, beta: float = 1.0) -> jax.Array:
  """Masked mean over positions of the mean over D of PyTorch's SmoothL1Loss:
  0.5·d²/β where |d| < β, else |d| − 0.5·β (β = 0 is plain L1)."""
  if beta < 0:
    raise ValueError(f"smooth_l1 needs beta >= 0, got {beta}")
  if pred_NxD.shape != target_NxD.shape:
    raise ValueError(f"prediction {pred_NxD.shape} and target {target_NxD.shape} differ in shape")
  d = pred_NxD.astype(jnp.float32) - target_NxD.astype(jnp.float32)
  ad = jnp.abs(d)
  if beta == 0:
    per_NxD = ad
  else:
    per_NxD = jnp.where(ad < beta, 0.5 * d * d / beta, ad - 0.5 * beta)
  return masked_mean(jnp.mean(per_NxD, axis=-1), mask_N)


def acceptance_from_tvd(p_logits_NxV: jax.Array, q_logits_NxV: jax.Array) -> jax.Array:
  """Per-position expected acceptance of speculative sampling, 1 − TVD(p, q) = Σ min(p, q); shape N."""
  return 1.0 - divergence_per_position("tvd", p_logits_NxV, q_logits_NxV)
