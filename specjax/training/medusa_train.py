"""Training Medusa-1 heads on a feature store (the target's own replies and final hidden states), as the
``medusa`` package's recipe does it in spirit: head i (0-based) reads the target's final hidden state h_t and
learns the target's distribution of the token i + 2 places on, i.e. the distribution the target gives at
row t + 1 + i (self-distillation: ``losses.divergence`` against it, or cross-entropy on the target's token).
Only pairs inside one sequence whose predicted token is a reply token count.  Blocks start at the identity
(zero weights) and every head at the target's own head, so step 0 drafts the target's next-token guess.

The heads train with ``recipes._fit`` (AdamW, orbax checkpoints, exact resume) and are written in the
published layout (``checkpoints/medusa_io.save_medusa``), so ``--drafter medusa --draft RUN/drafter`` loads
them like released heads.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError
from specjax.speculative import medusa
from specjax.training import eagle_train, losses


def init_params(mcfg: medusa.MedusaConfig, target_head_VxD) -> dict:
  """Identity blocks and copies of the target's head: what training starts from."""
  K, R, D = mcfg.num_heads, mcfg.num_layers, mcfg.target.d_model
  head = jnp.asarray(target_head_VxD, jnp.float32)
  return {"res_w": jnp.zeros((K, R, D, D), jnp.float32), "res_b": jnp.zeros((K, R, D), jnp.float32),
          "head": jnp.broadcast_to(head, (K, *head.shape)).copy()}


def _ahead(x_BxT, n: int):
  """y[:, t] = x[:, t + n] (zero past the end)."""
  return jnp.concatenate([x_BxT[:, n:], jnp.zeros_like(x_BxT[:, :n])], axis=1)


def loss_fn(trainable, frozen, mcfg: medusa.MedusaConfig, batch, kind: str = "fkl"):
  """(loss, metrics): the heads' mean divergence from the target, and per head 1 − TVD and top-1 agreement."""
  final = batch["final"].astype(jnp.float32)
  B, T, D = final.shape
  q_BxTxKxV = medusa.medusa_logits(trainable, final.reshape(B * T, D)).reshape(B, T, mcfg.num_heads, -1)
  p_BxTxV = jax.lax.stop_gradient(eagle_train.target_logits(frozen, final))
  seg, mask = batch["seg"], batch["loss_mask"]
  total, metrics = 0.0, {}
  for i in range(mcfg.num_heads):
    n = i + 1
    ok = _ahead(mask, n) & (_ahead(seg, n) == seg) & (seg > 0)            # [B, T]
    p = _ahead(p_BxTxV, n).reshape(B * T, -1)
    q = q_BxTxKxV[:, :, i].reshape(B * T, -1)
    m = ok.reshape(B * T)
    if kind == "ce":
      labels = _ahead(_ahead(batch["tokens"], 1), n).reshape(B * T)       # the target's reply token t + 1 + n
      total = total + losses.cross_entropy(labels, q, m)
    else:
      total = total + losses.divergence(kind, p, q, m)
    metrics[f"accept_h{n}"] = 1.0 - losses.divergence("tvd", p, q, m)
    metrics[f"top1_h{n}"] = jnp.sum((jnp.argmax(q, -1) == jnp.argmax(p, -1)) & m) / jnp.maximum(jnp.sum(m), 1)
  loss = total / mcfg.num_heads
  metrics["loss"] = loss
  return loss, metrics


def held_out_acceptance(mcfg, params, frozen, store, indices, *, seq_len: int = 512) -> dict:
  """1 − TVD and first-choice agreement per depth on stored (held-out) sequences (``tvd_by_position``'s
  measure for Medusa: depth d is head d - 1)."""
  batcher = eagle_train.PackedBatcher(store, store.final, np.asarray(indices), batch_size=1, seq_len=seq_len)
  step = jax.jit(lambda p, b: loss_fn(p, frozen, mcfg, b, "tvd")[1])
  acc, top1, n = np.zeros(mcfg.num_heads), np.zeros(mcfg.num_heads), 0
  for row in batcher._pack(0):
    batch = batcher.assemble([row])
    c = int(np.sum(batch["loss_mask"]))
    metrics = jax.device_get(step(params, batch))
    acc += c * np.asarray([metrics[f"accept_h{i + 1}"] for i in range(mcfg.num_heads)])
    top1 += c * np.asarray([metrics[f"top1_h{i + 1}"] for i in range(mcfg.num_heads)])
    n += c
  n = max(n, 1)
  return {"tvd_acceptance_by_position": (acc / n).tolist(), "greedy_match_by_position": (top1 / n).tolist()}


def train_medusa(*, run_dir: str, resume: bool = False, model: str = "smollm2-135m", data_dir: str = "",
                 num_prompts: int = 2400, max_new_tokens: int = 256, gen_batch_size: int = 32,
                 num_heads: int = 4, num_layers: int = 1, loss: str = "fkl", **fit_kw) -> dict:
  """Train Medusa-1 heads for ``model``: data (once per data directory; the directory ``train_eagle`` makes
  for the same ``num_prompts`` and ``max_new_tokens``, so the heads compare at equal data), training
  (``recipes._fit``'s settings: steps, batch_size, seq_len, learning_rate, ...), export to RUN_DIR/drafter in the
  published layout, held-out 1 − TVD per depth; returns a summary (also summary.json)."""
  from specjax import api
  from specjax.checkpoints import medusa_io
  from specjax.training import data as data_lib, prepare, recipes
  if loss not in ("ce",) + losses.KINDS:
    raise SpecjaxError(f"unknown loss '{loss}': choose ce or one of {', '.join(losses.KINDS)}")
  run = Path(run_dir).expanduser()
  if run.exists() and any(run.iterdir()) and not resume:
    raise SpecjaxError(f"run directory {run} already exists: pass --resume to continue it, or another --run-dir")
  m = api.load(model)
  data_dir = Path(data_dir).expanduser() if data_dir else prepare.default_data_dir(model, num_prompts,
                                                                                    max_new_tokens)
  prepare.prepare_data(m, data_dir, num_prompts=num_prompts, max_new_tokens=max_new_tokens, extra_prompts=(),
                       gen_batch_size=gen_batch_size, seed=fit_kw.get("seed", 0),
                       fused_layers=data_lib.default_fused_layers(m.cfg.num_layers))
  store = eagle_train.FeatureData(data_dir)
  mcfg = medusa.MedusaConfig(m.cfg, num_heads, num_layers)
  head = m.params["embed"] if m.cfg.tie_embeddings else m.params["lm_head"]
  frozen = {"lm_head": jnp.asarray(head, jnp.float32)}
  settings = dict(kind="medusa", model=model, data_dir=str(data_dir), num_heads=num_heads,
                  num_layers=num_layers, loss=loss)
  res = recipes._fit(lambda tr, fz, b: loss_fn(tr, fz, mcfg, b, loss), init_params(mcfg, head), frozen, store,
                     store.final, run_dir=run, resume=resume, fingerprint={"drafter": "medusa", **settings},
                     settings=settings, **fit_kw)
  params = jax.device_get(res["params"])
  out = medusa_io.save_medusa(run / "drafter", mcfg, params)
  t0 = time.perf_counter()
  ev = held_out_acceptance(mcfg, params, frozen, store, res["held_idx"],
                           seq_len=res["settings"].get("seq_len", 512))
  summary = {"run_dir": str(run), "drafter": str(out), "data_dir": str(data_dir), "train_s": res["train_s"],
             "steps": res["settings"]["steps"], "data_tokens": int(store.meta["tokens"]),
             "final_loss": res["final_loss"], "held_out_sequences": int(len(res["held_idx"])), **ev,
             "eval_s": time.perf_counter() - t0, "settings": res["settings"]}
  (run / "summary.json").write_text(json.dumps(summary, indent=1))
  return summary
