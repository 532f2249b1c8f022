"""Drafters: fill a token tree per sequence (with its draft distributions), then follow the commit.

What every drafter offers the engine (``init``, ``propose``, ``commit``, ``forwards``, ...) is the ``Drafter``
protocol in ``protocol.py``; the other drafters live beside this module (``registry.py`` lists them all).

``propose``'s ``shape`` is a static tree (``tree_shapes.StaticTree``: chain, branching, paths, Sequoia) or a
``DynamicShape`` (the tree is chosen each step).  ``lengths_B`` is the target cache's committed length:
``seq_BxS[:, :lengths+1]`` is known and ``seq[b, lengths[b]] == last_B[b]`` is the newest token — the tree's root,
not yet in any cache.  The node of rank r below a node is the drafter's r-th choice there.  ``Draft.q`` holds,
per node, the distribution its children were drawn from; it is None for deterministic drafters and when
sampling is greedy (acceptance never reads it).  ``commit`` gets the accepted root-to-leaf path as the
drafter's own slots (``Draft.slots``; -1 past the leaf) so a drafter with a cache can compact it.

  NoDrafter     no drafts (N = 0): plain autoregressive decoding through the same step.
  ModelDrafter  a small model with its own KV cache (a separate draft model, or the target's own layers
                for layer-skip self-speculation): one forward per depth over the nodes that have children.
  NgramDrafter  prompt lookup on device: the continuations that followed earlier occurrences of the last n
                tokens (several occurrences, several n), merged into a trie.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import decode, decoder as model_lib, sampling, sampling_rows
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, cache_bytes, compact, init_cache
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.trees.device import ForcedChain, sample_children


CACHE_DTYPE = jnp.float32     # drafters' own caches, whatever the target's dtype (memory.DRAFT_KV_BYTES bills it)


@dataclasses.dataclass(frozen=True)
class DynamicShape:
  """An EAGLE-2 style tree chosen every step: expand the ``top_k`` best frontier nodes by cumulative draft
  log-probability ``top_k`` children each, down to ``max_depth``, then keep the best ``num_nodes``."""
  num_nodes: int
  top_k: int = tree_shapes.DYNAMIC_DEFAULT_TOPK
  max_depth: int = tree_shapes.DYNAMIC_DEFAULT_DEPTH

  def __post_init__(self):
    if self.num_nodes < 1 or self.top_k < 1 or self.max_depth < 1:
      raise ValueError(f"dynamic tree needs N, TOPK and depth >= 1, got {self}")
    if self.num_nodes > self.candidates:
      raise ValueError(f"dynamic tree of {self.num_nodes} nodes scores only {self.candidates} candidates "
                       f"(TOPK {self.top_k}, depth {self.max_depth}): raise TOPK or the depth")

  @property
  def candidates(self) -> int:   # draft nodes scored before the best num_nodes are kept
    return self.top_k + (self.max_depth - 1) * self.top_k * self.top_k


def shape_for(spec, acc=None):
  """The engine's shape for a ``TreeSpec`` (static trees built now; dynamic ones described)."""
  if spec.kind == "dynamic":
    return DynamicShape(spec.num_nodes, spec.top_k, min(spec.max_depth, spec.num_nodes))
  return spec.build(acc)


class Draft(NamedTuple):
  tokens_BxN1: jax.Array           # node tokens; node 0 is the root (last_B)
  parents_BxN1: jax.Array          # parent index (< node), -1 at the root
  valid_BxN1: jax.Array            # which nodes hold a proposal
  q_BxN1xV: jax.Array | None       # distribution each node's children were drawn from (None: deterministic)
  slots_BxN1: jax.Array | None     # where each node sits in the drafter's own cache (None: node i at slot i)


def _static_draft(shape, tokens_BxN1, valid_BxN1=None, q=None, slots=None) -> Draft:
  B, N1 = tokens_BxN1.shape
  parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (B, N1))
  valid = jnp.ones((B, N1), bool) if valid_BxN1 is None else valid_BxN1
  return Draft(tokens_BxN1, parents, valid, q, slots)


@dataclasses.dataclass(frozen=True)
class NoDrafter:
  name: str = "none"
  siblings_without_replacement: bool = False

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    return ()

  def state_bytes_per_seq(self, max_len: int) -> int:
    """Bytes ``init`` allocates per sequence (the memory bill)."""
    return 0

  def forwards(self, shape) -> int:
    return 0

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp):
    B, N1 = seq_BxS.shape[0], shape.num_nodes + 1
    tokens = jnp.zeros((B, N1), jnp.int32).at[:, 0].set(last_B)
    valid = jnp.zeros((B, N1), bool)
    return state, Draft(tokens, jnp.full((B, N1), -1, jnp.int32).at[:, 1:].set(0), valid, None, None)

  def commit(self, state, lengths_B, path_slots_BxD1, new_lengths_B):
    return state


def _target_vocab(params, logits_BxTxVr):
  """A draft model's logits over the target's vocabulary: a reduced head (``head_ids`` in its params) has
  its rows scattered back to their target ids, every other token at probability 0."""
  if "head_ids" not in params:
    return logits_BxTxVr
  return model_lib.scatter_to_vocab(logits_BxTxVr, params["head_ids"], params["embed"].shape[0])


class PerDepthLogits:
  """What a drafter that proposes every depth at once carries through one propose in place of a draft cache
  (the parallel head, Medusa): its state (``cache``) and the distributions of depths 1..D [B, D, V], which
  ``ModelDrafter``'s tree builders read where a sequential drafter would run a forward per depth."""

  def __init__(self, cache, logits_BxDxV):
    self.cache, self.logits_BxDxV = cache, logits_BxDxV

  def at_depth(self, depth: int, W: int) -> jax.Array:
    """The children's distribution of W nodes at ``depth`` (0-based: the root's children at 0): [B, W, V]."""
    lg = self.logits_BxDxV[:, depth]
    return jnp.broadcast_to(lg[:, None], (lg.shape[0], W, lg.shape[-1]))


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """Tree drafting with a small model that shares the target's tokenizer.

  Each propose first feeds [seq[len-1], last] (T=2), which re-writes the slot of the token before ``last``:
  that slot is missing when the deepest accepted node was a leaf never fed, and rewriting it otherwise is
  harmless.  The root's children come from that forward; then one forward per depth runs the nodes that have
  children (a chain: one row), writing each at its node's slot after the committed length with the tree's
  ancestor mask, and their children are the top-r choices (greedy) or draws without replacement (sampling,
  Gumbel top-k).  After acceptance ``commit`` moves the accepted path's entries into place.
  """
  cfg: ModelConfig
  name: str = "model"
  buckets: tuple[int, ...] | None = None
  siblings_without_replacement: bool = True

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    cache = init_cache(self.cfg, prompt_BxP.shape[0], max_len, CACHE_DTYPE)
    return decode.prefill(draft_params, self.cfg, cache, prompt_BxP, prompt_lens_B, self.buckets).cache

  def state_bytes_per_seq(self, max_len: int) -> int:
    """Bytes ``init`` allocates per sequence (the memory bill): the fp32 cache and its int32 length."""
    return cache_bytes(self.cfg, 1, max_len, CACHE_DTYPE) + 4

  def forwards(self, shape) -> int:
    return shape.max_depth if shape.num_nodes else 0

  def _root(self, params, state: KVCache, seq_BxS, lengths_B, last_B):
    """Forward [seq[len-1], last]: (the root's draft logits [B, V], its feature [B, F] or None, the cache with
    lengths = lengths)."""
    cache = state
    prev_B = jnp.take_along_axis(seq_BxS, jnp.maximum(lengths_B - 1, 0)[:, None], axis=1)[:, 0]
    start = jnp.maximum(lengths_B - 1, 0)
    pos = start[:, None] + jnp.arange(2)[None, :]
    out = decode.windowed_forward(params, self.cfg, jnp.stack([prev_B, last_B], axis=1), pos,
                                  cache.with_lengths(start), buckets=self.buckets)
    return _target_vocab(params, out.logits[:, 1]), None, out.cache.with_lengths(lengths_B)

  def _extend(self, params, cache: KVCache, tokens_BxW, depth: int, slots_BxW, mask_BxWxU, parent_feat_BxWxF):
    """Forward W nodes at one depth, each written at its slot after the committed length: (logits [B,W,V],
    their features [B,W,F] or None, cache).  ``parent_feat``: each node's parent's feature (feature drafters)."""
    pos = jnp.broadcast_to(cache.lengths[:, None] + depth, tokens_BxW.shape)
    out = decode.windowed_forward(params, self.cfg, tokens_BxW, pos, cache, buckets=self.buckets,
                                  region_mask_BxTxU=mask_BxWxU, slots_BxT=slots_BxW)
    return _target_vocab(params, out.logits), None, out.cache.with_lengths(cache.lengths)

  def _with_cache(self, state, cache: KVCache):
    """The drafter state after a propose whose forwards left ``cache`` (a plain model's state is its cache)."""
    return cache

  def propose(self, draft_params, state: KVCache, seq_BxS, lengths_B, last_B, shape, key, sp):
    if shape.num_nodes == 0:
      return NoDrafter().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
    if isinstance(shape, DynamicShape):
      return self._propose_dynamic(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
    root = self._root(draft_params, state, seq_BxS, lengths_B, last_B)
    return self._grow(draft_params, state, root, last_B, shape, key, sp)

  def _grow(self, draft_params, state, root, last_B, shape, key, sp):
    """The static tree ``shape`` drafted below the root, from ``root`` = ``_root``'s (logits, feature, cache):
    one forward per depth over the nodes with children."""
    B, N1 = last_B.shape[0], shape.num_nodes + 1
    parents, ranks, depths = np.asarray(shape.parents), np.asarray(shape.ranks), np.asarray(shape.depths)
    anc = shape.ancestors()
    logits, feat, cache = root
    logits_BxWxV = logits[:, None]
    expanding = [0]                                    # nodes whose logits are in logits_BxWxV
    tokens = jnp.zeros((B, N1), jnp.int32).at[:, 0].set(last_B)
    # Feature drafters: each node's own feature (its forward's output), read by its children's forward.
    feats = None if feat is None else jnp.zeros((B, N1, feat.shape[-1]), feat.dtype).at[:, 0].set(feat)
    q_all = None if sp.greedy else jnp.zeros((B, N1, logits.shape[-1]), jnp.float32)
    keys = sampling_rows.split(key, shape.max_depth)   # one key, or one per row (per-row sampling)
    valid = jnp.ones((B, N1), bool)                    # a child that was never drawn (filler) is not a proposal
    for d in range(1, shape.max_depth + 1):
      if d > 1:
        expanding = sorted({int(parents[i]) for i in np.flatnonzero(depths == d)})
        W = len(expanding)
        parent_feat = None if feats is None else feats[:, parents[expanding]]
        logits_BxWxV, feat_W, cache = self._extend(
            draft_params, cache, tokens[:, expanding], d - 1,
            jnp.broadcast_to(jnp.asarray(expanding, jnp.int32), (B, W)),
            jnp.broadcast_to(jnp.asarray(anc[expanding]), (B, W, N1)), parent_feat)
        if feats is not None:
          feats = feats.at[:, expanding].set(feat_W)
      children = np.flatnonzero(depths == d)
      K = int(ranks[children].max()) + 1
      chosen_BxWxK, q, drawn_BxWxK = sample_children(keys[d - 1], logits_BxWxV, K, sp)
      if isinstance(sp, ForcedChain):                  # offline replay: the chain's draft here is given
        chosen_BxWxK = sp.at_depth(d, chosen_BxWxK)
      row = np.asarray([expanding.index(int(parents[i])) for i in children])
      tokens = tokens.at[:, children].set(chosen_BxWxK[:, row, ranks[children]])
      valid = valid.at[:, children].set(drawn_BxWxK[:, row, ranks[children]] & valid[:, parents[children]])
      if q is not None:
        q_all = q_all.at[:, expanding].set(q)
    return self._with_cache(state, cache), _static_draft(shape, tokens, valid, q=q_all)

  def _propose_dynamic(self, draft_params, state: KVCache, seq_BxS, lengths_B, last_B, shape: DynamicShape,
                       key, sp):
    """EAGLE-2: score candidates by cumulative draft log-probability, expand the best ``top_k`` per depth,
    keep the best ``num_nodes`` overall (a child never outscores its parent, so they form a tree).  The
    choice is deterministic given the draft's logits, so acceptance treats the children as point masses."""
    B, k, D, N = seq_BxS.shape[0], shape.top_k, shape.max_depth, shape.num_nodes
    logprobs = lambda lg: jax.nn.log_softmax(lg if sp.greedy else sampling.filtered_logits(lg, sp), axis=-1)
    logits, root_feat, cache = self._root(draft_params, state, seq_BxS, lengths_B, last_B)
    score, tok = jax.lax.top_k(logprobs(logits), k)                                  # [B, k]
    # Feature drafters: the frontier's parents' features (all the root's at depth 2).
    front_feat = None if root_feat is None else jnp.broadcast_to(root_feat[:, None], (B, k, root_feat.shape[-1]))
    U = 1 + (D - 1) * k                             # draft slots: root, then k frontier nodes per depth
    cand_tok = [last_B[:, None], tok.astype(jnp.int32)]
    cand_score = [jnp.zeros((B, 1)), score]
    cand_parent = [jnp.full((B, 1), -1, jnp.int32), jnp.zeros((B, k), jnp.int32)]
    n_ids = 1 + shape.candidates                   # candidate ids: the root, then every candidate
    slot_of = jnp.zeros((B, n_ids), jnp.int32)         # draft slot of each candidate that was fed (else unused)
    front_id = jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), (B, k))     # candidate ids
    front_score, front_tok = score, tok.astype(jnp.int32)
    front_anc = jnp.zeros((B, k, U), bool).at[:, :, 0].set(True)                   # root
    rows_Bx1, rows_1xW = jnp.arange(B)[:, None], jnp.arange(k)[None, :]
    n_cand = 1 + k
    for d in range(2, D + 1):
      slots = jnp.broadcast_to(1 + (d - 2) * k + jnp.arange(k, dtype=jnp.int32), (B, k))
      front_anc = front_anc.at[rows_Bx1, rows_1xW, slots].set(True)
      slot_of = slot_of.at[rows_Bx1, front_id].set(slots)
      logits_BxWxV, feat_W, cache = self._extend(draft_params, cache, front_tok, d - 1, slots, front_anc,
                                                 front_feat)
      lp, ctok = jax.lax.top_k(logprobs(logits_BxWxV), k)                             # [B, W, K] (W = K = k)
      cscore = (front_score[:, :, None] + lp).reshape(B, k * k)
      cand_tok.append(ctok.reshape(B, k * k).astype(jnp.int32))
      cand_score.append(cscore)
      cand_parent.append(jnp.repeat(front_id, k, axis=1))
      if d < D:
        front_score, best = jax.lax.top_k(cscore, k)
        front_id = n_cand + best.astype(jnp.int32)
        front_tok = jnp.take_along_axis(cand_tok[-1], best, axis=1)
        front_anc = jnp.take_along_axis(front_anc, (best // k)[:, :, None], axis=1)
        if feat_W is not None:
          front_feat = jnp.take_along_axis(feat_W, (best // k)[:, :, None], axis=1)
      n_cand += k * k
    tok_all = jnp.concatenate(cand_tok, axis=1)
    score_all = jnp.concatenate(cand_score, axis=1)
    parent_all = jnp.concatenate(cand_parent, axis=1)
    slot_all = slot_of
    # The best N candidates (ties: the lower id, i.e. the shallower), in id order = BFS order.
    _, best = jax.lax.top_k(score_all[:, 1:], N)
    chosen = jnp.sort(best + 1, axis=1)                                               # [B, N]
    node_of = jnp.zeros((B, n_cand), jnp.int32).at[jnp.arange(B)[:, None], chosen].set(
        jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.int32), (B, N)))
    chosen1 = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), chosen], axis=1)      # root first
    parents = jnp.take_along_axis(node_of, jnp.maximum(jnp.take_along_axis(parent_all, chosen1, axis=1), 0),
                                  axis=1).at[:, 0].set(-1)
    draft = Draft(jnp.take_along_axis(tok_all, chosen1, axis=1), parents, jnp.ones((B, N + 1), bool), None,
                  jnp.take_along_axis(slot_all, chosen1, axis=1))
    return self._with_cache(state, cache), draft

  def commit(self, state: KVCache, lengths_B, path_slots_BxD1, new_lengths_B):
    return compact(state, lengths_B, path_slots_BxD1).with_lengths(new_lengths_B)


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup: earlier occurrences of the last n tokens (n = max_ngram down to min_ngram, the
  ``occurrences`` best of each) propose the tokens that followed them; the continuations form a trie.

  Candidates are ranked by match length, then by how many known tokens follow the occurrence (up to the
  tree's depth), then by recency — so the first is the most recent occurrence followed by a full-depth
  continuation, else the earliest.  The node of rank r below a node is the r-th distinct next token among the
  candidates through that node, in rank order; a static tree keeps the nodes that exist, a dynamic one the
  first N trie nodes taking candidates in rank order.

  ``match_caps[i]`` caps the tokens proposed after a match of only i + 1 tokens (longer matches: the depth):
  short matches are rarely right (on summarization, a 1-token match's first draft is accepted ~1 time in 4, a
  3-token match's 7 in 10), and the engine verifies only as many slots as some sequence drafted, so not
  drafting them saves most of a verification's extra cost.
  """
  max_ngram: int = 3
  min_ngram: int = 1
  match_caps: tuple[int, ...] = ()
  occurrences: int = 4
  name: str = "ngram"
  siblings_without_replacement: bool = False

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    return ()

  def state_bytes_per_seq(self, max_len: int) -> int:
    return 0           # it reads the sequence buffer the engine keeps anyway

  def forwards(self, shape) -> int:
    return 0

  def candidates(self, seq_BxS, lengths_B, D: int):
    """Continuations [B, R, D] and their lengths [B, R], best first (R = occurrences x n-gram sizes)."""
    B, S = seq_BxS.shape
    L_B = lengths_B                                   # index of the newest known token
    i_S = jnp.arange(S)
    per_n = min(self.occurrences, S)                  # occurrences kept per n-gram size
    toks, lens = [], []
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      match = jnp.ones((B, S), bool)
      for j in range(n):
        want_B = jnp.take_along_axis(seq_BxS, jnp.maximum(L_B - n + 1 + j, 0)[:, None], axis=1)
        shifted = jnp.roll(seq_BxS, -j, axis=1)       # shifted[:, i] = seq[:, i + j]
        match &= shifted == want_B
      # The occurrence must end before the newest token and the suffix must exist.
      ok = match & (i_S[None, :] + n - 1 < L_B[:, None]) & (L_B[:, None] >= n - 1)
      avail = jnp.clip(L_B[:, None] + 1 - (i_S[None, :] + n), 0, D)          # known tokens that follow
      rank = jnp.where(ok, jnp.where(avail >= D, S + i_S[None, :], S - i_S[None, :]), -1)
      top, occ = jax.lax.top_k(rank, per_n)                                    # [B, per_n]
      cap = self.match_caps[n - 1] if n <= len(self.match_caps) else D
      start = occ + n
      lens.append(jnp.where(top >= 0, jnp.minimum(jnp.take_along_axis(avail, occ, axis=1), cap), 0))
      idx = jnp.minimum(start[:, :, None] + jnp.arange(D)[None, None, :], S - 1)
      toks.append(jnp.take_along_axis(seq_BxS[:, None, :], idx, axis=2))
    return jnp.concatenate(toks, axis=1).astype(jnp.int32), jnp.concatenate(lens, axis=1).astype(jnp.int32)

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp):
    B, N1 = seq_BxS.shape[0], shape.num_nodes + 1
    if shape.num_nodes == 0:
      return NoDrafter().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
    cand, clen = self.candidates(seq_BxS, lengths_B, shape.max_depth)
    if isinstance(shape, DynamicShape):
      return state, _trie(cand, clen, last_B, shape.num_nodes)
    R = cand.shape[1]
    earlier = jnp.tril(jnp.ones((R, R), bool), -1)                             # earlier[c, c'] = c' < c
    through = [jnp.ones((B, R), bool)]                                         # candidates through node i
    tokens, valid = [last_B], [jnp.ones((B,), bool)]
    for i in range(1, N1):
      p, r, d = shape.parents[i], shape.ranks[i], shape.depths[i]
      m = through[p] & (clen > d - 1)
      tok_c = cand[:, :, d - 1]
      same = (tok_c[:, :, None] == tok_c[:, None, :]) & m[:, None, :] & earlier[None]
      first = m & ~jnp.any(same, axis=2)
      rank_c = jnp.cumsum(first, axis=1) - 1
      sel = first & (rank_c == r)
      ok = jnp.any(sel, axis=1)
      tok = jnp.sum(jnp.where(sel, tok_c, 0), axis=1)
      tokens.append(tok)
      valid.append(ok)
      through.append(m & (tok_c == tok[:, None]) & ok[:, None])
    return state, _static_draft(shape, jnp.stack(tokens, axis=1).astype(jnp.int32), jnp.stack(valid, axis=1))

  def commit(self, state, lengths_B, path_slots_BxD1, new_lengths_B):
    return state


def _trie(cand_BxRxD, clen_BxR, last_B, N: int) -> Draft:
  """The first N nodes of the trie of the candidates, taking them best first, in BFS order."""
  B, R, D = cand_BxRxD.shape
  d_D = jnp.arange(D)
  live = d_D[None, None, :] < clen_BxR[:, :, None]                                         # [B, R, D]
  same = jnp.cumprod(cand_BxRxD[:, :, None, :] == cand_BxRxD[:, None, :, :], axis=3).astype(bool)
  same &= live[:, :, None, :] & live[:, None, :, :]                                         # [B, R, R', D]
  owner = jnp.argmax(same, axis=2).astype(jnp.int32)                     # the first candidate with the prefix
  new = live & (owner == jnp.arange(R)[None, :, None])                   # [B, R, D]: a trie node of its own
  flat_new = new.reshape(B, R * D)                                       # candidate-major order
  keep = flat_new & (jnp.cumsum(flat_new, axis=1) <= N)
  depth_f = jnp.tile(d_D, R)[None, :]
  f = jnp.arange(R * D)[None, :]
  order = jnp.argsort(jnp.where(keep, depth_f * R * D + f, 2 * R * D * D), axis=1)[:, :N]  # BFS, [B, N]
  kept = jnp.take_along_axis(keep, order, axis=1)
  node_of = jnp.zeros((B, R * D), jnp.int32).at[jnp.arange(B)[:, None], order].set(
      jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.int32), (B, N)))
  c_of, d_of = order // D, order % D
  parent_flat = jnp.take_along_axis(owner.reshape(B, R * D), c_of * D + jnp.maximum(d_of - 1, 0), axis=1) * D \
      + jnp.maximum(d_of - 1, 0)
  parents = jnp.where(d_of == 0, 0, jnp.take_along_axis(node_of, parent_flat, axis=1))
  tokens = jnp.take_along_axis(cand_BxRxD.reshape(B, R * D), order, axis=1)
  root = lambda x, v: jnp.concatenate([jnp.full((B, 1), v, x.dtype), x], axis=1)
  return Draft(root(tokens, 0).at[:, 0].set(last_B), root(parents.astype(jnp.int32), -1),
               root(kept, True), None, None)


def propose_chain(drafter, draft_params, state, seq_BxS, lengths_B, last_B, N: int, key, sp):
  """A chain of N proposals as (state, tokens [B, N], live count [B]): the chain of N nodes read as a list."""
  state, d = drafter.propose(draft_params, state, seq_BxS, lengths_B, last_B, tree_shapes.chain(N), key, sp)
  live = jnp.sum(jnp.cumprod(d.valid_BxN1[:, 1:], axis=1), axis=1).astype(jnp.int32)
  return state, d.tokens_BxN1[:, 1:], live


def layer_subset(params, layers: tuple[int, ...]):
  """The target's own parameters restricted to ``layers`` (shared arrays, no copy in the list layout)."""
  stacked = params["layers"]
  if isinstance(stacked, (list, tuple)):
    sub = [stacked[i] for i in layers]
  else:
    idx = jnp.asarray(layers)
    sub = jax.tree_util.tree_map(lambda x: x[idx], stacked)
  return {**params, "layers": sub}
