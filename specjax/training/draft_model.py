"""A small Llama-family draft model distilled from the target.

The draft has the target's width, heads and tokenizer and a few layers, initialised from a subset of the
target's own layers (so it starts as the layer-skip drafter and learns from there), with the target's
embedding, head and final norm (the embedding/head optionally frozen).  With a reduced vocabulary the head
keeps only ``head_ids`` (the target tokens most frequent on the training data, as for the feature drafter):
its logits are over those rows, and the engine scatters them back to target ids with every other token at
probability zero, so the rejection rule stays lossless.  Trained on the same stored data as
the feature drafter: the target's distribution at each position comes from its stored final hidden state
through its head, so every divergence of ``losses`` is exact.  Exported as a Hugging Face Llama directory
(config.json, model.safetensors, tokenizer files) that ``--drafter model --draft DIR`` loads like any other
checkpoint, and that other tools can load too.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import decoder as model_lib
from specjax.models.kv_cache import init_cache
from specjax.training import losses


def draft_config(target_cfg, layers: tuple[int, ...], reduced: bool = False):
  """The draft's config: the target's with ``len(layers)`` layers; a reduced head is its own (untied) matrix.
  ``vocab_size`` stays the target's: the embedding reads target ids."""
  cfg = target_cfg.with_layers(layers, name=f"{target_cfg.name}-draft{len(layers)}")
  return cfg.replace(tie_embeddings=False) if reduced else cfg


def init_from_target(target_params, layers: tuple[int, ...], head_ids=None) -> dict:
  """Draft parameters: the target's layers ``layers`` (copied), its embedding, final norm (and head; only
  the rows ``head_ids`` [Vr] for a reduced vocabulary, kept as ``head_ids``)."""
  stacked = model_lib.stack_layers(target_params)["layers"]
  idx = np.asarray(layers)
  out = {"embed": target_params["embed"], "final_norm": jnp.array(target_params["final_norm"]),
         "layers": jax.tree_util.tree_map(lambda x: jnp.array(np.asarray(x)[idx]), stacked)}
  head = target_params.get("lm_head", target_params["embed"])
  if head_ids is not None:
    ids = jnp.asarray(np.asarray(head_ids), jnp.int32)
    out["lm_head"], out["head_ids"] = jnp.take(head, ids, axis=0), ids
  elif "lm_head" in target_params:
    out["lm_head"] = target_params["lm_head"]
  return out


def split(params: dict, freeze_embeddings: bool) -> tuple[dict, dict]:
  """(trainable, frozen); a reduced head's ``head_ids`` are always frozen."""
  frozen_keys = ({"embed", "lm_head"} if freeze_embeddings else set()) | {"head_ids"}
  return ({k: v for k, v in params.items() if k not in frozen_keys},
          {k: v for k, v in params.items() if k in frozen_keys})


def train_forward(params, cfg, batch):
  """Logits [B, T, V] over packed rows: positions restart per sequence, attention stays inside it."""
  tokens, seg = batch["tokens"], batch["seg"]
  B, T = tokens.shape
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  out = model_lib.forward(params, cfg, tokens, batch["pos"], init_cache(cfg, B, T, jnp.float32),
                          extra_mask_BxTxT=same)
  return out.logits


def loss_fn(trainable, frozen, cfg, kind: str, batch, target_head, t2d=None):
  """(loss, metrics): ``kind`` (ce | fkl | rkl | jsd | tvd) against the target's distribution at each
  response position.  With a reduced vocabulary ``target_head`` holds the same rows as the draft's head (the
  target's distribution restricted to them) and ``t2d`` [V] maps target ids to rows (-1 outside), for ce."""
  logits = train_forward({**trainable, **frozen}, cfg, batch)
  p_logits = jax.lax.stop_gradient(jnp.einsum("btd,vd->btv", batch["final"].astype(jnp.float32), target_head))
  B, T, V = logits.shape
  m = batch["loss_mask"].reshape(B * T)
  q, p = logits.reshape(B * T, V), p_logits.reshape(B * T, V)
  if kind == "ce":
    nxt = jnp.concatenate([batch["tokens"][:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1).reshape(B * T)
    if t2d is not None:
      nxt = t2d[nxt]
    loss = losses.cross_entropy(jnp.maximum(nxt, 0), q, m & (nxt >= 0))
  else:
    loss = losses.divergence(kind, p, q, m)
  top1 = jnp.sum((jnp.argmax(q, -1) == jnp.argmax(p, -1)) & m) / jnp.maximum(jnp.sum(m), 1)
  accept = 1.0 - losses.divergence("tvd", p, q, m)
  return loss, {"loss": loss, "top1_s1": top1, "accept_s1": accept}


def export_hf(path: str | Path, cfg, params: dict, tokenizer, *, training: dict | None = None) -> Path:
  """A Hugging Face Llama directory (written to a temporary name, then renamed)."""
  from safetensors.numpy import save_file
  path = Path(path)
  H, K, E, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  g = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  tensors = {"model.embed_tokens.weight": g(params["embed"]), "model.norm.weight": g(params["final_norm"])}
  if not cfg.tie_embeddings:
    tensors["lm_head.weight"] = g(params["lm_head"])
  reduced = "head_ids" in params
  if reduced:    # EAGLE-3's convention: d2t maps a draft row to its target token id
    tensors["d2t"] = np.asarray(params["head_ids"], np.int64)
  L = params["layers"]
  for i in range(cfg.num_layers):
    q, k, v = np.split(np.asarray(L["w_qkv"][i]), [H * E, (H + K) * E], axis=0)
    gate, up = np.split(np.asarray(L["w_gate_up"][i]), [F], axis=0)
    pre = f"model.layers.{i}."
    tensors.update({pre + "self_attn.q_proj.weight": g(q), pre + "self_attn.k_proj.weight": g(k),
                    pre + "self_attn.v_proj.weight": g(v), pre + "self_attn.o_proj.weight": g(L["wo"][i]),
                    pre + "mlp.gate_proj.weight": g(gate), pre + "mlp.up_proj.weight": g(up),
                    pre + "mlp.down_proj.weight": g(L["w_down"][i]),
                    pre + "input_layernorm.weight": g(L["attn_norm"][i]),
                    pre + "post_attention_layernorm.weight": g(L["mlp_norm"][i])})
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers, "num_attention_heads": H,
            "num_key_value_heads": K, "head_dim": E, "intermediate_size": F, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "max_position_embeddings": cfg.max_position, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": "float32",
            "specjax_drafter": "model", "specjax_training": training or {}}
  if reduced:
    config["draft_vocab_size"] = int(np.shape(params["head_ids"])[0])
  tmp = path.with_name(path.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  save_file(tensors, str(tmp / "model.safetensors"))
  (tmp / "config.json").write_text(json.dumps(config, indent=1))
  tokenizer.hf.save(str(tmp / "tokenizer.json"))
  tok_cfg = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
             "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template}
  (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
  if path.exists():
    shutil.rmtree(path)
  os.replace(tmp, path)
  return path
