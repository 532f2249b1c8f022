"""Attention over the KV cache: which slots each query sees (committed context plus the causal or tree region
after it), grouped-query attention (the reference and the layout-friendly version the decoder runs), and
writing new keys and values into their slots."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import cpu_attention

# A large finite negative instead of -inf, so a fully masked row never becomes NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def attention_mask(lengths_B: jax.Array, T: int, S: int, extra_mask_BxTxT: jax.Array | None,
                   region_mask_BxTxU: jax.Array | None = None) -> jax.Array:
  """Which cache slots each new query may see: [B, T, S] bool.

  Slot j is visible to query t of sequence b when it is committed context (j < lengths[b]) or it is a slot
  lengths[b] + u of the region after it that ``region_mask[b, t, u]`` allows.  Without a region mask the
  region is this call's T new slots, causal (u <= t), further restricted by ``extra_mask`` when given.
  """
  return cpu_attention.visible_slots(lengths_B, region_mask(lengths_B.shape[0], T, extra_mask_BxTxT,
                                                            region_mask_BxTxU), S)


def visible_at(lengths_B: jax.Array, region_BxTxU: jax.Array, slots_BxN: jax.Array,
               lo_BxT: jax.Array | None = None) -> jax.Array:
  """[B, T, N] bool: whether query t sees slot ``slots[b, n]``: committed (< lengths[b]) or a region slot the
  region mask allows, and (a windowed layer) not before ``lo[b, t]``."""
  U = region_BxTxU.shape[2]
  rel_BxN = slots_BxN - lengths_B[:, None]
  rel_BxTxN = jnp.broadcast_to(rel_BxN[:, None, :], region_BxTxU.shape[:2] + rel_BxN.shape[1:])
  region = jnp.take_along_axis(region_BxTxU, jnp.clip(rel_BxTxN, 0, U - 1), axis=2)
  seen = (rel_BxTxN < 0) | ((rel_BxTxN < U) & region)
  return seen if lo_BxT is None else seen & (slots_BxN[:, None, :] >= lo_BxT[:, :, None])


def softcap_scores(scores, softcap: float | None):
  """Gemma 2's attention logit cap: c·tanh(scores / c) (identity without a cap)."""
  return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def region_mask(B: int, T: int, extra_mask_BxTxT=None, region_mask_BxTxU=None) -> jax.Array:
  """The visibility of the slots after the committed ones: the region mask itself, else causal over the T
  new slots (and'ed with ``extra_mask``)."""
  if region_mask_BxTxU is not None:
    return region_mask_BxTxU
  causal = cpu_attention.causal_mask(B, T)
  return causal if extra_mask_BxTxT is None else causal & extra_mask_BxTxT


def attend_reference(q_BxTxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
                     mask_BxTxS: jax.Array, softcap: float | None = None) -> jax.Array:
  """Grouped-query attention written the obvious way (the reference for ``attend``). Returns [B, T, H, E]."""
  B, T, H, E = q_BxTxHxE.shape
  K = k_BxSxKxE.shape[2]
  q = q_BxTxHxE.reshape(B, T, K, H // K, E)
  scores = jnp.einsum("btkge,bske->bkgts", q, k_BxSxKxE,
                      preferred_element_type=jnp.float32) / math.sqrt(E)
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], softcap_scores(scores, softcap), MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bske->btkge", probs.astype(v_BxSxKxE.dtype), v_BxSxKxE,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, H, E).astype(q_BxTxHxE.dtype)


# XLA:CPU multiplies a product of few rows with other blockings than one of many, so the same query row
# summed differently in a one-row plain step and a k + 1-row verification (fp32 and bf16; measured: the T*H
# rows of 1..4 queries differ from 8's, 8 to 64 agree).  The queries are padded to at least this many rows.
ATTEND_MIN_ROWS = 64


def attend(q_BxTxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
           mask_BxTxS: jax.Array, softcap: float | None = None) -> jax.Array:
  """Grouped-query attention of T queries over S cache slots; softmax in fp32. Returns [B, T, H, E].

  Reads k and v in the cache's own row layout [B, S, K*E]: each query head is placed in its kv head's block
  of a block-diagonal [T*H, K*E] matrix, so both products are plain batched matmuls with no transposed copy
  of the cache (K times the attention arithmetic, which is negligible for decode-sized T; XLA:CPU otherwise
  spends more time transposing the window than attending).  Same result as ``attend_reference``.
  """
  B, T, H, E = q_BxTxHxE.shape
  Tp = max(T, -(-ATTEND_MIN_ROWS // H))
  if Tp > T:       # padding query rows (they see no slot and are dropped): every T takes the same kernel
    q_BxTxHxE = jnp.pad(q_BxTxHxE, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    mask_BxTxS = jnp.pad(mask_BxTxS, ((0, 0), (0, Tp - T), (0, 0)))
    return attend(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, softcap)[:, :T]
  S, K = k_BxSxKxE.shape[1], k_BxSxKxE.shape[2]
  G = H // K
  dt = k_BxSxKxE.dtype
  eye_KxK = jnp.eye(K, dtype=dt)
  q_blocks = (q_BxTxHxE.astype(dt).reshape(B, T, K, G, 1, E) * eye_KxK.reshape(1, 1, K, 1, K, 1))
  q_BxNxC = q_blocks.reshape(B, T * H, K * E)                                   # N = T*H, C = K*E
  scores = jnp.einsum("bnc,bsc->bns", q_BxNxC, k_BxSxKxE.reshape(B, S, K * E),
                      preferred_element_type=jnp.float32) / math.sqrt(E)
  scores = softcap_scores(scores.reshape(B, T, H, S), softcap)
  scores = jnp.where(mask_BxTxS[:, :, None, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).reshape(B, T * H, S)
  o = jnp.einsum("bns,bsc->bnc", probs.astype(dt), v_BxSxKxE.reshape(B, S, K * E),
                 preferred_element_type=jnp.float32)
  o = jnp.einsum("btkgje,kj->btkge", o.reshape(B, T, K, G, K, E), eye_KxK.astype(o.dtype))
  return o.reshape(B, T, H, E).astype(q_BxTxHxE.dtype)


def write_slots(buf_LxBxSxKxE, layer, new_BxTxKxE, lengths_B, offsets_BxT=None):
  """Write T new entries per sequence at slots lengths[b] + offsets[b, t] (default t; out-of-range writes are
  dropped)."""
  B, T = new_BxTxKxE.shape[:2]
  b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  offsets = jnp.arange(T)[None, :] if offsets_BxT is None else offsets_BxT
  s_idx = lengths_B[:, None] + offsets
  return buf_LxBxSxKxE.at[layer, b_idx, s_idx].set(new_BxTxKxE.astype(buf_LxBxSxKxE.dtype), mode="drop")
