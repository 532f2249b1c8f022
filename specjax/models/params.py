"""The parameter pytree of a decoder: its layout, random initialisation, assembly from a checkpoint's
per-layer matrices, and the stacked / per-layer execution layouts.

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
    q_norm, k_norm          [L, E]   with ``cfg.qk_norm`` (Qwen3, Gemma 3)
    post_attn_norm, post_mlp_norm [L, D]  with ``cfg.sandwich_norms`` (Gemma 2/3: each block's output normed)
Matrices are stored [out, in] (the PyTorch / GGUF orientation): on XLA:CPU a batch-1 matrix-vector product
streams that layout faster than [in, out].
Fusing q/k/v and gate/up makes one larger matrix-vector product instead of several small ones, which is what
a bandwidth-bound decode step wants; ``params_from_hf_layout`` builds this layout from the usual separate
matrices (what checkpoints store).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import quant
from specjax.models.config import ModelConfig

Params = dict[str, Any]


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
  layers.update(_family_norms(cfg, lambda shape: jnp.ones(shape, dtype)))
  # The embedding at std 1/sqrt(D), like the head it doubles as when tied: logits of order 1.  (At std 1 a
  # tied head gives logits of order sqrt(D) and the token's own embedding dominates the residual stream, so
  # a random model repeats one token whatever the prompt: useless for testing, greedy or sampled.)
  params = {"embed": dense((V, D), D), "final_norm": jnp.ones((D,), dtype), "layers": layers}
  if not cfg.tie_embeddings:
    params["lm_head"] = dense((V, D), D)
  return params


def _family_norms(cfg: ModelConfig, make) -> dict[str, Any]:
  """The norm leaves a family adds (``make(shape)`` builds one), keyed like ``layers``."""
  L, D, E = cfg.num_layers, cfg.d_model, cfg.head_dim
  out = {}
  if cfg.qk_norm:
    out.update(q_norm=make((L, E)), k_norm=make((L, E)))
  if cfg.sandwich_norms:
    out.update(post_attn_norm=make((L, D)), post_mlp_norm=make((L, D)))
  return out


def family_tensor_names(cfg: ModelConfig) -> tuple[str, ...]:
  """The optional per-layer tensors ``cfg``'s family needs, named as in ``params_from_hf_layout`` (and as
  the leaves of ``layers``): q_norm, k_norm [E]; post_attn_norm, post_mlp_norm [D]."""
  return (("q_norm", "k_norm") if cfg.qk_norm else ()) + (
      ("post_attn_norm", "post_mlp_norm") if cfg.sandwich_norms else ())


def params_from_hf_layout(cfg: ModelConfig, embed, final_norm, layers: list[dict[str, Any]],
                          lm_head=None, dtype=jnp.float32) -> Params:
  """Assemble specjax parameters from per-layer matrices in Hugging Face naming and orientation.

  Each entry of ``layers`` holds numpy arrays ``q_proj [H*E, D]``, ``k_proj``/``v_proj [K*E, D]``,
  ``o_proj [D, H*E]``, ``gate_proj``/``up_proj [F, D]``, ``down_proj [D, F]``, ``input_layernorm [D]``,
  ``post_attention_layernorm [D]`` (the norm before the MLP), with ``cfg.qkv_bias`` ``q_bias``/``k_bias``/
  ``v_bias``, and what the family adds (``family_tensor_names``); norm weights are the multipliers themselves
  (a Gemma loader has added its 1).
  ``embed`` is [V, D]; ``lm_head`` [V, D] or None when tied.  Shapes are checked against ``cfg``.
  """
  D, H, K, E, F, V = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim,
                      cfg.vocab_size)
  expected = {"q_proj": (H * E, D), "k_proj": (K * E, D), "v_proj": (K * E, D), "o_proj": (D, H * E),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F), "input_layernorm": (D,),
              "post_attention_layernorm": (D,)}
  if cfg.qkv_bias:
    expected.update(q_bias=(H * E,), k_bias=(K * E,), v_bias=(K * E,))
  for name in family_tensor_names(cfg):
    expected[name] = (E,) if name in ("q_norm", "k_norm") else (D,)
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
  for name in family_tensor_names(cfg):
    stacked[name] = stack(lambda l, name=name: l[name])
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
