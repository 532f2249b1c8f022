"""Suffix decoding on device: draft the most frequent continuations of the longest suffix match, found in a
bounded index of earlier requests and in every sequence of the batch (SuffixDecoding, Oliaro et al. 2024).

The index is data, not a shape: the drafter's ``draft_params`` are ``{"corpus_C": int32 [C]}``, the prompts and
outputs of earlier requests laid end to end (``-1`` between them and in the unused front), newest last.
``absorb`` appends finished sequences on the host and evicts the oldest tokens past C, between decode loops
(``api.generate``, between batches) or between steps (the server, when a request finishes): the decode loop
itself never leaves the device.  Replacing the array compiles nothing.

Each step, per sequence b (haystack = the corpus, then every row's known tokens, -1 elsewhere):

  1. match length at every haystack position i: how many of the last ``max_match`` tokens of b end at i;
     M_b = the longest match that has at least one known token after it (its own newest position excluded).
  2. the ``occurrences`` most recent positions with a match of M_b; their continuations (up to the tree's
     depth, cut where the known tokens end) form a trie whose node counts are how many continuations share
     that prefix; count / occurrences is the empirical probability of the path (the suffix tree's
     count(child) / count(match), multiplied down the path).
  3. nodes with probability < ``min_prob`` are dropped, and at most ceil(``spec_factor`` x M_b) are kept (a
     short match proposes little: the speculation follows the match); a dynamic tree keeps the most probable
     nodes (parents always before children), a static tree's node of rank r is its parent's r-th most
     frequent child.

Drafts are deterministic (``Draft.q`` is None): under sampling each node is a point mass, which the tree rule
accepts with the residual's probability of its token, so the output is exactly the target's.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculative.drafters import Draft, DynamicShape, NoDrafter, _static_draft

DEFAULT_CORPUS_TOKENS = 1 << 16       # 256 KiB of int32 on the device


def empty_index(corpus_tokens: int = DEFAULT_CORPUS_TOKENS) -> dict:
  """The drafter's params before any request has finished: an empty corpus of ``corpus_tokens`` slots."""
  if corpus_tokens < 1:
    raise ValueError(f"the suffix index needs >= 1 token slot, got {corpus_tokens}")
  return {"corpus_C": jnp.full((int(corpus_tokens),), -1, jnp.int32)}


def absorb(draft_params: dict, sequences: Sequence[Sequence[int]]) -> dict:
  """The index with ``sequences`` (prompt + output token ids, oldest first) appended, the oldest tokens
  evicted past its size.  Host side; the result has the same shape (nothing recompiles)."""
  corpus = np.asarray(jax.device_get(draft_params["corpus_C"]))
  C = corpus.shape[0]
  parts = [corpus]
  for s in sequences:
    s = np.asarray(s, np.int32).reshape(-1)
    if s.size:
      parts += [np.full((1,), -1, np.int32), s]
  grown = np.concatenate(parts)[-C:]
  # Placed as before: jit keys its executables by placement and committedness too (an uncommitted array stays
  # uncommitted; one replicated over a mesh stays so).
  old = draft_params["corpus_C"]
  new = jax.device_put(grown, old.sharding) if getattr(old, "committed", False) else jax.device_put(grown)
  return {**draft_params, "corpus_C": new}


def corpus_fill(draft_params: dict) -> int:
  """Token slots of the index in use (tokens and separators), for reports and the bounded-size check."""
  c = np.asarray(jax.device_get(draft_params["corpus_C"]))
  live = np.nonzero(c >= 0)[0]
  return 0 if live.size == 0 else int(c.shape[0] - live[0])


@dataclasses.dataclass(frozen=True)
class SuffixDrafter:
  max_match: int = 16         # longest suffix matched (tokens)
  occurrences: int = 32       # most recent occurrences of the longest match whose continuations are counted
  min_prob: float = 0.1       # a node's path probability must reach this to be drafted
  spec_factor: float = 1.0    # at most ceil(spec_factor x match length) nodes per step
  cross_rows: bool = True     # also search the batch's other sequences (requests running beside this one)
  name: str = "suffix"
  siblings_without_replacement: bool = False

  def __post_init__(self):
    if self.max_match < 1 or self.occurrences < 1:
      raise ValueError(f"suffix drafter needs max_match and occurrences >= 1, got {self}")
    if not 0.0 <= self.min_prob <= 1.0 or self.spec_factor <= 0:
      raise ValueError(f"suffix drafter needs 0 <= min_prob <= 1 and spec_factor > 0, got {self}")

  def init(self, draft_params, prompt_BxP, prompt_lens_B, max_len):
    return ()

  def state_bytes_per_seq(self, max_len: int) -> int:
    return 0      # the index is its params (billed once, not per sequence); the rest is the engine's buffer

  def forwards(self, shape) -> int:
    return 0

  def absorb(self, draft_params, sequences):
    return absorb(draft_params, sequences)

  def index_stats(self, draft_params) -> dict:
    """Token slots of the index in use, and its size."""
    return {"tokens": corpus_fill(draft_params), "capacity": int(draft_params["corpus_C"].shape[0])}

  # ---------------------------------------------------------------------------------------------- lookup
  def _haystack(self, corpus_C, seq_BxS, lengths_B):
    """Per row: the tokens searched [B, H] (-1 where unknown or between documents), where the row's own
    sequence starts in them [B] (or a scalar), and the row's known tokens [B, S]."""
    B, S = seq_BxS.shape
    known = jnp.arange(S)[None, :] <= lengths_B[:, None]
    rows = jnp.where(known, seq_BxS, -1).astype(jnp.int32)
    sep = jnp.full((B, 1), -1, jnp.int32)
    if not self.cross_rows:         # the corpus and the row's own tokens only
      hay = jnp.concatenate([jnp.broadcast_to(corpus_C, (B,) + corpus_C.shape), sep, rows], axis=1)
      return hay, corpus_C.shape[0] + 1, rows
    shared = jnp.concatenate([corpus_C, jnp.concatenate([rows, sep], axis=1).reshape(-1)])   # one for all rows
    return jnp.broadcast_to(shared, (B,) + shared.shape), corpus_C.shape[0] + jnp.arange(B) * (S + 1), rows

  def candidates(self, corpus_C, seq_BxS, lengths_B, D: int):
    """Continuations [B, R, D], their lengths [B, R] (0: none) and the match length [B]."""
    B = seq_BxS.shape[0]
    hay_BxH, own0, rows = self._haystack(corpus_C, seq_BxS, lengths_B)
    H = hay_BxH.shape[1]
    own_last = own0 + lengths_B                                          # the newest token, in the haystack
    # 1. match length ending at each position (the suffix read backwards: q_j = seq[L - j]).
    run = jnp.ones((B, H), bool)
    mlen = jnp.zeros((B, H), jnp.int32)
    pad = jnp.full((B, self.max_match), -1, jnp.int32)
    padded = jnp.concatenate([pad, hay_BxH], axis=1)
    for j in range(self.max_match):
      q_B = jnp.take_along_axis(rows, jnp.maximum(lengths_B - j, 0)[:, None], axis=1)[:, 0]
      q_B = jnp.where(lengths_B - j >= 0, q_B, -2)                       # before the start: matches nothing
      shifted = jax.lax.dynamic_slice_in_dim(padded, self.max_match - j, H, axis=1)   # hay[i - j]
      run &= shifted == q_B[:, None]
      mlen += run
    # At least one known token must follow (the newest token is its own trivial match: none follows it).
    nxt = jnp.concatenate([hay_BxH[:, 1:], jnp.full((B, 1), -1, jnp.int32)], axis=1)
    i_H = jnp.arange(H)[None, :]
    ok = (mlen > 0) & (nxt >= 0) & (i_H != own_last[:, None])
    mlen = jnp.where(ok, mlen, 0)
    M_B = jnp.max(mlen, axis=1)
    best = ok & (mlen == M_B[:, None]) & (M_B[:, None] > 0)
    # The R most recent of them, newest first (a scatter by rank from the end: no sort over the haystack).
    R = min(self.occurrences, H)
    from_end = jnp.cumsum(best[:, ::-1], axis=1)[:, ::-1]               # best positions at or after i
    slot = jnp.where(best & (from_end <= R), from_end - 1, R)
    occ_BxR = jnp.full((B, R + 1), -1, jnp.int32).at[jnp.arange(B)[:, None], slot].set(
        jnp.broadcast_to(i_H, (B, H)).astype(jnp.int32))[:, :R]                      # -1: no occurrence
    idx = jnp.maximum(occ_BxR, 0)[:, :, None] + 1 + jnp.arange(D)[None, None, :]
    cont = jnp.take_along_axis(hay_BxH[:, None, :], jnp.minimum(idx, H - 1), axis=2)   # [B, R, D]
    live = (occ_BxR[:, :, None] >= 0) & (idx < H) & (jnp.cumprod(cont >= 0, axis=2) > 0)
    clen = jnp.sum(live, axis=2).astype(jnp.int32)
    return jnp.where(live, cont, 0).astype(jnp.int32), clen, M_B

  @staticmethod
  def _counts(cand_BxRxD, clen_BxR):
    """Per continuation and depth: how many continuations share its prefix (count), the first that does
    (owner), whether it is that first one (a trie node of its own) and the flat index of its parent node."""
    B, R, D = cand_BxRxD.shape
    live = jnp.arange(D)[None, None, :] < clen_BxR[:, :, None]
    same = jnp.cumprod(cand_BxRxD[:, :, None, :] == cand_BxRxD[:, None, :, :], axis=3).astype(bool)
    same &= live[:, :, None, :] & live[:, None, :, :]                    # [B, R, R', D]
    count = jnp.sum(same, axis=2).astype(jnp.int32)                      # [B, R, D]
    owner = jnp.argmax(same, axis=2).astype(jnp.int32)
    new = live & (owner == jnp.arange(R)[None, :, None])
    d_D = jnp.arange(D)[None, None, :]
    parent = jnp.where(d_D == 0, -1, jnp.roll(owner, 1, axis=2) * D + d_D - 1)   # owner[c, d-1] * D + d-1
    return count, new, parent

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp):
    B, N1 = seq_BxS.shape[0], shape.num_nodes + 1
    if shape.num_nodes == 0:
      return NoDrafter().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
    D = shape.max_depth
    cand, clen, match_B = self.candidates(draft_params["corpus_C"], seq_BxS, lengths_B, D)
    R = cand.shape[1]
    count, new, parent = self._counts(cand, clen)
    n_occ = jnp.maximum(jnp.sum(clen > 0, axis=1), 1)                        # [B]
    prob = count / n_occ[:, None, None]
    node_ok = new & (prob >= self.min_prob)
    cap_B = jnp.ceil(self.spec_factor * match_B).astype(jnp.int32)              # nodes this match may propose
    if isinstance(shape, DynamicShape):
      draft = _most_probable(cand, count, node_ok, parent, last_B, shape.num_nodes)
      return state, draft._replace(valid_BxN1=draft.valid_BxN1 & (jnp.arange(N1)[None, :] <= cap_B[:, None]))
    # A static tree: node i is the ranks[i]-th most frequent child of its parent's trie node.
    flat = [jnp.full((B,), -1, jnp.int32)]          # trie node (c * D + d) of each tree node; -1 the root
    tokens, valid = [last_B], [jnp.ones((B,), bool)]
    c_R = jnp.arange(R)[None, :]
    for i in range(1, N1):
      p, r, d = shape.parents[i], shape.ranks[i], shape.depths[i] - 1
      child = node_ok[:, :, d] & (parent[:, :, d] == flat[p][:, None]) & valid[p][:, None]
      score = jnp.where(child, count[:, :, d] * (R + 1) + (R - c_R), -1)
      top, c_sel = jax.lax.top_k(score, min(r + 1, R))
      ok = top[:, -1] >= 0 if r < R else jnp.zeros((B,), bool)
      c = c_sel[:, -1]
      tokens.append(jnp.where(ok, jnp.take_along_axis(cand[:, :, d], c[:, None], axis=1)[:, 0], 0))
      valid.append(ok & (i <= cap_B))
      flat.append(jnp.where(ok, c * D + d, -2))
    return state, _static_draft(shape, jnp.stack(tokens, axis=1).astype(jnp.int32), jnp.stack(valid, axis=1))

  def commit(self, state, lengths_B, path_slots_BxD1, new_lengths_B):
    return state


def _most_probable(cand_BxRxD, count_BxRxD, node_ok_BxRxD, parent_BxRxD, last_B, N: int) -> Draft:
  """The N most probable trie nodes (by count; ties: shallower, then earlier) as a draft tree.  A parent's
  count is at least its child's and it is shallower, so it always comes first."""
  B, R, D = cand_BxRxD.shape
  RD = R * D                                    # trie nodes: candidate-major, R x D
  flat_ok = node_ok_BxRxD.reshape(B, RD)
  f = jnp.arange(RD)
  depth_f, c_f = f % D, f // D
  key = jnp.where(flat_ok, count_BxRxD.reshape(B, RD) * (D * R + 1) - (depth_f * R + c_f)[None, :], -(D * R + 2))
  top, order = jax.lax.top_k(key, min(N, RD))                                  # [B, N'] flat indices
  if order.shape[1] < N:
    fill = N - order.shape[1]
    top = jnp.concatenate([top, jnp.full((B, fill), -(D * R + 2), top.dtype)], axis=1)
    order = jnp.concatenate([order, jnp.zeros((B, fill), order.dtype)], axis=1)
  kept = top > -(D * R + 2)
  node_of = jnp.zeros((B, RD + 1), jnp.int32).at[jnp.arange(B)[:, None], jnp.where(kept, order, RD)].set(
      jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.int32), (B, N)))
  par_flat = jnp.take_along_axis(parent_BxRxD.reshape(B, RD), order, axis=1)    # -1: the root
  parents = jnp.where(par_flat < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par_flat, 0), axis=1))
  tokens = jnp.take_along_axis(cand_BxRxD.reshape(B, RD), order, axis=1)
  root = lambda x, v: jnp.concatenate([jnp.full((B, 1), v, x.dtype), x], axis=1)
  return Draft(root(jnp.where(kept, tokens, 0), 0).at[:, 0].set(last_B), root(parents.astype(jnp.int32), -1),
               root(kept, True), None, None)
