"""Writing an EAGLE-3 drafter in the ``speculators`` layout (what vLLM loads): ``config.json`` with
``speculators_model_type: "eagle3"``, the layer's own Llama (or Qwen3) config, the capture ids as hidden-state
indices (specjax tap i = index i + 1), and ``model.safetensors`` with ``fc``, ``layers.0.*``, ``norm``,
``lm_head``, ``embed_tokens``, ``d2t``/``t2d`` and, where the head has them, ``fc_norm.{i}`` / ``input_norm``.
``eagle3_io.load_eagle3`` reads it back.

Only the EAGLE-3 architecture has a speculators equivalent: specjax's own feature heads (fc over [embedding ;
feature] into a Llama layer) compute something else, so they are refused with the setting that trains an
EAGLE-3 head instead.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError

SPECULATORS_VERSION = "0.9.0"        # the package version whose layout this writes (and was tested against)


def _rope_parameters(cfg) -> dict:
  out = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
  r = cfg.rope_scaling
  if r is None:
    return out
  out.update(rope_type=r.kind, factor=float(r.factor))
  if r.kind == "llama3":
    out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
               original_max_position_embeddings=r.original_max_position_embeddings)
  elif r.kind == "yarn":
    out.update(original_max_position_embeddings=r.original_max_position_embeddings, beta_fast=r.beta_fast,
               beta_slow=r.beta_slow, truncate=r.truncate)
    if r.attention_factor is not None:
      out["attention_factor"] = r.attention_factor
  return out


def layer_config(cfg, vocab_size: int) -> dict:
  """The drafter layer as a transformers config dict (a Qwen3 layer where it has q/k norms)."""
  return {"model_type": "qwen3" if cfg.qk_norm else "llama", "hidden_size": cfg.d_model,
          "intermediate_size": cfg.ffn_dim, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
          "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "attention_bias": cfg.qkv_bias,
          "max_position_embeddings": cfg.max_position, "rope_parameters": _rope_parameters(cfg),
          "vocab_size": vocab_size, "tie_word_embeddings": False}


def _tensors(ecfg, params) -> dict[str, np.ndarray]:
  cfg, M = ecfg.layer_cfg, ecfg.target.d_model
  H, K, E, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  a = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))           # noqa: E731
  L = {k: np.asarray(v)[0] for k, v in params["layers"].items()}
  q, k, v = np.split(L["w_qkv"], [H * E, (H + K) * E], axis=0)
  gate, up = np.split(L["w_gate_up"], [F], axis=0)
  p = "layers.0."
  out = {"fc.weight": a(params["fuse"]), "norm.weight": a(params["final_norm"]), "lm_head.weight": a(params["lm_head"]),
         "embed_tokens.weight": a(params["embed"]), p + "input_layernorm.weight": a(params["embed_norm"]),
         p + "hidden_norm.weight": a(params["hidden_norm"] if ecfg.norm_before_residual else L["attn_norm"]),
         p + "post_attention_layernorm.weight": a(L["mlp_norm"]), p + "self_attn.q_proj.weight": a(q),
         p + "self_attn.k_proj.weight": a(k), p + "self_attn.v_proj.weight": a(v),
         p + "self_attn.o_proj.weight": a(L["wo"]), p + "mlp.gate_proj.weight": a(gate),
         p + "mlp.up_proj.weight": a(up), p + "mlp.down_proj.weight": a(L["w_down"])}
  if cfg.qk_norm:
    out[p + "self_attn.q_norm.weight"], out[p + "self_attn.k_norm.weight"] = a(L["q_norm"]), a(L["k_norm"])
  if cfg.qkv_bias:
    for name, b in zip("qkv", np.split(L["b_qkv"], [H * E, (H + K) * E])):
      out[f"{p}self_attn.{name}_proj.bias"] = a(b)
  fuse_norm = params.get("fuse_norm")
  if fuse_norm is not None and np.ndim(fuse_norm) == 2:
    out.update({f"fc_norm.{i}.weight": a(w) for i, w in enumerate(np.asarray(fuse_norm))})
  elif fuse_norm is not None:
    out["input_norm.weight"] = a(fuse_norm)
  if ecfg.reduced:
    ids = np.asarray(params["head_ids"], np.int64)
    out["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
    t2d = np.zeros(ecfg.target.vocab_size, bool)
    t2d[ids] = True
    out["t2d"] = t2d
  assert M == cfg.d_model
  return out


def save_speculators(path, ecfg, params: dict, *, verifier: str | None = None,
                     verifier_architectures=("LlamaForCausalLM",), training: dict | None = None) -> Path:
  """Write an EAGLE-3 head (``ecfg.layout == "eagle3"``; ``params`` with its frozen part: ``embed``,
  ``head_ids`` when reduced) to ``path`` in the speculators layout (via a temporary name, then renamed).
  ``verifier``: the target's Hugging Face directory or hub name, recorded for the loaders that read it."""
  if ecfg.layout != "eagle3":
    raise SpecjaxError("only an EAGLE-3 head has a speculators equivalent (specjax's own feature heads feed "
                       "fc([embedding ; feature]) into a Llama layer): train one with train_eagle.architecture = "
                       "'eagle3'")
  if len(set(ecfg.feature_layers)) != len(ecfg.feature_layers):
    raise SpecjaxError(f"the head reads target layers {list(ecfg.feature_layers)}; speculators takes distinct "
                       "capture layers only: train one on distinct fused_layers")
  fuse_norm = params.get("fuse_norm")
  config = {
      "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
      "speculators_version": SPECULATORS_VERSION, "draft_vocab_size": ecfg.head_size,
      "eagle_aux_hidden_state_layer_ids": [t + 1 for t in ecfg.feature_layers],
      "norm_before_residual": ecfg.norm_before_residual, "norm_output": ecfg.norm_output,
      "fc_norm": fuse_norm is not None and np.ndim(fuse_norm) == 2,
      "norm_before_fc": fuse_norm is not None and np.ndim(fuse_norm) == 1,
      "embed_requires_grad": False, "target_hidden_size": None, "tie_word_embeddings": False,
      "transformer_layer_config": layer_config(ecfg.layer_cfg, ecfg.target.vocab_size),
      "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                             "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                                   "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                             "verifier": {"name_or_path": verifier,
                                          "architectures": list(verifier_architectures)}},
      **({"specjax_training": training} if training else {})}
  from safetensors.numpy import save_file
  path = Path(path)
  tmp = path.with_name(path.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  save_file(_tensors(ecfg, params), str(tmp / "model.safetensors"))
  (tmp / "config.json").write_text(json.dumps(config, indent=1))
  if path.exists():
    shutil.rmtree(path)
  os.replace(tmp, path)
  return path
