"""Rotary position embeddings (rotate-half convention, the Hugging Face layout): the inverse frequencies a
config asks for (plain, or scaled the llama3, yarn or linear way), the cos/sin tables at given positions, and
their application to queries and keys.  A family with a second rope for its windowed layers (Gemma 3's local
base) gets its tables with ``local=True``."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig, RopeScaling


def _llama3(inv_R: np.ndarray, s: RopeScaling) -> np.ndarray:
  """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * np.pi / inv_R
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * inv_R / s.factor + smooth * inv_R
  return np.where(wavelen > low_wavelen, inv_R / s.factor, np.where(wavelen < high_wavelen, inv_R, smoothed))


def _yarn(inv_R: np.ndarray, s: RopeScaling, theta: float, E: int) -> np.ndarray:
  """YaRN's NTK-by-parts: dimensions that turn fewer than ``beta_slow`` times over the original context are
  interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times are kept, a linear
  ramp between."""
  def dim_of(rotations):   # the dimension whose wavelength fits ``rotations`` turns in the original context
    return E * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
  low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, E - 1)
  if low == high:
    high += 0.001
  ramp_R = np.clip((np.arange(E // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  keep_R = 1.0 - ramp_R
  return inv_R / s.factor * (1.0 - keep_R) + inv_R * keep_R


def yarn_attention_factor(s: RopeScaling) -> float:
  """YaRN's cos/sin multiplier: the given one, else 0.1 ln(factor) + 1."""
  if s.attention_factor is not None:
    return float(s.attention_factor)
  return 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
  """Inverse frequencies [E/2]: the global rope with the config's scaling, or (``local``) the windowed
  layers' own unscaled base when the config has one."""
  E = cfg.head_dim
  theta = cfg.local_rope_theta if local and cfg.local_rope_theta is not None else cfg.rope_theta
  inv = 1.0 / (theta ** (np.arange(0, E, 2, dtype=np.float64) / E))
  s = None if local and cfg.local_rope_theta is not None else cfg.rope_scaling
  if s is not None:
    if s.kind == "llama3":
      inv = _llama3(inv, s)
    elif s.kind == "yarn":
      inv = _yarn(inv, s, theta, E)
    else:                                  # linear: positions / factor
      inv = inv / s.factor
  return inv.astype(np.float32)


def rope_tables(cfg: ModelConfig, positions_BxT: jax.Array, local: bool = False) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B, T, E/2] for the given positions (times YaRN's attention factor under yarn scaling)."""
  angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg, local))
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  s = None if local and cfg.local_rope_theta is not None else cfg.rope_scaling
  if s is not None and s.kind == "yarn":
    f = jnp.float32(yarn_attention_factor(s))
    cos, sin = cos * f, sin * f
  return cos, sin


def has_local_rope(cfg: ModelConfig) -> bool:
  """Whether windowed layers use other tables than global ones."""
  return cfg.windowed and cfg.local_rope_theta is not None


def apply_rope(x_BxTxNxE: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array) -> jax.Array:
  x = x_BxTxNxE.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  cos, sin = cos_BxTxR[:, :, None, :], sin_BxTxR[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxE.dtype)
