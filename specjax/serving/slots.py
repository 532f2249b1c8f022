"""The jitted operations on one slot of a running batch (``SpecState`` of B sequences), for the continuous
batcher: a request's B = 1 prefill written into its slot, a slot marked finished, a slot's recorded features
read back; and the compiled set of them on one device or over a mesh."""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from specjax import speculative as spec
from specjax.models.kv_cache import init_cache


def _insert(big, small, slot):
  """Write a B = 1 state into slot ``slot`` of a batched one: KV buffers [L, B, ...] (5-D) along axis 1,
  every other array along axis 0."""
  def put(b, s):
    axis = 1 if b.ndim == 5 else 0
    return jax.lax.dynamic_update_index_in_dim(b, jnp.take(s, 0, axis=axis).astype(b.dtype), slot, axis)
  return jax.tree_util.tree_map(put, big, small)


def admit_slot(engine: spec.Engine, target_params, draft_params, state: spec.SpecState, slot, prompt_1xP,
               prompt_len_1, max_new_1, key, rows_1=None) -> spec.SpecState:
  """Prefill one request into ``slot`` of the running batch; the other slots are untouched.  ``rows_1``: its
  sampling settings and seed (a per-row engine)."""
  S = state.seq_BxS.shape[1]
  one = spec.init(engine, target_params, draft_params, init_cache(engine.cfg, 1, S, state.cache.k.dtype), prompt_1xP, prompt_len_1,
                  max_new_1, key, rows_1)
  if engine.per_row:
    state = state.replace(rows=_insert(state.rows, one.rows, slot))
  if state.record is not None:       # online adaptation: the prompt's recorded features
    state = state.replace(record=_insert(state.record, one.record, slot))
  return state.replace(
      cache=_insert(state.cache, one.cache, slot), draft=_insert(state.draft, one.draft, slot),
      seq_BxS=_insert(state.seq_BxS, one.seq_BxS, slot), last_B=_insert(state.last_B, one.last_B, slot),
      num_new_B=_insert(state.num_new_B, one.num_new_B, slot), done_B=_insert(state.done_B, one.done_B, slot),
      max_new_B=_insert(state.max_new_B, one.max_new_B, slot),
      starts_BxS=_insert(state.starts_BxS, one.starts_BxS, slot))


def finish_slot(state: spec.SpecState, slot) -> spec.SpecState:
  return state.replace(done_B=state.done_B.at[slot].set(True))


@jax.jit
def recorded_row(record, slot):
  """One slot's recorded features [S, F] (one compile whatever the slot)."""
  return jax.lax.dynamic_index_in_dim(record.feats_BxSxF, slot, axis=0, keepdims=False)


class _Jits(NamedTuple):
  """The batcher's compiled functions: on one device plain jits; on a mesh each with explicit out_shardings
  (the state keeps the placement ``sharding.state_shardings`` gives it: slots over "data", KV heads over
  "model"), the inputs placed likewise."""
  init: Callable
  step: Callable
  admit: Callable
  finish: Callable


SINGLE = _Jits(spec.init_jit, spec.step_jit,
                jax.jit(admit_slot, static_argnums=(0,), donate_argnums=(3,)),
                jax.jit(finish_slot, donate_argnames=("state",)))


def mesh_jits(state_sh) -> _Jits:
  return _Jits(jax.jit(spec.init, static_argnames=("engine",), donate_argnames=("cache",), out_shardings=state_sh),
               jax.jit(spec.spec_step, static_argnames=("engine",), donate_argnames=("state",),
                       out_shardings=state_sh),
               jax.jit(admit_slot, static_argnums=(0,), donate_argnums=(3,), out_shardings=state_sh),
               jax.jit(finish_slot, donate_argnames=("state",), out_shardings=state_sh))
