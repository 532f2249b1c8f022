"""Offline replay: the τ of any drafter, chain, static or dynamic tree and k over known outputs, with no target
decoding — one teacher-forced target pass (``record``) and then only the drafter's own forwards (``replay``).

Greedy.  Greedy speculative decoding commits exactly the greedy output, so the steps it takes are fixed by that
output and the drafter: each step the drafter proposes from the tokens known so far (its own state advanced as
the engine advances it), the longest path whose tokens are the output's next tokens is accepted, then one more
token.  ``replay`` runs the engine's own stages — ``draft``, ``commit``, ``advance``, ``count`` — with the
target's verdict read from the output (``device.accept_given``), so every counter (τ, α, per-depth and per-node
acceptance, verification rows) is the engine's.  A feature drafter (EAGLE, Medusa, DFlash) reads the target's
features of the accepted path, recorded by the same pass.

Sampled chains (token-wise verification).  Given the output x, the acceptance of the draft at each depth is
independent of the others with probability a = min(1, q(x) / p(x)) — q the draft distribution along x, p the
target's: speculative sampling emits x through an accepted draft with probability min(p(x), q(x)) and through
the residual with p(x) − min(p(x), q(x)), and the step structure follows from the coins.  So ``replay`` forces
the drafter's chain onto the output (``device.ForcedChain``: q is computed as when sampling, the draft is x),
and flips those coins.  Because speculative sampling's outputs are distributed as plain sampling's, a plain
sampled run's outputs serve as well as the engine's own: the τ replayed over them is distributed as the
engine's (``tests/speculative/test_replay.py`` checks both within the stated error).  A deterministic drafter (n-gram,
suffix) proposes what it proposes: its draft is kept exactly when it equals x.  Sampled trees are not replayed:
a tree's recursive rejection depends on the siblings' draws and the target's residuals, which one output
does not determine — except a deterministic drafter's (an n-gram or suffix trie): siblings are distinct tokens
drawn with probability p one after another, so the output's token is accepted exactly when it is a child, as
greedy.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import decoder as model_lib, sampling
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.speculative import engine as eng
from specjax.speculative.acceptance import CHAIN_ONLY
from specjax.speculative.protocol import feature_layers
from specjax.speculative.trees import device as tree_lib
from specjax.speculative.trees import specs as tree_shapes


class Known(NamedTuple):
  """Known sequences (prompt, then output) with what one teacher-forced target pass says about them."""
  seq_BxS: jax.Array                 # int32, zeros past each end; S leaves room for a step's tree past the end
  prompt_lens_B: jax.Array           # int32
  ends_B: jax.Array                  # int32: prompt + output tokens known
  logp_BxS: jax.Array | None         # log p(seq[t + 1] | seq[:t + 1]) under the sampling rule, at t (sampled)
  features_BxSxF: jax.Array | None   # the target's forward taps at every position (a feature drafter's)


def record(target_params, cfg: ModelConfig, seq_BxS, prompt_lens_B, ends_B, sp: sampling.SamplingParams,
           taps: tuple[int, ...] | None = None) -> Known:
  """One target forward over the known sequences: each position's log-probability of the next known token
  under ``sp`` (needed to replay sampling) and, with ``taps`` (``Engine.forward_taps``), the features a
  feature drafter reads.  S is the engine's buffer length (its max_len), whose room mask the replay applies too."""
  seq = jnp.asarray(seq_BxS, jnp.int32)
  if sp.greedy and taps is None:      # greedy replay of a drafter that reads no features: the tokens suffice
    return Known(seq, jnp.asarray(prompt_lens_B, jnp.int32), jnp.asarray(ends_B, jnp.int32), None, None)
  fwd = _teacher_forced(cfg, taps, None if sp.greedy else sp)
  logp, feats = fwd(target_params, seq)
  return Known(seq, jnp.asarray(prompt_lens_B, jnp.int32), jnp.asarray(ends_B, jnp.int32), logp, feats)


@functools.lru_cache(maxsize=8)
def _teacher_forced(cfg: ModelConfig, taps, sp):
  @jax.jit
  def fwd(params, seq_BxS):
    B, S = seq_BxS.shape
    cache = init_cache(cfg, B, S)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    out = model_lib.forward(params, cfg, seq_BxS, pos, cache, feature_layers=taps)
    logp = None
    if sp is not None:
      lp_BxSxV = jax.nn.log_softmax(sampling.filtered_logits(out.logits, sp), axis=-1)
      nxt = jnp.concatenate([seq_BxS[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
      logp = jnp.take_along_axis(lp_BxSxV, nxt[:, :, None], axis=2)[:, :, 0]
    return logp, out.features
  return fwd


def check_replayable(engine: eng.Engine) -> None:
  """Refuse, in one line, what replay cannot reproduce."""
  if engine.per_row:
    raise ValueError("replay runs one sampling rule for the batch: build the engine without per_row")
  if engine.acceptance is not None and not engine.sp.greedy:
    raise ValueError(f"replay reproduces token-wise verification; {type(engine.acceptance).__name__} is another "
                     "rule (greedy decoding needs none)")


def _start(engine: eng.Engine, target_params, draft_params, known: Known, P: int, max_new_B, key) -> eng.SpecState:
  """The engine's state after ``init``, from the known output (no target forward): the first output token is
  known, the drafter initialised on the prompt as ``engine.init`` does."""
  B, S = known.seq_BxS.shape
  lens = known.prompt_lens_B
  prompt_BxP = jnp.where(jnp.arange(P)[None, :] < lens[:, None], known.seq_BxS[:, :P], 0)
  if feature_layers(engine.drafter) is None:
    draft = engine.drafter.init(draft_params, prompt_BxP, lens, S)
  else:
    draft = engine.drafter.init(draft_params, prompt_BxP, lens, S,
                                eng._drafter_features(engine, target_params, known.features_BxSxF[:, :P]))
  first_B = jnp.take_along_axis(known.seq_BxS, lens[:, None], axis=1)[:, 0]
  live = max_new_B > 0
  seq = jnp.where(jnp.arange(S)[None, :] <= lens[:, None], known.seq_BxS, 0)   # nothing from the future
  carrier = KVCache(k=jnp.zeros((0, B, 0, 1, 1)), v=jnp.zeros((0, B, 0, 1, 1)), lengths=lens)   # lengths only
  return eng.SpecState(cache=carrier, draft=draft, seq_BxS=seq, last_B=first_B,
                       num_new_B=live.astype(jnp.int32),
                       done_B=~live | eng._is_eos(first_B, engine.eos_ids) | (live.astype(jnp.int32) >= max_new_B),
                       max_new_B=max_new_B, key=key, stats=eng.SpecStats.zeros(B, *engine.stats_sizes),
                       starts_BxS=jnp.zeros((B, S), bool))


def _known_at(known: Known, lengths_B, offsets_BxN1):
  S = known.seq_BxS.shape[1]
  idx = jnp.clip(lengths_B[:, None] + offsets_BxN1, 0, S - 1)
  return jnp.take_along_axis(known.seq_BxS, idx, axis=1), idx


def _accept_sampled_chain(tree: tree_lib.Tree, d, known: Known, lengths_B, u_BxN1,
                          broken: str | None = None) -> tree_lib.TreeAcceptance:
  """The chain's coins given the output: draft i (depth i) is kept with probability min(1, q(x)/p(x)) when it
  is the output's token x there (a deterministic draft: exactly then), the first failure ends the path.
  ``broken="unconditioned"`` is a deliberately wrong variant (the engine's own min(1, p/q) applied to the
  output's token, ignoring that the output is given), kept so the tests can show they catch it."""
  B, N1 = tree.tokens_BxN1.shape
  x_BxN1, idx = _known_at(known, lengths_B, tree.depth_BxN1)
  match = tree.valid_BxN1 & (tree.tokens_BxN1 == x_BxN1)
  if d.q_BxN1xV is None:
    keep = match
  else:
    parent = jnp.maximum(tree.parents_BxN1, 0)
    q_par = jnp.take_along_axis(d.q_BxN1xV, parent[:, :, None], axis=1)                    # [B, N1, V]
    q_x = jnp.take_along_axis(q_par, tree.tokens_BxN1[:, :, None], axis=2)[:, :, 0]
    p_x = jnp.exp(jnp.take_along_axis(known.logp_BxS, jnp.maximum(idx - 1, 0), axis=1))  # p of x after its parent
    keep = match & ((u_BxN1 * q_x < p_x) if broken == "unconditioned" else (u_BxN1 * p_x < q_x))
  keep = keep.at[:, 0].set(True)
  n_B = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1) - 1                   # a chain: node i at depth i
  nxt, _ = _known_at(known, lengths_B, n_B[:, None] + 1)
  accepted = jnp.arange(N1)[None, :] <= n_B[:, None]
  return tree_lib.TreeAcceptance(n_B.astype(jnp.int32), nxt[:, 0], accepted)


def replay_step(engine: eng.Engine, target_params, draft_params, known: Known, state: eng.SpecState,
                k_active_B, broken: str | None = None) -> eng.SpecState:
  """``engine.spec_step`` with the target's verdict read from the known output instead of a target forward."""
  B, S = state.seq_BxS.shape
  lengths_B, live_B = state.cache.lengths, ~state.done_B
  key, k_draft, k_accept = jax.random.split(state.key, 3)
  sp = engine.sp
  if not sp.greedy:       # the chain's drafts forced onto the output: q along it
    x_BxD, _ = _known_at(known, lengths_B, jnp.arange(1, engine.k_max + 1)[None, :])
    sp = tree_lib.ForcedChain(x_BxD, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
  draft_state, d, tree = eng.draft(engine, draft_params, state, k_active_B, live_B, k_draft, sp)
  if engine.sp.greedy or d.q_BxN1xV is None:   # greedy, or deterministic drafts (a node is kept exactly when
    best, _ = _known_at(known, lengths_B, tree.depth_BxN1 + 1)      # it is the output's token: siblings differ)
    rule = tree_lib.accept_given(tree, best)
  elif not tree_shapes.is_chain(engine.shape):
    raise ValueError("sampled replay of a sampling drafter covers chains: a sampled tree's acceptance depends on "
                     "its siblings' draws, which one output does not determine (replay the tree greedily, or a "
                     "deterministic drafter's tree)")
  else:
    rule = _accept_sampled_chain(tree, d, known, lengths_B, jax.random.uniform(k_accept, tree.tokens_BxN1.shape),
                                 broken)
  n_B = jnp.take_along_axis(tree.depth_BxN1, rule.leaf_B[:, None], axis=1)[:, 0]
  a = eng.Accepted(rule, n_B, tree_lib.path_nodes(tree, rule.leaf_B, engine.depth))
  node_1xN1 = jnp.arange(engine.k_max + 1)[None, :]
  rows_B = jnp.where(live_B, jnp.max(jnp.where(tree.valid_BxN1, node_1xN1, 0), axis=1) + 1, 0)
  feats = None
  if feature_layers(engine.drafter) is not None:      # the target's features at the nodes' positions
    pos = jnp.clip(lengths_B[:, None] + tree.depth_BxN1, 0, S - 1)
    feats = jnp.take_along_axis(known.features_BxSxF, pos[:, :, None], axis=1)
  v = eng.Verified(model_lib.ForwardOutput(None, None, None, feats), jnp.maximum(jnp.max(rows_B), 1), node_1xN1)
  c = eng.commit(engine, state, tree, a, live_B)
  new_lengths_B, last_B, num_new_B, done_B = eng.advance(state, c)
  draft_state = eng.commit_drafter(engine, target_params, draft_state, d, v, a.path_BxD1, lengths_B, new_lengths_B)
  stats = eng.count(engine, state.stats, tree, v, a, c, live_B)
  starts = state.starts_BxS.at[jnp.arange(B), jnp.where(live_B, lengths_B, S)].set(True, mode="drop")
  return eng.SpecState(cache=state.cache.with_lengths(new_lengths_B), draft=draft_state, seq_BxS=c.seq_BxS,
                       last_B=last_B, num_new_B=num_new_B, done_B=done_B, max_new_B=state.max_new_B, key=key,
                       stats=stats, starts_BxS=starts)


@functools.partial(jax.jit, static_argnames=("engine", "P", "broken"))
def _replay(target_params, draft_params, known: Known, max_new_B, k_active_B, key, *, engine, P, broken):
  state = _start(engine, target_params, draft_params, known, P, max_new_B, key)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B),
                            lambda s: replay_step(engine, target_params, draft_params, known, s, k_active_B, broken),
                            state)


def replay(engine: eng.Engine, target_params, draft_params, known: Known, *, max_new_B=None, k_active_B=None,
           key=None, prompt_width: int | None = None, broken: str | None = None) -> eng.SpecState:
  """The engine's run over ``known`` outputs without target decoding: the final state, whose ``stats`` are the
  engine's counters (greedy: exactly; sampled chains: one draw of them given the outputs — replay again with
  other keys for their spread) and whose ``seq_BxS`` holds the committed tokens (the known output, cut where
  the engine would stop).  ``max_new_B``: the engine's max_new_tokens (default: each known output's length;
  outputs known past it make the last step's acceptance the engine's too).  ``prompt_width``: the padded prompt
  width the engine's run had (its prompt bucket; default the longest prompt): the drafter is initialised on
  prompts of that width, as there.  ``target_params`` are only read
  for a feature drafter's features (the final norm), never run.  ``broken``: ``_accept_sampled_chain``'s wrong
  variant (tests only)."""
  check_replayable(engine)
  if feature_layers(engine.drafter) is not None and known.features_BxSxF is None:
    raise ValueError("a feature drafter reads the target's features: record(..., taps=engine.forward_taps)")
  if not engine.sp.greedy and known.logp_BxS is None:
    raise ValueError("sampled replay needs the target's log-probabilities: record(...) with the engine's sampling")
  B, S = known.seq_BxS.shape
  ends, lens = np.asarray(known.ends_B), np.asarray(known.prompt_lens_B)
  if np.any(ends > S):
    raise ValueError(f"a known sequence of {int(ends.max())} tokens does not fit buffers of S={S}: give the "
                     "engine's buffer length (its max_len)")
  max_new_B = jnp.asarray(ends - lens if max_new_B is None else max_new_B, jnp.int32)
  k_active_B = jnp.full((B,), engine.k_max, jnp.int32) if k_active_B is None else jnp.asarray(k_active_B, jnp.int32)
  key = jax.random.PRNGKey(0) if key is None else key
  return _replay(target_params, draft_params, known, max_new_B, k_active_B, key, engine=engine,
                 P=int(lens.max()) if prompt_width is None else int(prompt_width),
                 broken=broken)


def tau(stats: eng.SpecStats) -> float:
  """Mean tokens committed per live step (the engine's τ) over every sequence of ``stats``."""
  return float(np.sum(np.asarray(stats.committed_B))) / max(1, int(np.sum(np.asarray(stats.verify_steps_B))))
