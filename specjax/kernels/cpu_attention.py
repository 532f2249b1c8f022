"""A native CPU kernel for the attention of a decode or verification step over the KV cache.

``attend_cache`` computes, for T ≤ ``dispatch.ATTENTION_NATIVE_MAX_ROWS`` new query rows per sequence, grouped-query attention over
each sequence's live cache slots of one layer: committed slots ``j < lengths[b]`` and the slots
``lengths[b] + u`` (u < U) of the region after them that ``mask[b, t, u]`` allows — causal for plain decoding,
a token tree's ancestor mask for verification (the mask says it all; there is no implicit causal rule).  It
reads the cache buffer [L, B, S, K, E] in place, so no window is sliced or copied.  ``attend_cache_reference``
is the same computation in plain XLA; the kernel is ``cpu_attention.cc`` (built by ``native.py``), used only
on the CPU for float32, with gradients through the reference.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.kernels import dispatch, native

TARGET = "specjax_attend_cache"


def visible_slots(lengths_B: jax.Array, mask_BxTxU: jax.Array, S: int, lo_BxT: jax.Array | None = None) -> jax.Array:
  """[B, T, S] bool: committed slots, plus the region slots lengths + u that the mask allows (and, for a
  windowed layer, none before ``lo[b, t]``)."""
  B, T, U = mask_BxTxU.shape
  rel_BxTxS = jnp.broadcast_to(jnp.arange(S)[None, None, :] - lengths_B[:, None, None], (B, T, S))
  region = jnp.take_along_axis(mask_BxTxU, jnp.clip(rel_BxTxS, 0, U - 1), axis=2)
  seen = (rel_BxTxS < 0) | ((rel_BxTxS < U) & region)
  return seen if lo_BxT is None else seen & (jnp.arange(S)[None, None, :] >= lo_BxT[:, :, None])


def causal_mask(B: int, T: int) -> jax.Array:
  """[B, T, T]: new row t sees new slots u <= t (plain decoding, a chain of drafts, prefill)."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))


def attend_cache_reference(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, live=None,
                           lo_BxT=None):
  """Plain-XLA reference: [B, T, H, E] (rows t ≥ ``live`` zero; slots before ``lo`` unseen)."""
  B, T, H, E = q_BxTxHxE.shape
  S, K = k_LxBxSxKxE.shape[2], k_LxBxSxKxE.shape[3]
  k, v = k_LxBxSxKxE[layer], v_LxBxSxKxE[layer]
  q = q_BxTxHxE.reshape(B, T, K, H // K, E)
  scores = jnp.einsum("btkge,bske->btkgs", q, k) / math.sqrt(E)
  visible = visible_slots(lengths_B, mask_BxTxU, S, lo_BxT)[:, :, None, None, :]
  scores = jnp.where(visible, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(visible, probs, 0.0)
  out = jnp.einsum("btkgs,bske->btkge", probs, v).reshape(B, T, H, E)
  if live is not None:   # one count for every sequence, or one per sequence [B]
    live_B = jnp.broadcast_to(jnp.asarray(live), (B,))
    out = jnp.where((jnp.arange(T)[None, :] < live_B[:, None])[:, :, None, None], out, 0.0)
  return out


@jax.custom_vjp
def _native(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, live, lo_BxT):
  native.require()
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_BxTxHxE.shape, jnp.float32))(
      q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, jnp.asarray(layer, jnp.int32), lengths_B.astype(jnp.int32),
      mask_BxTxU.astype(bool), jnp.asarray(live, jnp.int32), lo_BxT.astype(jnp.int32))


def _fwd(q, k, v, layer, lengths, mask, live, lo):
  return _native(q, k, v, layer, lengths, mask, live, lo), (q, k, v, layer, lengths, mask, live, lo)


def _bwd(res, d_out):
  q, k, v, layer, lengths, mask, live, lo = res
  _, vjp = jax.vjp(lambda q, k, v: attend_cache_reference(q, k, v, layer, lengths, mask, live, lo), q, k, v)
  return (*vjp(d_out), None, None, None, None, None)


_native.defvjp(_fwd, _bwd)


def attend_cache_native(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, live=None,
                        lo_BxT=None):
  """The C++ kernel.  ``live`` (a traced count, or one per sequence [B]; default T): only the first ``live``
  new rows of each sequence are computed, the others come out zero at no cost (padded draft slots, finished
  sequences).  ``lo_BxT`` (a windowed layer): each query's first visible slot; earlier slots are not read."""
  B, T = q_BxTxHxE.shape[:2]
  live = T if live is None else live
  lo_BxT = jnp.zeros((B, T), jnp.int32) if lo_BxT is None else lo_BxT
  return _native(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, live, lo_BxT)


def attend_cache(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, live=None, backends=None,
                 lo_BxT=None):
  """The native kernel when it applies (``backends``: None resolves them now, for one device), else the
  reference."""
  backends = backends or dispatch.resolve()
  if dispatch.native_attention_applies(backends, q_BxTxHxE.shape[1], q_BxTxHxE.dtype, k_LxBxSxKxE.dtype):
    return attend_cache_native(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, live, lo_BxT)
  return attend_cache_reference(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, live,
                                lo_BxT)
