"""Training recipes: plain functions that ``specjax train CONFIG.gin`` binds (gin stays at the entry point).

``train_eagle`` does the whole job for a feature drafter, each stage resumable:
  1. data   (``prepare.py``, ``data.py``): prompts, the target's replies, its features — once per data directory,
            shared by every run that uses it;
  2. train  (``eagle_train.py`` + ``loop.py``): one jitted step, AdamW, orbax checkpoints in the run
            directory, exact resume with ``--resume``;
  3. export (``checkpoints/drafter_io.py``): ``RUN_DIR/drafter`` (safetensors + config.json), which
            ``--drafter eagle --draft RUN_DIR/drafter`` loads;
  4. eval   (``evaluate.py``): 1 − TVD per draft position on held-out sequences, written to eval.json.
"""
from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.errors import SpecjaxError
from specjax.training.prepare import _log, default_data_dir, prepare_data


def _check_settings(recipe: str, kw: dict, *fns) -> None:
  """Settings forwarded through **kwargs must exist somewhere down the line (gin would accept any name)."""
  import inspect
  known = {p for fn in fns for p in inspect.signature(fn).parameters}
  unknown = sorted(set(kw) - known)
  if unknown:
    raise SpecjaxError(f"unknown setting(s) for {recipe}: {', '.join(unknown)} (known: "
                       f"{', '.join(sorted(known - _INTERNAL))})")


_INTERNAL = {"target_params", "cfg", "loss_of", "params0", "frozen", "store", "feats", "fingerprint", "settings",
             "fit_kw", "model_name", "run_dir", "resume", "data_dir", "init"}


def _load_target(model: str, mesh: str | None):
  from specjax import api
  m = api.load(model)
  if mesh is not None:
    m = api.on_mesh(m, mesh)
    _log(f"target sharded over a {mesh} (data x model) mesh")
  return m


def train_eagle(*, run_dir: str, resume: bool = False, model: str = "smollm2-135m", data_dir: str | None = None,
                num_prompts: int = 2400, max_new_tokens: int = 256, extra_prompts: Sequence[str] = (),
                chat_prompts: int = 0, passage_prompts: int = 0, self_prompts: int = 0, code_prompts: int = 0,
                record_features: bool = True, max_len: int = 512, data_tokens: int = 0,
                gen_batch_size: int = 32, features: str = "final", fused_layers: Sequence[int] | None = None,
                eval_positions: int = 5, mesh: str | None = None, init_from: str | None = None,
                data_only: bool = False, **train_kw) -> dict:
  """Train an EAGLE-style feature drafter for ``model``: data (once per data directory), training
  (``train_eagle_on``'s settings), export to RUN_DIR/drafter, held-out evaluation; returns a summary (also
  written to summary.json).

  ``features``: ``final`` (the target's final hidden state) or ``fused`` (``fused_layers``, default low /
  middle / high).  The data directory defaults to the specjax cache (shared by every run on that data); what
  goes into it: ``num_prompts``, ``chat_prompts``, ``code_prompts``, ``passage_prompts``, ``self_prompts``
  (``prepare_data``, which records the features while the target replies unless ``record_features`` is off;
  ``max_len``: prompt + reply positions; ``data_tokens``: a budget of reply tokens for the first round).
  ``mesh`` ('DATAxMODEL'): the target (data generation, its feature pass) sharded over it, and training
  data-parallel on it (``_fit``).  ``init_from``: an exported drafter to continue from (fine-tuning on new
  data: its weights and its reduced vocabulary; its features and vocabulary size must match the settings).
  ``data_only``: stop once the data is complete (make it now, train later: a later run finds it).
  """
  from specjax.checkpoints import drafter_io
  from specjax.training import data as data_lib, evaluate

  _check_settings("train_eagle", train_kw, train_eagle_on, _fit)
  run = Path(run_dir).expanduser()
  if run.exists() and any(run.iterdir()) and not resume:
    raise SpecjaxError(f"run directory {run} already exists: pass --resume to continue it, or another --run-dir")
  t0 = time.perf_counter()
  m = _load_target(model, mesh)
  fused = tuple(fused_layers) if fused_layers is not None else data_lib.default_fused_layers(m.cfg.num_layers)
  ddir = (Path(data_dir).expanduser() if data_dir
          else default_data_dir(model, num_prompts, max_new_tokens, chat_prompts, passage_prompts, self_prompts,
                                code_prompts, data_tokens))
  prepare_data(m, ddir, num_prompts=num_prompts, max_new_tokens=max_new_tokens, extra_prompts=extra_prompts,
               chat_prompts=chat_prompts, passage_prompts=passage_prompts, self_prompts=self_prompts,
               code_prompts=code_prompts, record_features=record_features, max_len=max_len,
               data_tokens=data_tokens,
               gen_batch_size=gen_batch_size, seed=train_kw.get("seed", 0), fused_layers=fused)
  data_s = time.perf_counter() - t0
  if data_only:
    meta = json.loads((ddir / data_lib.FEATURES / "meta.json").read_text())
    summary = {"data_dir": str(ddir), "data_s": data_s, "data_tokens": meta["tokens"],
               "response_tokens": meta["response_tokens"], "sequences": meta["sequences"]}
    run.mkdir(parents=True, exist_ok=True)
    (run / "data_summary.json").write_text(json.dumps(summary, indent=1))
    _log(f"data complete in {ddir}: {meta['sequences']} sequences, {meta['tokens']} tokens")
    return summary
  init = _init_from(init_from, m, model, fused if features == "fused" else (), train_kw) if init_from else None
  res = train_eagle_on(m.params, m.cfg, data_dir=ddir, run_dir=run, resume=resume, features=features,
                       fused_layers=fused, model_name=model, mesh=m.mesh, init=init, **train_kw)
  ecfg, store = res["ecfg"], res["store"]
  params = jax.device_get(res["params"])
  training = {**res["settings"], "init_from": init_from, "train_tokens": int(store.meta["tokens"]),
              "sequences": store.num_sequences, "train_s": res["train_s"]}
  if ecfg.layout == "eagle3":      # the published architecture: written where vLLM reads it
    from specjax.checkpoints import speculators_io
    out = speculators_io.save_speculators(run / "drafter", ecfg, {**params, **res["frozen"]}, verifier=m.source,
                                          training=training)
  else:
    out = drafter_io.save_drafter(run / "drafter", ecfg, params, target_name=model, tokenizer=m.tokenizer,
                                  head_ids=res["head_ids"], training=training)
  _log(f"exported {out}")
  ev = evaluate.tvd_by_position(m, ecfg, {**params, **res["frozen"]}, store, res["held_idx"],
                                positions=eval_positions, seq_len=res["settings"]["seq_len"])
  summary = {"run_dir": str(run), "drafter": str(out), "data_dir": str(ddir), "data_s": data_s,
             "train_s": res["train_s"], "steps": res["settings"]["steps"], "final_loss": res["final_loss"],
             "train_sequences": res["train_sequences"], "held_out_sequences": int(len(res["held_idx"])),
             "data_tokens": int(store.meta["tokens"]), "response_tokens": int(store.meta["response_tokens"]),
             **ev, "settings": {**res["settings"], "init_from": init_from}}
  (run / "summary.json").write_text(json.dumps(summary, indent=1))
  return summary


def _init_from(init_from: str, m, model: str, fused: Sequence[int], train_kw: dict):
  """(trainable weights, reduced vocabulary or None) of an exported drafter to continue training from; its
  features, head size and parallel positions must be the ones these settings ask for."""
  from specjax.checkpoints import drafter_io
  ecfg0, params0, _ = drafter_io.load_drafter(init_from, m.cfg, m.params, m.tokenizer, model)
  want = (tuple(fused), int(train_kw.get("reduced_vocab", 0)), int(train_kw.get("parallel", 0)))
  if (ecfg0.feature_layers, ecfg0.head_size if ecfg0.reduced else 0, ecfg0.parallel) != want:
    raise SpecjaxError(f"init_from {init_from} reads layers {list(ecfg0.feature_layers)} with a "
                       f"{ecfg0.head_size}-token head (parallel {ecfg0.parallel}); the settings ask for "
                       f"{list(want[0])}, reduced_vocab {want[1]} and parallel {want[2]}: make them match the "
                       "drafter")
  frozen = ("embed", "head_ids", "target_head") + (("lm_head",) if ecfg0.layout != "eagle3" else ())
  _log(f"starting from the drafter in {init_from}")
  return ({k: v for k, v in params0.items() if k not in frozen},
          None if "head_ids" not in params0 else np.asarray(params0["head_ids"]))


def _reduced_head(store, cfg, size: int, train_idx=None):
  """(head_ids [size]: the target tokens most frequent on the training sequences ``train_idx`` (default all),
  sorted; t2d [V]: target id -> row, -1 outside) for a reduced draft vocabulary."""
  from specjax.training import eagle_train
  counts = eagle_train.token_counts(store, cfg.vocab_size, train_idx)
  head_ids = eagle_train.reduced_vocabulary(counts, size, always=cfg.eos_token_ids)
  pred = store.predicted_positions()
  covered = float(np.isin(np.asarray(store.topk_ids[:, 0])[pred], head_ids).mean())
  _log(f"reduced vocabulary: {size} tokens (chosen on the training split) cover {covered:.4f} of the target's "
       "first choices on all the data")
  return head_ids, _t2d(head_ids, cfg.vocab_size)


def _t2d(head_ids, vocab_size: int) -> jax.Array:
  """target id -> row of the reduced head, -1 outside it."""
  return jnp.full((vocab_size,), -1, jnp.int32).at[jnp.asarray(head_ids)].set(
      jnp.arange(len(head_ids), dtype=jnp.int32))


def train_eagle_on(target_params, cfg, *, data_dir, run_dir, resume: bool = False, model_name: str = "",
                   features: str = "final", fused_layers: Sequence[int] = (), reduced_vocab: int = 0,
                   loss: str = "fkl", w_cls: float = 1.0, w_reg: float = 0.0, unroll: int = 1,
                   step_decay: float = 1.0, matmul_dtype: str = "float32", parallel: int = 0, init=None,
                   architecture: str = "eagle", **fit_kw) -> dict:
  """The training stage on an existing feature store (``_fit``'s settings: steps, batch, optimizer,
  checkpoints).  ``init``: (trainable parameters, head_ids or None) to start from instead of a fresh drafter.

  ``reduced_vocab``: 0 = the target's vocabulary, else that many most frequent tokens.  ``loss``: ce | fkl |
  rkl | jsd | tvd (weight ``w_cls``), plus ``w_reg`` × smooth-L1 feature regression; ``unroll`` > 1 trains on
  the drafter's own features for that many steps (EAGLE-3's training-time test), step s weighted
  ``step_decay ** (s - 1)``.  ``matmul_dtype`` bfloat16: the drafter's products in bfloat16 with float32 sums
  (``eagle_train.train_forward``; parameters and optimizer stay float32).  ``parallel`` K >= 2: a parallel
  drafter (all K draft positions in one forward, ``speculative/eagle_parallel.py``), trained with unroll K.
  ``architecture``: "eagle" (specjax's head: fc([embedding ; feature]) into a Llama layer, the target's head
  rows) or "eagle3" (the published EAGLE-3 architecture, fused features only: its own head over the reduced
  vocabulary, started from the target's rows; exported in the speculators layout).
  """
  from specjax.speculative import eagle
  from specjax.training import eagle_train

  if features not in ("final", "fused"):
    raise SpecjaxError(f"features must be 'final' or 'fused', got '{features}'")
  if parallel and unroll != parallel:
    _log(f"a parallel drafter of {parallel} positions trains all of them: unroll {unroll} -> {parallel}")
    unroll = parallel
  try:
    lcfg = eagle_train.LossConfig(kind=loss, w_cls=w_cls, w_reg=w_reg, unroll=unroll, step_decay=step_decay,
                                  matmul_dtype=matmul_dtype)
    ecfg = _eagle_config(cfg, architecture, features, fused_layers, reduced_vocab, parallel)
  except ValueError as e:
    raise SpecjaxError(str(e)) from e
  store = eagle_train.FeatureData(data_dir)
  if init is not None and ecfg.reduced:
    head_ids, t2d = init[1], _t2d(init[1], cfg.vocab_size)
  else:
    # the vocabulary from the sequences training will see (the held-out split is _fit's, same seed)
    train_idx, _ = store.split(fit_kw.get("held_out", 0.02), fit_kw.get("seed", 0))
    head_ids, t2d = _reduced_head(store, cfg, reduced_vocab, train_idx) if ecfg.reduced else (None, None)
  frozen = {**eagle.frozen_from_target(ecfg, target_params, head_ids), "t2d": t2d}
  seed = fit_kw.get("seed", 0)
  if ecfg.layout == "eagle3":      # its own head (trainable), started from the target's rows it scores against
    frozen["target_head"] = frozen.pop("lm_head")
    fresh = {**eagle.init_eagle3(ecfg, jax.random.PRNGKey(seed), head_ids),
             "lm_head": jnp.array(frozen["target_head"], jnp.float32)}     # a copy: the train step donates it
    fresh.pop("head_ids", None)
  else:
    fresh = eagle.init_trainable(ecfg, jax.random.PRNGKey(seed)) if init is None else None
  # (a copy of ``init``: the train step donates its state)
  params0 = fresh if init is None else jax.tree.map(lambda x: jnp.array(x, jnp.float32), init[0])

  def loss_of(trainable, frozen, batch):
    fz = {k: v for k, v in frozen.items() if k != "t2d"}
    return eagle_train.loss_fn(trainable, fz, ecfg, lcfg, batch, frozen["t2d"])

  settings = dict(kind="eagle", architecture=architecture, model=model_name or cfg.name, data_dir=str(data_dir),
                  features=features,
                  feature_layers=list(ecfg.feature_layers), reduced_vocab=reduced_vocab, loss=loss, w_cls=w_cls,
                  w_reg=w_reg, unroll=unroll, step_decay=step_decay, matmul_dtype=matmul_dtype, parallel=parallel)
  fingerprint = {"drafter": "eagle", "target": model_name or cfg.name, **ecfg.to_dict(), "loss": lcfg.kind,
                 "unroll": unroll}
  res = _fit(loss_of, params0, frozen, store, store.features_for(ecfg), run_dir=run_dir, resume=resume,
             fingerprint=fingerprint, settings=settings, **fit_kw)
  return {**res, "ecfg": ecfg, "frozen": {k: v for k, v in frozen.items() if k != "t2d"}, "head_ids": head_ids,
          "store": store}


def _eagle_config(cfg, architecture: str, features: str, fused_layers, reduced_vocab: int, parallel: int):
  from specjax.speculative import eagle
  if architecture not in ("eagle", "eagle3"):
    raise ValueError(f"architecture must be 'eagle' (specjax's head) or 'eagle3' (the published one), got "
                     f"'{architecture}'")
  if architecture == "eagle3" and (features != "fused" or parallel):
    raise ValueError("an EAGLE-3 head reads fused features (features='fused') and drafts one position per "
                     "forward (parallel=0)")
  layers = tuple(fused_layers) if features == "fused" else ()
  if architecture == "eagle3":
    return eagle.EagleConfig(cfg, layers, reduced_vocab, layout="eagle3")
  return eagle.EagleConfig(cfg, layers, reduced_vocab, parallel)


def data_sharding(batch_size: int, mesh=None):
  """How a batch is placed: over the "data" axis of ``mesh`` (a (data, model) mesh: ``sharding.make_mesh``),
  or with no mesh and several devices over a one-axis data mesh of all of them (parameters replicated).  jit's
  SPMD partitioner turns the step data-parallel (gradients all-reduced).  None on one device, no mesh."""
  from jax.sharding import NamedSharding, PartitionSpec
  from specjax.parallel import sharding
  if mesh is None:
    if jax.device_count() == 1:
      return None
    mesh = sharding.make_mesh((jax.device_count(), 1))     # all devices on "data", the model whole
  n = mesh.shape["data"]
  if batch_size % n:
    raise SpecjaxError(f"batch_size {batch_size} does not split over {n} devices of the data axis: use a "
                       f"multiple of {n}")
  return NamedSharding(mesh, PartitionSpec("data"))


def _norm(tree):
  return optax.tree.norm(tree) if hasattr(optax, "tree") and hasattr(optax.tree, "norm") else optax.global_norm(tree)


def _fit(loss_of, params0, frozen, store, feats, *, run_dir, resume: bool, fingerprint: dict, settings: dict,
         steps: int = 1000, batch_size: int = 4, seq_len: int = 512, learning_rate: float = 1e-3,
         warmup_steps: int = 50, weight_decay: float = 0.0, clip_norm: float = 1.0, seed: int = 0,
         checkpoint_every: int = 100, keep_checkpoints: int = 2, held_out: float = 0.02, log_every: int = 10,
         progress: bool = True, mesh=None) -> dict:
  """The loop every drafter shares: ``loss_of(trainable, frozen, batch) -> (loss, metrics)`` in one jitted
  step, AdamW with warm-up and cosine decay, orbax checkpoints in RUN_DIR/checkpoints, exact resume.

  ``mesh`` ('DATAxMODEL' or a jax Mesh): batches over "data", the trainable and frozen parameters (and so
  the optimizer state) placed by ``sharding.RULES`` over "model"; the same losses as one device."""
  from specjax.parallel import sharding
  from specjax.training import eagle_train, loop, optim
  from specjax.training.checkpoint import Checkpointer

  if isinstance(mesh, str):
    mesh = sharding.make_mesh(mesh)
  shard = data_sharding(batch_size, mesh)      # checks batch_size against the data axis first
  if mesh is not None:
    params0, frozen = sharding.shard_params(params0, mesh), sharding.shard_params(frozen, mesh)

  run = Path(run_dir)
  run.mkdir(parents=True, exist_ok=True)
  train_idx, held_idx = store.split(held_out, seed)
  batcher = eagle_train.PackedBatcher(store, feats, train_idx, batch_size=batch_size, seq_len=seq_len, seed=seed)
  if batcher.truncated:
    _log(f"{batcher.truncated} sequences longer than seq_len={seq_len} are cut")
  tx = optim.make_optimizer(learning_rate=learning_rate, total_steps=steps, warmup_steps=warmup_steps,
                            weight_decay=weight_decay, clip_norm=clip_norm)
  schedule = optim.make_schedule(learning_rate=learning_rate, total_steps=steps, warmup_steps=warmup_steps)
  state = loop.make_train_state(params0, tx.init(params0), jax.random.PRNGKey(seed))
  if mesh is not None:   # the step count, the key and the like: replicated over the mesh
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.device_put(state, jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else rep, state))
  ckpt = Checkpointer(run / "checkpoints", every=checkpoint_every, keep=keep_checkpoints,
                      fingerprint={**fingerprint, "data": str(Path(store.dir).resolve())})
  if resume:
    restored = loop.resume(ckpt, jax.eval_shape(lambda: state), batcher, required=False)
    if restored is not None:
      placed = jax.tree.map(lambda x: x.sharding, state)    # restored arrays go where fresh ones would
      state, start = restored
      state = jax.device_put(state, placed)
      _log(f"resumed at step {start}")

  @partial(jax.jit, donate_argnums=0)
  def _step(state, frozen, batch):
    (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"], frozen, batch)
    updates, opt = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {**metrics, "grad_norm": _norm(grads), "lr": schedule(state["step"] + 1)}
    return {**state, "params": params, "opt_state": opt, "step": state["step"] + 1}, metrics

  last = {}

  def step_fn(state, batch):
    if shard is not None:
      batch = jax.device_put(batch, shard)
    with sharding.use(mesh):                   # traced on the first call: native kernels step aside on a mesh
      state, metrics = _step(state, frozen, batch)
    last["loss"] = metrics["loss"]
    return state, metrics

  settings = {**settings, "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
              "learning_rate": learning_rate, "warmup_steps": warmup_steps, "weight_decay": weight_decay,
              "clip_norm": clip_norm, "seed": seed, "held_out": held_out,
              "mesh": None if mesh is None else "x".join(map(str, mesh.devices.shape))}
  t1 = time.perf_counter()
  state = loop.train(step_fn, state, batcher, total_steps=steps, run_dir=run, checkpointer=ckpt,
                     log_every=log_every, tokens_per_batch=batch_size * seq_len, progress=progress,
                     extra_meta={"settings": settings})
  ckpt.close()
  return {"params": state["params"], "held_idx": held_idx, "train_sequences": int(len(train_idx)),
          "settings": settings, "train_s": time.perf_counter() - t1,
          "final_loss": float(last["loss"]) if "loss" in last else None}


def train_draft_model(*, run_dir: str, resume: bool = False, model: str = "smollm2-135m",
                      data_dir: str | None = None, num_prompts: int = 2400, max_new_tokens: int = 256,
                      extra_prompts: Sequence[str] = (), chat_prompts: int = 0, passage_prompts: int = 0,
                      self_prompts: int = 0,
                      gen_batch_size: int = 32, layers: Sequence[int] = (0, 1, 2, 3),
                      freeze_embeddings: bool = True, loss: str = "fkl", reduced_vocab: int = 0,
                      mesh: str | None = None, **fit_kw) -> dict:
  """Distil a small Llama draft model (the target's ``layers`` to start from, its embedding and head, frozen
  or not) on the stored data; exported to RUN_DIR/drafter as a Hugging Face directory for ``--drafter model``.
  ``reduced_vocab``: 0 = the target's vocabulary, else a head of that many most frequent tokens."""
  from specjax.checkpoints import drafter_io
  from specjax.training import draft_model, eagle_train, losses

  _check_settings("train_draft_model", fit_kw, _fit)
  if loss not in ("ce",) + losses.KINDS:
    raise SpecjaxError(f"unknown loss '{loss}': choose ce, fkl, rkl, jsd or tvd")
  run = Path(run_dir).expanduser()
  if run.exists() and any(run.iterdir()) and not resume:
    raise SpecjaxError(f"run directory {run} already exists: pass --resume to continue it, or another --run-dir")
  m = _load_target(model, mesh)
  layers = tuple(int(i) for i in layers)
  if not layers or any(not 0 <= i < m.cfg.num_layers for i in layers):
    raise SpecjaxError(f"layers {list(layers)}: give indices in [0, {m.cfg.num_layers})")
  ddir = (Path(data_dir).expanduser() if data_dir
          else default_data_dir(model, num_prompts, max_new_tokens, chat_prompts, passage_prompts, self_prompts))
  prepare_data(m, ddir, num_prompts=num_prompts, max_new_tokens=max_new_tokens, extra_prompts=extra_prompts,
               chat_prompts=chat_prompts, passage_prompts=passage_prompts, self_prompts=self_prompts,
               gen_batch_size=gen_batch_size, seed=fit_kw.get("seed", 0))
  store = eagle_train.FeatureData(ddir)
  if not 0 <= reduced_vocab <= m.cfg.vocab_size:
    raise SpecjaxError(f"reduced_vocab={reduced_vocab}: use 1..{m.cfg.vocab_size} tokens, or 0 for all")
  reduced = 0 < reduced_vocab < m.cfg.vocab_size
  train_idx, _ = store.split(fit_kw.get("held_out", 0.02), fit_kw.get("seed", 0))
  head_ids, t2d = _reduced_head(store, m.cfg, reduced_vocab, train_idx) if reduced else (None, None)
  dcfg = draft_model.draft_config(m.cfg, layers, reduced)
  trainable, frozen = draft_model.split(draft_model.init_from_target(m.params, layers, head_ids),
                                        freeze_embeddings)
  head = m.params["embed"] if m.cfg.tie_embeddings else m.params["lm_head"]
  if reduced:      # the target's distribution restricted to the draft's rows
    head = jnp.take(head, jnp.asarray(head_ids), axis=0)
  aux = {"head": head, **({"t2d": t2d} if reduced else {})}

  def loss_of(tr, fz, batch):
    return draft_model.loss_fn(tr, {k: v for k, v in fz.items() if k not in aux}, dcfg, loss, batch, fz["head"],
                               fz.get("t2d"))

  settings = dict(kind="model", model=model, data_dir=str(ddir), layers=list(layers),
                  freeze_embeddings=freeze_embeddings, loss=loss, reduced_vocab=reduced_vocab if reduced else 0)
  res = _fit(loss_of, trainable, {**frozen, **aux}, store, store.final, run_dir=run, resume=resume,
             fingerprint={"drafter": "model", "target": model, "layers": list(layers), "loss": loss,
                          "freeze_embeddings": freeze_embeddings, "reduced_vocab": reduced_vocab if reduced else 0},
             settings=settings, mesh=m.mesh, **fit_kw)
  params = {**jax.device_get(res["params"]), **frozen}
  out = draft_model.export_hf(run / "drafter", dcfg, params, m.tokenizer,
                              training={**res["settings"], "train_s": res["train_s"]})
  drafter_io.register(out.resolve(), "model", model)
  _log(f"exported {out}")
  summary = {"run_dir": str(run), "drafter": str(out), "data_dir": str(ddir), "train_s": res["train_s"],
             "steps": res["settings"]["steps"], "final_loss": res["final_loss"],
             "data_tokens": int(store.meta["tokens"]), "settings": res["settings"]}
  (run / "summary.json").write_text(json.dumps(summary, indent=1))
  return summary


def distill_losses(*, run_dir: str, resume: bool = False, model: str = "smollm2-135m",
                   data_dir: str | None = None, num_prompts: int = 2400, max_new_tokens: int = 256,
                   losses: Sequence[str] = ("ce", "fkl", "rkl", "jsd", "tvd"), eval_positions: int = 5,
                   mesh: str | None = None, **train_kw) -> dict:
  """The distillation losses side by side (DistillSpec): one feature drafter per loss, same data, steps and
  seed, each in RUN_DIR/<loss>; held-out 1 − TVD and greedy agreement per draft position, as a table
  (results.csv) and a plot (losses.png)."""
  from specjax.training import evaluate
  _check_settings("distill_losses", train_kw, train_eagle_on, _fit)
  run = Path(run_dir).expanduser()
  m = _load_target(model, mesh)
  ddir = Path(data_dir).expanduser() if data_dir else default_data_dir(model, num_prompts, max_new_tokens)
  prepare_data(m, ddir, num_prompts=num_prompts, max_new_tokens=max_new_tokens, extra_prompts=(),
               gen_batch_size=32, seed=train_kw.get("seed", 0))
  rows = []
  for kind in losses:
    sub = run / kind
    if sub.exists() and any(sub.iterdir()) and not resume:
      raise SpecjaxError(f"{sub} already exists: pass --resume to continue, or another --run-dir")
    res = train_eagle_on(m.params, m.cfg, data_dir=ddir, run_dir=sub, resume=resume, model_name=model, loss=kind,
                         mesh=m.mesh, **train_kw)
    ev = evaluate.tvd_by_position(m, res["ecfg"], {**jax.device_get(res["params"]), **res["frozen"]},
                                  res["store"], res["held_idx"], positions=eval_positions,
                                  seq_len=res["settings"]["seq_len"])
    rows.append({"loss": kind, "train_s": round(res["train_s"], 1), "final_loss": res["final_loss"],
                 **{f"tvd_acc_{i + 1}": round(a, 4) for i, a in enumerate(ev["tvd_acceptance_by_position"])},
                 **{f"greedy_{i + 1}": round(a, 4) for i, a in enumerate(ev["greedy_match_by_position"])}})
    _log(f"{kind}: held-out 1 - TVD by position {ev['tvd_acceptance_by_position']}")
  from specjax.eval.report import write_csv
  from specjax.eval.report import make_plot
  write_csv(rows, run / "results.csv")
  long = [{"loss": r["loss"], "position": i + 1, "1 - TVD": r[f"tvd_acc_{i + 1}"]}
          for r in rows for i in range(eval_positions)]
  make_plot(long, {"file": "losses.png", "x": "position", "y": "1 - TVD", "group": "loss",
                   "title": "held-out acceptance (1 - TVD) by draft position, per distillation loss"}, run)
  summary = {"run_dir": str(run), "rows": rows, "data_dir": str(ddir)}
  (run / "summary.json").write_text(json.dumps(summary, indent=1))
  return summary
