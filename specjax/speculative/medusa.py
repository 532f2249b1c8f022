"""Medusa-1 heads: K extra heads on the target's last hidden state, head i guessing the token i + 2 places on.

A Medusa head (Cai et al., 2024; the layout of the ``medusa`` package's ``MedusaModel``) is R residual
blocks x ← x + SiLU(W x + b) followed by a linear map to the vocabulary, applied to the target's final
(normed) hidden state h_{L-1} — the state whose own head produced the root token x_L.  Head i (0-based)
gives the distribution of the token at depth i + 1 below the root (x_{L+1+i}).  No head sees what was drafted
above it, so one step costs one evaluation of the K heads, and the tree builders shared with the parallel
drafter give every node at depth d its children from head d - 1:

  chain:K          top-1 (greedy) or a draw (sampling) at each depth;
  static trees     Medusa's own trees (``--tree paths:FILE``) or any branching;
  dynamic:N        EAGLE-2's best-N expansion by cumulative log-probability.

Lossless sampling holds as for any drafter: each node's children are drawn from the head distribution
recorded as its q.  The state is the root's producing hidden state; ``commit`` takes the new root's from the
accepted path's target features (no extra target pass).

Parameters (``MedusaConfig`` K heads, R blocks, width D, vocabulary V):
  res_w [K, R, D, D]  res_b [K, R, D]  (each block's ``linear``, [out, in])
  head  [K, V, D]
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.config import ModelConfig
from specjax.speculative.drafters import ModelDrafter, NoDrafter, PerDepthLogits


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  """Static description of a set of Medusa heads for a target (hashable)."""
  target: ModelConfig
  num_heads: int                 # K: the depths one step can draft
  num_layers: int = 1            # R: residual blocks per head

  def __post_init__(self):
    if self.num_heads < 1 or self.num_layers < 0:
      raise ValueError(f"Medusa heads: {self.num_heads} heads of {self.num_layers} blocks (need >= 1 and >= 0)")

  def shapes(self) -> dict[str, tuple[int, ...]]:
    K, R, D, V = self.num_heads, self.num_layers, self.target.d_model, self.target.vocab_size
    return {"res_w": (K, R, D, D), "res_b": (K, R, D), "head": (K, V, D)}


def init_params(mcfg: MedusaConfig, key: jax.Array, scale: float = 1.0) -> dict:
  """Random heads (tests): blocks N(0, scale²/D), heads N(0, 1/D)."""
  shapes = mcfg.shapes()
  k_w, k_b, k_h = jax.random.split(key, 3)
  D = mcfg.target.d_model
  return {"res_w": jax.random.normal(k_w, shapes["res_w"]) * (scale / D ** 0.5),
          "res_b": jax.random.normal(k_b, shapes["res_b"]) * 0.1,
          "head": jax.random.normal(k_h, shapes["head"]) / D ** 0.5}


def medusa_logits(params, hidden_BxD: jax.Array) -> jax.Array:
  """Every head on the hidden states: [B, K, V] float32 (depth d's distribution at index d - 1)."""
  x_BxKxD = jnp.broadcast_to(hidden_BxD.astype(jnp.float32)[:, None, :],
                             (hidden_BxD.shape[0], params["head"].shape[0], hidden_BxD.shape[-1]))
  for r in range(params["res_w"].shape[1]):
    y = jnp.einsum("bkd,ked->bke", x_BxKxD, params["res_w"][:, r].astype(jnp.float32)) + params["res_b"][:, r]
    x_BxKxD = x_BxKxD + jax.nn.silu(y)
  return jnp.einsum("bkd,kvd->bkv", x_BxKxD, params["head"].astype(jnp.float32))


@struct.dataclass
class MedusaState:
  feat_BxF: jax.Array      # the target's final hidden state that produced the root (h_{L-1})


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(ModelDrafter):
  """Medusa heads in the engine (``ModelDrafter``'s tree builders; ``cfg`` is the target's)."""
  mcfg: MedusaConfig = None
  name: str = "medusa"

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return ()                  # the target's final hidden state

  @property
  def max_depth(self) -> int:
    return self.mcfg.num_heads

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len, target_features_BxPxF=None):
    if target_features_BxPxF is None:
      raise ValueError("Medusa heads need the target's prefill features")
    feat = jnp.take_along_axis(target_features_BxPxF, (prompt_lens_B - 1)[:, None, None], axis=1)[:, 0]
    return MedusaState(feat_BxF=feat.astype(jnp.float32))

  def state_bytes_per_seq(self, max_len: int) -> int:
    return self.mcfg.target.d_model * 4

  def forwards(self, shape) -> int:
    return 1 if shape.num_nodes else 0

  def _root(self, params, state: MedusaState, seq_BxS, lengths_B, last_B):
    logits = medusa_logits(params, state.feat_BxF)
    return logits[:, 0], None, PerDepthLogits(state, logits)

  def _extend(self, params, drafted: PerDepthLogits, tokens_BxW, depth: int, slots_BxW, mask_BxWxU,
              parent_feat_BxWxF):
    return drafted.at_depth(depth, tokens_BxW.shape[1]), None, drafted

  def _with_cache(self, state, drafted: PerDepthLogits):
    return drafted.cache          # the Medusa state, carried unchanged through the propose

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp):
    if shape.num_nodes == 0:
      return NoDrafter().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
    if shape.max_depth > self.max_depth:
      raise ValueError(f"{self.max_depth} Medusa heads draft {self.max_depth} deep; the tree has depth "
                       f"{shape.max_depth}")
    return super().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)

  def commit(self, state: MedusaState, lengths_B, path_slots_BxD1, new_lengths_B, path_features_BxD1xF=None):
    """The new root's producing hidden state: the target's at the last accepted node (path index
    new_lengths - lengths - 1; the root's own when nothing was accepted)."""
    fed = new_lengths_B > lengths_B
    idx = jnp.clip(new_lengths_B - lengths_B - 1, 0, path_features_BxD1xF.shape[1] - 1)
    feat = jnp.take_along_axis(path_features_BxD1xF, idx[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    return MedusaState(feat_BxF=jnp.where(fed[:, None], feat, state.feat_BxF))
