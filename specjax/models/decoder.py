"""A Llama-family decoder as pure functions of a parameter pytree.

Parameters (layers stacked on a leading axis L and run with ``lax.scan``):
  embed        [V, D]
  final_norm   [D]
  lm_head      [V, D]            only when the embeddings are not tied
  layers:
    attn_norm  [L, D]
    w_qkv      [L, (H+2K)*E, D]   q, k and v projections stacked   (b_qkv [L, (H+2K)*E] with qkv_bias)
    wo         [L, D, H*E]
    mlp_norm   [L, D]
    w_gate_up  [L, 2F, D]         gate and up projections stacked
    w_down     [L, D, F]
Matrices are stored [out, in] (the PyTorch / GGUF orientation): on XLA:CPU a batch-1 matrix-vector product
streams that layout faster than [in, out].
Fusing q/k/v and gate/up makes one larger matrix-vector product instead of several small ones, which is what
a bandwidth-bound decode step wants; ``params_from_hf_layout`` builds this layout from the usual separate
matrices (what checkpoints store).

RoPE uses the rotate-half convention (Hugging Face layout; GGUF loaders undo llama.cpp's permutation).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import pallas as pallas_kernels
from specjax.models.config import ModelConfig
from specjax.kernels import cpu_attention, cpu_matmul, cpu_qmatmul, dispatch
from specjax.models import quant
from specjax.parallel import sharding
from specjax.models.kv_cache import KVCache
from specjax.models import attention
from specjax.models.attention import MASK_VALUE
from specjax.models.rope import apply_rope, rope_tables

Params = dict[str, Any]


class ForwardOutput(NamedTuple):
  logits: jax.Array   # [B, T, V] float32
  hidden: jax.Array   # [B, T, D] final hidden states (after the final norm)
  cache: KVCache      # k/v written at lengths..lengths+T-1; lengths advanced by T
  features: jax.Array | None = None   # [B, T, F] with ``feature_layers``: what a feature drafter reads


# ----------------------------------------------------------------------------------------------------------
# Parameters


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
  """Random parameters (for tests and for training a draft model from scratch)."""
  D, H, K, E, F, V, L = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim,
                         cfg.vocab_size, cfg.num_layers)
  keys = iter(jax.random.split(key, 12))

  def dense(shape, fan_in):
    return (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

  layers = {
      "attn_norm": jnp.ones((L, D), dtype),
      "w_qkv": dense((L, (H + 2 * K) * E, D), D),
      "wo": dense((L, D, H * E), H * E),
      "mlp_norm": jnp.ones((L, D), dtype),
      "w_gate_up": dense((L, 2 * F, D), D),
      "w_down": dense((L, D, F), F),
  }
  if cfg.qkv_bias:
    layers["b_qkv"] = dense((L, (H + 2 * K) * E), 1) * 0.1
  # The embedding at std 1/sqrt(D), like the head it doubles as when tied: logits of order 1.  (At std 1 a
  # tied head gives logits of order sqrt(D) and the token's own embedding dominates the residual stream, so
  # a random model repeats one token whatever the prompt: useless for testing, greedy or sampled.)
  params = {"embed": dense((V, D), D), "final_norm": jnp.ones((D,), dtype), "layers": layers}
  if not cfg.tie_embeddings:
    params["lm_head"] = dense((V, D), D)
  return params


def params_from_hf_layout(cfg: ModelConfig, embed, final_norm, layers: list[dict[str, Any]],
                          lm_head=None, dtype=jnp.float32) -> Params:
  """Assemble specjax parameters from per-layer matrices in Hugging Face naming and orientation.

  Each entry of ``layers`` holds numpy arrays ``q_proj [H*E, D]``, ``k_proj``/``v_proj [K*E, D]``,
  ``o_proj [D, H*E]``, ``gate_proj``/``up_proj [F, D]``, ``down_proj [D, F]``, ``input_layernorm [D]``,
  ``post_attention_layernorm [D]`` and, with ``cfg.qkv_bias``, ``q_bias``/``k_bias``/``v_bias``.
  ``embed`` is [V, D]; ``lm_head`` [V, D] or None when tied.  Shapes are checked against ``cfg``.
  """
  D, H, K, E, F, V = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim,
                      cfg.vocab_size)
  expected = {"q_proj": (H * E, D), "k_proj": (K * E, D), "v_proj": (K * E, D), "o_proj": (D, H * E),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F), "input_layernorm": (D,),
              "post_attention_layernorm": (D,)}
  if cfg.qkv_bias:
    expected.update(q_bias=(H * E,), k_bias=(K * E,), v_bias=(K * E,))
  if len(layers) != cfg.num_layers:
    raise ValueError(f"checkpoint has {len(layers)} layers but the config says {cfg.num_layers}")
  for i, layer in enumerate(layers):
    for name, shape in expected.items():
      if name not in layer:
        raise ValueError(f"layer {i} is missing tensor '{name}'")
      if tuple(np.shape(layer[name])) != shape:
        raise ValueError(f"layer {i} tensor '{name}' has shape {tuple(np.shape(layer[name]))}, "
                         f"expected {shape} for config '{cfg.name}'")
  if tuple(np.shape(embed)) != (V, D):
    raise ValueError(f"embedding has shape {tuple(np.shape(embed))}, expected {(V, D)}")

  def stack(fn):
    return jnp.asarray(np.stack([fn(layer) for layer in layers]), dtype)

  stacked = {
      "attn_norm": stack(lambda l: l["input_layernorm"]),
      "w_qkv": stack(lambda l: np.concatenate([l["q_proj"], l["k_proj"], l["v_proj"]], axis=0)),
      "wo": stack(lambda l: l["o_proj"]),
      "mlp_norm": stack(lambda l: l["post_attention_layernorm"]),
      "w_gate_up": stack(lambda l: np.concatenate([l["gate_proj"], l["up_proj"]], axis=0)),
      "w_down": stack(lambda l: l["down_proj"]),
  }
  if cfg.qkv_bias:
    stacked["b_qkv"] = stack(lambda l: np.concatenate([l["q_bias"], l["k_bias"], l["v_bias"]]))
  params = {"embed": jnp.asarray(embed, dtype), "final_norm": jnp.asarray(final_norm, dtype),
            "layers": stacked}
  if not cfg.tie_embeddings:
    if lm_head is None:
      raise ValueError("config has untied embeddings but the checkpoint has no lm_head")
    params["lm_head"] = jnp.asarray(lm_head, dtype)
  return params


def unstack_layers(params: Params) -> Params:
  """The same parameters with ``layers`` as a list of per-layer dicts.

  On XLA:CPU a ``lax.scan`` over stacked weights copies each layer's slice before its matmuls, which makes a
  bandwidth-bound decode step about 2x slower; a Python loop over separate per-layer arrays streams each
  weight once.  The stacked layout stays canonical (loaders, training); this is an execution layout.
  """
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  L = jax.tree_util.tree_leaves(layers)[0].shape[0]
  return {**params, "layers": [jax.tree_util.tree_map(lambda x: x[i], layers) for i in range(L)]}


def stack_layers(params: Params) -> Params:
  layers = params["layers"]
  if not isinstance(layers, (list, tuple)):
    return params
  return {**params, "layers": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)}


def param_bytes(params: Params) -> int:
  return quant.param_bytes(params)


def cast_params(params: Params, dtype) -> Params:
  if quant.holds_quantized(params):
    raise ValueError("cast_params: the parameters hold quantized weights; load the model in fp32 to change "
                     "their dtype")
  return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)


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


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  x = x_BxTxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
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


def forward(params: Params, cfg: ModelConfig, tokens_BxT: jax.Array, positions_BxT: jax.Array,
            cache: KVCache, extra_mask_BxTxT: jax.Array | None = None,
            kv_window: int | None = None, head_index_B: jax.Array | None = None,
            kv_buckets: tuple[int, ...] | None = None, live_T: jax.Array | None = None,
            region_mask_BxTxU: jax.Array | None = None, slots_BxT: jax.Array | None = None,
            feature_layers: tuple[int, ...] | None = None,
            inputs_embeds_BxTxD: jax.Array | None = None) -> ForwardOutput:
  """Run T new tokens per sequence through the model on top of the cache.

  ``tokens_BxT``: token ids; ``positions_BxT``: their RoPE positions (usually lengths[b] + t; tree nodes use
  their depth); ``cache``: the KV cache, the new entries written at slots lengths[b] + t.  The optional
  keywords are ``ForwardOptions``' fields (documented there).
  Returns ForwardOutput(logits [B,T,V] fp32, hidden [B,T,D], cache with lengths += T, features or None).
  """
  opts = ForwardOptions(extra_mask_BxTxT=extra_mask_BxTxT, region_mask_BxTxU=region_mask_BxTxU,
                        slots_BxT=slots_BxT, kv_window=kv_window, kv_buckets=kv_buckets, live_T=live_T,
                        head_index_B=head_index_B, feature_layers=feature_layers,
                        inputs_embeds_BxTxD=inputs_embeds_BxTxD)
  B, T = tokens_BxT.shape
  taps = _checked_taps(cfg, feature_layers)
  dtype = quant.activation_dtype(params)
  x_BxTxD = _embed(params, tokens_BxT, inputs_embeds_BxTxD, dtype)
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
  cos_BxTxR: jax.Array          # RoPE tables of the new tokens' positions (R = E/2)
  sin_BxTxR: jax.Array
  region_BxTxU: jax.Array       # visibility of the slots after the committed ones
  mask_BxTxW: jax.Array         # visibility of the W window slots (XLA attention)
  windows: list[int]            # the KV window buckets, ascending; the last is W
  bucket: jax.Array             # int32 index into ``windows``: the smallest covering max(lengths) + U
  attention_path: str           # "native", "pallas" or "xla" (``dispatch.attention``)
  live_T: jax.Array | None
  slots_BxT: jax.Array | None


def _checked_taps(cfg: ModelConfig, feature_layers: tuple[int, ...] | None) -> tuple[int, ...]:
  """The layer indices whose outputs ``forward`` keeps (``()`` without ``feature_layers`` or with ``()``)."""
  taps = tuple(feature_layers or ())
  if any(not 0 <= i < cfg.num_layers for i in taps):
    raise ValueError(f"feature_layers {taps} outside the model's {cfg.num_layers} layers")
  return taps


def _embed(params: Params, tokens_BxT: jax.Array, inputs_embeds_BxTxD: jax.Array | None, dtype) -> jax.Array:
  """The first layer's input [B, T, D]: the tokens' embeddings, or the given inputs."""
  if inputs_embeds_BxTxD is None:
    return quant.embed_rows(params["embed"], tokens_BxT, dtype)
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
  # Mask over the window: new slots are written in the region lengths..lengths+U-1 (< W by the caller's contract).
  region_BxTxU = attention.region_mask(B, T, opts.extra_mask_BxTxT, opts.region_mask_BxTxU)
  U = region_BxTxU.shape[2]
  mask_BxTxW = cpu_attention.visible_slots(lengths_B, region_BxTxU, windows[-1])
  bucket = jnp.sum(jnp.asarray(windows[:-1], jnp.int32) < jnp.max(lengths_B) + U).astype(jnp.int32)
  backends = backends_of(cfg)
  path = dispatch.attention(backends, T, dtype, cache.k.dtype)
  return _LayerContext(cfg=cfg, backends=backends, dtype=dtype, B=B, T=T, lengths_B=lengths_B,
                       cos_BxTxR=cos_BxTxR, sin_BxTxR=sin_BxTxR, region_BxTxU=region_BxTxU,
                       mask_BxTxW=mask_BxTxW, windows=windows, bucket=bucket, attention_path=path,
                       live_T=opts.live_T, slots_BxT=opts.slots_BxT)


def _attend_cache(ctx: _LayerContext, q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer) -> jax.Array:
  """One layer's attention of the new queries over the cache (already holding their k, v) on the call's
  backend: the native CPU kernel, Pallas tree attention, or XLA over the window bucket.  [B, T, H, E]."""
  # Both kernels read each sequence's live slots straight from the buffer: no window needed.
  if ctx.attention_path == "native":
    return cpu_attention.attend_cache_native(q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer,
                                             ctx.lengths_B, ctx.region_BxTxU, ctx.live_T)
  if ctx.attention_path == "pallas":
    if ctx.backends.distributed:   # a custom call GSPMD cannot split: each device runs it on its shard
      return sharding.attention_per_shard(pallas_kernels.tree_attention, ctx.backends.mesh, q_BxTxHxE,
                                          k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer, ctx.lengths_B,
                                          ctx.region_BxTxU)
    return pallas_kernels.tree_attention(q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer, ctx.lengths_B,
                                         ctx.region_BxTxU)

  def over(w):
    return lambda q, k_all, v_all: attention.attend(q, k_all[layer, :, :w].astype(ctx.dtype),
                                          v_all[layer, :, :w].astype(ctx.dtype), ctx.mask_BxTxW[:, :, :w])
  if len(ctx.windows) == 1:
    return over(ctx.windows[0])(q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE)
  return jax.lax.switch(ctx.bucket, [over(w) for w in ctx.windows], q_BxTxHxE, k_all_LxBxSxKxE,
                        v_all_LxBxSxKxE)


def _project_qkv(ctx: _LayerContext, lp: Params, x_BxTxD: jax.Array):
  """The attention norm, the fused q/k/v projection (+ bias) and RoPE on q and k: q [B,T,H,E], k, v [B,T,K,E]."""
  cfg = ctx.cfg
  B, T, H, K, E = ctx.B, ctx.T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  h_BxTxD = rms_norm(x_BxTxD, lp["attn_norm"], cfg.norm_eps)
  qkv = linear(h_BxTxD, lp["w_qkv"], ctx.live_T, ctx.backends)
  if cfg.qkv_bias:
    qkv = qkv + lp["b_qkv"]
  q, k, v = jnp.split(qkv, [H * E, (H + K) * E], axis=-1)
  q_BxTxHxE = apply_rope(q.reshape(B, T, H, E), ctx.cos_BxTxR, ctx.sin_BxTxR)
  k_BxTxKxE = apply_rope(k.reshape(B, T, K, E), ctx.cos_BxTxR, ctx.sin_BxTxR)
  return q_BxTxHxE, k_BxTxKxE, v.reshape(B, T, K, E)


def _attention_block(ctx: _LayerContext, lp: Params, x_BxTxD, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer):
  """One layer's attention with its residual: q/k/v, the new k, v written into the cache, attention, the
  output projection.  Returns (x [B,T,D], k_all, v_all)."""
  q_BxTxHxE, k_BxTxKxE, v_BxTxKxE = _project_qkv(ctx, lp, x_BxTxD)
  k_all_LxBxSxKxE = attention.write_slots(k_all_LxBxSxKxE, layer, k_BxTxKxE, ctx.lengths_B, ctx.slots_BxT)
  v_all_LxBxSxKxE = attention.write_slots(v_all_LxBxSxKxE, layer, v_BxTxKxE, ctx.lengths_B, ctx.slots_BxT)
  o_BxTxHxE = _attend_cache(ctx, q_BxTxHxE, k_all_LxBxSxKxE, v_all_LxBxSxKxE, layer)
  HE = ctx.cfg.num_heads * ctx.cfg.head_dim
  x_BxTxD = x_BxTxD + linear(o_BxTxHxE.reshape(ctx.B, ctx.T, HE), lp["wo"], ctx.live_T, ctx.backends)
  return x_BxTxD, k_all_LxBxSxKxE, v_all_LxBxSxKxE


def _mlp_block(ctx: _LayerContext, lp: Params, x_BxTxD: jax.Array) -> jax.Array:
  """One layer's SwiGLU MLP with its residual: norm → gate/up → silu(gate)·up → down."""
  h_BxTxD = rms_norm(x_BxTxD, lp["mlp_norm"], ctx.cfg.norm_eps)
  gate_BxTxF, up_BxTxF = jnp.split(linear(h_BxTxD, lp["w_gate_up"], ctx.live_T, ctx.backends), 2, axis=-1)
  return x_BxTxD + linear(jax.nn.silu(gate_BxTxF) * up_BxTxF, lp["w_down"], ctx.live_T, ctx.backends)


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
  return rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps)


def _final_head(params: Params, ctx: _LayerContext, x_BxTxD: jax.Array, head_index_B: jax.Array | None):
  """The rows ``head_index_B`` picks (all without it), the final norm and the head: (hidden [B,J,D], logits
  [B,J,V] fp32)."""
  if head_index_B is not None:         # one row per sequence [B], or several [B, J]
    rows_BxJ = head_index_B if head_index_B.ndim == 2 else head_index_B[:, None]
    x_BxTxD = jnp.take_along_axis(x_BxTxD, rows_BxJ[:, :, None], axis=1)
  hidden_BxJxD = rms_norm(x_BxTxD, params["final_norm"], ctx.cfg.norm_eps)
  logits_BxJxV = lm_head(params, ctx.cfg, hidden_BxJxD, None if head_index_B is not None else ctx.live_T,
                         ctx.backends)
  return hidden_BxJxD, logits_BxJxV


def scatter_to_vocab(logits_BxTxVr: jax.Array, head_ids_Vr: jax.Array, vocab_size: int) -> jax.Array:
  """Logits of a reduced head (rows ``head_ids``) over the full vocabulary: every other token at
  ``MASK_VALUE``, so its probability after softmax is exactly 0 (drafters with a reduced vocabulary)."""
  full = jnp.full(logits_BxTxVr.shape[:-1] + (vocab_size,), MASK_VALUE, jnp.float32)
  return full.at[..., head_ids_Vr].set(logits_BxTxVr.astype(jnp.float32))


def lm_head(params: Params, cfg: ModelConfig, hidden_BxTxD: jax.Array, live_T=None, backends=None) -> jax.Array:
  head_VxD = params["embed"] if cfg.tie_embeddings else params["lm_head"]
  return linear(hidden_BxTxD, head_VxD, live_T, backends or backends_of(cfg)).astype(jnp.float32)
