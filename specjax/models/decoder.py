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

Params = dict[str, Any]

# A large finite negative instead of -inf, so a fully masked row never becomes NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


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


def attention_mask(lengths_B: jax.Array, T: int, S: int, extra_mask_BxTxT: jax.Array | None,
                   region_mask_BxTxU: jax.Array | None = None) -> jax.Array:
  """Which cache slots each new query may see: [B, T, S] bool.

  Slot j is visible to query t of sequence b when it is committed context (j < lengths[b]) or it is a slot
  lengths[b] + u of the region after it that ``region_mask[b, t, u]`` allows.  Without a region mask the
  region is this call's T new slots, causal (u <= t), further restricted by ``extra_mask`` when given.
  """
  return cpu_attention.visible_slots(lengths_B, region_mask(lengths_B.shape[0], T, extra_mask_BxTxT,
                                                            region_mask_BxTxU), S)


def region_mask(B: int, T: int, extra_mask_BxTxT=None, region_mask_BxTxU=None) -> jax.Array:
  """The visibility of the slots after the committed ones: the region mask itself, else causal over the T
  new slots (and'ed with ``extra_mask``)."""
  if region_mask_BxTxU is not None:
    return region_mask_BxTxU
  causal = cpu_attention.causal_mask(B, T)
  return causal if extra_mask_BxTxT is None else causal & extra_mask_BxTxT


def attend_reference(q_BxTxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
                     mask_BxTxS: jax.Array) -> jax.Array:
  """Grouped-query attention written the obvious way (the reference for ``attend``). Returns [B, T, H, E]."""
  B, T, H, E = q_BxTxHxE.shape
  K = k_BxSxKxE.shape[2]
  q = q_BxTxHxE.reshape(B, T, K, H // K, E)
  scores = jnp.einsum("btkge,bske->bkgts", q, k_BxSxKxE,
                      preferred_element_type=jnp.float32) / math.sqrt(E)
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bske->btkge", probs.astype(v_BxSxKxE.dtype), v_BxSxKxE,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, H, E).astype(q_BxTxHxE.dtype)


# XLA:CPU multiplies a product of few rows with other blockings than one of many, so the same query row
# summed differently in a one-row plain step and a k + 1-row verification (fp32 and bf16; measured: the T*H
# rows of 1..4 queries differ from 8's, 8 to 64 agree).  The queries are padded to at least this many rows.
ATTEND_MIN_ROWS = 64


def attend(q_BxTxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
           mask_BxTxS: jax.Array) -> jax.Array:
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
    return attend(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS)[:, :T]
  S, K = k_BxSxKxE.shape[1], k_BxSxKxE.shape[2]
  G = H // K
  dt = k_BxSxKxE.dtype
  eye_KxK = jnp.eye(K, dtype=dt)
  q_blocks = (q_BxTxHxE.astype(dt).reshape(B, T, K, G, 1, E) * eye_KxK.reshape(1, 1, K, 1, K, 1))
  q_BxNxC = q_blocks.reshape(B, T * H, K * E)                                   # N = T*H, C = K*E
  scores = jnp.einsum("bnc,bsc->bns", q_BxNxC, k_BxSxKxE.reshape(B, S, K * E),
                      preferred_element_type=jnp.float32) / math.sqrt(E)
  scores = jnp.where(mask_BxTxS[:, :, None, :], scores.reshape(B, T, H, S), MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).reshape(B, T * H, S)
  o = jnp.einsum("bns,bsc->bnc", probs.astype(dt), v_BxSxKxE.reshape(B, S, K * E),
                 preferred_element_type=jnp.float32)
  o = jnp.einsum("btkgje,kj->btkge", o.reshape(B, T, K, G, K, E), eye_KxK.astype(o.dtype))
  return o.reshape(B, T, H, E).astype(q_BxTxHxE.dtype)


def _write_slots(buf_LxBxSxKxE, layer, new_BxTxKxE, lengths_B, offsets_BxT=None):
  """Write T new entries per sequence at slots lengths[b] + offsets[b, t] (default t; out-of-range writes are
  dropped)."""
  B, T = new_BxTxKxE.shape[:2]
  b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  offsets = jnp.arange(T)[None, :] if offsets_BxT is None else offsets_BxT
  s_idx = lengths_B[:, None] + offsets
  return buf_LxBxSxKxE.at[layer, b_idx, s_idx].set(new_BxTxKxE.astype(buf_LxBxSxKxE.dtype), mode="drop")


# ----------------------------------------------------------------------------------------------------------
# The forward


def forward(params: Params, cfg: ModelConfig, tokens_BxT: jax.Array, positions_BxT: jax.Array,
            cache: KVCache, extra_mask_BxTxT: jax.Array | None = None,
            kv_window: int | None = None, head_index_B: jax.Array | None = None,
            kv_buckets: tuple[int, ...] | None = None, live_T: jax.Array | None = None,
            region_mask_BxTxU: jax.Array | None = None, slots_BxT: jax.Array | None = None,
            feature_layers: tuple[int, ...] | None = None,
            inputs_embeds_BxTxD: jax.Array | None = None) -> ForwardOutput:
  """Run T new tokens per sequence through the model on top of the cache.

  Args:
    tokens_BxT: token ids.
    positions_BxT: RoPE positions of the new tokens (usually lengths[b] + t; tree nodes use their depth).
    cache: the KV cache; the new entries are written at slots lengths[b] + t.
    extra_mask_BxTxT: optional extra visibility among the new tokens (True = may attend), and'ed with causal.
    region_mask_BxTxU: instead of causal & extra, the visibility of the U slots lengths[b] + u after the
      committed ones (a token tree: the ancestors of each new node, written earlier or in this call).
    slots_BxT: where the new entries go, as offsets u from lengths[b] (default t); with a region mask a
      drafter extending a tree writes each frontier node at its node's slot.
    kv_window: static number of leading cache slots attention reads (must cover max(lengths) + T, or + U with a region mask);
      ``None`` reads the whole buffer.  Lets a caller skip empty slots at the end of the buffer.
    kv_buckets: static window sizes; each layer's attention reads the smallest one covering
      max(lengths) + T (a ``lax.switch``: every bucket compiled once, chosen by data), so a step at a short
      context does not pay for the empty end of a long buffer and nothing recompiles as sequences grow.
    head_index_B: compute logits only at this new-token index per sequence (prefill wants just the last
      prompt position): logits and hidden are then [B, 1, ...]; or at J indices per sequence ([B, J]: a
      parallel drafter's draft rows), [B, J, ...].
    live_T: optional traced count ≤ T, or one count per sequence [B]: only each sequence's first live_T new
      tokens matter (a verification whose later draft slots are empty this step; 0 for a finished sequence).  The native CPU kernels skip the others, so the step
      costs what live_T tokens cost; their logits are zero (XLA paths compute and zero them) and their KV
      entries, written past the committed length, are garbage that later steps overwrite.
    feature_layers: static; also return ``features`` [B, T, F] for every new token (before ``head_index_B``
      picks one): ``()`` = the final hidden state (after the final norm, F = D: EAGLE's feature); layer
      indices = the residual stream after each of those layers, concatenated (F = D x count: EAGLE-3's
      fused low, middle and high features).
    inputs_embeds_BxTxD: the first layer's input instead of the tokens' embeddings (a feature drafter's
      projection of [embedding; feature]); ``tokens_BxT`` then only gives the shape.
  Returns:
    ForwardOutput(logits [B,T,V] fp32, hidden [B,T,D], cache with lengths += T, features or None).
  """
  B, T = tokens_BxT.shape
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  S = cache.max_len
  W = S if kv_window is None else min(int(kv_window), S)
  dtype = quant.activation_dtype(params)
  lengths = cache.lengths

  if inputs_embeds_BxTxD is None:
    x_BxTxD = quant.embed_rows(params["embed"], tokens_BxT, dtype)
  else:
    x_BxTxD = inputs_embeds_BxTxD.astype(dtype)
  cos, sin = rope_tables(cfg, positions_BxT)
  # Mask over the window: new slots are written in the region lengths..lengths+U-1 (< W by the caller's contract).
  region_BxTxU = region_mask(B, T, extra_mask_BxTxT, region_mask_BxTxU)
  U = region_BxTxU.shape[2]
  mask_BxTxW = cpu_attention.visible_slots(lengths, region_BxTxU, W)
  windows = sorted({min(int(b), W) for b in kv_buckets} | {W}) if kv_buckets else [W]
  bucket = jnp.sum(jnp.asarray(windows[:-1], jnp.int32) < jnp.max(lengths) + U).astype(jnp.int32)

  backends = backends_of(cfg)
  path = dispatch.attention(backends, T, dtype, cache.k.dtype)

  def attend_layer(q, k_all, v_all, layer):
    # Both kernels read each sequence's live slots straight from the buffer: no window needed.
    if path == "native":
      return cpu_attention.attend_cache_native(q, k_all, v_all, layer, lengths, region_BxTxU, live_T)
    if path == "pallas":
      if backends.distributed:   # a custom call GSPMD cannot split: each device runs it on its shard
        return sharding.attention_per_shard(pallas_kernels.tree_attention, backends.mesh, q, k_all, v_all,
                                            layer, lengths, region_BxTxU)
      return pallas_kernels.tree_attention(q, k_all, v_all, layer, lengths, region_BxTxU)

    def over(w):
      return lambda q, k_all, v_all: attend(q, k_all[layer, :, :w].astype(dtype),
                                            v_all[layer, :, :w].astype(dtype), mask_BxTxW[:, :, :w])
    if len(windows) == 1:
      return over(W)(q, k_all, v_all)
    return jax.lax.switch(bucket, [over(w) for w in windows], q, k_all, v_all)

  def layer_fn(carry, layer_in):
    x_BxTxD, k_all, v_all = carry
    lp, layer = layer_in
    h = rms_norm(x_BxTxD, lp["attn_norm"], cfg.norm_eps)
    qkv = linear(h, lp["w_qkv"], live_T, backends)
    if cfg.qkv_bias:
      qkv = qkv + lp["b_qkv"]
    q, k, v = jnp.split(qkv, [H * E, (H + K) * E], axis=-1)
    q = apply_rope(q.reshape(B, T, H, E), cos, sin)
    k = apply_rope(k.reshape(B, T, K, E), cos, sin)
    v = v.reshape(B, T, K, E)
    k_all = _write_slots(k_all, layer, k, lengths, slots_BxT)
    v_all = _write_slots(v_all, layer, v, lengths, slots_BxT)
    o = attend_layer(q, k_all, v_all, layer)
    x_BxTxD = x_BxTxD + linear(o.reshape(B, T, H * E), lp["wo"], live_T, backends)
    h = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.norm_eps)
    gate, up = jnp.split(linear(h, lp["w_gate_up"], live_T, backends), 2, axis=-1)
    x_BxTxD = x_BxTxD + linear(jax.nn.silu(gate) * up, lp["w_down"], live_T, backends)
    return (x_BxTxD, k_all, v_all), x_BxTxD if taps else None

  taps = tuple(feature_layers or ())
  if any(not 0 <= i < cfg.num_layers for i in taps):
    raise ValueError(f"feature_layers {taps} outside the model's {cfg.num_layers} layers")
  carry = (x_BxTxD, cache.k, cache.v)
  if isinstance(params["layers"], (list, tuple)):   # unstacked layout (see unstack_layers)
    outs = []
    for layer, lp in enumerate(params["layers"]):
      carry, y = layer_fn(carry, (lp, layer))
      outs.append(y)
    tapped = [outs[i] for i in taps]
  else:
    carry, ys = jax.lax.scan(layer_fn, carry, (params["layers"], jnp.arange(cfg.num_layers)))
    tapped = [ys[i] for i in taps]
  x_BxTxD, k_all, v_all = carry
  features = None
  if feature_layers is not None:
    features = (jnp.concatenate(tapped, axis=-1) if taps
                else rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps))
  if head_index_B is not None:         # one row per sequence [B], or several [B, J]
    rows_BxJ = head_index_B if head_index_B.ndim == 2 else head_index_B[:, None]
    x_BxTxD = jnp.take_along_axis(x_BxTxD, rows_BxJ[:, :, None], axis=1)
  hidden = rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps)
  logits = lm_head(params, cfg, hidden, None if head_index_B is not None else live_T, backends)
  return ForwardOutput(logits, hidden, KVCache(k=k_all, v=v_all, lengths=lengths + T), features)


def scatter_to_vocab(logits_BxTxVr: jax.Array, head_ids_Vr: jax.Array, vocab_size: int) -> jax.Array:
  """Logits of a reduced head (rows ``head_ids``) over the full vocabulary: every other token at
  ``MASK_VALUE``, so its probability after softmax is exactly 0 (drafters with a reduced vocabulary)."""
  full = jnp.full(logits_BxTxVr.shape[:-1] + (vocab_size,), MASK_VALUE, jnp.float32)
  return full.at[..., head_ids_Vr].set(logits_BxTxVr.astype(jnp.float32))


def lm_head(params: Params, cfg: ModelConfig, hidden_BxTxD: jax.Array, live_T=None, backends=None) -> jax.Array:
  head_VxD = params["embed"] if cfg.tie_embeddings else params["lm_head"]
  return linear(hidden_BxTxD, head_VxD, live_T, backends or backends_of(cfg)).astype(jnp.float32)
