"""The speculative step and loop.

One iteration (``spec_step``, one jitted function over static shapes B, K = k_max, S):
  1. the drafter proposes K tokens (slots at or past k_active[b] are masked),
  2. the target verifies [last, d_1..d_K] in one forward over the fixed KV buffers (K+1 new slots, of which
     the native CPU kernels compute only those some sequence still needs),
  3. the acceptance rule keeps n[b] drafts and picks the next token (correction or bonus),
  4. commit: EOS and max_new_tokens may cut the n+1 new tokens short; the target cache length advances by
     the number kept (rejected slots stay behind the length, masked, overwritten later), the drafter
     rolls back to the same length.
With K = 0 and ``NoDrafter`` this is plain autoregressive decoding: baselines run the same code.

``generate`` runs prefill and the whole loop on device (``lax.while_loop``); ``init`` + ``decode_loop`` are the
same in two calls (benchmarks time decoding apart from prefill); ``init`` + ``spec_step`` are the
step-at-a-time API for a host-side scheduler (k_active is data: changing it compiles nothing).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax import decode, sampling
from specjax.kv_cache import KVCache
from specjax.speculative.acceptance import rule_for


@struct.dataclass
class SpecStats:
  iterations: jax.Array        # loop iterations run (scalar)
  target_forwards: jax.Array   # target forwards, prefill included (scalar)
  draft_forwards: jax.Array    # drafter forwards (model drafters; scalar)
  drafted_B: jax.Array         # live draft tokens offered for verification
  accepted_B: jax.Array        # of which accepted
  committed_B: jax.Array       # tokens committed by speculative iterations (accepted + 1 per iteration)
  verify_steps_B: jax.Array    # iterations in which the sequence was live
  pos_accepted_K: jax.Array    # per draft position: accepted
  pos_reached_K: jax.Array     # per draft position: examined
  verify_rows_K1: jax.Array    # [K+1]: iterations whose verification had 1, 2, ..., K+1 live rows


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


class Engine(NamedTuple):
  """Static description of a speculative decoder (hashable: a jit static argument)."""
  cfg: Any                     # target ModelConfig
  drafter: Any                 # NoDrafter | ModelDrafter | NgramDrafter
  k_max: int
  sp: sampling.SamplingParams
  eos_ids: tuple[int, ...] = ()
  buckets: tuple[int, ...] | None = None
  draft_forwards_per_step: int = 0   # for stats: model drafters run k_max forwards per iteration
  acceptance: Any = None             # None: GreedyAcceptance when sp is greedy, else SpeculativeSampling

  @property
  def rule(self):
    return self.acceptance if self.acceptance is not None else rule_for(self.sp)


def _is_eos(tok, eos_ids):
  if not eos_ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


def init(engine: Engine, target_params, draft_params, cache: KVCache, prompt_BxP, prompt_lens_B, max_new_B,
         key) -> SpecState:
  """Prefill target and drafter and sample the first token from the target."""
  B, P = prompt_BxP.shape
  S = cache.max_len
  pre = decode.prefill(target_params, engine.cfg, cache, prompt_BxP, prompt_lens_B, engine.buckets)
  draft = engine.drafter.init(draft_params, prompt_BxP, prompt_lens_B, S)
  key, sub = jax.random.split(key)
  tok = sampling.sample(pre.last_logits_BxV, sub, engine.sp)
  live = max_new_B > 0
  seq = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompt_BxP)
  seq = jnp.where(jnp.arange(S)[None, :] < prompt_lens_B[:, None], seq, 0)
  seq = seq.at[jnp.arange(B), jnp.where(live, prompt_lens_B, S)].set(tok, mode="drop")
  num_new = live.astype(jnp.int32)
  K = engine.k_max
  zeros_B = jnp.zeros((B,), jnp.int32)
  stats = SpecStats(iterations=jnp.zeros((), jnp.int32), target_forwards=jnp.ones((), jnp.int32),
                    draft_forwards=jnp.zeros((), jnp.int32), drafted_B=zeros_B, accepted_B=zeros_B,
                    committed_B=zeros_B, verify_steps_B=zeros_B, pos_accepted_K=jnp.zeros((K,), jnp.int32),
                    pos_reached_K=jnp.zeros((K,), jnp.int32),
                    verify_rows_K1=jnp.zeros((K + 1,), jnp.int32))
  return SpecState(cache=pre.cache, draft=draft, seq_BxS=seq, last_B=tok, num_new_B=num_new,
                   done_B=~live | _is_eos(tok, engine.eos_ids) | (num_new >= max_new_B), max_new_B=max_new_B,
                   key=key, stats=stats)


def spec_step(engine: Engine, target_params, draft_params, state: SpecState, k_active_B) -> SpecState:
  """One draft → verify → accept → commit iteration for every live sequence."""
  K = engine.k_max
  cache = state.cache
  B, S = state.seq_BxS.shape
  lengths = cache.lengths
  live = ~state.done_B
  key, k_draft, k_accept = jax.random.split(state.key, 3)

  # 1. Draft.
  draft, drafts_BxK, q, limit_B = engine.drafter.propose(draft_params, state.draft, state.seq_BxS, lengths,
                                                        state.last_B, K, k_draft, engine.sp)
  # Never draft past the cache: K+1 slots must fit at lengths.
  room_B = jnp.maximum(S - 1 - lengths, 0)
  k_act = jnp.minimum(jnp.minimum(k_active_B, limit_B), jnp.minimum(room_B, K)).astype(jnp.int32)

  # 2. Verify [last, d_1..d_K] in one target forward over K+1 slots.  Only the first `rows` matter (the most
  #    live drafts of any sequence, + 1): the native CPU kernels skip the rest, so a step whose drafter found
  #    little to propose costs about what a plain decoding step costs.  Nothing here depends on `rows` for
  #    shapes: it is data, and changing it compiles nothing.
  verify_BxK1 = jnp.concatenate([state.last_B[:, None], drafts_BxK], axis=1)
  positions = lengths[:, None] + jnp.arange(K + 1)[None, :]
  rows = jnp.max(jnp.where(live, k_act, 0)) + 1
  out = decode.windowed_forward(target_params, engine.cfg, verify_BxK1, positions, cache,
                                buckets=engine.buckets, live_T=rows)

  # 3. Accept.
  acc = engine.rule(out.logits, drafts_BxK, q, k_act, k_accept, engine.sp)
  n = acc.num_accepted_B

  # 4. Commit: candidates d_1..d_n, next; cut at the first EOS and at max_new_tokens.
  j_K1 = jnp.arange(K + 1)[None, :]
  cand = jnp.concatenate([drafts_BxK, jnp.zeros((B, 1), jnp.int32)], axis=1)
  cand = jnp.where(j_K1 == n[:, None], acc.next_token_B[:, None], cand)
  valid = j_K1 <= n[:, None]
  eos = _is_eos(cand, engine.eos_ids) & valid
  after_eos = (jnp.cumsum(eos.astype(jnp.int32), axis=1) - eos.astype(jnp.int32)) > 0
  budget = (state.max_new_B - state.num_new_B)[:, None]
  keep = valid & ~after_eos & (j_K1 < budget) & live[:, None]
  count = jnp.sum(keep, axis=1).astype(jnp.int32)                 # tokens committed this iteration
  idx = jnp.where(keep, lengths[:, None] + 1 + j_K1, S)
  seq = state.seq_BxS.at[jnp.arange(B)[:, None], idx].set(cand, mode="drop")
  new_lengths = lengths + count
  newest = jnp.take_along_axis(cand, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
  last = jnp.where(count > 0, newest, state.last_B)
  num_new = state.num_new_B + count
  hit_eos = jnp.any(eos & keep, axis=1)
  done = state.done_B | hit_eos | (num_new >= state.max_new_B)

  st = state.stats
  live_i = live.astype(jnp.int32)
  stats = SpecStats(
      iterations=st.iterations + 1,
      target_forwards=st.target_forwards + 1,
      draft_forwards=st.draft_forwards + engine.draft_forwards_per_step,
      drafted_B=st.drafted_B + k_act * live_i,
      accepted_B=st.accepted_B + n * live_i,
      committed_B=st.committed_B + count,
      verify_steps_B=st.verify_steps_B + live_i,
      pos_accepted_K=st.pos_accepted_K + jnp.sum(acc.accepted_BxK & live[:, None], axis=0),
      pos_reached_K=st.pos_reached_K + jnp.sum(acc.reached_BxK & live[:, None], axis=0),
      verify_rows_K1=st.verify_rows_K1.at[rows - 1].add(1))
  return SpecState(cache=out.cache.with_lengths(new_lengths), draft=engine.drafter.commit(draft, new_lengths),
                   seq_BxS=seq, last_B=last, num_new_B=num_new, done_B=done, max_new_B=state.max_new_B,
                   key=key, stats=stats)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("cache",))
def generate(target_params, draft_params, cache: KVCache, prompt_BxP, prompt_lens_B, max_new_B, k_active_B,
             key, *, engine: Engine) -> SpecState:
  """Prefill, then speculative iterations until every sequence is done — one on-device loop."""
  state = init(engine, target_params, draft_params, cache, prompt_BxP, prompt_lens_B, max_new_B, key)
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
