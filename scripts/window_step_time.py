"""Step time of one decoder layer at a long and a short context: a windowed layer's must not grow with the
context (it reads only its window), a global layer's may.

For a real model with sliding-window layers (default ``gemma3-270m``), one windowed and one global layer
are cut out as one-layer models (``ModelConfig.with_layers``, the real weights), their KV buffers filled
with random entries up to each context length, and a one-token decode step (the forward a plain decode
step runs: projections, RoPE, the new entry written, attention over the cache, the MLP) is timed on the
backends ``api.load`` picked (the native CPU kernels here).  Prints a table and one JSON line.

  python scripts/window_step_time.py [--model gemma3-270m] [--contexts 1024,8192] [--repeats 200]
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import api
from specjax.measure import provenance
from specjax.models import decoder
from specjax.models.kv_cache import KVCache, init_cache


def _cpu() -> str:
  return provenance.describe()["cpu"]


def layer_model(m, layer: int):
  """A one-layer model made of layer ``layer`` of ``m`` (its weights, window and rope)."""
  cfg = m.cfg.with_layers((layer,), name=f"{m.cfg.name}-layer{layer}")
  params = decoder.stack_layers(m.exec_params)
  one = {**params, "layers": jax.tree_util.tree_map(lambda x: x[layer:layer + 1], params["layers"])}
  return cfg, decoder.unstack_layers(one)


def step_seconds(cfg, params, contexts: list[int], max_len: int, repeats: int) -> dict[int, float]:
  """Median seconds of a one-token forward at each context (committed positions; random KV entries), the
  contexts timed in alternation so that a drift of the machine lands on all of them.  The KV buffers are
  donated and handed back (as the decode loop does), so no step copies them."""
  cache = init_cache(cfg, 1, max_len, jnp.float32)
  r = np.random.default_rng(0)
  k = jnp.asarray(r.standard_normal(cache.k.shape).astype(np.float32))
  cache = KVCache(k=k, v=k * 0.5, lengths=jnp.asarray([0], jnp.int32))

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(p, c, tok, pos):
    out = decoder.forward(p, cfg, tok, pos, c)
    return out.logits, out.cache

  tok = jnp.asarray([[17]], jnp.int32)
  times = {c: [] for c in contexts}
  for i in range(repeats + 3):
    for c in contexts:
      cache = cache.with_lengths(jnp.asarray([c], jnp.int32))
      pos = jnp.asarray([[c]], jnp.int32)
      t0 = time.perf_counter()
      logits, cache = step(params, cache, tok, pos)
      logits.block_until_ready()
      if i >= 3:                          # the first rounds compile and warm up
        times[c].append(time.perf_counter() - t0)
  return {c: float(np.median(t)) for c, t in times.items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="gemma3-270m")
  ap.add_argument("--contexts", default="1024,8192")
  ap.add_argument("--repeats", type=int, default=200)
  args = ap.parse_args()
  m = api.load(args.model)
  if not m.cfg.windowed:
    raise SystemExit(f"{args.model} has no sliding-window layer")
  contexts = [int(c) for c in args.contexts.split(",")]
  max_len = max(contexts) + 64
  windowed = next(i for i in range(m.cfg.num_layers) if m.cfg.window(i))
  glob = next((i for i in range(m.cfg.num_layers) if not m.cfg.window(i)), None)
  rows = {}
  for name, layer in (("windowed", windowed), ("global", glob)):
    if layer is None:
      continue
    cfg, params = layer_model(m, layer)
    # The head would dominate a one-layer step (262k rows on Gemma): time the layer, not the vocabulary.
    params = {**params, "embed": params["embed"][:1024]}
    cfg = cfg.replace(vocab_size=1024)
    rows[name] = {"layer": layer, "window": m.cfg.window(layer),
                  "ms": {c: 1e3 * t for c, t in step_seconds(cfg, params, contexts, max_len, args.repeats).items()}}
  print(f"{args.model} on {_cpu()}, backends {m.cfg.backends.attention} attention")
  for name, row in rows.items():
    ms = row["ms"]
    ratio = ms[contexts[-1]] / ms[contexts[0]]
    print(f"  {name:8s} layer {row['layer']:2d} (window {row['window'] or 'none'}): "
          + ", ".join(f"{c} ctx {ms[c]:.3f} ms" for c in contexts) + f"  ratio {ratio:.3f}")
  print(json.dumps({"model": args.model, "cpu": _cpu(), "contexts": contexts, "layers": rows}))


if __name__ == "__main__":
  main()
