"""What one speculative step's drafting costs, per drafter, on this machine: the sequential feature head
(one forward per depth), the parallel head (one forward for all K positions) and, for scale, the target's own
one-token step.

  python scripts/draft_cost.py [--model qwen2.5-coder-1.5b] [--k 4] [--vocab 32768] [--context 384]
                               [--head-weights fp32,bf16,int8] [--json]

Heads with random weights of the target's shape (a trained head costs the same): fused low/middle/high
features, a reduced head of ``--vocab`` rows.  Timed inside jit, batch 1, after one accepted token (the
steady state: two pending tokens fed first), median of ``--reps``:

  sequential_step_ms      one depth of the sequential head (a one-token forward: what a chain pays k times)
  sequential_chain_ms     its whole chain:K propose (the root forward with the pending tokens, then K - 1 depths)
  sequential_mean_step_ms the chain's cost per drafted token (sequential_chain_ms / K)
  parallel_chain_ms       the parallel head's chain:K propose (one forward over pending + K - 1 placeholders)
  target_step_ms          the target's plain decoding step at the same context

The issue's bar: the parallel chain:4 costs at most 1.5x one sequential step (reported against one depth and
against the chain's mean step).  Per weight type the three are timed in alternation, one call each per round,
so that drift on a shared machine falls on all of them alike.  ``--head-weights``: the heads
again at each weight type (``--draft-weights`` of a head: its layer, fc, fuse and head rows quantized by
``runtime.builder.quantize_head``), under ``by_head_weights``; the keys above are the first type's.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import decoder as model_lib, sampling
from specjax.measure import provenance
from specjax.speculative import eagle
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.eagle_parallel import ParallelEagleDrafter


def _median_ms(fn, reps: int) -> float:
  return _interleaved_medians_ms({"fn": fn}, reps)["fn"]


def _interleaved_medians_ms(fns: dict, reps: int) -> dict:
  """Each function's median time over ``reps`` rounds, one call of each per round (after a warm-up): a
  shared machine's drift then falls on every function alike, and their ratios hold."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t)
  return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="qwen2.5-coder-1.5b")
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=32768, help="reduced head rows (0: the full vocabulary)")
  ap.add_argument("--context", type=int, default=384)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--head-weights", default="fp32", help="comma-separated head weight types (fp32, bf16, int8, int4)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  from specjax import api
  from specjax.models import buffers
  from specjax.models.kv_cache import init_cache
  from specjax.speculative import Engine, NoDrafter
  from specjax.runtime.builder import quantize_head
  from specjax.training.data import default_fused_layers
  head_weights = [w.strip() for w in args.head_weights.split(",") if w.strip()]
  m = api.load(args.model)
  cfg = m.cfg
  K, P = args.k, args.context
  max_len = buffers.buffer_length(P, 256, K)
  buckets = buffers.kv_buckets(max_len)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(100, 5000, (1, P)), jnp.int32)
  lens = jnp.array([P], jnp.int32)
  seq = jnp.zeros((1, max_len), jnp.int32).at[:, :P + 2].set(jnp.asarray(rng.integers(100, 5000, (1, P + 2))))
  sp = sampling.SamplingParams()
  key = jax.random.PRNGKey(0)
  out = {"model": args.model, "k": K, "vocab": args.vocab or cfg.vocab_size, "context": P,
         "by_head_weights": {w: {} for w in head_weights}}
  for w in head_weights:     # per weight type: the sequential and parallel heads timed in alternation
    fns = {}
    for parallel in (0, K):
      ecfg = eagle.EagleConfig(cfg, default_fused_layers(cfg.num_layers), args.vocab, parallel)
      tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(1))
      head_ids = np.sort(rng.choice(cfg.vocab_size, ecfg.head_size, replace=False)) if ecfg.reduced else None
      params = model_lib.unstack_layers(quantize_head({**tr, **eagle.frozen_from_target(ecfg, m.params, head_ids)},
                                                      w))
      cls = ParallelEagleDrafter if parallel else eagle.EagleDrafter
      d = cls(ecfg.layer_cfg.replace(backends=cfg.backends), buckets=buckets, ecfg=ecfg, max_depth=K)
      feats = jnp.asarray(rng.normal(size=(1, P, ecfg.feature_dim)), jnp.float32)
      st = d.init(params, prompt, lens, max_len, feats)
      # the steady state: one draft accepted last step, so two tokens (P, P+1) are fed before drafting
      st = d.commit(st, lens, None, lens + 1, jnp.asarray(rng.normal(size=(1, K + 1, ecfg.feature_dim)),
                                                           jnp.float32))
      lengths = lens + 1
      propose = jax.jit(lambda p, s, d=d, lengths=lengths: d.propose(p, s, seq, lengths, seq[:, P + 1],
                                                                     tree_shapes.chain(K), key, sp)[1].tokens_BxN1)
      name = "parallel" if parallel else "sequential"
      fns[f"{name}_chain_ms"] = functools.partial(propose, params, st)
      if not parallel:        # one depth: a one-token forward on top of the cache (what each later depth pays)
        ext = jax.jit(lambda p, c, d=d: d._extend(p, c, seq[:, P + 1:P + 2], 1, jnp.ones((1, 1), jnp.int32),
                                                  jnp.ones((1, 1, 2), bool), jnp.zeros((1, 1, cfg.d_model)))[0])
        fns["sequential_step_ms"] = functools.partial(ext, params, st.cache.with_lengths(lengths))
    row = out["by_head_weights"][w] = _interleaved_medians_ms(fns, args.reps)
    # what the sequential chain pays per drafted token on average (its first step feeds the pending tokens)
    row["sequential_mean_step_ms"] = row["sequential_chain_ms"] / K
  out.update(out["by_head_weights"][head_weights[0]])
  eng = Engine(cfg=cfg, drafter=NoDrafter(), k_max=0, sp=sp, buckets=buckets)
  from specjax.speculative import engine as engine_lib
  state = engine_lib.init_jit(eng, m.prefill_params, (), init_cache(cfg, 1, max_len, m.dtype), prompt, lens,
                              jnp.array([10_000], jnp.int32), key)
  step = jax.jit(lambda p, s: engine_lib.spec_step(eng, p, (), s, jnp.zeros((1,), jnp.int32)).last_B)
  out["target_step_ms"] = _median_ms(lambda: step(m.exec_params, state), args.reps)
  for row in [out, *out["by_head_weights"].values()]:
    row["parallel_chain_over_sequential_step"] = row["parallel_chain_ms"] / row["sequential_step_ms"]
    row["parallel_chain_over_sequential_mean_step"] = row["parallel_chain_ms"] / row["sequential_mean_step_ms"]
  out["machine"] = provenance.describe()
  if args.json:
    print(json.dumps(out, indent=1))
  else:
    for key_, v in out.items():
      if key_ == "by_head_weights":
        for w, row in v.items():
          print(f"{'head weights ' + w:>40}: " + ", ".join(f"{n} {t:.1f}" for n, t in row.items()))
      elif key_ != "machine":
        print(f"{key_:>40}: {v:.3f}" if isinstance(v, float) else f"{key_:>40}: {v}")

if __name__ == "__main__":
  main()
