"""Sampling settings as per-sequence data: what lets one compiled step decode requests that each asked for
their own temperature, top-k, top-p and seed (the server's continuous batching).

``SamplingParams`` (sampling.py) is static: one setting compiled into an engine.  ``RowSampling`` holds one
setting per sequence as arrays, and each sequence draws from its own PRNG key, so a seeded request gets the
same tokens whichever other requests share its step.  Every function here equals its ``sampling`` twin
applied row by row with that row's settings (tests/models/test_sampling_rows.py); a row with temperature 0 is
greedy: its distribution is the one-hot argmax and its draw is the argmax.

The random helpers at the bottom (``split``, ``uniform``, ``gumbel``, ``categorical``) take either one key
(uint32 [2]: one stream for the batch, as a static engine draws) or one key per row ([B, 2]: row b's draws
from its own key), so the drafters and acceptance rules serve both engines with one code path.
``RowState`` is what an engine in per-row mode (``Engine.per_row``) carries in its state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models.attention import MASK_VALUE


@struct.dataclass
class RowSampling:
  temperature_B: jax.Array      # float32; 0 = greedy
  top_k_B: jax.Array            # int32; 0 = no top-k filter
  top_p_B: jax.Array            # float32 in (0, 1]; 1 = no nucleus filter

  @classmethod
  def of(cls, settings) -> "RowSampling":
    """From a list of ``sampling.SamplingParams`` (validated there), one per sequence."""
    return cls(jnp.asarray([s.temperature for s in settings], jnp.float32),
               jnp.asarray([s.top_k for s in settings], jnp.int32),
               jnp.asarray([s.top_p for s in settings], jnp.float32))

  @property
  def greedy_B(self) -> jax.Array:
    return self.temperature_B == 0.0

  @property
  def greedy(self) -> bool:
    """Never greedy as a whole (the static question drafters and rules ask of ``SamplingParams``): a greedy
    row goes through the sampling rule with a one-hot p, which accepts exactly what greedy acceptance does
    and draws the argmax."""
    return False

  @property
  def any_filter(self) -> jax.Array:
    """A row asks for top-k or top-p (else the sorts are skipped)."""
    return jnp.any((self.top_k_B > 0) | (self.top_p_B < 1.0))


@struct.dataclass
class RowState:
  """Per-sequence decoding data an engine in per-row mode keeps in its state."""
  sampling: RowSampling
  keys_Bx2: jax.Array           # uint32: each sequence's own PRNG key (its seed)
  logprob_BxS: jax.Array        # float32: log p(token) under the target's own distribution (temperature 1, no
                                # filter), at each generated token's position; 0 elsewhere

  @classmethod
  def create(cls, settings, seeds, max_len: int) -> "RowState":
    """One ``SamplingParams`` and one integer seed in [0, 2^64) per sequence."""
    return cls(RowSampling.of(settings), seed_keys(seeds), jnp.zeros((len(settings), max_len), jnp.float32))


def seed_keys(seeds) -> jax.Array:
  """Raw threefry keys [B, 2] of 64-bit seeds: the words (high, low), which is ``jax.random.PRNGKey(seed)``
  for a seed below 2^32 (above it, PRNGKey keeps only the low word unless x64 is on: seeds would collide)."""
  s = np.asarray([int(x) for x in seeds], dtype=np.uint64).reshape(-1)
  return jnp.asarray(np.stack([s >> np.uint64(32), s & np.uint64(0xFFFFFFFF)], axis=1).astype(np.uint32))


def _per_row(x_B, logits_BxV):
  """[B] broadcast against [B, ..., V]."""
  return x_B.reshape(x_B.shape + (1,) * (logits_BxV.ndim - 1))


def filtered_logits(logits_BxV: jax.Array, rs: RowSampling) -> jax.Array:
  """``sampling.filtered_logits`` with row b's settings (any leading shape [B, ...]; greedy rows: meaningless,
  as there).  When no row asks for top-k or top-p the sorts over the vocabulary are skipped (``lax.cond``)."""
  x = logits_BxV.astype(jnp.float32) / _per_row(jnp.where(rs.greedy_B, 1.0, rs.temperature_B), logits_BxV)
  return jax.lax.cond(rs.any_filter, _filter, lambda x, rs: x, x, rs)


# The filters look for their cut among the top candidates first (``lax.top_k``: ~20x cheaper than a sort of
# a 49k vocabulary on a CPU); only when some row's cut lies further down (top-p over a flat distribution)
# does the whole batch fall back to a bisection on the values (``_filter_by_search``).  Both keep the tokens
# the reference sort (``_filter_by_sort``) keeps.
TOP_CANDIDATES = 1024


def _filter(x, rs: RowSampling):
  V = x.shape[-1]
  C = min(TOP_CANDIDATES, V)
  top = jax.lax.top_k(x, C)[0]                                                      # [..., C] descending
  k = _per_row(jnp.where((rs.top_k_B > 0) & (rs.top_k_B < V), rs.top_k_B, V), x)
  top_p = _per_row(rs.top_p_B, x)
  idx = jnp.arange(C)
  in_k = idx < k
  # The nucleus is taken over the top-k filtered values: its normaliser is theirs (all of V without top-k).
  log_z = jnp.where(k <= C, jax.nn.logsumexp(jnp.where(in_k, top, -jnp.inf), axis=-1, keepdims=True),
                    jax.nn.logsumexp(x, axis=-1, keepdims=True))
  probs = jnp.where(in_k, jnp.exp(top - log_z), 0.0)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = in_k & ((mass_before < top_p) | (top_p >= 1.0))
  no_filter = (k >= V) & (top_p >= 1.0)
  # The cut is inside the candidates: within the top k <= C, or a candidate already has the nucleus' mass.
  fits = no_filter | (k <= C) | jnp.any(in_k & ~keep, axis=-1, keepdims=True)
  threshold = jnp.where(no_filter, -jnp.inf, jnp.min(jnp.where(keep, top, jnp.inf), axis=-1, keepdims=True))
  return jax.lax.cond(jnp.all(fits), lambda x, rs: jnp.where(x < threshold, MASK_VALUE, x), _filter_by_search,
                      x, rs)


def _ordered_bits(x):
  """float32 → int32 with the same order (negative floats: every bit but the sign flipped)."""
  i = jax.lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _smallest(pred, shape):
  """Per row, the smallest int32 t with pred(t) [..., 1] true (pred monotone: false below, true from t on),
  by bisection over the int32 range (32 halvings)."""
  lo = jnp.full(shape, jnp.iinfo(jnp.int32).min, jnp.int32)       # pred(lo) may be true: the answer is lo
  hi = jnp.full(shape, jnp.iinfo(jnp.int32).max, jnp.int32)       # pred(hi) is true

  def body(_, lh):
    lo, hi = lh
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)                    # floor((lo + hi) / 2) without overflow
    ok = pred(mid)
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
  return jax.lax.fori_loop(0, 32, body, (lo, hi))[1]


def _filter_by_search(x, rs: RowSampling):
  """The cuts of ``_filter_by_sort`` found by bisection on the values' bits, per row: the k-th largest value
  is the largest t with count(x ≥ t) ≥ k, and the nucleus's smallest value is the smallest t with
  mass(x > t) < top_p.  32 masked sums over V each, against a sort of V."""
  V = x.shape[-1]
  bits = _ordered_bits(x)
  shape = x.shape[:-1] + (1,)
  k = _per_row(jnp.where((rs.top_k_B > 0) & (rs.top_k_B < V), rs.top_k_B, V), x)
  # kth: largest t with count(bits >= t) >= k  ==  (smallest t with count(bits >= t + 1) < k)
  kth_bits = _smallest(lambda t: jnp.sum(bits >= t + 1, axis=-1, keepdims=True) < k, shape)
  kth_bits = jnp.where(k < V, kth_bits, jnp.iinfo(jnp.int32).min)
  in_k = bits >= kth_bits
  xk = jnp.where(in_k, x, MASK_VALUE)
  p = jax.nn.softmax(xk, axis=-1)
  top_p = _per_row(rs.top_p_B, x)
  cut_bits = _smallest(lambda t: jnp.sum(jnp.where(bits > t, p, 0.0), axis=-1, keepdims=True) < top_p, shape)
  cut_bits = jnp.where(top_p < 1.0, jnp.maximum(cut_bits, kth_bits), kth_bits)
  return jnp.where(in_k & (bits >= cut_bits), x, MASK_VALUE)


def _filter_by_sort(x, rs: RowSampling):
  """The reference of the per-row cut (a sort of the vocabulary)."""
  V = x.shape[-1]
  desc = jnp.sort(x, axis=-1)[..., ::-1]
  k = _per_row(jnp.where((rs.top_k_B > 0) & (rs.top_k_B < V), rs.top_k_B, V), x)
  kth = jnp.take_along_axis(desc, k - 1, axis=-1)                                   # [..., 1]
  x = jnp.where(x < kth, MASK_VALUE, x)
  # The nucleus over the top-k filtered values (the order sampling.py applies them in).
  desc = jnp.where(jnp.arange(V) < k, desc, MASK_VALUE)
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  top_p = _per_row(rs.top_p_B, x)
  keep = (mass_before < top_p) | (top_p >= 1.0)
  threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(x < threshold, MASK_VALUE, x)


def probs(logits_BxV: jax.Array, rs: RowSampling) -> jax.Array:
  """Row b's sampling distribution (one-hot argmax for a greedy row)."""
  V = logits_BxV.shape[-1]
  one_hot = jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), V, dtype=jnp.float32)
  return jnp.where(_per_row(rs.greedy_B, logits_BxV), one_hot, jax.nn.softmax(filtered_logits(logits_BxV, rs), -1))


def row_keys(keys_Bx2: jax.Array, step) -> jax.Array:
  """Each sequence's key for one step: its own key folded with the step number (its count of steps so far,
  not the batch's), so its draws do not depend on the batch."""
  return jax.vmap(jax.random.fold_in)(keys_Bx2, jnp.broadcast_to(jnp.asarray(step, jnp.uint32),
                                                                 keys_Bx2.shape[:1]))


def sample(logits_BxV: jax.Array, keys_Bx2: jax.Array, rs: RowSampling) -> jax.Array:
  """One token per row [B] int32, row b drawn with its own key (argmax for a greedy row)."""
  draw = jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys_Bx2, filtered_logits(logits_BxV, rs))
  return jnp.where(rs.greedy_B, jnp.argmax(logits_BxV, axis=-1), draw).astype(jnp.int32)



# ---------------------------------------------------------------------------------------------------------
# Random draws from one key or from one key per row.


def _rowwise(key) -> bool:
  return key.ndim == 2


def split(key: jax.Array, n: int) -> jax.Array:
  """n keys [n, 2] from one key; n per-row keys [n, B, 2] from per-row keys [B, 2]."""
  if not _rowwise(key):
    return jax.random.split(key, n)
  return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(key), 0, 1)


def uniform(key: jax.Array, shape) -> jax.Array:
  """Uniform [0, 1) draws of ``shape`` = [B, ...]; with per-row keys, row b from key b."""
  if not _rowwise(key):
    return jax.random.uniform(key, shape)
  return jax.vmap(lambda k: jax.random.uniform(k, tuple(shape[1:])))(key)


def gumbel(key: jax.Array, shape) -> jax.Array:
  if not _rowwise(key):
    return jax.random.gumbel(key, shape)
  return jax.vmap(lambda k: jax.random.gumbel(k, tuple(shape[1:])))(key)


def categorical(key: jax.Array, logits_BxV: jax.Array) -> jax.Array:
  """One draw per row over the last axis, int32 [B, ...]."""
  if not _rowwise(key):
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)
  return jax.vmap(lambda k, lg: jax.random.categorical(k, lg, axis=-1))(key, logits_BxV).astype(jnp.int32)
