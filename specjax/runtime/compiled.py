"""Ahead-of-time executables of a decode: prefill per prompt bucket and the decode loop per engine, batch
and buffer, compiled side by side (or read back from memory or the persistent cache)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import functools
import time

import jax
import jax.numpy as jnp

from specjax.models import buffers, sampling
from specjax import speculative as spec
from specjax.models.kv_cache import init_cache
from specjax.progress import say
from specjax.runtime.loaded import Model


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


def compile_generate(m: Model, engine: spec.Engine, batch_size: int, prompt_pad: int, max_len: int,
                     draft_params=(), log=say):
  """The two executables of a generation, each compiled once per shape that matters to it:

    prefill  (``speculative.init``, on ``m.prefill_params``): once per (engine, batch, prompt bucket, buffer
             length)
    decode loop (``speculative.decode_loop``): once per (engine, batch, buffer length), whatever the prompts

  Whatever is missing is lowered here and compiled on two threads at once (XLA compiles on one core each),
  or read back from the persistent compilation cache.  Returns (prefill_fn, loop_fn, seconds spent); call
  ``prefill_fn(m.prefill_params, ...)`` and ``loop_fn(m.exec_params, ...)``.
  """
  from specjax.runtime import compile_cache

  drafts = _signature(draft_params)       # one draft model at two weight types: two executables
  init_key = ("init", engine, batch_size, prompt_pad, max_len, drafts)
  loop_key = ("loop", engine, batch_size, max_len, drafts)
  if init_key in m._compiled and loop_key in m._compiled:
    return m._compiled[init_key], m._compiled[loop_key], 0.0
  t0 = time.perf_counter()
  before = compile_cache.counts()
  from specjax.parallel import sharding
  cache = jax.eval_shape(lambda: init_cache(m.cfg, batch_size, max_len, m.dtype))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  if m.mesh is not None:            # the inputs' shardings are part of what is compiled
    cache = sharding.abstract_cache(cache, m.mesh)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding.batch_sharding(s, m.mesh))  # noqa
  B = batch_size
  made = [k for k in (init_key, loop_key) if k not in m._compiled]
  init_args = (m.prefill_params, draft_params, cache, i32(B, prompt_pad), i32(B), i32(B), jax.random.PRNGKey(0))
  todo = {}
  if m.mesh is None:
    init_traced = spec.init_jit.trace(engine, *init_args)
    state_info = init_traced.out_info       # the state's shapes come from the prefill's trace
    if init_key not in m._compiled:
      todo[init_key] = init_traced.lower()
    if loop_key not in m._compiled:
      todo[loop_key] = spec.decode_loop_jit.lower(engine, m.exec_params, draft_params, state_info, i32(B))
  else:
    # On a mesh both executables get explicit shardings: the prefill's state out (KV over data and model,
    # per-sequence arrays over data: sharding.state_shardings), the loop's state in and result out; the
    # two then compile independently, like on one device.
    init_fn, loop_fn = _sharded_jits(m.mesh, B)
    state_abs = jax.eval_shape(functools.partial(spec.init, engine), *init_args)
    state_info = sharding.with_shardings(state_abs, sharding.state_shardings(state_abs, m.mesh, B))
    if init_key not in m._compiled:
      todo[init_key] = init_fn(state_abs).lower(engine, *init_args)
    if loop_key not in m._compiled:
      loop_args = (m.exec_params, draft_params, state_info, i32(B))
      res_abs = jax.eval_shape(functools.partial(spec.decode_loop, engine), *loop_args)
      todo[loop_key] = loop_fn(res_abs).lower(engine, *loop_args)
  if not todo:
    pass
  elif len(todo) == 1:
    (key, lowered), = todo.items()
    m._compiled[key] = lowered.compile()
  else:
    with ThreadPoolExecutor(len(todo)) as pool:
      for key, fn in zip(todo, pool.map(lambda lowered: lowered.compile(), todo.values())):
        m._compiled[key] = fn
  seconds = time.perf_counter() - t0
  what = " and ".join({"init": f"prefill (prompt bucket {prompt_pad})", "loop": "decode loop"}[k[0]]
                      for k in made)
  log(f"{what} for {_shape_key(engine)}, batch {B}, buffer {max_len}: "
      f"{compile_cache.describe(compile_cache.since(before))} in {seconds:.1f}s")
  return m._compiled[init_key], m._compiled[loop_key], seconds


def make_engine(m: Model, drafter, k_max: int, sp: sampling.SamplingParams, eos_ids: tuple[int, ...],
                max_len: int, tree=None) -> spec.Engine:
  """``tree``: the engine's shape (``TreeChoice.shape``: a StaticTree or a DynamicShape with k_max nodes);
  None drafts the chain of k_max."""
  return spec.Engine(cfg=m.cfg, drafter=drafter, k_max=k_max, sp=sp, eos_ids=eos_ids,
                     buckets=buffers.kv_buckets(max_len), tree=tree)


def device_inputs(m: Model, batch_size: int, max_len: int, *host_arrays):
  """A fresh KV cache and the per-sequence host arrays [B, ...] on the model's devices: ``device_put``
  (jnp.asarray would compile a copy per new shape), or on a mesh the cache over (data, model) and the arrays
  over data (every process of a multi-process run passes the same whole arrays)."""
  cache = init_cache(m.cfg, batch_size, max_len, m.dtype)
  if m.mesh is None:
    return cache, jax.device_put(host_arrays)
  from specjax.parallel import sharding
  return sharding.shard_cache(cache, m.mesh), tuple(sharding.shard_batch(x, m.mesh) for x in host_arrays)
