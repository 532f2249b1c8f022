"""Timing a speculative method's parts alone: ``Timer`` (where a benchmark's wall time went) and
``time_draft_and_verify`` (one propose of the engine's draft nodes, and one verify forward with 1..N+1 live rows,
each the median of repeated calls from the state right after prefill).  ``bench`` predicts a speedup from them
(τ × plain step ÷ (draft + verify)); ``experiments/weights.py`` and ``scripts/replay_ngram.py`` use them too."""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.api import Model, device_inputs
from specjax.models import decode
from specjax.speculative.trees import specs as tree_shapes


class Timer:
  """Where a benchmark's wall time went: compiling (or reading executables from the compilation cache),
  prefill, and the timed decode loops."""

  def __init__(self, log=print):
    self.compile_s = self.prefill_s = self.decode_s = 0.0
    self.log = log

  def as_dict(self) -> dict:
    return {"compile_s": self.compile_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s}


def _verify_mask_N1xN1(shape) -> tuple[np.ndarray, np.ndarray]:
  """(region mask [N1, N1], depths [N1]) of the verify forward that ``time_draft_and_verify`` times.

  A static tree (a chain included) gets its own ancestor mask, exactly what the engine verifies.  A dynamic
  tree changes every step, so it is timed with the chain's (causal) mask over the same N+1 rows: a proxy,
  as the forward's cost is set by the number of live rows, hardly by which tree slots each row sees."""
  static = shape if isinstance(shape, tree_shapes.StaticTree) else tree_shapes.chain(shape.num_nodes)
  return static.ancestors(), np.asarray(static.depths, np.int32)


def time_draft_and_verify(m: Model, engine, draft_params, arr, lens, max_len: int,
                          repeats: int = 9, timer: Timer | None = None) -> tuple[float, dict[int, float]]:
  """Measured cost of one propose (the engine's whole tree, or chain, of k_max = N draft nodes) and of one
  verify forward with 1, ..., N+1 live rows under the tree's region mask (see ``_verify_mask_N1xN1``), each
  timed alone (median), from the state right after prefill.  Caches are donated and fed back, as in the
  loop, so no timing includes a copy of a KV buffer."""
  timer = timer or Timer()
  B = arr.shape[0]
  K = engine.k_max
  init_fn, _, seconds = m.executables.for_batch(m, engine, B, arr.shape[1], max_len, draft_params,
                                                log=lambda msg: timer.log(f"[bench] {msg}"))
  timer.compile_s += seconds
  cache, inputs = device_inputs(m, B, max_len, arr, lens, np.full((B,), 2, np.int32))
  state = init_fn(m.prefill_params, draft_params, cache, *inputs, jax.random.PRNGKey(0))
  lengths = state.cache.lengths
  mask_N1xN1, depth_N1 = _verify_mask_N1xN1(engine.shape)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def propose(dp, draft_state, seq_BxS, last_B):
    new_state, d = engine.drafter.propose(dp, draft_state, seq_BxS, lengths, last_B, engine.shape,
                                          jax.random.PRNGKey(1), engine.sp)
    return new_state, d.tokens_BxN1

  @functools.partial(jax.jit, donate_argnums=(1,))
  def verify(tp, cache, last_B, rows):
    toks = jnp.concatenate([last_B[:, None], jnp.zeros((B, K), jnp.int32)], axis=1)
    pos = lengths[:, None] + jnp.asarray(depth_N1)[None, :]
    mask = jnp.broadcast_to(jnp.asarray(mask_N1xN1), (B, K + 1, K + 1))
    out = decode.windowed_forward(tp, engine.cfg, toks, pos, cache.with_lengths(lengths),
                                  buckets=engine.buckets, live_T=rows, region_mask_BxTxU=mask)
    return out.cache, out.logits

  seq, last = state.seq_BxS, state.last_B
  t0 = time.perf_counter()
  propose_c = propose.lower(draft_params, state.draft, seq, last).compile() if K else None
  verify_c = verify.lower(m.exec_params, state.cache, last, jnp.int32(1)).compile()
  timer.compile_s += time.perf_counter() - t0

  def median(fn, carry):
    times = []
    for i in range(repeats + 1):
      t0 = time.perf_counter()
      carry, out = fn(carry)
      jax.block_until_ready(out)
      if i:                        # the first call warms up
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), carry

  t_draft = median(lambda c: propose_c(draft_params, c, seq, last), state.draft)[0] if K else 0.0
  t_verify, cache = {}, state.cache
  for w in range(1, K + 2):
    t_verify[w], cache = median(lambda c, w=w: verify_c(m.exec_params, c, last, jnp.int32(w)), cache)
  return t_draft, t_verify
