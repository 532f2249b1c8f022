"""The speculative step and loop.

One iteration (``spec_step``, one jitted function over static shapes B, N1 = N + 1 tree slots, S):
  1. the drafter fills a token tree of N draft nodes under the root ``last`` (``tree.py``; the engine's
     ``shape``: a chain of k by default, any static tree, or a dynamic one chosen each step); node slots
     past k_active[b] or past the buffer's room are masked,
  2. the target verifies all N1 nodes in one forward over the fixed KV buffers, attention masked by the
     tree's ancestors, positions = length + depth (the native CPU kernels compute only the rows up to the
     last live node),
  3. the acceptance rule picks the accepted root-to-leaf path (n[b] drafts) and the next token,
  4. commit: EOS and max_new_tokens may cut the n+1 new tokens short; the accepted path's K/V move to the
     slots right after the committed prefix (``kv_cache.compact``; nothing moves for a chain), the length
     advances by the number kept, the drafter compacts its own cache the same way.
With N = 0 and ``NoDrafter`` this is plain autoregressive decoding: baselines run the same code.

``generate`` runs prefill and the whole loop on device (``lax.while_loop``); ``init`` + ``decode_loop`` are the
same in two calls (benchmarks time decoding apart from prefill); ``init`` + ``spec_step`` are the
step-at-a-time API for a host-side scheduler (k_active is data: changing it compiles nothing).

``Engine(per_row=True)`` reads each sequence's sampling settings and PRNG key from the state
(``SpecState.rows``, a ``sampling_rows.RowState`` given to ``init``): rows with different temperatures, top-k,
top-p and seeds share one compiled step, each drawing from its own key folded with its token count, and each
committed token's log-probability is recorded.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models import decode, decoder as model_lib, sampling, sampling_rows
from specjax.models.kv_cache import KVCache, compact
from specjax.speculative.trees import device as tree_lib
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.acceptance import SpeculativeSampling, rule_for


@struct.dataclass
class SpecStats:
  iterations: jax.Array        # loop iterations run (scalar)
  target_forwards: jax.Array   # target forwards, prefill included (scalar)
  draft_forwards: jax.Array    # drafter forwards (model drafters; scalar)
  drafted_B: jax.Array         # live draft tokens offered for verification
  accepted_B: jax.Array        # of which accepted
  committed_B: jax.Array       # tokens committed by speculative iterations (accepted + 1 per iteration)
  verify_steps_B: jax.Array    # iterations in which the sequence was live
  pos_accepted_K: jax.Array    # [D] per tree depth: a node there was accepted
  pos_reached_K: jax.Array     # [D] per tree depth: the accepted path reached a node with children there
  verify_rows_K1: jax.Array    # [N+1]: iterations whose verification had 1, 2, ..., N+1 live rows
  node_accepted_N1: jax.Array  # [N+1]: per tree node, live iterations whose accepted path went through it


@struct.dataclass
class SpecState:
  cache: KVCache
  draft: Any
  seq_BxS: jax.Array
  last_B: jax.Array
  num_new_B: jax.Array
  done_B: jax.Array
  max_new_B: jax.Array
  key: jax.Array
  stats: SpecStats
  starts_BxS: jax.Array        # bool: positions whose token was the root of an iteration (a draft followed it)
  rows: Any = None             # sampling_rows.RowState in per-row mode (``Engine.per_row``), else None
  record: Any = None           # Recorded with ``Engine.record``, else None


class Record(NamedTuple):
  """What the loop records at every position it commits (``Engine.record``): the target's residual stream
  after ``taps`` (layer outputs, concatenated: F = D × len(taps)) and its ``top_k`` most likely next tokens
  with their log-probabilities.  The verify forwards compute both already, so a drafter's training data
  (``training/data.py``) costs no second target pass."""
  taps: tuple[int, ...]
  top_k: int = 8
  final: bool = True           # also the final hidden state (after the final norm; D more columns, last)

  def forward_taps(self, num_layers: int) -> tuple[int, ...]:
    return tuple(self.taps) + ((num_layers - 1,) if self.final else ())


def _recorded(engine: Engine, params, features_BxTxF) -> jax.Array:
  """The forward's tapped outputs as recorded (float16): the last tap normalised into the final hidden state
  when ``record.final``."""
  if engine.record.final:
    D = engine.cfg.d_model
    last = model_lib.rms_norm(features_BxTxF[..., -D:].astype(jnp.float32), params["final_norm"],
                              engine.cfg.norm_eps)
    features_BxTxF = jnp.concatenate([features_BxTxF[..., :-D].astype(jnp.float32), last], axis=-1)
  return features_BxTxF.astype(jnp.float16)


@struct.dataclass
class Recorded:
  feats_BxSxF: jax.Array       # float16: the tapped layers' outputs of the token at each position
  topk_ids_BxSxK: jax.Array    # int32: the target's top-k next tokens after each position
  topk_lp_BxSxK: jax.Array     # float16: their log-probabilities


class Engine(NamedTuple):
  """Static description of a speculative decoder (hashable: a jit static argument)."""
  cfg: Any                     # target ModelConfig
  drafter: Any                 # NoDrafter | ModelDrafter | NgramDrafter
  k_max: int                   # N: draft nodes per iteration (a chain's k)
  sp: sampling.SamplingParams
  eos_ids: tuple[int, ...] = ()
  buckets: tuple[int, ...] | None = None
  acceptance: Any = None             # None: GreedyAcceptance when sp is greedy, else SpeculativeSampling
  tree: Any = None                   # StaticTree | DynamicShape with k_max nodes; None: the chain of k_max
  stats_nodes: int = 0               # size the per-depth / per-node counters for this many nodes (at least
                                     # k_max): engines of several k then share one SpecState (a scheduler)
  per_row: bool = False              # sampling settings and PRNG keys per sequence, read from the state
                                     # (``SpecState.rows``; the server's requests); ``sp`` is then unused
  record: Record | None = None       # record the target's features and top-k at every committed position

  @property
  def rule(self):
    if self.acceptance is not None:
      return self.acceptance
    # Per-row mode: one rule for every row; a greedy row's one-hot p makes it exactly greedy acceptance.
    return SpeculativeSampling() if self.per_row else rule_for(self.sp)

  @property
  def shape(self):
    shape = self.tree if self.tree is not None else tree_shapes.chain(self.k_max)
    if shape.num_nodes != self.k_max:
      raise ValueError(f"engine k_max={self.k_max} but its tree has {shape.num_nodes} nodes")
    return shape

  @property
  def depth(self) -> int:       # D: the deepest node
    return self.shape.max_depth

  @property
  def stats_sizes(self) -> tuple[int, int]:
    """(depths, nodes) of the SpecStats counters: this engine's, or ``stats_nodes``' if larger."""
    return max(self.depth, self.stats_nodes), max(self.k_max, self.stats_nodes)


def _is_eos(tok, eos_ids):
  if not eos_ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


def init(engine: Engine, target_params, draft_params, cache: KVCache, prompt_BxP, prompt_lens_B, max_new_B,
         key, rows: sampling_rows.RowState | None = None) -> SpecState:
  """Prefill target and drafter and sample the first token from the target.  ``rows``: each sequence's
  sampling settings and seed (required in per-row mode, where ``key`` is unused)."""
  B, P = prompt_BxP.shape
  S = cache.max_len
  taps = _feature_layers(engine.drafter)
  pre = decode.prefill(target_params, engine.cfg, cache, prompt_BxP, prompt_lens_B, engine.buckets,
                       feature_layers=_forward_taps(engine))
  record = None
  if engine.record is not None:   # the prompt's features, and the top-k after its last token
    F, K = pre.features.shape[-1], engine.record.top_k
    record = Recorded(feats_BxSxF=jnp.zeros((B, S, F), jnp.float16).at[:, :P].set(
                          _recorded(engine, target_params, pre.features)),
                      topk_ids_BxSxK=jnp.zeros((B, S, K), jnp.int32),
                      topk_lp_BxSxK=jnp.zeros((B, S, K), jnp.float16))
    record = _record_topk(record, pre.last_logits_BxV[:, None], (prompt_lens_B - 1)[:, None])
  if taps is None:
    draft = engine.drafter.init(draft_params, prompt_BxP, prompt_lens_B, S)
  else:   # a feature drafter reads the target's features of the prompt
    draft = engine.drafter.init(draft_params, prompt_BxP, prompt_lens_B, S,
                                _drafter_features(engine, target_params, pre.features))
  if engine.per_row:
    if rows is None:
      raise ValueError("a per-row engine needs each sequence's sampling settings and seed: pass rows=RowState")
    # A row's k-th draw comes from its own key folded with its count of tokens so far (0 here).
    tok = sampling_rows.sample(pre.last_logits_BxV, sampling_rows.row_keys(rows.keys_Bx2, 0), rows.sampling)
    lp_B = jnp.take_along_axis(jax.nn.log_softmax(pre.last_logits_BxV.astype(jnp.float32), -1), tok[:, None],
                               axis=1)[:, 0]
    rows = rows.replace(logprob_BxS=jnp.zeros((B, S), jnp.float32).at[jnp.arange(B), prompt_lens_B].set(
        lp_B, mode="drop"))
  else:
    key, sub = jax.random.split(key)
    tok = sampling.sample(pre.last_logits_BxV, sub, engine.sp)
    rows = None
  live = max_new_B > 0
  seq = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompt_BxP)
  seq = jnp.where(jnp.arange(S)[None, :] < prompt_lens_B[:, None], seq, 0)
  seq = seq.at[jnp.arange(B), jnp.where(live, prompt_lens_B, S)].set(tok, mode="drop")
  num_new = live.astype(jnp.int32)
  D, N = engine.stats_sizes
  zeros_B = jnp.zeros((B,), jnp.int32)
  stats = SpecStats(iterations=jnp.zeros((), jnp.int32), target_forwards=jnp.ones((), jnp.int32),
                    draft_forwards=jnp.zeros((), jnp.int32), drafted_B=zeros_B, accepted_B=zeros_B,
                    committed_B=zeros_B, verify_steps_B=zeros_B, pos_accepted_K=jnp.zeros((D,), jnp.int32),
                    pos_reached_K=jnp.zeros((D,), jnp.int32),
                    verify_rows_K1=jnp.zeros((N + 1,), jnp.int32),
                    node_accepted_N1=jnp.zeros((N + 1,), jnp.int32))
  return SpecState(cache=pre.cache, draft=draft, seq_BxS=seq, last_B=tok, num_new_B=num_new,
                   done_B=~live | _is_eos(tok, engine.eos_ids) | (num_new >= max_new_B), max_new_B=max_new_B,
                   key=key, stats=stats, starts_BxS=jnp.zeros((B, S), bool), rows=rows, record=record)


def _feature_layers(drafter):
  """What a feature drafter (EAGLE) reads from the target's forwards (see ``model.forward``); None for the
  others."""
  return getattr(drafter, "feature_layers", None)


def _forward_taps(engine: Engine):
  """The ``feature_layers`` of the engine's target forwards: the drafter's, or what ``record`` asks for (a
  feature drafter's own layers then come first: ``_drafter_features``)."""
  taps = _feature_layers(engine.drafter)
  if engine.record is None:
    return taps
  if taps is not None and tuple(taps) != tuple(engine.record.taps):
    raise ValueError(f"recording layers {list(engine.record.taps)} while a feature drafter reading layers "
                     f"{list(taps)} drafts: record the drafter's own layers (Record(taps=its feature_layers))")
  return engine.record.forward_taps(engine.cfg.num_layers)


def _drafter_features(engine: Engine, target_params, features_BxTxF):
  """What a feature drafter reads of the target forward's ``features``: all of them, unless the engine also
  records, when the forward returns the recorded taps (the drafter's layers, then the last layer's raw output)
  and the drafter's part is cut out of them — its fused layers, or the final hidden state (the last layer's
  output under the final norm, as ``model.forward`` computes it)."""
  taps = _feature_layers(engine.drafter)
  if engine.record is None or taps is None:
    return features_BxTxF
  D = engine.cfg.d_model
  if taps:
    return features_BxTxF[..., :len(taps) * D]
  if not engine.record.final:          # taps () and no final column: the forward returned the final state
    return features_BxTxF
  return model_lib.rms_norm(features_BxTxF[..., -D:], target_params["final_norm"], engine.cfg.norm_eps)


def _record_topk(record: Recorded, logits_BxJxV, pos_BxJ) -> Recorded:
  """The top-k next tokens of the distributions ``logits_BxJxV`` at positions ``pos_BxJ`` (S: dropped); nothing
  with ``Record.top_k = 0``."""
  if record.topk_ids_BxSxK.shape[-1] == 0:
    return record
  lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits_BxJxV.astype(jnp.float32), axis=-1),
                          record.topk_ids_BxSxK.shape[-1])
  b = jnp.arange(pos_BxJ.shape[0])[:, None]
  return record.replace(topk_ids_BxSxK=record.topk_ids_BxSxK.at[b, pos_BxJ].set(ids, mode="drop"),
                        topk_lp_BxSxK=record.topk_lp_BxSxK.at[b, pos_BxJ].set(lp.astype(jnp.float16),
                                                                                mode="drop"))


def spec_step(engine: Engine, target_params, draft_params, state: SpecState, k_active_B) -> SpecState:
  """One draft → verify → accept → commit iteration for every live sequence."""
  shape, N, D = engine.shape, engine.k_max, engine.depth
  N1 = N + 1
  cache = state.cache
  B, S = state.seq_BxS.shape
  lengths = cache.lengths
  live = ~state.done_B
  key = state.key
  if engine.per_row:        # each row's keys for this step: its own key folded with its token count
    sp = state.rows.sampling
    k_draft, k_accept = sampling_rows.split(sampling_rows.row_keys(state.rows.keys_Bx2, state.num_new_B), 2)
  else:
    sp = engine.sp
    key, k_draft, k_accept = jax.random.split(key, 3)

  # 1. Draft a tree.  Node i is verified at slot lengths + i: never past the cache, never past k_active.
  draft, d = engine.drafter.propose(draft_params, state.draft, state.seq_BxS, lengths, state.last_B, shape,
                                    k_draft, sp)
  room_B = jnp.maximum(S - 1 - lengths, 0)
  active = jnp.arange(N1)[None, :] <= jnp.minimum(k_active_B, room_B)[:, None]
  tree = tree_lib.build(d.tokens_BxN1, d.parents_BxN1, d.valid_BxN1 & active & live[:, None])

  # 2. Verify every node in one target forward.  Only each sequence's rows up to its last live node matter,
  #    none for a finished sequence or an empty serving slot: the native CPU kernels skip the rest, so a step
  #    costs what its live rows cost (a sequence whose drafter found nothing costs a plain step; idle slots
  #    cost nothing).  `rows_B` is data: changing it compiles nothing.
  node_ids = jnp.arange(N1)[None, :]
  rows_B = jnp.where(live, jnp.max(jnp.where(tree.valid_BxN1, node_ids, 0), axis=1) + 1, 0).astype(jnp.int32)
  rows = jnp.maximum(jnp.max(rows_B), 1)
  taps = _feature_layers(engine.drafter)
  out = decode.windowed_forward(target_params, engine.cfg, tree.tokens_BxN1, tree_lib.positions(tree, lengths),
                                cache, buckets=engine.buckets, live_T=rows_B,
                                region_mask_BxTxU=tree_lib.region_mask(tree), feature_layers=_forward_taps(engine))

  # 3. Accept: a root-to-leaf path of n drafts, then the next token.
  acc = engine.rule(tree, out.logits, d.q_BxN1xV, k_accept, sp,
                    engine.drafter.siblings_without_replacement)
  n = jnp.take_along_axis(tree.depth_BxN1, acc.leaf_B[:, None], axis=1)[:, 0]
  path = tree_lib.path_nodes(tree, acc.leaf_B, D)                               # [B, D+1], -1 past n

  # 4. Commit: the path's drafts, then next; cut at the first EOS and at max_new_tokens.
  j_D1 = jnp.arange(D + 1)[None, :]
  path_tok = jnp.take_along_axis(tree.tokens_BxN1, jnp.maximum(path[:, 1:], 0), axis=1)
  cand = jnp.concatenate([path_tok, jnp.zeros((B, 1), jnp.int32)], axis=1)
  cand = jnp.where(j_D1 == n[:, None], acc.next_token_B[:, None], cand)
  valid = j_D1 <= n[:, None]
  eos = _is_eos(cand, engine.eos_ids) & valid
  after_eos = (jnp.cumsum(eos.astype(jnp.int32), axis=1) - eos.astype(jnp.int32)) > 0
  budget = (state.max_new_B - state.num_new_B)[:, None]
  keep = valid & ~after_eos & (j_D1 < budget) & live[:, None]
  count = jnp.sum(keep, axis=1).astype(jnp.int32)                 # tokens committed this iteration
  idx = jnp.where(keep, lengths[:, None] + 1 + j_D1, S)
  seq = state.seq_BxS.at[jnp.arange(B)[:, None], idx].set(cand, mode="drop")
  row_state = state.rows
  if engine.per_row:        # each committed token's log-probability: the logits of the path node before it
    path_logits = jnp.take_along_axis(out.logits, jnp.maximum(path, 0)[:, :, None], axis=1)    # [B, D+1, V]
    lp = jnp.take_along_axis(jax.nn.log_softmax(path_logits.astype(jnp.float32), -1), cand[:, :, None],
                             axis=2)[:, :, 0]
    row_state = row_state.replace(
        logprob_BxS=row_state.logprob_BxS.at[jnp.arange(B)[:, None], idx].set(lp, mode="drop"))
  new_lengths = lengths + count
  newest = jnp.take_along_axis(cand, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
  last = jnp.where(count > 0, newest, state.last_B)
  num_new = state.num_new_B + count
  hit_eos = jnp.any(eos & keep, axis=1)
  done = state.done_B | hit_eos | (num_new >= state.max_new_B)

  # The accepted path's K/V move next to the prefix (a chain's path is already there).
  new_cache = out.cache.with_lengths(new_lengths)
  if not tree_shapes.is_chain(shape):
    new_cache = compact(new_cache, lengths, path)
  slots = d.slots_BxN1 if d.slots_BxN1 is not None else jnp.broadcast_to(node_ids, (B, N1)).astype(jnp.int32)
  path_slots = jnp.where(path >= 0, jnp.take_along_axis(slots, jnp.maximum(path, 0), axis=1), -1)
  if taps is None:
    draft = engine.drafter.commit(draft, lengths, path_slots, new_lengths)
  else:   # the target's features along the accepted path (the root first) feed the drafter's next step
    path_feats = jnp.take_along_axis(_drafter_features(engine, target_params, out.features),
                                     jnp.maximum(path, 0)[:, :, None], axis=1)
    draft = engine.drafter.commit(draft, lengths, path_slots, new_lengths, path_feats)

  record = state.record
  if record is not None:   # the root and the accepted nodes: their features, and the top-k after each
    safe_path = jnp.maximum(path, 0)[:, :, None]
    pos = jnp.where(j_D1 < count[:, None], lengths[:, None] + j_D1, S)                # [B, D+1]
    feats = _recorded(engine, target_params, jnp.take_along_axis(out.features, safe_path, axis=1))
    record = record.replace(feats_BxSxF=record.feats_BxSxF.at[jnp.arange(B)[:, None], pos].set(feats,
                                                                                                 mode="drop"))
    record = _record_topk(record, jnp.take_along_axis(out.logits, safe_path, axis=1), pos)

  st = state.stats
  D_st, N_st = engine.stats_sizes
  pad = lambda x, n: jnp.pad(x, (0, n - x.shape[0]))            # noqa: E731  (counters sized for a scheduler)
  live_i = live.astype(jnp.int32)
  reached_D = jnp.take_along_axis(tree_lib.has_child(tree), jnp.maximum(path[:, :D], 0), axis=1) & (path[:, :D] >= 0)
  stats = SpecStats(
      iterations=st.iterations + 1,
      target_forwards=st.target_forwards + 1,
      draft_forwards=st.draft_forwards + engine.drafter.forwards(shape),
      drafted_B=st.drafted_B + jnp.sum(tree.valid_BxN1[:, 1:], axis=1).astype(jnp.int32) * live_i,
      accepted_B=st.accepted_B + n * live_i,
      committed_B=st.committed_B + count,
      verify_steps_B=st.verify_steps_B + live_i,
      pos_accepted_K=st.pos_accepted_K + pad(jnp.sum((j_D1[:, :D] < n[:, None]) & live[:, None], axis=0), D_st),
      pos_reached_K=st.pos_reached_K + pad(jnp.sum(reached_D & live[:, None], axis=0), D_st),
      verify_rows_K1=st.verify_rows_K1.at[rows - 1].add(1),
      node_accepted_N1=st.node_accepted_N1 + pad(jnp.sum(acc.accepted_BxN1 & live[:, None], axis=0), N_st + 1))
  starts = state.starts_BxS.at[jnp.arange(B), jnp.where(live, lengths, S)].set(True, mode="drop")
  return SpecState(cache=new_cache, draft=draft, seq_BxS=seq, last_B=last, num_new_B=num_new, done_B=done,
                   max_new_B=state.max_new_B, key=key, stats=stats, starts_BxS=starts, rows=row_state,
                   record=record)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("cache",))
def generate(target_params, draft_params, cache: KVCache, prompt_BxP, prompt_lens_B, max_new_B, k_active_B,
             key, rows=None, *, engine: Engine) -> SpecState:
  """Prefill, then speculative iterations until every sequence is done — one on-device loop."""
  state = init(engine, target_params, draft_params, cache, prompt_BxP, prompt_lens_B, max_new_B, key, rows)
  return decode_loop(engine, target_params, draft_params, state, k_active_B)


def decode_loop(engine: Engine, target_params, draft_params, state: SpecState, k_active_B) -> SpecState:
  """Speculative iterations from a prefilled state until every sequence is done — one on-device loop."""
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B),
                            lambda s: spec_step(engine, target_params, draft_params, s, k_active_B), state)


def autoregressive(cfg, sp: sampling.SamplingParams, eos_ids: tuple[int, ...] = (),
                   buckets: tuple[int, ...] | None = None) -> Engine:
  """Plain decoding: the k = 0 case of the speculative step."""
  from specjax.speculative.drafters import NoDrafter
  return Engine(cfg=cfg, drafter=NoDrafter(), k_max=0, sp=sp, eos_ids=eos_ids, buckets=buckets)


init_jit = jax.jit(init, static_argnames=("engine",), donate_argnames=("cache",))
step_jit = jax.jit(spec_step, static_argnames=("engine",), donate_argnames=("state",))
decode_loop_jit = jax.jit(decode_loop, static_argnames=("engine",), donate_argnames=("state",))
