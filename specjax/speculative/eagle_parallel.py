"""Parallel drafting (P-EAGLE style): a feature drafter that proposes K positions in one forward.

The sequential feature drafter (``eagle.py``) runs one forward per tree depth, each at the latency floor.
This one runs a single forward over

    [the pending tokens c..L (with the target's features; the last is the root ``last`` at position L),
     placeholder_1 .. placeholder_{K-1} at positions L+1 .. L+K-1]

where each placeholder is a learned input vector (no token, no feature).  Attention is causal: a placeholder
sees the drafter's cache, the fed pending tokens and the placeholders before it.  The root's output is the
distribution of the token at depth 1; placeholder j's output that of depth j + 1.  None of them depends on
which tokens were drafted above it, so:

  chain:K          top-1 (greedy) or a draw (sampling) at each depth;
  static trees     every node at depth d gets its children from the depth-(d+1) distribution;
  dynamic:N        EAGLE-2's best-N expansion by cumulative log-probability, over those distributions.

Lossless sampling holds as for any drafter: each node's children are drawn from the distribution recorded as
its q.  The training forward is ``eagle_train.train_forward`` with the placeholders at steps 2..K
(``tests/speculative/test_eagle_parallel.py`` pins the two together).

The state is the sequential drafter's (``EagleState``): the placeholders' KV entries land after the committed
length and the next propose overwrites them with the accepted tokens, fed with their target features.  The
forward's rows are contiguous (pending tokens, then the placeholders right after the root, then dead rows),
so it is a plain causal forward with per-sequence live rows.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.models import decode, decoder as model_lib
from specjax.speculative.drafters import NoDrafter, PerDepthLogits
from specjax.speculative.eagle import EagleDrafter, EagleState, input_proj, target_feature, to_target_vocab


@dataclasses.dataclass(frozen=True)
class ParallelEagleDrafter(EagleDrafter):
  """``max_depth`` = K, the positions one forward drafts (the trained placeholders + 1)."""
  name: str = "eagle-parallel"

  def forwards(self, shape) -> int:
    return 1 if shape.num_nodes else 0

  def draft_positions(self, params, state: EagleState, seq_BxS, lengths_B, depth: int):
    """The one forward: (logits of depths 1..depth [B, depth, V] over the target's vocabulary, the cache with
    lengths = lengths_B: entries before it final, the root's entry at lengths_B kept by ``commit``).

    Row i of the forward sits at position c + i: the pending tokens up to the root (i <= root), then the
    placeholders (root < i <= root + depth - 1), then dead rows — a plain causal forward whose live rows
    per sequence are root + depth (the native CPU kernels skip the rest)."""
    cache = state.cache
    c = cache.lengths
    B, S = seq_BxS.shape
    D1, n_ph = self.pending, depth - 1                           # pending tokens, placeholders
    T = D1 + n_ph
    i_T = jnp.arange(T, dtype=jnp.int32)
    pos = c[:, None] + i_T[None, :]
    tokens = jnp.take_along_axis(seq_BxS, jnp.minimum(pos[:, :D1], S - 1), axis=1)
    backends = model_lib.backends_of(self.cfg)
    x_pend = input_proj(params, tokens, target_feature(params, self.ecfg, state.feats_BxD1xF), backends)
    root_B = lengths_B - c                                       # the root's row
    j = i_T[None, :] - root_B[:, None]                           # 1..n_ph: placeholder j
    ph = params["placeholders"][:max(n_ph, 1)].astype(x_pend.dtype)
    x_ph = jnp.take(ph, jnp.clip(j - 1, 0, max(n_ph, 1) - 1), axis=0)               # [B, T, M]
    x_pend = jnp.pad(x_pend, ((0, 0), (0, n_ph), (0, 0)))
    x = jnp.where((j <= 0)[..., None], x_pend, jnp.where(((j >= 1) & (j <= n_ph))[..., None], x_ph, 0.0))
    toks = jnp.pad(tokens, ((0, 0), (0, n_ph)))
    rows = root_B[:, None] + jnp.arange(depth, dtype=jnp.int32)[None, :]          # the root, the placeholders
    out = decode.windowed_forward(params, self.cfg, toks, pos, cache, buckets=self.buckets,
                                  live_T=root_B + depth, inputs_embeds_BxTxD=x, head_index_B=rows)
    logits = out.logits                                                              # [B, depth, Vr]
    return to_target_vocab(params, self.ecfg, logits), out.cache.with_lengths(lengths_B)

  # The hooks of ModelDrafter.propose / _propose_dynamic: depth d's children come from the one forward.

  def _root(self, params, asked: "_Asked", seq_BxS, lengths_B, last_B):
    logits, cache = self.draft_positions(params, asked.state, seq_BxS, lengths_B, asked.depth)
    return logits[:, 0], None, PerDepthLogits(cache, logits)

  def _extend(self, params, drafted: PerDepthLogits, tokens_BxW, depth: int, slots_BxW, mask_BxWxU,
              parent_feat_BxWxF):
    return drafted.at_depth(depth, tokens_BxW.shape[1]), None, drafted

  def _with_cache(self, asked: "_Asked", drafted: PerDepthLogits):
    return asked.state.replace(cache=drafted.cache)

  def propose(self, draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp):
    if shape.num_nodes == 0:
      return NoDrafter().propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
    if shape.max_depth > self.max_depth:
      raise ValueError(f"parallel drafter trained for {self.max_depth} positions, tree has depth {shape.max_depth}")
    return super().propose(draft_params, _Asked(state, shape.max_depth), seq_BxS, lengths_B, last_B, shape, key,
                           sp)


class _Asked:
  """The state handed through the shared tree builders, with the depth this propose drafts."""

  def __init__(self, state: EagleState, depth: int):
    self.state, self.depth = state, depth
