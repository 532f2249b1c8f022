"""Rotary position embeddings (rotate-half convention, the Hugging Face layout): the inverse frequencies a
config asks for, the cos/sin tables at given positions, and their application to queries and keys."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [E/2], with Llama-3 frequency scaling when the config asks for it."""
  E = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, E, 2, dtype=np.float64) / E))
  s = cfg.rope_scaling
  if s is not None:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv / s.factor + smooth * inv
    inv = np.where(wavelen > low_wavelen, inv / s.factor,
                   np.where(wavelen < high_wavelen, inv, smoothed))
  return inv.astype(np.float32)


def rope_tables(cfg: ModelConfig, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, E/2] for the given positions."""
  angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxTxNxE: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array) -> jax.Array:
  x = x_BxTxNxE.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  cos, sin = cos_BxTxR[:, :, None, :], sin_BxTxR[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxE.dtype)
