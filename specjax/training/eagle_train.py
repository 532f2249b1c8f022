"""Training the EAGLE-style feature drafter against stored target features (teacher forcing).

The training forward is the engine's drafter run over whole sequences at once:

  step 1:  input_t = fc([embed(x_t) ; g_{t-1}])  with g the target's features (zero at a sequence start)
  step s:  input_t = fc([embed(x_t) ; h^{(s-1)}_{t-1}])  the drafter's own previous output (EAGLE-3's
           training-time test: what a depth-(s-1) tree node sees)

and at step s the query at position t attends to what a depth-(s-1) node attends to in the engine: step-1
keys up to position t-s+1 (the committed prefix and the root) and the step-m key at position t-s+m for
m = 2..s (its drafted ancestors, then itself).  With ``unroll = 1`` this is plain causal attention.  Every
step's logits at t are scored against the target's distribution of token t+1 (``losses.divergence`` or
cross-entropy on the target's token) and, with ``w_reg``, its output against the target's final hidden state
(smooth L1: EAGLE's feature regression).  Only response positions count.

A parallel drafter (``EagleConfig.parallel = K``, unroll = K) is the same forward with step s >= 2's input
replaced by its learned placeholder: all K positions of an anchor are then computed in one engine forward
(``speculative/eagle_parallel.py``), and the mask above is exactly what they attend to there.

Sequences are packed end to end into rows of ``seq_len`` tokens (segment ids keep them apart; positions
restart per sequence, as in the engine).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import attention, decoder as model_lib, quant, rope
from specjax.errors import SpecjaxError
from specjax.speculative import eagle
from specjax.training import losses


# ----------------------------------------------------------------------------------------------------------
# Data


class FeatureData:
  """The arrays of a ``features/`` directory (memory-mapped) and the sequences' boundaries."""

  def __init__(self, data_dir: str | Path):
    d = Path(data_dir) / "features"
    if not (d / "meta.json").exists():
      raise SpecjaxError(f"no complete feature store in {d}: run `specjax distill-data` (features stage) first")
    try:
      self.meta = json.loads((d / "meta.json").read_text())
      load = lambda name: np.load(d / name, mmap_mode="r")
      self.tokens, self.offsets, self.prompt_lens = load("tokens.npy"), load("offsets.npy"), load("prompt_lens.npy")
      self.final, self.fused = load("final.npy"), load("fused.npy")
      self.topk_ids = load("topk_ids.npy")
    except (OSError, ValueError, json.JSONDecodeError) as e:
      raise SpecjaxError(f"feature store {d} is damaged ({e}): delete it and rerun the features stage") from e
    n = len(self.prompt_lens)
    if len(self.offsets) != n + 1 or self.offsets[-1] != len(self.tokens) or len(self.final) != len(self.tokens):
      raise SpecjaxError(f"feature store {d} is inconsistent (offsets, tokens and features disagree): delete "
                         "it and rerun the features stage")
    self.dir = d

  @property
  def num_sequences(self) -> int:
    return len(self.prompt_lens)

  def predicted_positions(self) -> np.ndarray:
    """bool [T]: the positions whose next token the drafter learns (the last prompt token to the token before
    the last), where the stored top-k is the target's (a recorded store has none at earlier prompt
    positions)."""
    T = len(self.tokens)
    starts = np.asarray(self.offsets[:-1]) + np.maximum(np.asarray(self.prompt_lens, np.int64) - 1, 0)
    ends = np.asarray(self.offsets[1:]) - 1
    edge = np.zeros(T + 1, np.int64)
    np.add.at(edge, starts, 1)
    np.add.at(edge, np.maximum(ends, starts), -1)
    return np.cumsum(edge[:T]) > 0

  def features_for(self, ecfg: eagle.EagleConfig):
    if ecfg.fused:
      if tuple(self.meta["fused_layers"]) != tuple(ecfg.feature_layers):
        raise SpecjaxError(f"feature store has fused layers {self.meta['fused_layers']} but the drafter reads "
                           f"{list(ecfg.feature_layers)}: recompute features with those layers or change the "
                           "config")
      return self.fused
    return self.final

  def split(self, held_out: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) sequence indices."""
    order = np.random.default_rng(seed).permutation(self.num_sequences)
    k = max(1, int(round(held_out * self.num_sequences))) if held_out > 0 else 0
    return np.sort(order[k:]), np.sort(order[:k])


def token_counts(data: FeatureData, vocab_size: int, sequences=None) -> np.ndarray:
  """How often each target token is the target's first choice or a response token (for a reduced vocab),
  over ``sequences`` (indices; default all: pass the training split, so a held-out score is not flattered)."""
  keep = np.ones(len(data.tokens), bool)
  if sequences is not None:
    keep[:] = False
    offsets = np.asarray(data.offsets)
    for s in sequences:
      keep[offsets[s]:offsets[s + 1]] = True
  first = np.asarray(data.topk_ids[:, 0])[data.predicted_positions() & keep]
  counts = np.bincount(first, minlength=vocab_size).astype(np.int64)
  return counts + np.bincount(np.asarray(data.tokens)[keep], minlength=vocab_size)


def reduced_vocabulary(counts: np.ndarray, size: int, always=()) -> np.ndarray:
  """The ``size`` most frequent token ids (plus ``always``, e.g. EOS), sorted."""
  order = np.argsort(-counts, kind="stable")
  keep = list(dict.fromkeys([int(t) for t in always] + order.tolist()))[:size]
  return np.sort(np.asarray(keep, np.int32))


class PackedBatcher:
  """Batches of packed rows; position = (epoch, row); the packing of an epoch depends only on (seed, epoch)."""

  def __init__(self, data: FeatureData, feats, indices: np.ndarray, *, batch_size: int, seq_len: int,
               seed: int = 0):
    self.data, self.feats, self.indices = data, feats, np.asarray(indices)
    self.B, self.T, self.seed = batch_size, seq_len, seed
    lens = np.diff(np.asarray(data.offsets))[self.indices]
    self.truncated = int(np.sum(lens > seq_len))
    self.epoch, self.row = 0, 0
    self._rows = self._pack(0)

  def _pack(self, epoch: int) -> list[list[int]]:
    order = np.random.default_rng([self.seed, epoch]).permutation(self.indices)
    off = np.asarray(self.data.offsets)
    rows, cur, used = [], [], 0
    for s in order:
      n = min(int(off[s + 1] - off[s]), self.T)
      if used + n > self.T:
        rows.append(cur)
        cur, used = [], 0
      cur.append(int(s))
      used += n
    if cur:
      rows.append(cur)
    return rows

  @property
  def rows_per_epoch(self) -> int:
    return len(self._rows)

  def position(self) -> dict:
    return {"epoch": self.epoch, "row": self.row}

  def seek(self, position: dict) -> None:
    self.epoch, self.row = int(position["epoch"]), int(position["row"])
    self._rows = self._pack(self.epoch)

  def next(self) -> dict:
    rows = []
    for _ in range(self.B):
      if self.row >= len(self._rows):
        self.epoch, self.row = self.epoch + 1, 0
        self._rows = self._pack(self.epoch)
      rows.append(self._rows[self.row])
      self.row += 1
    return self.assemble(rows)

  def assemble(self, rows: list[list[int]]) -> dict:
    B, T = len(rows), self.T
    F, D = self.feats.shape[1], self.data.final.shape[1]
    off = np.asarray(self.data.offsets)
    out = {"tokens": np.zeros((B, T), np.int32), "pos": np.zeros((B, T), np.int32),
           "seg": np.zeros((B, T), np.int32), "loss_mask": np.zeros((B, T), bool),
           "feats": np.zeros((B, T, F), np.float16), "final": np.zeros((B, T, D), np.float16)}
    for b, seqs in enumerate(rows):
      at = 0
      for j, s in enumerate(seqs):
        a = int(off[s])
        n = min(int(off[s + 1]) - a, T - at)
        sl = slice(at, at + n)
        out["tokens"][b, sl] = self.data.tokens[a:a + n]
        out["pos"][b, sl] = np.arange(n)
        out["seg"][b, sl] = j + 1
        p = int(self.data.prompt_lens[s])
        # position t predicts token t+1: response tokens, the next one inside this sequence
        out["loss_mask"][b, at + max(p - 1, 0):at + n - 1] = True
        out["feats"][b, sl] = self.feats[a:a + n]
        out["final"][b, sl] = self.data.final[a:a + n]
        at += n
    return out


# ----------------------------------------------------------------------------------------------------------
# The training forward


@dataclasses.dataclass(frozen=True)
class LossConfig:
  kind: str = "fkl"          # ce | fkl | rkl | jsd | tvd  (against the target's distribution)
  w_cls: float = 1.0         # weight of that term
  w_reg: float = 0.0         # smooth-L1 regression of the drafter's output to the target's final hidden state
  unroll: int = 1            # training-time test steps (1 = teacher forcing only)
  step_decay: float = 1.0    # weight of step s is step_decay ** (s - 1)
  matmul_dtype: str = "float32"   # or bfloat16 (train_forward)

  def __post_init__(self):
    if self.kind not in ("ce",) + losses.KINDS:
      raise ValueError(f"unknown loss '{self.kind}': choose ce or one of {', '.join(losses.KINDS)}")
    if self.unroll < 1:
      raise ValueError(f"unroll must be >= 1, got {self.unroll}")
    if self.matmul_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"matmul_dtype must be float32 or bfloat16, got '{self.matmul_dtype}'")


def _shift_prev(x_BxTxF, seg_BxT):
  """x_{t-1} within each sequence (zero at a sequence start)."""
  prev = jnp.concatenate([jnp.zeros_like(x_BxTxF[:, :1]), x_BxTxF[:, :-1]], axis=1)
  same = jnp.concatenate([jnp.zeros_like(seg_BxT[:, :1], bool), seg_BxT[:, 1:] == seg_BxT[:, :-1]], axis=1)
  return jnp.where(same[..., None], prev, 0)


def _shift(x_BxTx, n: int):
  """y[:, t] = x[:, t - n] (zero-filled): the diagonal keys of the training-time test."""
  if n == 0:
    return x_BxTx
  pad = jnp.zeros_like(x_BxTx[:, :n])
  return jnp.concatenate([pad, x_BxTx[:, :-n]], axis=1)


def _dot(spec: str, x, w, dtype):
  """einsum in ``dtype`` (bfloat16: both operands rounded, products summed in float32), else as is."""
  if dtype == jnp.float32:
    return jnp.einsum(spec, x, w)
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def train_forward(params, ecfg: eagle.EagleConfig, batch, unroll: int = 1, matmul_dtype=jnp.float32):
  """Logits [S, B, T, Vr] and output hidden states [S, B, T, D] of the S = unroll training-time-test steps.

  ``matmul_dtype`` bfloat16: the projections, the MLP and the head multiply in bfloat16 with float32 sums
  (the parameters, norms, attention and losses stay float32) — on CPUs with bfloat16 matrix units (AMX,
  AVX512-BF16) several times the float32 rate; float32 is the engine's arithmetic exactly."""
  dt = jnp.dtype(matmul_dtype)
  cfg = ecfg.layer_cfg
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  G = H // K
  lp = jax.tree_util.tree_map(lambda x: x[0], params["layers"])
  tokens, seg, pos = batch["tokens"], batch["seg"], batch["pos"]
  B, T = tokens.shape
  cos, sin = rope.rope_tables(cfg, pos)
  t_idx = jnp.arange(T)
  same_seg = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)        # [B, T(query), T(key)]
  # cfg.first_slot (published EAGLE layouts): a sequence's first tokens are seen only by themselves
  seen = pos[:, None, :] >= jnp.minimum(cfg.first_slot, pos[:, :, None])
  g = _shift_prev(_first_feature(params, ecfg, batch["feats"].astype(jnp.float32), dt), seg)
  keys, values, logits_all, hidden_all = [], [], [], []
  if ecfg.parallel and unroll != ecfg.parallel:
    raise ValueError(f"a parallel drafter of K={ecfg.parallel} trains with unroll = K, got {unroll}")
  for s in range(1, unroll + 1):
    x, h = _layer_input(params, ecfg, lp, tokens, g, s, dt)
    qkv = _dot("btd,nd->btn", h, lp["w_qkv"], dt)
    if "b_qkv" in lp:              # Qwen2's q/k/v biases (the engine's layer adds them too)
      qkv = qkv + lp["b_qkv"]
    q, k, v = jnp.split(qkv, [H * E, (H + K) * E], axis=-1)
    q, k = q.reshape(B, T, H, E), k.reshape(B, T, K, E)
    if cfg.qk_norm:                # a published drafter's Qwen3 layer
      q, k = model_lib.rms_norm(q, lp["q_norm"], cfg.norm_eps), model_lib.rms_norm(k, lp["k_norm"], cfg.norm_eps)
    q = rope.apply_rope(q, cos, sin).reshape(B, T, K, G, E)
    k = rope.apply_rope(k, cos, sin)
    v = v.reshape(B, T, K, E)
    keys.append(k)
    values.append(v)
    scale = 1.0 / math.sqrt(E)
    # step-1 keys: positions u <= t - s + 1 of the same sequence
    s1 = jnp.einsum("btkge,buke->bkgtu", q, keys[0]) * scale
    ok1 = same_seg & (t_idx[None, None, :] <= t_idx[None, :, None] - (s - 1)) & seen
    s1 = jnp.where(ok1[:, None, None], s1, attention.MASK_VALUE)
    # diagonal keys: step m at position t - s + m, m = 2..s
    diag_s, diag_v = [], []
    for m in range(2, s + 1):
      n = s - m
      km, vm = _shift(keys[m - 1], n), _shift(values[m - 1], n)
      ok = (t_idx >= n)[None, :] & (_shift(seg, n) == seg) & (seg > 0)               # [B, T]
      sc = jnp.einsum("btkge,btke->bkgt", q, km) * scale
      diag_s.append(jnp.where(ok[:, None, None], sc, attention.MASK_VALUE)[..., None])
      diag_v.append(vm)
    scores = jnp.concatenate([s1] + diag_s, axis=-1) if diag_s else s1
    probs = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bkgtu,buke->btkge", probs[..., :T], values[0])
    for i, vm in enumerate(diag_v):
      o = o + probs[..., T + i].transpose(0, 3, 1, 2)[..., None] * vm[:, :, :, None, :]
    x = x + _dot("btn,dn->btd", o.reshape(B, T, H * E), lp["wo"], dt)
    h = model_lib.rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
    gate, up = jnp.split(_dot("btd,nd->btn", h, lp["w_gate_up"], dt), 2, axis=-1)
    x = x + _dot("btf,df->btd", jax.nn.silu(gate) * up, lp["w_down"], dt)
    hidden = model_lib.rms_norm(x, params["final_norm"], cfg.norm_eps) if cfg.final_norm else x
    logits_all.append(_dot("btd,vd->btv", hidden, params["lm_head"], dt))
    hidden_all.append(hidden)
    # the next step reads the drafter's own output at t - 1 (EAGLE-3: before the final norm)
    g = _shift_prev(x if ecfg.feeds_prenorm else hidden, seg)
  return jnp.stack(logits_all), jnp.stack(hidden_all)


def _first_feature(params, ecfg: eagle.EagleConfig, feats_BxTxF, dt):
  """``eagle.target_feature`` (with specjax's fused head, its fuse product in ``dt``)."""
  if ecfg.fused and ecfg.layout != "eagle3" and dt != jnp.float32:
    return _dot("btf,df->btd", eagle.normalized_taps(ecfg, feats_BxTxF), params["fuse"], dt)
  return eagle.target_feature(params, ecfg, feats_BxTxF)


def _layer_input(params, ecfg: eagle.EagleConfig, lp, tokens_BxT, g_BxTxM, s: int, dt):
  """Step s's residual input x [B,T,M] and what its q/k/v read: norm(x), or EAGLE-3's [normed embedding ;
  normed feature] [B,T,2M]."""
  cfg = ecfg.layer_cfg
  B, T = tokens_BxT.shape
  if ecfg.parallel and s > 1:
    # Parallel drafting: the s-th draft position reads a learned placeholder, not a token and a feature
    # (row t = the placeholder at t for the anchor t - s + 1; its keys are the anchor's context and the
    # anchor's earlier placeholders: the same diagonal mask as the training-time test).
    x = jnp.broadcast_to(params["placeholders"][s - 2].astype(jnp.float32), (B, T, cfg.d_model))
  elif ecfg.layout == "eagle3":
    x, prefix = eagle.layer_inputs(params, ecfg, tokens_BxT, g_BxTxM)
    h = model_lib.rms_norm(x, lp["attn_norm"], cfg.norm_eps) if cfg.input_norm else x
    return x, jnp.concatenate([prefix, h], axis=-1)
  elif dt == jnp.float32:
    x = eagle.input_proj(params, tokens_BxT, g_BxTxM)
  else:
    e = quant.embed_rows(params["embed"], tokens_BxT, jnp.float32)
    x = _dot("btf,df->btd", jnp.concatenate([e, g_BxTxM], axis=-1), params["fc"], dt)
  return x, model_lib.rms_norm(x, lp["attn_norm"], cfg.norm_eps)


def target_logits(frozen, final_BxTxD, matmul_dtype=jnp.float32):
  """The target's logits over the drafter's vocabulary (its head rows) from its stored final hidden states;
  softmax over them = the target's distribution restricted to that vocabulary."""
  head = frozen["target_head"] if "target_head" in frozen else frozen["lm_head"]   # EAGLE-3 trains its own head
  return _dot("btd,vd->btv", final_BxTxD.astype(jnp.float32), head, jnp.dtype(matmul_dtype))


def loss_fn(trainable, frozen, ecfg: eagle.EagleConfig, lcfg: LossConfig, batch, t2d=None):
  """(loss, metrics).  ``t2d`` [V]: target id -> draft vocabulary index (-1 outside), for cross-entropy."""
  params = {**trainable, **frozen}
  logits_S, hidden_S = train_forward(params, ecfg, batch, lcfg.unroll, lcfg.matmul_dtype)
  p_logits = jax.lax.stop_gradient(target_logits(frozen, batch["final"], lcfg.matmul_dtype))
  final = batch["final"].astype(jnp.float32)
  mask = batch["loss_mask"]
  B, T = mask.shape
  next_tok = jnp.concatenate([batch["tokens"][:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
  labels = next_tok if t2d is None else t2d[next_tok]
  total, metrics, wsum = 0.0, {}, 0.0
  flat = lambda x: x.reshape(B * T, *x.shape[2:])
  for s in range(lcfg.unroll):
    w = lcfg.step_decay ** s
    m = flat(mask)
    if lcfg.kind == "ce":
      ok = m & (flat(labels) >= 0)
      cls = losses.cross_entropy(jnp.maximum(flat(labels), 0), flat(logits_S[s]), ok)
    else:
      cls = losses.divergence(lcfg.kind, flat(p_logits), flat(logits_S[s]), m)
    reg = losses.smooth_l1(flat(hidden_S[s]), flat(final), m) if lcfg.w_reg else 0.0
    total = total + w * (lcfg.w_cls * cls + lcfg.w_reg * reg)
    wsum += w
    acc = jnp.sum((jnp.argmax(flat(logits_S[s]), -1) == jnp.argmax(flat(p_logits), -1)) & m) / jnp.maximum(
        jnp.sum(m), 1)
    tvd = losses.divergence("tvd", flat(p_logits), flat(logits_S[s]), m)
    metrics[f"top1_s{s + 1}"] = acc
    metrics[f"accept_s{s + 1}"] = 1.0 - tvd
    if lcfg.w_reg:
      metrics[f"reg_s{s + 1}"] = reg
  loss = total / wsum
  metrics["loss"] = loss
  return loss, metrics
