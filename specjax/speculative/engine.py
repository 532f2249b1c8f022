"""The speculative step and loop.

One iteration (``spec_step``, one jitted function over static shapes B, N1 = N + 1 tree slots, S), as stages:
  ``draft``   the drafter fills a token tree of N draft nodes under the root ``last`` (``trees/``; the engine's
              ``shape``: a chain of k by default, any static tree, or a dynamic one chosen each step); node
              slots past k_active[b] or past the buffer's room are masked,
  ``verify``  the target verifies all N1 nodes in one forward over the fixed KV buffers, attention masked by
              the tree's ancestors, positions = length + depth (the native CPU kernels compute only the rows
              up to the last live node),
  ``accept``  the acceptance rule picks the accepted root-to-leaf path (n[b] drafts) and the next token,
  ``commit``  EOS and max_new_tokens may cut the n+1 new tokens short; they go into the sequence buffer,
  ``advance`` the length advances by the number kept; the accepted path's K/V move to the slots right after the
              committed prefix (``kv_cache.compact``; nothing moves for a chain) and the drafter compacts its
              own cache the same way,
  ``count``   the statistics (``SpecStats``); with ``Engine.record`` the step's features and top-k are recorded
              (``record.py``), in per-row mode each committed token's log-probability.
With N = 0 and ``NoDrafter`` this is plain autoregressive decoding: baselines run the same code.

``generate`` runs prefill and the whole loop on device (``lax.while_loop``); ``init`` + ``decode_loop`` are the
same in two calls (benchmarks time decoding apart from prefill); ``init`` + ``spec_step`` are the
step-at-a-time API for a host-side scheduler (k_active is data: changing it compiles nothing).

``Engine(per_row=True)`` reads each sequence's sampling settings and PRNG key from the state
(``SpecState.rows``, a ``sampling_rows.RowState`` given to ``init``): rows with different temperatures, top-k,
top-p and seeds share one compiled step, each drawing from its own key folded with its token count, and each
committed token's log-probability is recorded.

Shape letters.  An array's name ends in its shape (``tokens_BxN1`` is [B, N1]; ``count_B`` is [B]), and one
letter means one thing throughout ``specjax/speculative/``:

  B    sequences in the batch (one cache row each; a serving slot)
  S    positions per sequence: the KV cache's and the sequence buffer's length (max_len)
  P    the batch's padded prompt length
  N    draft nodes per step (``Engine.k_max``; a chain's k); N1 = N + 1 tree slots, node 0 the root (``last``)
  D    tree depth: the deepest draft node (``Engine.depth``); D1 = D + 1, a root-to-leaf path, root first
  V    the target's vocabulary (Vr: the rows of a reduced draft head)
  M    the model width (d_model)
  F    feature width: target layer outputs read or recorded, concatenated (M per tapped layer)
  T    tokens fed to one forward
  U    the slots after the committed prefix that one forward's tree mask covers
  W    rows of one drafter forward: the nodes with children at one depth, a dynamic tree's frontier, a chunk
  J    positions recorded at once (a step's path: D1; a prompt's last token: 1)
  K    the best K tokens of one distribution: a node's children drawn together, a dynamic tree's TOPK, the
       recorded top-k (``Record.top_k``), the ranks of an acceptance table
  R    candidate continuations a lookup drafter ranks (n-gram occurrences, suffix matches)
  H    positions a suffix drafter searches (its corpus, then every row's known tokens)
  C    token slots of the suffix drafter's corpus
  2    a raw PRNG key's two words (``keys_Bx2``)

``models/`` keeps its own letters for weights and caches (there D is d_model and K the KV heads: the cache is
[L, B, S, K, E]); its keyword arguments keep them where this package calls it (``inputs_embeds_BxTxD``).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models import decode, decoder as model_lib, sampling, sampling_rows
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, compact
from specjax.speculative import record as record_lib
from specjax.speculative.acceptance import CHAIN_ONLY, AcceptanceRule, SpeculativeSampling, rule_for
from specjax.speculative.drafters import Draft, DynamicShape, NoDrafter
from specjax.speculative.protocol import Drafter, DraftSampling, DraftShape, DraftState, feature_layers
from specjax.speculative.record import Record, Recorded
from specjax.speculative.trees import device as tree_lib
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.trees.static import StaticTree


@struct.dataclass
class SpecStats:
  iterations: jax.Array        # loop iterations run (scalar)
  target_forwards: jax.Array   # target forwards, prefill included (scalar)
  draft_forwards: jax.Array    # drafter forwards (model drafters; scalar)
  drafted_B: jax.Array         # live draft tokens offered for verification
  accepted_B: jax.Array        # of which accepted
  committed_B: jax.Array       # tokens committed by speculative iterations (accepted + 1 per iteration)
  verify_steps_B: jax.Array    # iterations in which the sequence was live
  pos_accepted_D: jax.Array    # per tree depth 1..D: a node there was accepted
  pos_reached_D: jax.Array     # per tree depth 1..D: the accepted path reached a node with children there
  verify_rows_N1: jax.Array    # iterations whose verification had 1, 2, ..., N+1 live rows
  node_accepted_N1: jax.Array  # per tree node: live iterations whose accepted path went through it

  @classmethod
  def zeros(cls, B: int, D: int, N: int) -> SpecStats:
    """The counters before the first step (prefill's one target forward counted), for B sequences, trees of
    depth D and N nodes."""
    zeros_B = jnp.zeros((B,), jnp.int32)
    return cls(iterations=jnp.zeros((), jnp.int32), target_forwards=jnp.ones((), jnp.int32),
               draft_forwards=jnp.zeros((), jnp.int32), drafted_B=zeros_B, accepted_B=zeros_B,
               committed_B=zeros_B, verify_steps_B=zeros_B, pos_accepted_D=jnp.zeros((D,), jnp.int32),
               pos_reached_D=jnp.zeros((D,), jnp.int32), verify_rows_N1=jnp.zeros((N + 1,), jnp.int32),
               node_accepted_N1=jnp.zeros((N + 1,), jnp.int32))


@struct.dataclass
class SpecState:
  cache: KVCache
  draft: DraftState            # the drafter's own state (``protocol.DraftState``)
  seq_BxS: jax.Array
  last_B: jax.Array
  num_new_B: jax.Array
  done_B: jax.Array
  max_new_B: jax.Array
  key: jax.Array
  stats: SpecStats
  starts_BxS: jax.Array        # bool: positions whose token was the root of an iteration (a draft followed it)
  rows: sampling_rows.RowState | None = None   # per-row mode (``Engine.per_row``): each sequence's sampling
  record: Recorded | None = None               # with ``Engine.record``: what the loop recorded


class Engine(NamedTuple):
  """Static description of a speculative decoder (hashable: a jit static argument)."""
  cfg: ModelConfig                   # the target's
  drafter: Drafter                   # ``protocol.Drafter`` (the registry builds them by name)
  k_max: int                         # N: draft nodes per iteration (a chain's k)
  sp: sampling.SamplingParams
  eos_ids: tuple[int, ...] = ()
  buckets: tuple[int, ...] | None = None
  acceptance: AcceptanceRule | None = None   # None: GreedyAcceptance when sp is greedy, else SpeculativeSampling
  tree: StaticTree | DynamicShape | None = None   # with k_max nodes; None: the chain of k_max
  stats_nodes: int = 0               # size the per-depth / per-node counters for this many nodes (at least
                                     # k_max): engines of several k then share one SpecState (a scheduler)
  per_row: bool = False              # sampling settings and PRNG keys per sequence, read from the state
                                     # (``SpecState.rows``; the server's requests); ``sp`` is then unused
  record: Record | None = None       # record the target's features and top-k at every committed position

  @property
  def rule(self) -> AcceptanceRule:
    if self.acceptance is not None:
      chain = getattr(self.shape, "parents", None) == tuple(range(-1, self.k_max))   # a dynamic tree has none
      if isinstance(self.acceptance, CHAIN_ONLY) and not chain:
        raise ValueError(f"{type(self.acceptance).__name__} judges a chain of drafts; this engine drafts a tree: "
                         "drop --tree, or verify it token by token (--verify tokenwise)")
      return self.acceptance
    # Per-row mode: one rule for every row; a greedy row's one-hot p makes it exactly greedy acceptance.
    return SpeculativeSampling() if self.per_row else rule_for(self.sp)

  @property
  def shape(self) -> DraftShape:
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

  @property
  def forward_taps(self) -> tuple[int, ...] | None:
    """The ``feature_layers`` of the target forwards: what the drafter reads, or what ``record`` asks for."""
    return record_lib.forward_taps(self.record, feature_layers(self.drafter), self.cfg.num_layers)


def _is_eos(tok, eos_ids):
  if not eos_ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


def _drafter_features(engine: Engine, target_params, features_BxTxF: jax.Array) -> jax.Array:
  """What the engine's feature drafter reads of a target forward's features (``record.drafter_features``)."""
  return record_lib.drafter_features(engine.record, feature_layers(engine.drafter), engine.cfg, target_params,
                                     features_BxTxF)


def init(engine: Engine, target_params, draft_params, cache: KVCache, prompt_BxP, prompt_lens_B, max_new_B,
         key, rows: sampling_rows.RowState | None = None) -> SpecState:
  """Prefill target and drafter and sample the first token from the target.  ``rows``: each sequence's
  sampling settings and seed (required in per-row mode, where ``key`` is unused)."""
  B, P = prompt_BxP.shape
  S = cache.max_len
  pre = decode.prefill(target_params, engine.cfg, cache, prompt_BxP, prompt_lens_B, engine.buckets,
                       feature_layers=engine.forward_taps)
  record = None
  if engine.record is not None:   # the prompt's features, and the top-k after its last token
    record = record_lib.start(engine.record, engine.cfg, target_params, pre.features, pre.last_logits_BxV,
                              prompt_lens_B, S)
  if feature_layers(engine.drafter) is None:
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
  stats = SpecStats.zeros(B, *engine.stats_sizes)
  return SpecState(cache=pre.cache, draft=draft, seq_BxS=seq, last_B=tok, num_new_B=num_new,
                   done_B=~live | _is_eos(tok, engine.eos_ids) | (num_new >= max_new_B), max_new_B=max_new_B,
                   key=key, stats=stats, starts_BxS=jnp.zeros((B, S), bool), rows=rows, record=record)


# ------------------------------------------------------------------------------------------------------------
# The step, stage by stage (``spec_step`` at the end composes them).  Each is pure and keeps every shape
# static; their order is the step's, so the traced program (and every PRNG draw) is the one-body step's.

def step_keys(engine: Engine, state: SpecState) -> tuple[jax.Array, jax.Array, jax.Array, DraftSampling]:
  """This step's randomness: (the next state's batch key, the drafter's key, the acceptance rule's key, the
  sampling rule).  Per-row mode: each row's two keys come from its own key folded with its token count (the
  batch key passes through unused); else the batch key splits in three."""
  key = state.key
  if engine.per_row:
    k_draft_B, k_accept_B = sampling_rows.split(sampling_rows.row_keys(state.rows.keys_Bx2, state.num_new_B), 2)
    return key, k_draft_B, k_accept_B, state.rows.sampling
  key, k_draft, k_accept = jax.random.split(key, 3)
  return key, k_draft, k_accept, engine.sp


def draft(engine: Engine, draft_params, state: SpecState, k_active_B: jax.Array, live_B: jax.Array,
          key: jax.Array, sp: DraftSampling) -> tuple[DraftState, Draft, tree_lib.Tree]:
  """1. The drafter's tree under each sequence's newest token: (the drafter's state after proposing, its
  ``Draft`` [B, N1], the tree the target verifies).  Node i is verified at slot lengths + i, so a node is
  live only up to ``k_active_B`` and inside the cache, and no node of a finished sequence (``live_B``) is:
  data, never a shape."""
  lengths_B = state.cache.lengths
  N1, S = engine.k_max + 1, state.seq_BxS.shape[1]
  draft_state, d = engine.drafter.propose(draft_params, state.draft, state.seq_BxS, lengths_B, state.last_B,
                                          engine.shape, key, sp)
  room_B = jnp.maximum(S - 1 - lengths_B, 0)
  active_BxN1 = jnp.arange(N1)[None, :] <= jnp.minimum(k_active_B, room_B)[:, None]
  tree = tree_lib.build(d.tokens_BxN1, d.parents_BxN1, d.valid_BxN1 & active_BxN1 & live_B[:, None])
  return draft_state, d, tree


class Verified(NamedTuple):
  """The target's forward over a tree (``verify``)."""
  out: model_lib.ForwardOutput   # logits [B, N1, V]; the cache with the nodes' K/V written; features [B, N1, F]
  rows: jax.Array                # scalar int32: the rows verified (the most any sequence needed; at least 1)
  node_1xN1: jax.Array           # the node ids 0..N


def verify(engine: Engine, target_params, cache: KVCache, tree: tree_lib.Tree, live_B: jax.Array) -> Verified:
  """2. The target's forward over every node of ``tree`` [B, N1] at positions lengths + depth, attention
  masked by the tree's ancestors.  Only each sequence's rows up to its last live node matter, none for a
  finished sequence or an empty serving slot: the native CPU kernels skip the rest, so a step costs what its
  live rows cost (a sequence whose drafter found nothing costs a plain step; idle slots cost nothing).  The
  live rows are data: changing them compiles nothing."""
  node_1xN1 = jnp.arange(engine.k_max + 1)[None, :]
  rows_B = jnp.where(live_B, jnp.max(jnp.where(tree.valid_BxN1, node_1xN1, 0), axis=1) + 1, 0).astype(jnp.int32)
  rows = jnp.maximum(jnp.max(rows_B), 1)
  out = decode.windowed_forward(target_params, engine.cfg, tree.tokens_BxN1, tree_lib.positions(tree, cache.lengths),
                                cache, buckets=engine.buckets, live_T=rows_B,
                                region_mask_BxTxU=tree_lib.region_mask(tree), feature_layers=engine.forward_taps)
  return Verified(out, rows, node_1xN1)


class Accepted(NamedTuple):
  """The acceptance rule's verdict on a tree (``accept``)."""
  rule: tree_lib.TreeAcceptance  # leaf_B, next_token_B, accepted_BxN1 (the nodes on the path)
  n_B: jax.Array                 # accepted drafts: the leaf's depth
  path_BxD1: jax.Array           # the path's node at each depth 0..D (-1 past n)


def accept(engine: Engine, tree: tree_lib.Tree, logits_BxN1xV: jax.Array, q_BxN1xV: jax.Array | None,
           key: jax.Array, sp: DraftSampling) -> Accepted:
  """3. The acceptance rule over ``tree`` with the target's ``logits_BxN1xV`` (and the drafter's
  ``q_BxN1xV`` when sampling): a root-to-leaf path of n drafts, then the next token."""
  acc = engine.rule(tree, logits_BxN1xV, q_BxN1xV, key, sp, engine.drafter.siblings_without_replacement)
  n_B = jnp.take_along_axis(tree.depth_BxN1, acc.leaf_B[:, None], axis=1)[:, 0]
  path_BxD1 = tree_lib.path_nodes(tree, acc.leaf_B, engine.depth)
  return Accepted(acc, n_B, path_BxD1)


class Committed(NamedTuple):
  """The tokens a step commits (``commit``): the accepted path's drafts, then the next token."""
  j_1xD1: jax.Array              # 0..D: a new token's index along the path
  cand_BxD1: jax.Array           # the path's drafts, the next token at n (0 past it)
  eos_BxD1: jax.Array            # an EOS among the first n + 1
  keep_BxD1: jax.Array           # committed: up to n, none after the first EOS, within max_new, live only
  count_B: jax.Array             # int32: how many
  idx_BxD1: jax.Array            # where they went in the sequence buffer (S: nowhere)
  seq_BxS: jax.Array             # the sequence buffer with them


def commit(engine: Engine, state: SpecState, tree: tree_lib.Tree, a: Accepted, live_B: jax.Array) -> Committed:
  """4. The accepted path's drafts and the next token written after each live sequence's newest token, cut at
  the first EOS and at max_new_tokens."""
  B, S = state.seq_BxS.shape
  lengths_B, n_B, path_BxD1 = state.cache.lengths, a.n_B, a.path_BxD1
  j_1xD1 = jnp.arange(engine.depth + 1)[None, :]
  path_tok_BxD = jnp.take_along_axis(tree.tokens_BxN1, jnp.maximum(path_BxD1[:, 1:], 0), axis=1)
  cand = jnp.concatenate([path_tok_BxD, jnp.zeros((B, 1), jnp.int32)], axis=1)
  cand = jnp.where(j_1xD1 == n_B[:, None], a.rule.next_token_B[:, None], cand)
  valid = j_1xD1 <= n_B[:, None]
  eos = _is_eos(cand, engine.eos_ids) & valid
  after_eos = (jnp.cumsum(eos.astype(jnp.int32), axis=1) - eos.astype(jnp.int32)) > 0
  budget_Bx1 = (state.max_new_B - state.num_new_B)[:, None]
  keep = valid & ~after_eos & (j_1xD1 < budget_Bx1) & live_B[:, None]
  count_B = jnp.sum(keep, axis=1).astype(jnp.int32)
  idx = jnp.where(keep, lengths_B[:, None] + 1 + j_1xD1, S)
  seq = state.seq_BxS.at[jnp.arange(B)[:, None], idx].set(cand, mode="drop")
  return Committed(j_1xD1, cand, eos, keep, count_B, idx, seq)


def row_logprobs(rows: sampling_rows.RowState, logits_BxN1xV: jax.Array, path_BxD1: jax.Array,
                 c: Committed) -> sampling_rows.RowState:
  """Per-row mode: each committed token's log-probability under the target, from the logits of the path
  node before it, written at its position in ``rows.logprob_BxS``."""
  B = path_BxD1.shape[0]
  path_logits_BxD1xV = jnp.take_along_axis(logits_BxN1xV, jnp.maximum(path_BxD1, 0)[:, :, None], axis=1)
  lp_BxD1 = jnp.take_along_axis(jax.nn.log_softmax(path_logits_BxD1xV.astype(jnp.float32), -1),
                                c.cand_BxD1[:, :, None], axis=2)[:, :, 0]
  return rows.replace(logprob_BxS=rows.logprob_BxS.at[jnp.arange(B)[:, None], c.idx_BxD1].set(lp_BxD1,
                                                                                                mode="drop"))


def advance(state: SpecState, c: Committed) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """5a. Each sequence after the commit: (its committed length, newest token, tokens generated, done)."""
  new_lengths_B = state.cache.lengths + c.count_B
  newest_B = jnp.take_along_axis(c.cand_BxD1, jnp.maximum(c.count_B - 1, 0)[:, None], axis=1)[:, 0]
  last_B = jnp.where(c.count_B > 0, newest_B, state.last_B)
  num_new_B = state.num_new_B + c.count_B
  hit_eos_B = jnp.any(c.eos_BxD1 & c.keep_BxD1, axis=1)
  done_B = state.done_B | hit_eos_B | (num_new_B >= state.max_new_B)
  return new_lengths_B, last_B, num_new_B, done_B


def commit_target_cache(engine: Engine, cache: KVCache, lengths_B: jax.Array, new_lengths_B: jax.Array,
                        path_BxD1: jax.Array) -> KVCache:
  """5b. The verified cache with the accepted path's K/V moved next to the prefix (a chain's path is already
  there) and the new lengths."""
  cache = cache.with_lengths(new_lengths_B)
  if not tree_shapes.is_chain(engine.shape):
    cache = compact(cache, lengths_B, path_BxD1)
  return cache


def commit_drafter(engine: Engine, target_params, draft_state: DraftState, d: Draft, v: Verified,
                   path_BxD1: jax.Array, lengths_B: jax.Array, new_lengths_B: jax.Array) -> DraftState:
  """5c. The drafter's ``commit``: the accepted path as its own slots (``Draft.slots``; -1 past the leaf), and
  for a feature drafter the target's features along it (the root first) to read next step."""
  B, N1 = d.tokens_BxN1.shape
  slots_BxN1 = (d.slots_BxN1 if d.slots_BxN1 is not None
                else jnp.broadcast_to(v.node_1xN1, (B, N1)).astype(jnp.int32))
  path_slots_BxD1 = jnp.where(path_BxD1 >= 0, jnp.take_along_axis(slots_BxN1, jnp.maximum(path_BxD1, 0), axis=1),
                              -1)
  if feature_layers(engine.drafter) is None:
    return engine.drafter.commit(draft_state, lengths_B, path_slots_BxD1, new_lengths_B)
  path_feats_BxD1xF = jnp.take_along_axis(_drafter_features(engine, target_params, v.out.features),
                                          jnp.maximum(path_BxD1, 0)[:, :, None], axis=1)
  return engine.drafter.commit(draft_state, lengths_B, path_slots_BxD1, new_lengths_B, path_feats_BxD1xF)


def count(engine: Engine, stats: SpecStats, tree: tree_lib.Tree, v: Verified, a: Accepted, c: Committed,
          live_B: jax.Array) -> SpecStats:
  """6. The counters after the step (per-depth and per-node ones padded to ``Engine.stats_sizes``, so that
  engines of several k share one state)."""
  D, (D_st, N_st) = engine.depth, engine.stats_sizes
  pad = lambda x, n: jnp.pad(x, (0, n - x.shape[0]))            # noqa: E731
  live_1_B = live_B.astype(jnp.int32)
  path_BxD1 = a.path_BxD1
  reached_BxD = (jnp.take_along_axis(tree_lib.has_child(tree), jnp.maximum(path_BxD1[:, :D], 0), axis=1)
                 & (path_BxD1[:, :D] >= 0))
  return SpecStats(
      iterations=stats.iterations + 1,
      target_forwards=stats.target_forwards + 1,
      draft_forwards=stats.draft_forwards + engine.drafter.forwards(engine.shape),
      drafted_B=stats.drafted_B + jnp.sum(tree.valid_BxN1[:, 1:], axis=1).astype(jnp.int32) * live_1_B,
      accepted_B=stats.accepted_B + a.n_B * live_1_B,
      committed_B=stats.committed_B + c.count_B,
      verify_steps_B=stats.verify_steps_B + live_1_B,
      pos_accepted_D=stats.pos_accepted_D + pad(jnp.sum((c.j_1xD1[:, :D] < a.n_B[:, None]) & live_B[:, None],
                                                        axis=0), D_st),
      pos_reached_D=stats.pos_reached_D + pad(jnp.sum(reached_BxD & live_B[:, None], axis=0), D_st),
      verify_rows_N1=stats.verify_rows_N1.at[v.rows - 1].add(1),
      node_accepted_N1=stats.node_accepted_N1 + pad(jnp.sum(a.rule.accepted_BxN1 & live_B[:, None], axis=0),
                                                    N_st + 1))


def spec_step(engine: Engine, target_params, draft_params, state: SpecState, k_active_B) -> SpecState:
  """One draft → verify → accept → commit iteration for every live sequence: the stages above, in order."""
  B, S = state.seq_BxS.shape
  lengths_B, live_B = state.cache.lengths, ~state.done_B
  key, k_draft, k_accept, sp = step_keys(engine, state)
  draft_state, d, tree = draft(engine, draft_params, state, k_active_B, live_B, k_draft, sp)
  v = verify(engine, target_params, state.cache, tree, live_B)
  a = accept(engine, tree, v.out.logits, d.q_BxN1xV, k_accept, sp)
  c = commit(engine, state, tree, a, live_B)
  rows = row_logprobs(state.rows, v.out.logits, a.path_BxD1, c) if engine.per_row else state.rows
  new_lengths_B, last_B, num_new_B, done_B = advance(state, c)
  cache = commit_target_cache(engine, v.out.cache, lengths_B, new_lengths_B, a.path_BxD1)
  draft_state = commit_drafter(engine, target_params, draft_state, d, v, a.path_BxD1, lengths_B, new_lengths_B)
  record = state.record
  if record is not None:   # the root and the accepted nodes: their features, and the top-k after each
    record = record_lib.record_path(record, engine.record, engine.cfg, target_params, v.out.features,
                                    v.out.logits, a.path_BxD1, c.j_1xD1, c.count_B, lengths_B)
  stats = count(engine, state.stats, tree, v, a, c, live_B)
  starts = state.starts_BxS.at[jnp.arange(B), jnp.where(live_B, lengths_B, S)].set(True, mode="drop")
  return SpecState(cache=cache, draft=draft_state, seq_BxS=c.seq_BxS, last_B=last_B, num_new_B=num_new_B,
                   done_B=done_B, max_new_B=state.max_new_B, key=key, stats=stats, starts_BxS=starts, rows=rows,
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


def autoregressive(cfg: ModelConfig, sp: sampling.SamplingParams, eos_ids: tuple[int, ...] = (),
                   buckets: tuple[int, ...] | None = None) -> Engine:
  """Plain decoding: the k = 0 case of the speculative step."""
  return Engine(cfg=cfg, drafter=NoDrafter(), k_max=0, sp=sp, eos_ids=eos_ids, buckets=buckets)


init_jit = jax.jit(init, static_argnames=("engine",), donate_argnames=("cache",))
step_jit = jax.jit(spec_step, static_argnames=("engine",), donate_argnames=("state",))
decode_loop_jit = jax.jit(decode_loop, static_argnames=("engine",), donate_argnames=("state",))
