"""EAGLE-style feature drafter: one decoder layer that autoregresses over the target's features.

At position t the drafter reads the token x_t and the feature g_{t-1} that produced it, and predicts the
next feature; the target's (frozen) LM head turns that into the next token's distribution:

    input_t  = fc([embed(x_t) ; g_{t-1}])                    fc: [M, 2M]
    h_t      = final_norm(layer(input_t, its own KV cache))   one Llama decoder layer (the project's own)
    logits_t = head(h_t)                                     the target's head rows (all, or a reduced set)

g is the target's feature where the target has run (prefill, and every verified token), else the drafter's
own h (deeper tree nodes).  The target feature is either its final hidden state (EAGLE; F = M) or, EAGLE-3
style, the residual stream after a low, a middle and a high layer, each RMS-normalised and fused by
``fuse: [M, 3M]``.  Position 0 has no previous feature: g_{-1} = 0, in training and in the engine alike.

A reduced draft vocabulary keeps only ``head_ids`` (the target tokens most frequent on the training data):
the head costs Vr/V of the full one, and the drafter's logits are scattered back to target ids with every
other token at a large negative value — under sampling q is exactly zero outside the set, so the rejection
rule stays lossless.

Parameters: trainable ``fc``, ``fuse`` (fused features only), ``layers`` (one stacked layer, the model's
layout) and ``final_norm``; frozen, from the target: ``embed`` [V, M], ``lm_head`` [Vr, M] and, when reduced,
``head_ids`` [Vr].

Published EAGLE-3 drafters (``layout="eagle3"``, loaded by ``checkpoints/eagle3_io.py``) differ in three
places: the target feature is ``fuse`` over the raw taps (no normalisation, or their ``fuse_norm``); the layer's
input is not fc([embed; g]) but g itself, its attention reading [input_norm(embed(x)) ; hidden_norm(g)]
(``decoder.forward``'s ``attn_prefix_BxTxD``), the residual g; and the feature a deeper node feeds is the
layer's output before the final norm (after it with ``norm_output``).  Their own ``lm_head`` covers a draft
vocabulary whose target ids are ``head_ids`` (their ``d2t``), scattered like a reduced head.

In the engine (``EagleDrafter``) the state is the drafter's one-layer KV cache plus the target features of
the tokens accepted by the last step, which the next propose feeds first (re-computing the accepted nodes'
entries with the target's features instead of the drafter's guesses): no extra target pass.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models import decode, decoder as model_lib, quant
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.speculative.drafters import CACHE_DTYPE, ModelDrafter


LAYOUTS = ("specjax", "eagle1", "eagle3")


@dataclasses.dataclass(frozen=True)
class EagleConfig:
  """Static description of a feature drafter for a given target (hashable)."""
  target: ModelConfig
  feature_layers: tuple[int, ...] = ()     # () = the target's final hidden state; else fused layer taps
  vocab_size: int = 0                      # draft head rows; 0 = the target's vocabulary
  parallel: int = 0                        # K > 0: a parallel drafter (``eagle_parallel``) drafting K positions
                                           # in one forward (K - 1 learned placeholders); 0: sequential
  layout: str = "specjax"                  # "specjax" (trained here) or "eagle1": a published EAGLE-1/2 drafter
                                           # (fc with a bias, no norm before its attention or its head, RoPE
                                           # base 10000 whatever the target's, as the EAGLE package computes it);
                                           # "eagle3": a published EAGLE-3 drafter (see the module docstring)
  layer: tuple[tuple[str, Any], ...] = ()  # ModelConfig fields of the drafter's layer that differ from the
                                           # target's (a published drafter's own sizes, rope, q/k norms)
  norm_before_residual: bool = False       # EAGLE-3 (speculators): the residual is hidden_norm(g), not g
  norm_output: bool = False                # EAGLE-3.1 (speculators): deeper nodes feed the normed output

  def __post_init__(self):
    if self.vocab_size == self.target.vocab_size:       # one spelling of "the full vocabulary"
      object.__setattr__(self, "vocab_size", 0)
    if not 0 <= self.vocab_size <= self.target.vocab_size:
      raise ValueError(f"draft vocabulary of {self.vocab_size} tokens: use 1..{self.target.vocab_size} (0 = all)")
    if self.parallel == 1 or self.parallel < 0:
      raise ValueError(f"a parallel drafter drafts K >= 2 positions per forward, got {self.parallel} (0: sequential)")
    if self.layout not in LAYOUTS:
      raise ValueError(f"EAGLE layout '{self.layout}': use one of {', '.join(LAYOUTS)}")
    if any(not 0 <= i < self.target.num_layers for i in self.feature_layers):
      raise ValueError(f"feature layers {list(self.feature_layers)} outside the target's "
                       f"{self.target.num_layers} layers")

  @property
  def head_size(self) -> int:
    return self.vocab_size or self.target.vocab_size

  @property
  def reduced(self) -> bool:
    return self.head_size != self.target.vocab_size

  @property
  def fused(self) -> bool:
    return bool(self.feature_layers)

  @property
  def feature_dim(self) -> int:            # F: the width of the target feature it reads
    return self.target.d_model * max(1, len(self.feature_layers))

  @property
  def layer_cfg(self) -> ModelConfig:
    """The drafter as a one-layer model of the target's shape (a Llama layer, whatever the target's
    family) with an untied head of ``head_size`` rows."""
    kind = f"fused{'_'.join(map(str, self.feature_layers))}" if self.fused else "final"
    kind += f"-par{self.parallel}" if self.parallel else ""
    cfg = self.target.as_llama(name=f"{self.target.name}-eagle-{kind}-v{self.head_size}", num_layers=1,
                               vocab_size=self.head_size, tie_embeddings=False)
    if self.layout != "specjax":    # published drafters start at the pair (feature 0, token 1)
      cfg = cfg.replace(first_slot=1)
    if self.layout == "eagle1":
      cfg = cfg.replace(name=cfg.name + "-eagle1", input_norm=False, final_norm=False, rope_theta=10000.0,
                        rope_scaling=None)
    if self.layout == "eagle3":     # the attention norm is its hidden_norm (applied outside when it is residual)
      cfg = cfg.replace(name=cfg.name + "-eagle3", input_norm=not self.norm_before_residual, **dict(self.layer))
    return cfg

  @property
  def feeds_prenorm(self) -> bool:
    """Whether a deeper node's feature is the layer's output before the final norm (EAGLE-3) rather than the
    normed hidden state the head reads (specjax's heads; EAGLE-1 has no final norm, so both are one)."""
    return self.layout == "eagle3" and not self.norm_output

  def to_dict(self) -> dict:
    return {**({"layout": self.layout} if self.layout != "specjax" else {}),
            "feature_layers": list(self.feature_layers), "vocab_size": self.head_size,
            "target_vocab_size": self.target.vocab_size, "d_model": self.target.d_model,
            **({"parallel": self.parallel} if self.parallel else {})}


def init_trainable(ecfg: EagleConfig, key: jax.Array) -> dict:
  """Random trainable parameters (fc starts as [I ; I]-like: the embedding plus the feature)."""
  M, F = ecfg.target.d_model, ecfg.feature_dim
  k_layer, k_fc, k_fuse = jax.random.split(key, 3)
  layer = model_lib.init_params(ecfg.layer_cfg.replace(vocab_size=8, tie_embeddings=True), k_layer)
  eye = jnp.eye(M, dtype=jnp.float32)
  fc = jnp.concatenate([eye, eye], axis=1) + jax.random.normal(k_fc, (M, 2 * M)) * (0.02 / math.sqrt(M))
  params = {"fc": fc, "layers": layer["layers"], "final_norm": jnp.ones((M,), jnp.float32)}
  # The layer's output projections start small, so the first steps pass the input through.
  params["layers"]["wo"] = params["layers"]["wo"] * 0.1
  params["layers"]["w_down"] = params["layers"]["w_down"] * 0.1
  if ecfg.fused:
    n = len(ecfg.feature_layers)
    params["fuse"] = (jnp.tile(eye, (1, n)) / n
                      + jax.random.normal(k_fuse, (M, F)) * (0.02 / math.sqrt(F)))
  if ecfg.parallel:      # the layer inputs of draft positions 2..K (P-EAGLE's placeholders)
    params["placeholders"] = jax.random.normal(jax.random.fold_in(key, 7), (ecfg.parallel - 1, M)) * 0.02
  return params


def init_eagle3(ecfg: EagleConfig, key: jax.Array, head_ids=None) -> dict:
  """Random parameters of the published EAGLE-3 architecture for ``ecfg`` (layout "eagle3"): ``fuse`` over the
  raw taps, a layer whose q/k/v read 2M inputs, unit norms and its own ``lm_head`` over ``head_size`` rows
  (target ids ``head_ids`` when reduced).  The embedding is added from the target (``frozen_from_target``)."""
  cfg, M, F = ecfg.layer_cfg, ecfg.target.d_model, ecfg.feature_dim
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  k_layer, k_qkv, k_fuse, k_head = jax.random.split(key, 4)
  layers = model_lib.init_params(cfg.replace(vocab_size=8, tie_embeddings=True), k_layer)["layers"]
  layers["w_qkv"] = jax.random.normal(k_qkv, (1, (H + 2 * K) * E, 2 * M)) / math.sqrt(2 * M)
  params = {"fuse": jax.random.normal(k_fuse, (M, F)) / math.sqrt(F), "embed_norm": jnp.ones((M,), jnp.float32),
            "final_norm": jnp.ones((M,), jnp.float32), "layers": layers,
            "lm_head": jax.random.normal(k_head, (ecfg.head_size, M)) / math.sqrt(M)}
  if ecfg.norm_before_residual:
    params["hidden_norm"] = jnp.ones((M,), jnp.float32)
  if ecfg.reduced:
    if head_ids is None or len(head_ids) != ecfg.head_size:
      raise ValueError(f"a reduced vocabulary of {ecfg.head_size} needs head_ids of that length")
    params["head_ids"] = jnp.asarray(np.asarray(head_ids), jnp.int32)
  return params


def frozen_from_target(ecfg: EagleConfig, target_params, head_ids=None) -> dict:
  """The drafter's frozen part: the target's embedding and its head rows (``head_ids`` when reduced)."""
  embed = target_params["embed"]
  head = embed if ecfg.target.tie_embeddings else target_params["lm_head"]
  out = {"embed": embed}
  if ecfg.reduced:
    if head_ids is None or len(head_ids) != ecfg.head_size:
      raise ValueError(f"a reduced vocabulary of {ecfg.head_size} needs head_ids of that length")
    ids = jnp.asarray(np.asarray(head_ids), jnp.int32)
    out["lm_head"] = head.select_rows(ids) if quant.is_quantized(head) else jnp.take(head, ids, axis=0)
    out["head_ids"] = ids
  else:
    out["lm_head"] = head
  return out


def normalized_taps(ecfg: EagleConfig, feats_BxTxF: jax.Array) -> jax.Array:
  """Each tapped layer's residual stream RMS-normalised (float32, same shape): what ``fuse`` multiplies."""
  M, n = ecfg.target.d_model, len(ecfg.feature_layers)
  parts = feats_BxTxF.reshape(*feats_BxTxF.shape[:-1], n, M).astype(jnp.float32)
  parts = parts * jax.lax.rsqrt(jnp.mean(parts * parts, axis=-1, keepdims=True) + ecfg.target.norm_eps)
  return parts.reshape(feats_BxTxF.shape)


def eagle3_taps(params, ecfg: EagleConfig, feats_BxTxF: jax.Array) -> jax.Array:
  """What a published EAGLE-3 ``fc`` multiplies: the taps as they are, or normalised as its checkpoint says —
  ``fuse_norm`` [n, M], each tap by its own RMSNorm (``fc_norm``), or [n·M], one over all of them
  (speculators' ``norm_before_fc``)."""
  x = feats_BxTxF.astype(jnp.float32)
  if "fuse_norm" not in params:
    return x
  w, eps = params["fuse_norm"], ecfg.layer_cfg.norm_eps
  if w.ndim == 1:
    return model_lib.rms_norm(x, w, eps)
  parts = x.reshape(*x.shape[:-1], *w.shape)
  return model_lib.rms_norm(parts, w, eps).reshape(x.shape)


def target_feature(params, ecfg: EagleConfig, feats_BxTxF: jax.Array) -> jax.Array:
  """A target feature in the drafter's width M: as is (final hidden state), or each tapped layer
  RMS-normalised and fused by ``fuse``."""
  if not ecfg.fused:
    return feats_BxTxF
  taps = eagle3_taps(params, ecfg, feats_BxTxF) if ecfg.layout == "eagle3" else normalized_taps(ecfg, feats_BxTxF)
  if quant.is_quantized(params["fuse"]):           # a head at --draft-weights int8/int4/bf16
    return model_lib.linear(taps.reshape(-1, 1, taps.shape[-1]), params["fuse"]).reshape(*taps.shape[:-1], -1)
  return jnp.einsum("...f,df->...d", taps, params["fuse"])


def input_proj(params, tokens_BxT: jax.Array, g_BxTxM: jax.Array, backends=None) -> jax.Array:
  """fc([embed(x) ; g]) (+ its bias where the head has one) [B, T, M] (``backends``: the drafter's,
  ``model.backends_of``)."""
  e = quant.embed_rows(params["embed"], tokens_BxT, jnp.float32)
  x = jnp.concatenate([e, g_BxTxM.astype(jnp.float32)], axis=-1)
  y = model_lib.linear(x, params["fc"], backends=backends)
  return y + params["fc_bias"] if "fc_bias" in params else y        # EAGLE-1's fc has a bias


def layer_inputs(params, ecfg: EagleConfig, tokens_BxT: jax.Array, g_BxTxM: jax.Array, backends=None):
  """The layer's inputs for tokens x with features g: (its residual input [B,T,M], the attention prefix or
  None).  EAGLE-1 and specjax's heads: (fc([embed(x) ; g]), None); EAGLE-3: (g, or hidden_norm(g) when that is
  the residual; input_norm(embed(x)))."""
  if ecfg.layout != "eagle3":
    return input_proj(params, tokens_BxT, g_BxTxM, backends), None
  eps = ecfg.layer_cfg.norm_eps
  e = quant.embed_rows(params["embed"], tokens_BxT, jnp.float32)
  g = g_BxTxM.astype(jnp.float32)
  if ecfg.norm_before_residual:
    g = model_lib.rms_norm(g, params["hidden_norm"], eps)
  return g, model_lib.rms_norm(e, params["embed_norm"], eps)


def to_target_vocab(params, ecfg: EagleConfig, logits_BxTxVr: jax.Array) -> jax.Array:
  """Draft logits over the target's vocabulary: a reduced head's rows scattered to their target ids, every
  other token at ``attention.MASK_VALUE`` (probability exactly 0 after softmax)."""
  if not ecfg.reduced:
    return logits_BxTxVr
  return model_lib.scatter_to_vocab(logits_BxTxVr, params["head_ids"], ecfg.target.vocab_size)


def previous_features(feats_BxTxF: jax.Array) -> jax.Array:
  """g_{t-1} at every t (zero at t = 0)."""
  return jnp.concatenate([jnp.zeros_like(feats_BxTxF[:, :1]), feats_BxTxF[:, :-1]], axis=1)


@struct.dataclass
class EagleState:
  cache: KVCache          # the drafter's one-layer cache; entries before cache.lengths are final
  feats_BxD1xF: jax.Array  # target features g_{c-1}, g_c, ... of the tokens still to feed (c = cache.lengths)


@dataclasses.dataclass(frozen=True)
class EagleDrafter(ModelDrafter):
  """The feature drafter in the engine.  Tree drafting as ``ModelDrafter`` (one forward per depth over the
  nodes with children); each forward's input is fc([embed(token) ; the parent node's feature]).

  ``max_depth``: the deepest tree the engine drafts (the tokens one step can accept is max_depth + 1, which
  sizes the pending-feature buffer)."""
  ecfg: EagleConfig = None
  max_depth: int = 1
  name: str = "eagle"

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """What the engine's target forwards must return as ``features`` for this drafter."""
    return self.ecfg.feature_layers

  @property
  def pending(self) -> int:   # D1: the tokens one step can accept, whose features the next step feeds
    return self.max_depth + 1

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len, target_features_BxPxF=None):
    if target_features_BxPxF is None:
      raise ValueError("the EAGLE drafter needs the target's prefill features")
    B, P = prompt_BxP.shape
    cache = init_cache(self.cfg, B, max_len, CACHE_DTYPE).with_lengths(jnp.zeros((B,), jnp.int32))
    g = target_feature(draft_params, self.ecfg, previous_features(target_features_BxPxF))
    x, prefix = layer_inputs(draft_params, self.ecfg, prompt_BxP, g, model_lib.backends_of(self.cfg))
    window = next((w for w in self.buckets if w >= P), self.buckets[-1]) if self.buckets else None
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    out = model_lib.forward(draft_params, self.cfg, prompt_BxP, pos, cache, kv_window=window,
                            head_index_B=prompt_lens_B - 1, inputs_embeds_BxTxD=x, attn_prefix_BxTxD=prefix)
    last_feat = jnp.take_along_axis(target_features_BxPxF, (prompt_lens_B - 1)[:, None, None], axis=1)
    feats = jnp.zeros((B, self.pending, self.ecfg.feature_dim), jnp.float32).at[:, :1].set(last_feat)
    return EagleState(cache=out.cache.with_lengths(prompt_lens_B), feats_BxD1xF=feats)

  def state_bytes_per_seq(self, max_len: int) -> int:
    """Bytes ``init`` allocates per sequence: the one-layer cache and the pending target features (fp32)."""
    return super().state_bytes_per_seq(max_len) + self.pending * self.ecfg.feature_dim * 4

  def _root(self, params, state: EagleState, seq_BxS, lengths_B, last_B, head: bool = True):
    """Feed the pending tokens c..lengths with their target features; the last of them is the root.  With
    ``head=False`` only the cache is wanted: no head row is computed and the logits and feature are None."""
    c = state.cache.lengths
    B, S = seq_BxS.shape
    pos = c[:, None] + jnp.arange(self.pending, dtype=jnp.int32)[None, :]
    tokens = jnp.take_along_axis(seq_BxS, jnp.minimum(pos, S - 1), axis=1)
    root_B = lengths_B - c
    out = self._forward(params, tokens, pos, state.cache, target_feature(params, self.ecfg, state.feats_BxD1xF),
                        live_T=jnp.max(root_B) + 1,
                        head_index_B=root_B if head else jnp.zeros((B, 0), jnp.int32))
    if not head:
      return None, None, out.cache.with_lengths(lengths_B)
    logits = to_target_vocab(params, self.ecfg, out.logits[:, 0])
    if self.ecfg.feeds_prenorm:
      return logits, jnp.take_along_axis(out.features, root_B[:, None, None], axis=1)[:, 0], \
          out.cache.with_lengths(lengths_B)
    return logits, out.hidden[:, 0], out.cache.with_lengths(lengths_B)

  def _forward(self, params, tokens_BxT, pos_BxT, cache: KVCache, g_BxTxM, **kw):
    """The layer over tokens with their features (``windowed_forward``'s keywords in ``kw``); with
    ``feeds_prenorm`` its output before the final norm comes back as ``features``."""
    x, prefix = layer_inputs(params, self.ecfg, tokens_BxT, g_BxTxM, model_lib.backends_of(self.cfg))
    return decode.windowed_forward(params, self.cfg, tokens_BxT, pos_BxT, cache, buckets=self.buckets,
                                   inputs_embeds_BxTxD=x, attn_prefix_BxTxD=prefix,
                                   feature_layers=(0,) if self.ecfg.feeds_prenorm else None, **kw)

  def _extend(self, params, cache: KVCache, tokens_BxW, depth: int, slots_BxW, mask_BxWxU, parent_feat_BxWxF):
    pos = jnp.broadcast_to(cache.lengths[:, None] + depth, tokens_BxW.shape)
    out = self._forward(params, tokens_BxW, pos, cache, parent_feat_BxWxF, region_mask_BxTxU=mask_BxWxU,
                        slots_BxT=slots_BxW)
    fed = out.features if self.ecfg.feeds_prenorm else out.hidden
    return to_target_vocab(params, self.ecfg, out.logits), fed, out.cache.with_lengths(cache.lengths)

  def _with_cache(self, state: EagleState, cache: KVCache):
    return state.replace(cache=cache)

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp):
    if shape.num_nodes and shape.max_depth > self.max_depth:
      raise ValueError(f"EAGLE drafter built for depth {self.max_depth}, tree has depth {shape.max_depth}")
    return super().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)

  def commit(self, state: EagleState, lengths_B, path_slots_BxD1, new_lengths_B, path_features_BxD1xF=None):
    """Keep the root's entry (it was fed with its target feature); the accepted nodes and the next token are
    fed with their target features by the next propose."""
    fed = new_lengths_B > lengths_B
    D1 = self.pending
    feats = path_features_BxD1xF[:, :D1].astype(jnp.float32)
    if feats.shape[1] < D1:
      feats = jnp.pad(feats, ((0, 0), (0, D1 - feats.shape[1]), (0, 0)))
    c = jnp.where(fed, lengths_B + 1, state.cache.lengths)
    return EagleState(cache=state.cache.with_lengths(c),
                      feats_BxD1xF=jnp.where(fed[:, None, None], feats, state.feats_BxD1xF))
