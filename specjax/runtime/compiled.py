"""Compiling and running one batch of a decode: the one place that does it for ``api.generate``, ``bench``
and, through those, training's evaluation and the experiments (the continuous batcher runs one iteration at a
time instead: ``serving/slots.py``).

  ``Executables``  a model's ahead-of-time executables: prefill per prompt bucket, the decode loop per
                   engine, batch and buffer — read back untraced from specjax's own store
                   (``stored_executables``), else traced and compiled side by side or read from jax's cache
  ``run_batch``    prefill then the whole decode loop of one padded batch, each timed apart: a ``BatchRun``
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax import speculative as spec
from specjax.models.kv_cache import init_cache
from specjax.progress import say


def _shape_key(engine: spec.Engine) -> str:
  key = f"{engine.drafter.name} k={engine.k_max}"
  if engine.tree is not None:
    key += f" ({type(engine.tree).__name__}, depth {engine.depth})"
  return key


def _signature(tree) -> tuple:
  """What an executable depends on in a pytree argument: its structure (a ``QWeight``'s kind and group
  included) and each leaf's shape and dtype."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def _sharded_jits(mesh, batch_size: int):
  """jit builders for the prefill and the decode loop on ``mesh`` with explicit out_shardings (from the
  abstract output: ``sharding.state_shardings``); inputs carry theirs as ShapeDtypeStruct shardings."""
  from specjax.parallel import sharding

  def init_fn(out_abs):
    return jax.jit(spec.init, static_argnames=("engine",), donate_argnames=("cache",),
                   out_shardings=sharding.state_shardings(out_abs, mesh, batch_size))

  def loop_fn(out_abs):
    return jax.jit(spec.decode_loop, static_argnames=("engine",), donate_argnames=("state",),
                   out_shardings=sharding.state_shardings(out_abs, mesh, batch_size))
  return init_fn, loop_fn


class Executables:
  """The executables one model has, by what each depends on (engine, batch, prompt bucket, buffer length and
  the draft params' structure).  A ``Model`` owns one (``Model.executables``); a model moved onto a mesh gets
  a fresh one."""

  def __init__(self):
    self._by_key: dict = {}

  def __len__(self) -> int:
    return len(self._by_key)

  def count(self, what: str) -> int:
    """How many ``"init"`` (prefill) or ``"loop"`` executables are held."""
    return sum(1 for k in self._by_key if k[0] == what)

  def clear(self) -> None:
    self._by_key.clear()

  def for_batch(self, m, engine: spec.Engine, batch_size: int, prompt_pad: int, max_len: int, draft_params=(),
                log=say) -> tuple[Callable, Callable, float]:
    """The two executables of a batch, each compiled once per shape that matters to it:

      prefill  (``speculative.init``, on ``m.prefill_params``): once per (engine, batch, prompt bucket, buffer
               length)
      decode loop (``speculative.decode_loop``): once per (engine, batch, buffer length), whatever the prompts

    Whatever is missing is read back from specjax's store without tracing (``stored_executables``), else
    lowered here and compiled on two threads at once (XLA compiles on one core each) or read back from jax's
    persistent compilation cache, and stored.  Returns (prefill_fn, loop_fn, seconds spent); call
    ``prefill_fn(m.prefill_params, ...)`` and ``loop_fn(m.exec_params, ...)``."""
    drafts = _signature(draft_params)       # one draft model at two weight types: two executables
    keys = {"init": ("init", engine, batch_size, prompt_pad, max_len, drafts),
            "loop": ("loop", engine, batch_size, max_len, drafts)}
    missing = [k for k in keys.values() if k not in self._by_key]
    if not missing:
      return self._by_key[keys["init"]], self._by_key[keys["loop"]], 0.0
    from specjax.runtime import compile_cache, stored_executables
    t0 = time.perf_counter()
    before = compile_cache.counts()
    stored = _stored_keys(m, engine, batch_size, prompt_pad, max_len, draft_params)
    todo = set()
    for k in missing:                 # read back without tracing where specjax stored it before
      exe = stored_executables.read(stored.get(k[0]))
      if exe is not None:
        self._by_key[k] = exe
      else:
        todo.add(k[0])
    if todo:
      lowered = _lower(m, engine, batch_size, prompt_pad, max_len, draft_params, todo)
      self._compile({keys[what]: (low, stored.get(what)) for what, low in lowered.items()})
    seconds = time.perf_counter() - t0
    what = " and ".join({"init": f"prefill (prompt bucket {prompt_pad})", "loop": "decode loop"}[k[0]]
                        for k in missing)
    log(f"{what} for {_shape_key(engine)}, batch {batch_size}, buffer {max_len}: "
        f"{compile_cache.describe(compile_cache.since(before))} in {seconds:.1f}s")
    return self._by_key[keys["init"]], self._by_key[keys["loop"]], seconds

  def _compile(self, todo: dict) -> None:
    """Compile each (lowered, stored key) of ``todo`` (by executable key), storing it under its stored key."""
    from specjax.runtime.stored_executables import compile_and_store
    if len(todo) == 1:
      (key, (lowered, stored)), = todo.items()
      self._by_key[key] = compile_and_store(lowered, stored)
      return
    with ThreadPoolExecutor(len(todo)) as pool:
      for key, fn in zip(todo, pool.map(lambda job: compile_and_store(*job), todo.values())):
        self._by_key[key] = fn


def _stored_keys(m, engine: spec.Engine, B: int, prompt_pad: int, max_len: int, draft_params) -> dict:
  """The keys of the prefill and the decode loop in specjax's own store (``stored_executables``): what each
  executable depends on, computed without tracing.  None on a mesh (the shardings are not in the key)."""
  if m.mesh is not None:
    return {}
  from specjax.runtime.stored_executables import key
  dtype = str(jnp.dtype(m.dtype))
  return {"init": key(("init", engine, B, prompt_pad, max_len, dtype), (m.prefill_params, draft_params)),
          "loop": key(("loop", engine, B, max_len, dtype), (m.exec_params, draft_params))}


def _lower(m, engine: spec.Engine, B: int, prompt_pad: int, max_len: int, draft_params, which: set) -> dict:
  """The lowered prefill (``"init"``) and decode loop (``"loop"``) named in ``which``."""
  from specjax.parallel import sharding
  cache = jax.eval_shape(lambda: init_cache(m.cfg, B, max_len, m.dtype))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  if m.mesh is not None:            # the inputs' shardings are part of what is compiled
    cache = sharding.abstract_cache(cache, m.mesh)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding.batch_sharding(s, m.mesh))  # noqa
  init_args = (m.prefill_params, draft_params, cache, i32(B, prompt_pad), i32(B), i32(B), jax.random.PRNGKey(0))
  out = {}
  if m.mesh is None:
    init_traced = spec.init_jit.trace(engine, *init_args)
    if "init" in which:
      out["init"] = init_traced.lower()
    if "loop" in which:             # the state's shapes come from the prefill's trace
      out["loop"] = spec.decode_loop_jit.lower(engine, m.exec_params, draft_params, init_traced.out_info, i32(B))
    return out
  # On a mesh both executables get explicit shardings: the prefill's state out (KV over data and model,
  # per-sequence arrays over data: sharding.state_shardings), the loop's state in and result out; the
  # two then compile independently, like on one device.
  init_fn, loop_fn = _sharded_jits(m.mesh, B)
  state_abs = jax.eval_shape(functools.partial(spec.init, engine), *init_args)
  state_info = sharding.with_shardings(state_abs, sharding.state_shardings(state_abs, m.mesh, B))
  if "init" in which:
    out["init"] = init_fn(state_abs).lower(engine, *init_args)
  if "loop" in which:
    loop_args = (m.exec_params, draft_params, state_info, i32(B))
    res_abs = jax.eval_shape(functools.partial(spec.decode_loop, engine), *loop_args)
    out["loop"] = loop_fn(res_abs).lower(engine, *loop_args)
  return out


@dataclasses.dataclass
class BatchRun:
  """One batch decoded: the loop's final state (``result.seq_BxS``, ``num_new_B``, ``starts_BxS``, ``stats``,
  the drafter's state, ``record``) and where the time went."""
  result: Any
  compile_s: float
  prefill_s: float        # the inputs placed on the devices, prefill and each sequence's first token
  decode_s: float         # the decode loop alone, to its last token on the device


def run_batch(m, engine: spec.Engine, draft_params, tokens_BxP, lens_B, max_new_B, k_active_B, key,
              max_len: int, log=say) -> BatchRun:
  """Prefill a padded batch (host arrays: ``tokens_BxP`` in a prompt bucket, ``lens_B``, ``max_new_B``,
  ``k_active_B``), then run its whole decode loop: each on the model's executables for these shapes."""
  B, P = tokens_BxP.shape
  init_fn, loop_fn, compile_s = m.executables.for_batch(m, engine, B, P, max_len, draft_params, log=log)
  t0 = time.perf_counter()
  cache, (tokens, lens, max_new, k_active) = device_inputs(m, B, max_len, tokens_BxP, lens_B, max_new_B,
                                                           k_active_B)
  state = jax.block_until_ready(init_fn(m.prefill_params, draft_params, cache, tokens, lens, max_new, key))
  t1 = time.perf_counter()
  result = loop_fn(m.exec_params, draft_params, state, k_active)
  jax.block_until_ready(result.seq_BxS)
  return BatchRun(result, compile_s, t1 - t0, time.perf_counter() - t1)


def device_inputs(m, batch_size: int, max_len: int, *host_arrays):
  """A fresh KV cache and the per-sequence host arrays [B, ...] on the model's devices: ``device_put``
  (jnp.asarray would compile a copy per new shape), or on a mesh the cache over (data, model) and the arrays
  over data (every process of a multi-process run passes the same whole arrays)."""
  cache = init_cache(m.cfg, batch_size, max_len, m.dtype)
  if m.mesh is None:
    return cache, jax.device_put(host_arrays)
  from specjax.parallel import sharding
  return sharding.shard_cache(cache, m.mesh), tuple(sharding.shard_batch(x, m.mesh) for x in host_arrays)
