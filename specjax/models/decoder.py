"""A Llama-family decoder as pure functions of a parameter pytree (its layout: ``specjax.models.params``),
with what each model family changes (``ModelConfig``'s family fields: q/k norms, Gemma's sandwich norms and
GeGLU, embedding and query scales, soft-caps, per-layer sliding windows and a local rope).

RoPE uses the rotate-half convention (Hugging Face layout; GGUF loaders undo llama.cpp's permutation).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.kernels import pallas as pallas_kernels
from specjax.models.config import ModelConfig
from specjax.kernels import cpu_attention, cpu_matmul, cpu_qmatmul, dispatch
from specjax.models import quant
from specjax.parallel import sharding
from specjax.models.kv_cache import KVCache
from specjax.models import attention
from specjax.models.attention import MASK_VALUE
from specjax.models.rope import apply_rope, has_local_rope, rope_tables

from specjax.models.params import (  # noqa: F401  (the parameter functions, also reachable from here)
    Params, cast_params, family_tensor_names, init_params, param_bytes, params_from_hf_layout, stack_layers,
    unstack_layers)


class ForwardOutput(NamedTuple):
  logits: jax.Array   # [B, T, V] float32
  hidden: jax.Array   # [B, T, D] final hidden states (after the final norm)
  cache: KVCache      # k/v written at lengths..lengths+T-1; lengths advanced by T
  features: jax.Array | None = None   # [B, T, F] with ``feature_layers``: what a feature drafter reads


# ----------------------------------------------------------------------------------------------------------
# Building blocks


def backends_of(cfg: ModelConfig) -> dispatch.Backends:
  """The backends ``cfg`` was loaded with; a config built by hand resolves them now, on the mesh of
  ``sharding.use`` (None: one device)."""
  return cfg.backends if cfg.backends is not None else dispatch.resolve(sharding.current())


def linear(x_BxTxD: jax.Array, w_NxD, live_T=None, backends: dispatch.Backends | None = None) -> jax.Array:
  """x · wᵀ for a weight stored [out, in] (an array or a ``quant.QWeight``): the native CPU kernel for
  decode-sized inputs (where ``backends`` allow it), else XLA.  ``live_T`` (traced): only the first live_T
  tokens of each sequence matter; the rest come out zero."""
  B, T, D = x_BxTxD.shape
  backends = backends or dispatch.resolve(sharding.current())
  matmul = cpu_qmatmul.qmatmul_t if quant.is_quantized(w_NxD) else cpu_matmul.matmul_t
  return matmul(x_BxTxD.reshape(B * T, D), w_NxD, live_T, T, backends).reshape(B, T, w_NxD.shape[0])


def row_sum(x_BxTxD: jax.Array) -> jax.Array:
  """Σ over the last axis, [..., 1], in a fixed pairwise order made of elementwise adds only (zero-padded to a
  power of two, then halves added until one is left).  XLA:CPU reduces a row in a different order when it
  reduces 8 or more rows at once, so ``jnp.sum``/``jnp.mean`` gave a verification's rows other bits than the
  same rows decoded one at a time (RMSNorm: 5e-7); elementwise adds do not depend on how many rows run beside
  them, so plain decoding, verification and a batch give a row the same bits (what integer activations need,
  whose rounding turns a last-bit difference into a visible one)."""
  D = x_BxTxD.shape[-1]
  x = jnp.pad(x_BxTxD, [(0, 0)] * (x_BxTxD.ndim - 1) + [(0, (1 << max(D - 1, 0).bit_length()) - D)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  x = x_BxTxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(row_sum(x * x) / x.shape[-1] + eps)
  return (x * scale_D.astype(jnp.float32)).astype(x_BxTxD.dtype)




# ----------------------------------------------------------------------------------------------------------
# The forward


class ForwardOptions(NamedTuple):
  """The optional per-call inputs of ``forward``: its keyword arguments, same names, same meanings.

  extra_mask_BxTxT: extra visibility among the new tokens (True = may attend), and'ed with causal.
  region_mask_BxTxU: instead of causal & extra, the visibility of the U slots lengths[b] + u after the
    committed ones (a token tree: the ancestors of each new node, written earlier or in this call).
  slots_BxT: where the new entries go, as offsets u from lengths[b] (default t); with a region mask a drafter
    extending a tree writes each frontier node at its node's slot.
  kv_window: static number of leading cache slots attention reads (must cover max(lengths) + T, or + U with a
    region mask); ``None`` reads the whole buffer.  Lets a caller skip empty slots at the end of the buffer.
  kv_buckets: static window sizes; each layer's attention reads the smallest one covering max(lengths) + T (a
    ``lax.switch``: every bucket compiled once, chosen by data), so a step at a short context does not pay
    for the empty end of a long buffer and nothing recompiles as sequences grow.
  live_T: traced count ≤ T, or one count per sequence [B]: only each sequence's first live_T new tokens
    matter (a verification whose later draft slots are empty this step; 0 for a finished sequence).  The
    native CPU kernels skip the others, so the step costs what live_T tokens cost; their logits are zero (XLA
    paths compute and zero them) and their KV entries, written past the committed length, are garbage that
    later steps overwrite.
  head_index_B: compute logits only at this new-token index per sequence (prefill wants just the last prompt
    position): logits and hidden are then [B, 1, ...]; or at J indices per sequence ([B, J]: a parallel
    drafter's draft rows), [B, J, ...].
  feature_layers: static; also return ``features`` [B, T, F] for every new token (before ``head_index_B``
    picks one): ``()`` = the final hidden state (after the final norm, F = D: EAGLE's feature); layer indices
    = the residual stream after each of those layers, concatenated (F = D x count: EAGLE-3's fused low,
    middle and high features).
  inputs_embeds_BxTxD: the first layer's input instead of the tokens' embeddings (a feature drafter's
    projection of [embedding; feature]); ``tokens_BxT`` then only gives the shape.
  attn_prefix_BxTxD: placed before the (normed) residual stream as every layer's attention input, whose q/k/v
    then read [prefix ; norm(x)] (width 2D): EAGLE-3's layer, the prefix its normed token embedding.
  """
  extra_mask_BxTxT: jax.Array | None = None
  region_mask_BxTxU: jax.Array | None = None
  slots_BxT: jax.Array | None = None
  kv_window: int | None = None
  kv_buckets: tuple[int, ...] | None = None
  live_T: jax.Array | None = None
  head_index_B: jax.Array | None = None
  feature_layers: tuple[int, ...] | None = None
  inputs_embeds_BxTxD: jax.Array | None = None
  attn_prefix_BxTxD: jax.Array | None = None


def forward(params: Params, cfg: ModelConfig, tokens_BxT: jax.Array, positions_BxT: jax.Array,
            cache: KVCache, extra_mask_BxTxT: jax.Array | None = None,
            kv_window: int | None = None, head_index_B: jax.Array | None = None,
            kv_buckets: tuple[int, ...] | None = None, live_T: jax.Array | None = None,
            region_mask_BxTxU: jax.Array | None = None, slots_BxT: jax.Array | None = None,
            feature_layers: tuple[int, ...] | None = None,
            inputs_embeds_BxTxD: jax.Array | None = None,
            attn_prefix_BxTxD: jax.Array | None = None) -> ForwardOutput:
  """Run T new tokens per sequence through the model on top of the cache.

  ``tokens_BxT``: token ids; ``positions_BxT``: their RoPE positions (usually lengths[b] + t; tree nodes use
  their depth); ``cache``: the KV cache, the new entries written at slots lengths[b] + t.  The optional
  keywords are ``ForwardOptions``' fields (documented there).
  Returns ForwardOutput(logits [B,T,V] fp32, hidden [B,T,D], cache with lengths += T, features or None).
  """
  opts = ForwardOptions(extra_mask_BxTxT=extra_mask_BxTxT, region_mask_BxTxU=region_mask_BxTxU,
                        slots_BxT=slots_BxT, kv_window=kv_window, kv_buckets=kv_buckets, live_T=live_T,
                        head_index_B=head_index_B, feature_layers=feature_layers,
                        inputs_embeds_BxTxD=inputs_embeds_BxTxD, attn_prefix_BxTxD=attn_prefix_BxTxD)
  B, T = tokens_BxT.shape
  taps = _checked_taps(cfg, feature_layers)
  dtype = quant.activation_dtype(params)
  x_BxTxD = _embed(params, tokens_BxT, inputs_embeds_BxTxD, dtype, cfg.embed_scale)
  ctx = _layer_context(cfg, B, T, positions_BxT, cache, opts, dtype)
  (x_BxTxD, k_all, v_all), tapped = _run_layers(params, ctx, (x_BxTxD, cache.k, cache.v), taps)
  features = _features(params, cfg, x_BxTxD, tapped, feature_layers)
  hidden_BxJxD, logits_BxJxV = _final_head(params, ctx, x_BxTxD, head_index_B)
  return ForwardOutput(logits_BxJxV, hidden_BxJxD, KVCache(k=k_all, v=v_all, lengths=cache.lengths + T),
                       features)


class _LayerContext(NamedTuple):
  """What every layer of one ``forward`` call shares (built once, before the layers, by ``_layer_context``)."""
  cfg: ModelConfig
  backends: dispatch.Backends
  dtype: Any                    # the activation dtype
  B: int
  T: int
  lengths_B: jax.Array          # the committed lengths before this call
  positions_BxT: jax.Array      # the new tokens' positions (a windowed layer's first visible slot follows them)
  cos_BxTxR: jax.Array          # RoPE tables of the new tokens' positions (R = E/2)
  sin_BxTxR: jax.Array
  local_cos_BxTxR: jax.Array | None   # the windowed layers' own tables (Gemma 3), else None
  local_sin_BxTxR: jax.Array | None
  region_BxTxU: jax.Array       # visibility of the slots after the committed ones
  mask_BxTxW: jax.Array         # visibility of the W window slots (XLA attention)
  windows: list[int]            # the KV window buckets, ascending; the last is W
  bucket: jax.Array             # int32 index into ``windows``: the smallest covering max(lengths) + U
  attention_path: str           # "native", "pallas" or "xla" (``dispatch.attention``)
  live_T: jax.Array | None
  slots_BxT: jax.Array | None
  attn_prefix_BxTxD: jax.Array | None   # EAGLE-3's attention input prefix (``ForwardOptions``)


def _checked_taps(cfg: ModelConfig, feature_layers: tuple[int, ...] | None) -> tuple[int, ...]:
  """The layer indices whose outputs ``forward`` keeps (``()`` without ``feature_layers`` or with ``()``)."""
  taps = tuple(feature_layers or ())
  if any(not 0 <= i < cfg.num_layers for i in taps):
    raise ValueError(f"feature_layers {taps} outside the model's {cfg.num_layers} layers")
  return taps


def _embed(params: Params, tokens_BxT: jax.Array, inputs_embeds_BxTxD: jax.Array | None, dtype,
           embed_scale: float = 1.0) -> jax.Array:
  """The first layer's input [B, T, D]: the tokens' embeddings (times the family's scale), or the given
  inputs."""
  if inputs_embeds_BxTxD is None:
    x_BxTxD = quant.embed_rows(params["embed"], tokens_BxT, dtype)
    return x_BxTxD if embed_scale == 1.0 else x_BxTxD * jnp.asarray(embed_scale, dtype)
  return inputs_embeds_BxTxD.astype(dtype)


def _kv_windows(S: int, kv_window: int | None, kv_buckets: tuple[int, ...] | None) -> list[int]:
  """The window sizes attention may read, ascending, each ≤ W (the last, ``kv_window`` capped at S)."""
  W = S if kv_window is None else min(int(kv_window), S)
  return sorted({min(int(b), W) for b in kv_buckets} | {W}) if kv_buckets else [W]


def _layer_context(cfg: ModelConfig, B: int, T: int, positions_BxT: jax.Array, cache: KVCache,
                   opts: ForwardOptions, dtype) -> _LayerContext:
  """The RoPE tables, the masks, the window bucket and the attention backend of one call."""
  lengths_B = cache.lengths
  windows = _kv_windows(cache.max_len, opts.kv_window, opts.kv_buckets)
  cos_BxTxR, sin_BxTxR = rope_tables(cfg, positions_BxT)
  local_cos, local_sin = rope_tables(cfg, positions_BxT, local=True) if has_local_rope(cfg) else (None, None)
  # Mask over the window: new slots are written in the region lengths..lengths+U-1 (< W by the caller's contract).
  region_BxTxU = attention.region_mask(B, T, opts.extra_mask_BxTxT, opts.region_mask_BxTxU)
  U = region_BxTxU.shape[2]
  mask_BxTxW = cpu_attention.visible_slots(lengths_B, region_BxTxU, windows[-1])
  bucket = jnp.sum(jnp.asarray(windows[:-1], jnp.int32) < jnp.max(lengths_B) + U).astype(jnp.int32)
  backends = backends_of(cfg)
  path = dispatch.attention(backends, T, dtype, cache.k.dtype, softcap=cfg.attn_softcap is not None)
  return _LayerContext(cfg=cfg, backends=backends, dtype=dtype, B=B, T=T, lengths_B=lengths_B,
                       positions_BxT=positions_BxT, cos_BxTxR=cos_BxTxR, sin_BxTxR=sin_BxTxR,
                       local_cos_BxTxR=local_cos, local_sin_BxTxR=local_sin, region_BxTxU=region_BxTxU,
                       mask_BxTxW=mask_BxTxW, windows=windows, bucket=bucket, attention_path=path,
                       live_T=opts.live_T, slots_BxT=opts.slots_BxT,
                       attn_prefix_BxTxD=None if opts.attn_prefix_BxTxD is None
                       else opts.attn_prefix_BxTxD.astype(dtype))


def _window(ctx: _LayerContext, layer) -> int | jax.Array:
  """Layer ``layer``'s attention window (0: global): a Python int for an unrolled layer, traced in the scan."""
  cfg = ctx.cfg
  if not cfg.windowed or isinstance(layer, int):
    return cfg.window(layer) if cfg.windowed else 0
  return jnp.asarray(cfg.layer_windows, jnp.int32)[layer]


def _first_visible(ctx: _LayerContext, W) -> jax.Array | None:
  """lo [B, T]: the first slot each new query may see under window W (committed slot j holds position j, so
  the last W positions up to the query's own are the slots > position - W), and from ``cfg.first_slot`` on;
  None when neither applies."""
  if isinstance(W, int):
    lo = None if W == 0 else ctx.positions_BxT - (W - 1)
  else:
    lo = jnp.where(W > 0, ctx.positions_BxT - (W - 1), 0)
  if ctx.cfg.first_slot:              # a published EAGLE drafter: slot 0 unseen but by the first token itself
    first = jnp.minimum(ctx.cfg.first_slot, ctx.positions_BxT)
    lo = first if lo is None else jnp.maximum(lo, first)
  return lo


def _attend_cache(ctx: _LayerContext, q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer) -> jax.Array:
  """One layer's attention of the new queries over the cache (already holding their k, v) on the call's
  backend: the native CPU kernel, Pallas tree attention, or XLA over the window bucket (a windowed layer:
  over its window's W + U - 1 slots).  [B, T, H, E]."""
  W = _window(ctx, layer)
  lo_BxT = _first_visible(ctx, W)
  softcap = ctx.cfg.attn_softcap
  # Both kernels read each sequence's live slots (from lo on) straight from the buffer: no window needed.
  if ctx.attention_path == "native":
    return cpu_attention.attend_cache_native(q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer,
                                             ctx.lengths_B, ctx.region_BxTxU, ctx.live_T, lo_BxT)
  if ctx.attention_path == "pallas":
    if ctx.backends.distributed:   # a custom call GSPMD cannot split: each device runs it on its shard
      return sharding.attention_per_shard(pallas_kernels.tree_attention, ctx.backends.mesh, q_BxTxHxE,
                                          k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer, ctx.lengths_B,
                                          ctx.region_BxTxU, lo_BxT, softcap)
    return pallas_kernels.tree_attention(q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer, ctx.lengths_B,
                                         ctx.region_BxTxU, lo_BxT, softcap=softcap)
  U = ctx.region_BxTxU.shape[2]
  if isinstance(W, int) and 0 < W and W + U - 1 < ctx.windows[-1]:
    return _attend_window(ctx, q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer, W, lo_BxT)

  def over(w):
    def attend_w(q, k_all, v_all):
      mask = ctx.mask_BxTxW[:, :, :w]
      if lo_BxT is not None:
        mask = mask & (jnp.arange(w)[None, None, :] >= lo_BxT[:, :, None])
      return attention.attend(q, k_all[layer, :, :w].astype(ctx.dtype), v_all[layer, :, :w].astype(ctx.dtype),
                              mask, softcap)
    return attend_w
  if len(ctx.windows) == 1:
    return over(ctx.windows[0])(q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE)
  return jax.lax.switch(ctx.bucket, [over(w) for w in ctx.windows], q_BxTxHxE, k_all_LxBxSxKxE,
                        v_all_LxBxSxKxE)


def _attend_window(ctx: _LayerContext, q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer: int, W: int,
                   lo_BxT) -> jax.Array:
  """XLA attention of a windowed layer over only the N = W + U - 1 slots its queries can see, [lengths - W + 1,
  lengths + U) per sequence, gathered from the buffer: the work does not grow with the context."""
  U, S = ctx.region_BxTxU.shape[2], k_all_LxBxSxKxE.shape[2]
  N = W + U - 1
  start_B = jnp.clip(ctx.lengths_B - (W - 1), 0, S - N)
  slots_BxN = start_B[:, None] + jnp.arange(N)[None, :]
  k_BxNxKxE = jnp.take_along_axis(k_all_LxBxSxKxE[layer], slots_BxN[:, :, None, None], axis=1)
  v_BxNxKxE = jnp.take_along_axis(v_all_LxBxSxKxE[layer], slots_BxN[:, :, None, None], axis=1)
  mask_BxTxN = attention.visible_at(ctx.lengths_B, ctx.region_BxTxU, slots_BxN, lo_BxT)
  return attention.attend(q_BxTxHxE, k_BxNxKxE.astype(ctx.dtype), v_BxNxKxE.astype(ctx.dtype), mask_BxTxN,
                          ctx.cfg.attn_softcap)


def _rope_of(ctx: _LayerContext, layer) -> tuple[jax.Array, jax.Array]:
  """The RoPE tables layer ``layer`` uses: the windowed layers' own where the family has them."""
  if ctx.local_cos_BxTxR is None:
    return ctx.cos_BxTxR, ctx.sin_BxTxR
  W = _window(ctx, layer)
  if isinstance(W, int):
    return (ctx.local_cos_BxTxR, ctx.local_sin_BxTxR) if W else (ctx.cos_BxTxR, ctx.sin_BxTxR)
  return (jnp.where(W > 0, ctx.local_cos_BxTxR, ctx.cos_BxTxR),
          jnp.where(W > 0, ctx.local_sin_BxTxR, ctx.sin_BxTxR))


def _project_qkv(ctx: _LayerContext, lp: Params, x_BxTxD: jax.Array, layer):
  """The attention norm, the fused q/k/v projection (+ bias), the family's q/k norms and RoPE on q and k:
  q [B,T,H,E] (scaled so that attention's 1/sqrt(E) gives the family's query scale), k, v [B,T,K,E]."""
  cfg = ctx.cfg
  B, T, H, K, E = ctx.B, ctx.T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  h_BxTxD = rms_norm(x_BxTxD, lp["attn_norm"], cfg.norm_eps) if cfg.input_norm else x_BxTxD
  if ctx.attn_prefix_BxTxD is not None:                 # EAGLE-3: q/k/v over [normed embedding ; normed hidden]
    h_BxTxD = jnp.concatenate([ctx.attn_prefix_BxTxD, h_BxTxD], axis=-1)
  qkv = linear(h_BxTxD, lp["w_qkv"], ctx.live_T, ctx.backends)
  if cfg.qkv_bias:
    qkv = qkv + lp["b_qkv"]
  q, k, v = jnp.split(qkv, [H * E, (H + K) * E], axis=-1)
  q_BxTxHxE, k_BxTxKxE = q.reshape(B, T, H, E), k.reshape(B, T, K, E)
  if cfg.qk_norm:
    q_BxTxHxE = rms_norm(q_BxTxHxE, lp["q_norm"], cfg.norm_eps)
    k_BxTxKxE = rms_norm(k_BxTxKxE, lp["k_norm"], cfg.norm_eps)
  cos_BxTxR, sin_BxTxR = _rope_of(ctx, layer)
  q_BxTxHxE = apply_rope(q_BxTxHxE, cos_BxTxR, sin_BxTxR)
  k_BxTxKxE = apply_rope(k_BxTxKxE, cos_BxTxR, sin_BxTxR)
  if cfg.query_scale is not None:
    q_BxTxHxE = q_BxTxHxE * jnp.asarray(cfg.query_scale * math.sqrt(E), q_BxTxHxE.dtype)
  return q_BxTxHxE, k_BxTxKxE, v.reshape(B, T, K, E)


def _attention_block(ctx: _LayerContext, lp: Params, x_BxTxD, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer):
  """One layer's attention with its residual: q/k/v, the new k, v written into the cache, attention, the
  output projection.  Returns (x [B,T,D], k_all, v_all)."""
  q_BxTxHxE, k_BxTxKxE, v_BxTxKxE = _project_qkv(ctx, lp, x_BxTxD, layer)
  k_all_LxBxSxKxE = attention.write_slots(k_all_LxBxSxKxE, layer, k_BxTxKxE, ctx.lengths_B, ctx.slots_BxT)
  v_all_LxBxSxKxE = attention.write_slots(v_all_LxBxSxKxE, layer, v_BxTxKxE, ctx.lengths_B, ctx.slots_BxT)
  o_BxTxHxE = _attend_cache(ctx, q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer)
  HE = ctx.cfg.num_heads * ctx.cfg.head_dim
  out_BxTxD = linear(o_BxTxHxE.reshape(ctx.B, ctx.T, HE), lp["wo"], ctx.live_T, ctx.backends)
  if ctx.cfg.sandwich_norms:
    out_BxTxD = rms_norm(out_BxTxD, lp["post_attn_norm"], ctx.cfg.norm_eps)
  return x_BxTxD + out_BxTxD, k_all_LxBxSxKxE, v_all_LxBxSxKxE


def gate(cfg: ModelConfig, gate_BxTxF: jax.Array) -> jax.Array:
  """The gated MLP's activation: silu (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""
  return jax.nn.silu(gate_BxTxF) if cfg.activation == "silu" else jax.nn.gelu(gate_BxTxF, approximate=True)


def _mlp_block(ctx: _LayerContext, lp: Params, x_BxTxD: jax.Array) -> jax.Array:
  """One layer's gated MLP with its residual: norm → gate/up → act(gate)·up → down (→ Gemma's post norm)."""
  cfg = ctx.cfg
  h_BxTxD = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.norm_eps)
  gate_BxTxF, up_BxTxF = jnp.split(linear(h_BxTxD, lp["w_gate_up"], ctx.live_T, ctx.backends), 2, axis=-1)
  out_BxTxD = linear(gate(cfg, gate_BxTxF) * up_BxTxF, lp["w_down"], ctx.live_T, ctx.backends)
  if cfg.sandwich_norms:
    out_BxTxD = rms_norm(out_BxTxD, lp["post_mlp_norm"], cfg.norm_eps)
  return x_BxTxD + out_BxTxD


def _run_layers(params: Params, ctx: _LayerContext, carry, taps: tuple[int, ...]):
  """Every decoder layer over carry = (x [B,T,D], k_all, v_all): a Python loop over the unstacked layout (see
  ``unstack_layers``), else a ``lax.scan`` over the stacked weights.  Returns (carry, the residual stream
  after each layer in ``taps``)."""
  def layer_fn(carry, layer_in):
    x_BxTxD, k_all, v_all = carry
    lp, layer = layer_in
    x_BxTxD, k_all, v_all = _attention_block(ctx, lp, x_BxTxD, k_all, v_all, layer)
    x_BxTxD = _mlp_block(ctx, lp, x_BxTxD)
    return (x_BxTxD, k_all, v_all), x_BxTxD if taps else None

  if isinstance(params["layers"], (list, tuple)):
    outs = []
    for layer, lp in enumerate(params["layers"]):
      carry, y = layer_fn(carry, (lp, layer))
      outs.append(y)
    return carry, [outs[i] for i in taps]
  carry, ys = jax.lax.scan(layer_fn, carry, (params["layers"], jnp.arange(ctx.cfg.num_layers)))
  return carry, [ys[i] for i in taps]


def _features(params: Params, cfg: ModelConfig, x_BxTxD: jax.Array, tapped: list[jax.Array],
              feature_layers: tuple[int, ...] | None) -> jax.Array | None:
  """What ``feature_layers`` asks for, [B, T, F]: the tapped layers' outputs concatenated, or with ``()`` the
  final hidden state; None without it."""
  if feature_layers is None:
    return None
  if tapped:                           # layer indices: their residual streams side by side
    return jnp.concatenate(tapped, axis=-1)
  return rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps) if cfg.final_norm else x_BxTxD


def _final_head(params: Params, ctx: _LayerContext, x_BxTxD: jax.Array, head_index_B: jax.Array | None):
  """The rows ``head_index_B`` picks (all without it), the final norm and the head: (hidden [B,J,D], logits
  [B,J,V] fp32)."""
  if head_index_B is not None:         # one row per sequence [B], or several [B, J]
    rows_BxJ = head_index_B if head_index_B.ndim == 2 else head_index_B[:, None]
    x_BxTxD = jnp.take_along_axis(x_BxTxD, rows_BxJ[:, :, None], axis=1)
  hidden_BxJxD = rms_norm(x_BxTxD, params["final_norm"], ctx.cfg.norm_eps) if ctx.cfg.final_norm else x_BxTxD
  logits_BxJxV = lm_head(params, ctx.cfg, hidden_BxJxD, None if head_index_B is not None else ctx.live_T,
                         ctx.backends)
  return hidden_BxJxD, logits_BxJxV


def scatter_to_vocab(logits_BxTxVr: jax.Array, head_ids_Vr: jax.Array, vocab_size: int) -> jax.Array:
  """Logits of a reduced head (rows ``head_ids``) over the full vocabulary: every other token at
  ``MASK_VALUE``, so its probability after softmax is exactly 0 (drafters with a reduced vocabulary)."""
  full = jnp.full(logits_BxTxVr.shape[:-1] + (vocab_size,), MASK_VALUE, jnp.float32)
  return full.at[..., head_ids_Vr].set(logits_BxTxVr.astype(jnp.float32))


def lm_head(params: Params, cfg: ModelConfig, hidden_BxTxD: jax.Array, live_T=None, backends=None) -> jax.Array:
  """Logits [B, T, V] fp32 (soft-capped c·tanh(logits / c) where the family caps them)."""
  head_VxD = params["embed"] if cfg.tie_embeddings else params["lm_head"]
  logits = linear(hidden_BxTxD, head_VxD, live_T, backends or backends_of(cfg)).astype(jnp.float32)
  if cfg.final_softcap is not None:
    logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
  return logits
