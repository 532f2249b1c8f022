"""Token sampling rules: greedy, temperature, top-k, top-p, with explicit PRNG keys.

``filtered_logits`` is the single definition of "the distribution plain sampling draws from"; speculative
acceptance rules apply the same function to both the target's and the draft's logits, which is what makes
them lossless with respect to plain sampling.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models import sampling_rows
from specjax.models.attention import MASK_VALUE


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable; a jit static argument).

  temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 disable those filters.
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def filtered_logits(logits_BxV: jax.Array, sp: SamplingParams) -> jax.Array:
  """Temperature-scaled logits with tokens outside top-k / top-p set to a large negative value.

  The result's softmax is the exact distribution plain sampling draws from.  Not meaningful when greedy.
  ``sp`` may also be a ``sampling_rows.RowSampling`` (one setting per row); so for ``probs`` and ``sample``.
  """
  if isinstance(sp, sampling_rows.RowSampling):
    return sampling_rows.filtered_logits(logits_BxV, sp)
  x = logits_BxV.astype(jnp.float32) / sp.temperature
  V = x.shape[-1]
  if 0 < sp.top_k < V:
    kth_B = jax.lax.top_k(x, sp.top_k)[0][..., -1:]
    x = jnp.where(x < kth_B, MASK_VALUE, x)
  if sp.top_p < 1.0:
    sorted_BxV = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    keep = mass_before < sp.top_p
    threshold_B = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < threshold_B, MASK_VALUE, x)
  return x


def probs(logits_BxV: jax.Array, sp: SamplingParams) -> jax.Array:
  """The sampling distribution [B, V] (one-hot argmax when greedy)."""
  if isinstance(sp, sampling_rows.RowSampling):
    return sampling_rows.probs(logits_BxV, sp)
  if sp.greedy:
    return jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), logits_BxV.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(filtered_logits(logits_BxV, sp), axis=-1)


def sample(logits_BxV: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
  """Draw one token per row: [B] int32 (with a ``RowSampling``, ``key`` is one key per row [B, 2])."""
  if isinstance(sp, sampling_rows.RowSampling):
    return sampling_rows.sample(logits_BxV, key, sp)
  if sp.greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits_BxV, sp), axis=-1).astype(jnp.int32)
