"""An independent numpy implementation of a Llama-family forward (no cache), for tests only."""
from __future__ import annotations

import numpy as np

from specjax.models.config import ModelConfig


def random_hf_weights(cfg: ModelConfig, seed: int = 0) -> dict:
  """Random weights in Hugging Face naming and [out, in] orientation."""
  rng = np.random.default_rng(seed)
  D, H, K, E, F, V = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim,
                      cfg.vocab_size)

  def mat(o, i):
    return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

  layers = []
  for _ in range(cfg.num_layers):
    layer = {"q_proj": mat(H * E, D), "k_proj": mat(K * E, D), "v_proj": mat(K * E, D),
             "o_proj": mat(D, H * E), "gate_proj": mat(F, D), "up_proj": mat(F, D),
             "down_proj": mat(D, F),
             "input_layernorm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
             "post_attention_layernorm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    if cfg.qkv_bias:
      layer.update(q_bias=(0.1 * rng.standard_normal(H * E)).astype(np.float32),
                   k_bias=(0.1 * rng.standard_normal(K * E)).astype(np.float32),
                   v_bias=(0.1 * rng.standard_normal(K * E)).astype(np.float32))
    layers.append(layer)
  weights = {"embed": rng.standard_normal((V, D)).astype(np.float32),
             "final_norm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32), "layers": layers,
             "lm_head": None if cfg.tie_embeddings else mat(V, D)}
  return weights


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(cfg: ModelConfig):
  E = cfg.head_dim
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, E, 2) / E)
  s = cfg.rope_scaling
  if s is None:
    return inv
  out = []
  for f in inv:
    wavelen = 2 * np.pi / f
    if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
      out.append(f)
    elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
      out.append(f / s.factor)
    else:
      smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
          s.high_freq_factor - s.low_freq_factor)
      out.append((1 - smooth) * f / s.factor + smooth * f)
  return np.array(out)


def _rope(x_TxNxE, pos_T, inv):
  ang = pos_T[:, None] * inv[None, :]                       # T, E/2
  cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
  half = x_TxNxE.shape[-1] // 2
  rot = np.concatenate([-x_TxNxE[..., half:], x_TxNxE[..., :half]], -1)
  return x_TxNxE * cos + rot * sin


def reference_logits(cfg: ModelConfig, w: dict, tokens_T) -> np.ndarray:
  """Logits [T, V] of one sequence, float64, full causal attention."""
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  tokens_T = np.asarray(tokens_T)
  T = len(tokens_T)
  pos = np.arange(T, dtype=np.float64)
  inv = _inv_freq(cfg)
  x = w["embed"][tokens_T].astype(np.float64)
  causal = np.tril(np.ones((T, T), bool))
  for l in w["layers"]:
    h = _rms(x, l["input_layernorm"], cfg.norm_eps)
    q = h @ l["q_proj"].T
    k = h @ l["k_proj"].T
    v = h @ l["v_proj"].T
    if cfg.qkv_bias:
      q, k, v = q + l["q_bias"], k + l["k_bias"], v + l["v_bias"]
    q = _rope(q.reshape(T, H, E), pos, inv)
    k = _rope(k.reshape(T, K, E), pos, inv)
    v = v.reshape(T, K, E)
    k = np.repeat(k, H // K, axis=1)
    v = np.repeat(v, H // K, axis=1)
    s = np.einsum("qhe,khe->hqk", q, k) / np.sqrt(E)
    s = np.where(causal[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hqk,khe->qhe", p, v).reshape(T, H * E)
    x = x + o @ l["o_proj"].T
    h = _rms(x, l["post_attention_layernorm"], cfg.norm_eps)
    g = h @ l["gate_proj"].T
    x = x + ((g / (1 + np.exp(-g))) * (h @ l["up_proj"].T)) @ l["down_proj"].T
  x = _rms(x, w["final_norm"], cfg.norm_eps)
  head = w["embed"] if cfg.tie_embeddings else w["lm_head"]
  return x @ head.T
