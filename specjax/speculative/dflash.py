"""DFlash: a few non-causal draft layers over a block of mask tokens, conditioned on the target's features,
drafting a whole block in one forward.

A DFlash drafter (z-lab's releases; SpecForge's and speculators' ``DFlashDraftModel``) reads, for every
committed token t, the target's residual stream after a few of its layers (``feature_layers``, concatenated:
f_t [n·D]) and keeps in each of its L' layers the keys and values of the context

    c_t = hidden_norm(fc · f_t)                                                fc: [D, n·D]
    k_t = RoPE_t(k_norm(W_k c_t)),   v_t = W_v c_t                            each layer's own W_k, W_v

(the same c_t for every layer: the context never runs through the layers).  To draft after the newest token
x_s (the tree's root, at position s = ``lengths``), it runs its layers once over the block

    [x_s, m, m, ..., m]   at positions s .. s + block_size - 1      m = ``mask_token_id``

embedded with the target's embedding (z-lab: with the family's scale; speculators: its raw table); each layer
is a Qwen3 decoder layer whose attention reads the context c_{<s} and the whole block, both ways (non-causal).
The final norm and the head (the target's, or a draft vocabulary's own, scattered to target ids with q zero
elsewhere) over block rows 1..block_size - 1 give the distributions of depths 1..block_size - 1.  None depends
on what is drafted above it, so, as for the parallel head and Medusa (``drafters.PerDepthLogits``), a chain
takes the top-1 or a draw at each depth, a static tree gives every node at depth d its children from row
d + 1, and ``dynamic:N`` expands EAGLE-2-style over those rows.  Each node's children come from the
distribution recorded as its q, so sampling stays lossless.

In the engine the block runs through ``decoder.forward`` over the drafter's own cache: the context entries are
written first (``write_context``), then the block's T = block_size rows at slots s.., with a region mask that
lets every block row see every other.  The block's own entries land past the committed length and the next
step overwrites them.  The state is ``EagleState``: the cache (context entries final before ``cache.lengths``)
and the target features of the tokens still to write (the accepted path of the last step, root first).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.models import attention, decode, decoder as model_lib
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, cache_bytes, init_cache
from specjax.models.rope import apply_rope, rope_tables
from specjax.speculative.drafters import CACHE_DTYPE, ModelDrafter, NoDrafter, PerDepthLogits
from specjax.speculative.eagle import EagleState


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Static description of a DFlash drafter for a target (hashable)."""
  target: ModelConfig
  layer: ModelConfig                   # the draft layers as a model: L' layers of their own shape, the target's
                                       # width and embedding (scaled as the layout embeds), a head over the
                                       # target's vocabulary (the target's) or a draft vocabulary (its own)
  feature_layers: tuple[int, ...]      # the target layers whose outputs are concatenated into f_t
  block_size: int                      # rows of one draft forward: the root and block_size - 1 mask tokens
  mask_token_id: int

  def __post_init__(self):
    t, c = self.target, self.layer
    if self.block_size < 2:
      raise ValueError(f"a DFlash block of {self.block_size} drafts nothing (block_size >= 2)")
    if not 0 <= self.mask_token_id < t.vocab_size:
      raise ValueError(f"mask token {self.mask_token_id} outside the target's {t.vocab_size} tokens")
    if not self.feature_layers or any(not 0 <= i < t.num_layers for i in self.feature_layers):
      raise ValueError(f"feature layers {list(self.feature_layers)} outside the target's {t.num_layers} layers")
    if c.d_model != t.d_model or not 0 < c.vocab_size <= t.vocab_size:
      raise ValueError(f"draft layers of width {c.d_model} over {c.vocab_size} tokens for a target of "
                       f"{t.d_model} and {t.vocab_size}")

  @property
  def feature_dim(self) -> int:        # F: the width of f_t
    return self.target.d_model * len(self.feature_layers)

  @property
  def max_depth(self) -> int:          # the deepest node one block drafts
    return self.block_size - 1

  @property
  def reduced(self) -> bool:           # its own head over a draft vocabulary (target ids ``head_ids``)
    return self.layer.vocab_size != self.target.vocab_size


def init_params(dcfg: DFlashConfig, key: jax.Array) -> dict:
  """Random trainable parameters (tests): the draft layers, ``fc`` N(0, 1/F), unit norms."""
  cfg, D, F = dcfg.layer, dcfg.target.d_model, dcfg.feature_dim
  k_layers, k_fc = jax.random.split(key)
  layers = model_lib.init_params(cfg.replace(vocab_size=8, tie_embeddings=True), k_layers)["layers"]
  return {"layers": layers, "fc": jax.random.normal(k_fc, (D, F)) / math.sqrt(F),
          "hidden_norm": jnp.ones((D,), jnp.float32), "final_norm": jnp.ones((D,), jnp.float32)}


def frozen_from_target(dcfg: DFlashConfig, target_params) -> dict:
  """What the drafter reads of the target: its embedding, and its head when untied (a draft vocabulary's head
  is the drafter's own)."""
  out = {"embed": target_params["embed"]}
  if not dcfg.target.tie_embeddings and not dcfg.reduced:
    out["lm_head"] = target_params["lm_head"]
  return out


def context(params, dcfg: DFlashConfig, feats_BxTxF: jax.Array) -> jax.Array:
  """c = hidden_norm(fc · f) [B, T, D] float32: what every layer's context keys and values read."""
  cfg = dcfg.layer
  x = model_lib.linear(feats_BxTxF.astype(jnp.float32), params["fc"], backends=model_lib.backends_of(cfg))
  return model_lib.rms_norm(x, params["hidden_norm"], cfg.norm_eps)


def write_context(params, dcfg: DFlashConfig, cache: KVCache, feats_BxTxF: jax.Array, start_B: jax.Array) -> KVCache:
  """The cache with the context entries of T tokens written in every layer at slots (and positions) start + t;
  its lengths unchanged.  Writes past the buffer are dropped."""
  cfg = dcfg.layer
  B, T = feats_BxTxF.shape[:2]
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  backends = model_lib.backends_of(cfg)
  c_BxTxD = context(params, dcfg, feats_BxTxF)
  cos_BxTxR, sin_BxTxR = rope_tables(cfg, start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :])
  k_all, v_all = cache.k, cache.v
  for layer, lp in enumerate(model_lib.unstack_layers(params)["layers"]):
    qkv = model_lib.linear(c_BxTxD, lp["w_qkv"], backends=backends)
    if cfg.qkv_bias:
      qkv = qkv + lp["b_qkv"]
    k_BxTxKxE = qkv[..., H * E:(H + K) * E].reshape(B, T, K, E)
    v_BxTxKxE = qkv[..., (H + K) * E:].reshape(B, T, K, E)
    if cfg.qk_norm:
      k_BxTxKxE = model_lib.rms_norm(k_BxTxKxE, lp["k_norm"], cfg.norm_eps)
    k_BxTxKxE = apply_rope(k_BxTxKxE, cos_BxTxR, sin_BxTxR)
    k_all = attention.write_slots(k_all, layer, k_BxTxKxE, start_B)
    v_all = attention.write_slots(v_all, layer, v_BxTxKxE, start_B)
  return cache.replace(k=k_all, v=v_all)


def block_logits(params, dcfg: DFlashConfig, cache: KVCache, last_B: jax.Array, lengths_B: jax.Array,
                 depth: int, buckets: tuple[int, ...] | None = None) -> tuple[jax.Array, KVCache]:
  """The one forward over the block [last, mask, ...] at positions lengths.. on a cache whose context entries
  before ``lengths`` are written: (the distributions of depths 1..depth [B, depth, V] as logits, the cache with
  lengths = lengths_B; the block's entries after it are left to be overwritten)."""
  bs = dcfg.block_size
  B = last_B.shape[0]
  i_T = jnp.arange(bs, dtype=jnp.int32)
  tokens_BxT = jnp.where(i_T[None, :] == 0, last_B[:, None], dcfg.mask_token_id).astype(jnp.int32)
  both_ways_BxTxT = jnp.ones((B, bs, bs), bool)
  rows_BxJ = jnp.broadcast_to(jnp.arange(1, depth + 1, dtype=jnp.int32), (B, depth))
  out = decode.windowed_forward(params, dcfg.layer, tokens_BxT, lengths_B[:, None] + i_T[None, :],
                                cache.with_lengths(lengths_B), buckets=buckets, region_mask_BxTxU=both_ways_BxTxT,
                                head_index_B=rows_BxJ)
  logits = out.logits                  # a draft vocabulary's rows scattered to target ids, the rest at probability 0
  if dcfg.reduced:
    logits = model_lib.scatter_to_vocab(logits, params["head_ids"], dcfg.target.vocab_size)
  return logits, out.cache.with_lengths(lengths_B)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(ModelDrafter):
  """A DFlash drafter in the engine (``cfg`` is ``dcfg.layer``).  ``max_depth``: the deepest tree it drafts
  (at most block_size - 1), which sizes the pending features (max_depth + 1: what one step can accept)."""
  dcfg: DFlashConfig = None
  max_depth: int = 1
  name: str = "dflash"

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.dcfg.feature_layers

  @property
  def pending(self) -> int:            # D1
    return self.max_depth + 1

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len, target_features_BxPxF=None):
    """The prompt's context entries, for a buffer of max_len + block_size slots (a block near the end of the
    target's buffer still has its block_size rows)."""
    if target_features_BxPxF is None:
      raise ValueError("the DFlash drafter needs the target's prefill features")
    B = prompt_BxP.shape[0]
    cache = init_cache(self.cfg, B, max_len + self.dcfg.block_size, CACHE_DTYPE)
    cache = write_context(draft_params, self.dcfg, cache, target_features_BxPxF, jnp.zeros((B,), jnp.int32))
    feats = jnp.zeros((B, self.pending, self.dcfg.feature_dim), jnp.float32)
    return EagleState(cache=cache.with_lengths(prompt_lens_B), feats_BxD1xF=feats)

  def state_bytes_per_seq(self, max_len: int) -> int:
    """The fp32 context cache of max_len + block_size slots, its length and the pending features."""
    return (cache_bytes(self.cfg, 1, max_len + self.dcfg.block_size, CACHE_DTYPE) + 4
            + self.pending * self.dcfg.feature_dim * 4)

  def forwards(self, shape) -> int:
    return 1 if shape.num_nodes else 0

  def _written(self, params, state: EagleState, lengths_B) -> KVCache:
    """The cache with the pending tokens' context entries written (slots cache.lengths..; those past lengths_B
    are padding, overwritten by the block) and lengths = lengths_B."""
    cache = state.cache
    return write_context(params, self.dcfg, cache, state.feats_BxD1xF, cache.lengths).with_lengths(lengths_B)

  def block(self, params, state: EagleState, lengths_B, last_B) -> tuple[jax.Array, KVCache]:
    """The pending context written, then the one forward over the block under the root ``last_B`` at
    ``lengths_B``: (logits of depths 1..max_depth [B, max_depth, V], the cache with lengths = lengths_B)."""
    return block_logits(params, self.dcfg, self._written(params, state, lengths_B), last_B, lengths_B,
                        self.max_depth, self.buckets)

  # The hooks of ModelDrafter.propose / _propose_dynamic: every depth's children come from the one forward.

  def _root(self, params, state: EagleState, seq_BxS, lengths_B, last_B):
    logits, cache = self.block(params, state, lengths_B, last_B)
    return logits[:, 0], None, PerDepthLogits(cache, logits)

  def _extend(self, params, drafted: PerDepthLogits, tokens_BxW, depth: int, slots_BxW, mask_BxWxU,
              parent_feat_BxWxF):
    return drafted.at_depth(depth, tokens_BxW.shape[1]), None, drafted

  def _with_cache(self, state: EagleState, drafted: PerDepthLogits):
    return state.replace(cache=drafted.cache)

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp):
    if shape.num_nodes == 0:
      state = state.replace(cache=self._written(draft_params, state, lengths_B))
      return NoDrafter().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
    if shape.max_depth > self.max_depth:
      raise ValueError(f"DFlash drafter built for depth {self.max_depth} (block of {self.dcfg.block_size}), "
                       f"tree has depth {shape.max_depth}")
    return super().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)

  def commit(self, state: EagleState, lengths_B, path_slots_BxD1, new_lengths_B, path_features_BxD1xF=None):
    """The accepted path's tokens (the root at lengths_B first) become pending: their target features are
    written as context by the next propose."""
    fed = new_lengths_B > lengths_B
    D1 = self.pending
    feats = path_features_BxD1xF[:, :D1].astype(jnp.float32)
    if feats.shape[1] < D1:
      feats = jnp.pad(feats, ((0, 0), (0, D1 - feats.shape[1]), (0, 0)))
    c = jnp.where(fed, lengths_B, state.cache.lengths)
    return EagleState(cache=state.cache.with_lengths(c),
                      feats_BxD1xF=jnp.where(fed[:, None, None], feats, state.feats_BxD1xF))
