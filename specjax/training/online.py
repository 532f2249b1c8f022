"""Online adaptation: a trained feature drafter keeps learning from the traffic a server decodes.

The verify passes compute the target's features at every committed position already; with
``Engine.record`` (``OnlineAdapter.record``: the drafter's own layers plus the final hidden state, no top-k)
the decode loop keeps them, and when a request finishes the batcher hands its tokens and features to
``OnlineAdapter.observe``.  They go into a ``ReplayBuffer`` of at most ``buffer_tokens`` positions (the oldest
requests are evicted first, so the buffer follows the traffic).  ``OnlineAdapter.step`` runs one optax step
of the offline recipe's loss (``eagle_train.loss_fn``: forward KL against the target's distribution from its
recorded final hidden state, the training-time-test unroll, the feature regression) on a batch packed from
the buffer; ``draft_params`` gives the engine the adapted weights in the exact shapes and dtypes it was
compiled for, so swapping them compiles nothing.  The target's tokens never depend on the drafter: only
acceptance changes.

When the steps run is the server's choice (``serving/batcher.py``: while no request is waiting or running,
and optionally every n busy steps).  ``save``/``restore`` keep the adapted head and its optimizer state in
orbax checkpoints (``training/checkpoint.Checkpointer``), so a killed server restarts with the last adapted
head.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path
import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models import decoder as model_lib
from specjax.errors import SpecjaxError
from specjax.kernels.qformat import is_quantized
from specjax.speculative import eagle
from specjax.speculative.engine import Record
from specjax.training import eagle_train
from specjax.training.checkpoint import Checkpointer

FROZEN = ("embed", "lm_head", "head_ids")      # the target's part of a feature drafter's params


@dataclasses.dataclass(frozen=True)
class AdaptConfig:
  """How a served drafter adapts.  ``buffer_tokens``: positions the replay buffer holds (features and tokens
  of finished requests; oldest evicted first); ``batch_size`` × ``seq_len``: a training batch packed from it;
  ``min_tokens``: positions needed before the first step; ``replay``: how many times, on average, each served
  position is trained on (each finished request adds ``replay × positions ÷ (batch_size × seq_len)`` steps
  to the budget the adapter may take: training follows the traffic, and an idle server stops once it has
  learned what it saw); ``every``: also one step every ``every`` busy decode steps (0: only while idle);
  ``accumulate``: the optimizer updates the head once every this many steps, from their averaged gradients
  (``optax.MultiSteps``): each step is then a short micro-step (a small ``seq_len``), so that a request
  arriving while the idle server trains waits at most one micro-step, while each update still sees
  ``accumulate × batch_size × seq_len`` positions; ``checkpoint_every``: save every this many steps."""
  learning_rate: float = 1e-4
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  batch_size: int = 2
  seq_len: int = 256
  unroll: int = 2
  loss: str = "fkl"
  w_reg: float = 0.1
  buffer_tokens: int = 16384
  min_tokens: int = 256
  replay: float = 4.0
  every: int = 0
  accumulate: int = 1
  checkpoint_every: int = 50
  keep_checkpoints: int = 2
  matmul_dtype: str = "float32"     # or bfloat16: the training forward's matmuls (several times faster on AMX)
  seed: int = 0

  def __post_init__(self):
    for name in ("batch_size", "seq_len", "unroll", "buffer_tokens", "min_tokens", "accumulate",
                 "checkpoint_every", "keep_checkpoints"):
      if int(getattr(self, name)) < 1:
        raise SpecjaxError(f"adaptation setting {name} must be >= 1, got {getattr(self, name)}")
    if self.every < 0:
      raise SpecjaxError(f"--adapt-every must be >= 0 (0: adapt only while idle), got {self.every}")
    if not self.replay > 0:
      raise SpecjaxError(f"adaptation replay must be > 0 (passes over each served position), got {self.replay}")
    if not self.learning_rate > 0:
      raise SpecjaxError(f"--adapt-lr must be > 0, got {self.learning_rate}")
    if self.matmul_dtype not in ("float32", "bfloat16"):
      raise SpecjaxError(f"adaptation matmul_dtype must be float32 or bfloat16, got {self.matmul_dtype!r}")
    if self.buffer_tokens < self.seq_len:
      raise SpecjaxError(f"the replay buffer ({self.buffer_tokens} positions) must hold at least one training "
                         f"row of {self.seq_len}: raise --adapt-buffer-tokens")


class ReplayBuffer:
  """Finished requests' tokens and recorded features, at most ``capacity`` positions in all (the oldest
  evicted first).  A sequence longer than ``seq_len`` is kept as consecutive windows of ``seq_len`` positions
  from its first predicted position on (the prompt before the last ``seq_len`` positions of it is dropped),
  each with its absolute positions for the rotary embedding; a window attends only within itself.  ``batch``
  packs randomly drawn windows into rows laid out as ``eagle_train.PackedBatcher.assemble`` does."""

  def __init__(self, capacity: int, seq_len: int, feat_dim: int, final_dim: int, seed: int = 0):
    self.capacity, self.T, self.F, self.D = int(capacity), int(seq_len), int(feat_dim), int(final_dim)
    self._seqs: collections.deque[dict] = collections.deque()
    self.tokens_held = 0
    self.added = 0                 # sequences ever added
    self.windows_added = 0         # windows they were cut into
    self.evicted = 0               # windows evicted
    self.rng = np.random.default_rng(seed)

  def __len__(self) -> int:
    return len(self._seqs)

  def add(self, tokens, feats_TxF, final_TxD, prompt_len: int) -> None:
    """One finished sequence (prompt and reply): ``feats``/``final`` recorded at every position (the last
    position's are never used: nothing after it is predicted)."""
    tokens = np.asarray(tokens, np.int32)
    T = len(tokens)
    if T < 2 or T - prompt_len < 1:
      return
    # The first window holds up to half a window of the prompt's end and the reply's start; the rest of the
    # reply follows in windows that overlap the one before by two positions, so every position is predicted
    # once, reading its previous position's feature (``first`` = 1 in them: position 0 only supplies it).
    start = max(0, min(prompt_len - 1 - (self.T - 1) // 2, T - self.T))
    first = prompt_len - 1 - start
    while True:
      end = min(start + self.T, T)
      self._seqs.append({"tokens": tokens[start:end], "start": start, "first": first,
                         "feats": np.asarray(feats_TxF[start:end], np.float16),
                         "final": np.asarray(final_TxD[start:end], np.float16)})
      self.tokens_held += end - start
      self.windows_added += 1
      if end >= T:
        break
      start, first = end - 2, 1
    self.added += 1
    while self.tokens_held > self.capacity and self._seqs:
      old = self._seqs.popleft()
      self.tokens_held -= len(old["tokens"])
      self.evicted += 1

  @property
  def nbytes(self) -> int:
    return sum(s["tokens"].nbytes + s["feats"].nbytes + s["final"].nbytes for s in self._seqs)

  @property
  def capacity_bytes(self) -> int:
    """The most the buffer can hold: ``capacity`` positions of tokens and features."""
    return self.capacity * (4 + 2 * (self.F + self.D))

  def batch(self, batch_size: int) -> dict:
    """``batch_size`` rows of ``seq_len`` positions, each packed with randomly drawn sequences."""
    if not self._seqs:
      raise SpecjaxError("the replay buffer is empty: nothing to adapt on yet")
    B, T = batch_size, self.T
    out = {"tokens": np.zeros((B, T), np.int32), "pos": np.zeros((B, T), np.int32),
           "seg": np.zeros((B, T), np.int32), "loss_mask": np.zeros((B, T), bool),
           "feats": np.zeros((B, T, self.F), np.float16), "final": np.zeros((B, T, self.D), np.float16)}
    for b in range(B):
      at, j = 0, 0
      for i in self.rng.permutation(len(self._seqs)):
        s = self._seqs[int(i)]
        n = len(s["tokens"])
        if at + n > T:                  # (each sequence is at most T long: the first always fits)
          continue
        sl = slice(at, at + n)
        out["tokens"][b, sl] = s["tokens"][:n]
        out["pos"][b, sl] = s["start"] + np.arange(n)
        out["seg"][b, sl] = j + 1
        out["loss_mask"][b, at + s["first"]:at + n - 1] = True
        out["feats"][b, sl] = s["feats"][:n]
        out["final"][b, sl] = s["final"][:n]
        at, j = at + n, j + 1
        if at >= T:
          break
    return out


def _training_frozen(params: dict, matmul_dtype: str) -> dict:
  """The frozen part as the training forward reads it: a quantized head dequantized, and the head cast once
  to ``matmul_dtype`` (the step's products read it in that type: the same numbers, without a cast of the
  vocabulary-sized matrix in every step)."""
  out = {k: params[k] for k in FROZEN if k in params}
  if is_quantized(out.get("lm_head")):
    out["lm_head"] = out["lm_head"].dequantize(jnp.float32)
  if "lm_head" in out:
    out["lm_head"] = jnp.asarray(out["lm_head"], matmul_dtype)
  return out


class OnlineAdapter:
  """A feature drafter (``ecfg``) that learns from served requests; ``draft_params``: its params as the
  engine runs them (per-layer list on the CPU, ``model.unstack_layers``, or stacked), the frozen target part
  included.

  ``checkpoint_dir``: where the adapted head is saved (orbax, every ``cfg.checkpoint_every`` steps and at
  ``close``); if it holds a checkpoint of this drafter, the adapter starts from it (a restarted server)."""

  def __init__(self, ecfg: eagle.EagleConfig, draft_params: dict, cfg: AdaptConfig = AdaptConfig(), *,
               checkpoint_dir: str | Path | None = None, fingerprint: dict | None = None, log=None):
    self.ecfg, self.cfg, self.log = ecfg, cfg, log or (lambda msg: None)
    self._engine_params = draft_params
    self._unstacked = isinstance(draft_params.get("layers"), (list, tuple))
    stacked = model_lib.stack_layers(draft_params) if self._unstacked else draft_params
    engine_trainable = {k: v for k, v in stacked.items() if k not in FROZEN}
    self._dtypes = jax.tree_util.tree_map(lambda x: x.dtype, engine_trainable)
    trainable = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), engine_trainable)
    self.frozen = _training_frozen(draft_params, cfg.matmul_dtype)
    D = ecfg.target.d_model
    self.record = Record(taps=tuple(ecfg.feature_layers), top_k=0, final=True)
    self.feat_dim = D * max(len(ecfg.feature_layers), 1)
    self.buffer = ReplayBuffer(cfg.buffer_tokens, cfg.seq_len, self.feat_dim, D, cfg.seed)
    self.lcfg = eagle_train.LossConfig(kind=cfg.loss, w_reg=cfg.w_reg, unroll=ecfg.parallel or cfg.unroll,
                                       matmul_dtype=cfg.matmul_dtype)
    # An update whose gradients are not finite is skipped (the served head never takes a NaN); with
    # ``accumulate`` > 1 the update is made from the average of that many steps' gradients.
    self.opt = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                                                 optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)),
                                     max_consecutive_errors=1_000_000)
    if cfg.accumulate > 1:
      self.opt = optax.MultiSteps(self.opt, every_k_schedule=cfg.accumulate)
    self.state = {"params": trainable, "opt_state": self.opt.init(trainable), "step": jnp.zeros((), jnp.int32)}
    ecfg_, lcfg, opt = ecfg, self.lcfg, self.opt

    def _step(state, frozen, batch):
      (_, metrics), grads = jax.value_and_grad(eagle_train.loss_fn, has_aux=True)(
          state["params"], frozen, ecfg_, lcfg, batch)
      updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
      return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
              "step": state["step"] + 1}, metrics

    self._jit_step = jax.jit(_step)   # no donation: the engine may hold the same arrays (same dtype, no copy)
    self.steps, self.train_s, self.observe_s, self.history = 0, 0.0, 0.0, []
    self.budget = 0.0
    self.skipped = 0               # requests left out (a recorded feature not finite)
    self._busy_since_step = 0
    self.ckpt = None
    if checkpoint_dir is not None:
      fp = {"kind": "online-eagle", "feature_layers": list(ecfg.feature_layers), "head": ecfg.head_size,
            "parallel": ecfg.parallel, "d_model": D, **(fingerprint or {})}
      self.ckpt = Checkpointer(checkpoint_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                               fingerprint=fp)
      if self.ckpt.latest_step() is not None:
        self.state, meta = self.ckpt.restore(target=jax.eval_shape(lambda s: s, self.state))
        self.steps = int(meta["step"])
        self.log(f"[adapt] restored the adapted head at step {self.steps} from {self.ckpt.directory}")

  @classmethod
  def for_engine(cls, drafter, draft_params, cfg: AdaptConfig = AdaptConfig(), **kwargs) -> "OnlineAdapter":
    """The adapter of a built feature drafter (``registry.build``'s drafter and params); a drafter that reads
    no target features cannot adapt this way."""
    ecfg = getattr(drafter, "ecfg", None)
    if ecfg is None:
      raise SpecjaxError(f"--adapt trains a feature drafter's head from served traffic: drafter "
                         f"'{getattr(drafter, 'name', drafter)}' has none; use --drafter eagle (or "
                         "eagle-parallel) --draft DIR")
    return cls(ecfg, draft_params, cfg, **kwargs)

  # ------------------------------------------------------------------ data in
  def observe(self, tokens, recorded_TxF, prompt_len: int) -> None:
    """A finished request: its tokens (prompt + reply) and the features recorded at those positions
    (``record``'s layout: the drafter's layers, then the final hidden state)."""
    t0 = time.perf_counter()
    rec = np.asarray(recorded_TxF)
    if not np.all(np.isfinite(rec[:-1])):     # a feature past float16's range: left out, counted
      self.skipped += 1
      return
    D = self.ecfg.target.d_model
    final = rec[:, -D:]
    feats = rec[:, :self.feat_dim] if self.ecfg.fused else final
    self.buffer.add(tokens, feats, final, prompt_len)
    self.budget += self.cfg.replay * len(tokens) / (self.cfg.batch_size * self.cfg.seq_len)
    self.observe_s += time.perf_counter() - t0

  @property
  def ready(self) -> bool:
    """Enough in the buffer, and steps left in the budget the traffic has earned."""
    return self.buffer.tokens_held >= self.cfg.min_tokens and self.budget >= 1.0

  # ------------------------------------------------------------------ learning
  def warmup(self) -> float:
    """Compile the training step once (on a batch of zeros; the state is not changed); returns seconds."""
    t0 = time.perf_counter()
    probe = ReplayBuffer(self.cfg.seq_len, self.cfg.seq_len, self.feat_dim, self.ecfg.target.d_model)
    T = self.cfg.seq_len
    probe.add(np.zeros(T, np.int32), np.zeros((T, self.feat_dim)), np.zeros((T, self.ecfg.target.d_model)), 1)
    batch = probe.batch(self.cfg.batch_size)
    copy = jax.tree_util.tree_map(jnp.copy, self.state)
    jax.block_until_ready(self._jit_step(copy, self.frozen, batch))
    return time.perf_counter() - t0

  def step(self) -> dict:
    """One optimizer step on a batch from the replay buffer; returns its metrics (floats)."""
    t0 = time.perf_counter()
    batch = self.buffer.batch(self.cfg.batch_size)
    self.state, metrics = self._jit_step(self.state, self.frozen, batch)
    self.budget = max(0.0, self.budget - 1.0)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    self.steps += 1
    dt = time.perf_counter() - t0
    self.train_s += dt
    self.history.append({"step": self.steps, "t": time.time(), "seconds": dt, **metrics})
    if self.ckpt is not None and self.steps % self.cfg.checkpoint_every == 0:
      self.save()
    return metrics

  def busy_tick(self) -> bool:
    """Called after each busy decode step: whether an adaptation step is due (``cfg.every``)."""
    if not self.cfg.every:
      return False
    self._busy_since_step += 1
    if self._busy_since_step >= self.cfg.every:
      self._busy_since_step = 0
      return self.ready
    return False

  def draft_params(self) -> dict:
    """The engine's draft params with the adapted weights, in the shapes and dtypes it was compiled for."""
    adapted = jax.tree_util.tree_map(lambda x, d: x.astype(d), self.state["params"], self._dtypes)
    if self._unstacked:
      adapted = model_lib.unstack_layers(adapted)
    return {**self._engine_params, **adapted}

  # ------------------------------------------------------------------ checkpoints
  def save(self) -> bool:
    if self.ckpt is None:
      return False
    t0 = time.perf_counter()
    saved = self.ckpt.save(self.steps, self.state, {"buffer_tokens": self.buffer.tokens_held,
                                                    "requests_seen": self.buffer.added}, force=True)
    self.train_s += time.perf_counter() - t0
    return saved

  def close(self) -> None:
    if self.ckpt is not None:
      if self.steps:
        self.save()
      self.ckpt.close()

  def stats(self) -> dict:
    """What the adapter did: steps, seconds, the buffer's fill against its bound, the last losses."""
    last = self.history[-1] if self.history else {}
    return {"steps": self.steps, "train_s": self.train_s, "observe_s": self.observe_s, "budget": self.budget,
            "buffer_tokens": self.buffer.tokens_held, "buffer_capacity": self.buffer.capacity,
            "buffer_bytes": self.buffer.nbytes, "buffer_capacity_bytes": self.buffer.capacity_bytes,
            "requests_seen": self.buffer.added, "evicted": self.buffer.evicted, "skipped": self.skipped,
            "last": {k: v for k, v in last.items() if k not in ("t",)}}
