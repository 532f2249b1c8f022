"""Microbenchmarks of the native CPU kernels, each against its XLA reference in the same process.

  python scripts/bench_kernels.py [--isa best|all|avx2,...] [--json]

1. matmul: a chain of 90 `x · wᵀ` products with 3072×576 weights (637 MB, far larger than the caches) for
   M = 1..16 rows of x — what one decode (M = 1) or verification (M = k+1) step costs in matmuls.
2. forward: one SmolLM2-135M-shaped forward (random weights, fp32) over T new tokens on top of a cache
   holding `ctx` tokens, with the native attention kernel and with XLA attention (KV window buckets) —
   the verification cost curve the speculative speedup depends on.
Medians of repeated runs; absolute times drift on shared machines, compare within one run.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import buffers, config, decoder as model
from specjax.measure import provenance
from specjax.kernels import cpu_matmul, dispatch, native

ISAS = ["avx512"]   # kernel paths to time (set from --isa)
from specjax.models.kv_cache import init_cache


def median_ms(fn, *args, repeats=15):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)) * 1e3


def bench_matmul(rows=(1, 2, 3, 5, 6, 9, 16, 24, 32, 48)):
  ws = [jax.random.normal(jax.random.PRNGKey(i), (3072, 576)) for i in range(90)]
  nbytes = sum(w.nbytes for w in ws)

  def chain(mm):
    def run(ws, x):
      for w in ws:
        x = jnp.tanh(mm(x, w))[:, :576]
      return x
    return jax.jit(run)

  out = []
  for M in rows:
    x = jnp.full((M, 576), 0.01, jnp.float32)
    xla = median_ms(chain(cpu_matmul.matmul_t_reference), ws, x)
    row = {"rows": M, "xla_ms": xla}
    for isa in ISAS:     # the same executable: the kernel reads the path on every call
      native.set_isa(isa)
      nat = median_ms(chain(cpu_matmul.matmul_t_native), ws, x)
      row[f"native_{isa}_ms"], row[f"native_{isa}_gbs"] = nat, nbytes / nat / 1e6
    native.set_isa(native.detected_isa())
    out.append(row)
    print(f"matmul M={M:2d}: XLA {xla:6.1f} ms  " + "  ".join(
        f"{isa} {row[f'native_{isa}_ms']:6.1f} ms ({row[f'native_{isa}_gbs']:.1f} GB/s)" for isa in ISAS),
        flush=True)
  return out


def bench_forward(contexts=(100, 700, 1500), rows=(1, 2, 4, 6, 9)):
  cfg = config.SMOLLM2_135M
  params = model.unstack_layers(model.init_params(cfg, jax.random.PRNGKey(0)))
  S = 2048
  buckets = buffers.kv_buckets(S)
  applies = dispatch.native_attention_applies
  table = {(ctx, T): {"context": ctx, "new_tokens": T} for ctx in contexts for T in rows}
  variants = [(f"native_{isa}_attention_ms", True, isa) for isa in ISAS] + [("xla_attention_ms", False, None)]
  for label, use_native, isa in variants:
    dispatch.native_attention_applies = applies if use_native else (lambda *a: False)
    if isa:
      native.set_isa(isa)
    for T in rows:   # one compile per (variant, T); the context is data
      # The cache is donated and fed back, as in the decode loop (else every call copies the whole buffer).
      fwd = jax.jit(lambda p, t, pos, c: model.forward(p, cfg, t, pos, c, kv_buckets=buckets),
                    donate_argnums=(3,))
      cache = init_cache(cfg, 1, S)
      for ctx in contexts:
        lengths = jnp.full((1,), ctx, jnp.int32)
        pos = ctx + jnp.arange(T, dtype=jnp.int32)[None]
        toks = jnp.zeros((1, T), jnp.int32)
        times = []
        for i in range(16):
          jax.block_until_ready(cache)
          t0 = time.perf_counter()
          out = fwd(params, toks, pos, cache.with_lengths(lengths + 0))   # fresh: the cache is donated
          jax.block_until_ready(out.logits)
          times.append(time.perf_counter() - t0)
          cache = out.cache
        ms = float(np.median(times[1:])) * 1e3      # the first call compiles
        table[ctx, T][label] = ms
        print(f"forward {label[:-3]:>16} ctx={ctx:4d} T={T}: {ms:5.1f} ms", flush=True)
  dispatch.native_attention_applies = applies
  native.set_isa(native.detected_isa())
  out = list(table.values())
  best = f"native_{native.detected_isa()}_attention_ms"
  for r in out:   # verification cost relative to a one-token step at the same context
    base = next(b for b in out if b["context"] == r["context"] and b["new_tokens"] == 1)
    r["native_vs_one_token"] = r[best] / base[best]
    r["xla_vs_one_token"] = r["xla_attention_ms"] / base["xla_attention_ms"]
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true", help="print the results as JSON at the end")
  ap.add_argument("--isa", default="best",
                  help="kernel paths to time: 'best' (what this CPU runs), 'all' (every path it supports), or "
                       "a comma list of portable,avx2,avx512")
  ap.add_argument("--rows", default="1,2,3,5,6,9,16,24,32,48", help="matmul row counts M")
  ap.add_argument("--contexts", default="100,700,1500", help="forward: cached tokens before the new ones")
  ap.add_argument("--new-tokens", default="1,2,4,6,9", help="forward: new tokens T per step")
  ap.add_argument("--skip-forward", action="store_true")
  args = ap.parse_args()
  if not native.available():
    raise SystemExit("the native kernels are not available here (SPECJAX_NATIVE=0, no compiler, or not a CPU)")
  supported = native.ISAS[:native.ISAS.index(native.detected_isa()) + 1]
  global ISAS
  ISAS = {"best": [native.detected_isa()], "all": list(supported)}.get(
      args.isa, [i for i in args.isa.split(",") if i in supported])
  ints = lambda text: tuple(int(v) for v in text.split(","))   # noqa: E731
  print(f"machine: {provenance.short()}; paths timed: {', '.join(ISAS)}", flush=True)
  result = {"machine": provenance.describe(), "paths": ISAS, "matmul": bench_matmul(ints(args.rows))}
  if not args.skip_forward:
    result["forward"] = bench_forward(ints(args.contexts), ints(args.new_tokens))
  if args.json:
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
