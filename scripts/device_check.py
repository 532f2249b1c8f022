"""Every check that needs an accelerator, in one command that writes one JSON (docs/results/device_check/).

  python scripts/device_check.py [--tiny] [--model NAME] [--device h200] [--out FILE]

On a lent GPU (or TPU) it runs, in a few minutes:

  kernels     each Pallas kernel compiled for the device (Triton on a GPU, Mosaic on a TPU; interpret mode
              on the CPU) against its pure-JAX reference, in fp32 and bf16, over tree and chain masks
  verify      the time of one target forward of T = 1, 2, 4, ..., 64 new rows in bf16, beside the cost
              model's prediction for the device (``costmodel.step_time``): the verify-cost curve
  exactness   greedy speculative decoding equals plain greedy decoding, sequence for sequence, for an
              n-gram chain, a model-drafter tree and a dynamic tree (the draft model is the target itself, so
              every draft is accepted), on every attention path the device has
              (Pallas and XLA), in fp32 and bf16
  speedups    with ``--model`` (weights already in the cache: a lent machine has no network) n-gram and
              the draft model against plain decoding (``specjax.eval.bench``); without, the n-gram engine on
              random weights, labelled as such (its acceptance says nothing about real text)

The model is random-initialised at the shape of ``--config`` (default: SmolLM2-135M's; ``--tiny``: a 2-layer
toy, what the test suite runs on the CPU in a few seconds); nothing is downloaded.  Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import machine
from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.measure import costmodel  # noqa: E402
from specjax.kernels import dispatch  # noqa: E402
from specjax.speculative import Engine, ModelDrafter, NgramDrafter, NoDrafter, generate
from specjax.speculative.trees import specs as tree_shapes  # noqa: E402
from specjax.speculative.drafters import DynamicShape  # noqa: E402
from specjax.speculative.trees.static import StaticTree  # noqa: E402

TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}     # max |kernel - reference|, outputs of magnitude ~1


def _log(msg: str) -> None:
  print(f"[device-check] {msg}", file=sys.stderr, flush=True)


def _seconds(fn, *args, repeats: int = 5) -> float:
  """Median seconds of ``fn(*args)`` after one warm-up call, each call waited for."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def _tree_mask(T: int, U: int, rng) -> np.ndarray:
  """[T, U] visibility of a random tree of T nodes (root included) in slots 0..T-1, the engine's own
  ancestor mask (``StaticTree.ancestors``)."""
  parents = [-1] + sorted(int(rng.integers(0, i)) for i in range(1, T))    # BFS order: non-decreasing
  ranks = [0] + [parents[1:i].count(parents[i]) for i in range(1, T)]
  mask = np.zeros((T, U), bool)
  mask[:, :T] = StaticTree(tuple(parents), tuple(ranks)).ancestors()
  return mask


def check_kernels(shapes, interpret: bool, mask_kinds=("tree", "chain")) -> list[dict]:
  """The Pallas tree-attention kernel against its reference, per shape and dtype."""
  from specjax.kernels.pallas.tree_attention import tree_attention, tree_attention_reference
  rows = []
  rng = np.random.default_rng(0)
  for (B, T, H, K, E, S) in shapes:
    U = T
    lengths = rng.integers(1, S - U, B).astype(np.int32)
    masks = {"tree": np.stack([_tree_mask(T, U, rng) for _ in range(B)]),
             "chain": np.broadcast_to(np.tril(np.ones((T, U), bool)), (B, T, U))}
    masks = {name: mask for name, mask in masks.items() if name in mask_kinds}
    for dtype in ("float32", "bfloat16"):
      dt = jnp.dtype(dtype)
      q = jnp.asarray(rng.standard_normal((B, T, H, E)), dt)
      k = jnp.asarray(rng.standard_normal((2, B, S, K, E)), dt)
      v = jnp.asarray(rng.standard_normal((2, B, S, K, E)), dt)
      for name, mask in masks.items():
        args = (q, k, v, jnp.int32(1), jnp.asarray(lengths), jnp.asarray(mask))
        t = time.perf_counter()
        kernel = jax.jit(lambda *a: tree_attention(*a, interpret=interpret)).lower(*args).compile()
        compile_s = time.perf_counter() - t
        ref = jax.jit(tree_attention_reference)
        err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32) - ref(*args).astype(jnp.float32))))
        row = {"kernel": "tree_attention", "B": B, "T": T, "H": H, "K": K, "E": E, "S": S, "mask": name,
               "dtype": dtype, "max_abs_error": err, "ok": err <= TOLERANCE[dtype], "compile_s": compile_s,
               "kernel_ms": 1e3 * _seconds(kernel, *args), "reference_ms": 1e3 * _seconds(ref, *args)}
        rows.append(row)
        _log(f"tree_attention B{B} T{T} H{H}/K{K} E{E} S{S} {name} {dtype}: error {err:.2e} "
             f"({'ok' if row['ok'] else 'FAIL'}), kernel {row['kernel_ms']:.3f} ms, "
             f"reference {row['reference_ms']:.3f} ms")
  return rows


def check_verify_cost(cfg, params, spec, rows=(1, 2, 4, 8, 16, 32, 64), context: int = 256) -> list[dict]:
  """One forward of T new rows over ``context`` committed tokens (batch 1, bf16), measured and predicted."""
  out = []
  S = context + max(rows)
  for T in rows:
    cache = kv_cache.init_cache(cfg, 1, S, dtype=jnp.bfloat16).with_lengths(jnp.array([context], jnp.int32))
    toks = jnp.zeros((1, T), jnp.int32)
    pos = context + jnp.arange(T, dtype=jnp.int32)[None]
    fwd = jax.jit(lambda p, c, t, q: model.forward(p, cfg, t, q, c).logits)
    ms = 1e3 * _seconds(fwd, params, cache, toks, pos)
    pred = 1e3 * costmodel.step_time(spec, cfg, 1, T, context, "bfloat16")
    out.append({"rows": T, "context": context, "measured_ms": ms, "cost_model_ms": pred,
                "ratio": ms / pred if pred else None})
    _log(f"verify T={T:2d}: {ms:.3f} ms measured, {pred:.3f} ms predicted ({spec.name})")
  return out


def _prompts(vocab: int, B: int, P: int, seed: int = 0):
  """Prompts of repeated random patterns (so that n-gram lookup finds drafts), ragged lengths."""
  rng = np.random.default_rng(seed)
  lens = rng.integers(P // 2, P + 1, B).astype(np.int32)
  prompts = np.zeros((B, P), np.int32)
  for b in range(B):
    prompts[b, :lens[b]] = np.resize(rng.integers(3, vocab, int(rng.integers(2, 5))), lens[b])
  return prompts, lens


def _decode(cfg, params, dparams, draft_cfg, drafter, shape, prompts, lens, max_new: int):
  if isinstance(drafter, ModelDrafter):
    drafter = ModelDrafter(draft_cfg.replace(backends=cfg.backends), name=drafter.name)
  N = shape.num_nodes
  eng = Engine(cfg=cfg, drafter=drafter, k_max=N, sp=sampling.SamplingParams(), eos_ids=(), tree=shape)
  B, P = prompts.shape
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  cache = kv_cache.init_cache(cfg, B, P + max_new + N + 1, dtype=dtype)
  st = generate(params, dparams, cache, jnp.asarray(prompts), jnp.asarray(lens), jnp.full((B,), max_new, jnp.int32),
                jnp.full((B,), N, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  seq = np.asarray(st.seq_BxS)
  return [seq[b, lens[b]:lens[b] + int(st.num_new_B[b])].tolist() for b in range(B)], st


def check_exactness(cfg, draft_cfg, paths, B: int, P: int, max_new: int, dtypes=("float32", "bfloat16"),
                    only=None) -> list[dict]:
  """Greedy speculative = plain greedy, per attention path, dtype and drafter/shape (``only``: those runs)."""
  prompts, lens = _prompts(cfg.vocab_size, B, P)
  runs = {"ngram chain:4": (NgramDrafter(3), tree_shapes.chain(4)),
          "model branch:2,2": (ModelDrafter(draft_cfg), tree_shapes.branching([2, 2])),
          "model dynamic:6:2:3": (ModelDrafter(draft_cfg), DynamicShape(6, top_k=2, max_depth=3))}
  runs = {name: run for name, run in runs.items() if only is None or name in only}
  rows = []
  for dtype in dtypes:
    cast = lambda p: jax.tree_util.tree_map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, p)  # noqa: E731
    params = cast(model.init_params(cfg, jax.random.PRNGKey(0)))
    # The draft model is the target itself: every draft is accepted, so the accept-commit-bonus path runs on
    # every step (a random draft of another seed would agree with the target on almost nothing).
    dparams = params
    for path in paths:
      pcfg = cfg.replace(backends=dispatch.Backends(attention=path))
      plain, _ = _decode(pcfg, params, (), draft_cfg, NoDrafter(), tree_shapes.chain(0), prompts, lens, max_new)
      for name, (drafter, shape) in runs.items():
        dp = dparams if isinstance(drafter, ModelDrafter) else ()
        outs, st = _decode(pcfg, params, dp, draft_cfg, drafter, shape, prompts, lens, max_new)
        same = sum(a == b for a, b in zip(outs, plain))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(outs, plain) if a != b]
        rows.append({"path": path, "dtype": dtype, "run": name, "sequences": B, "identical": same,
                     "first_difference_at": first, "accepted": int(st.stats.accepted_B.sum())})
        _log(f"exactness {path} {dtype} {name}: {same}/{B} identical"
             + (f", first differences at {first}" if first else ""))
  return rows


def check_speedups(model_name: str | None, cfg, B: int, P: int, max_new: int) -> dict:
  """n-gram and the draft model against plain decoding on a real model when its weights are here; else the
  n-gram engine on random weights (tokens per second of each, same prompts)."""
  if model_name:
    import specjax
    from specjax.prompts import load_prompts
    m = specjax.load(model_name, dtype="bfloat16")
    prompts = load_prompts("specjax-prompts")[:B]
    out = {"model": model_name, "weights": "real"}
    for drafter in ("ngram", "model"):
      try:
        res = specjax.eval.bench(m, prompts, batch_size=B, max_new_tokens=max_new, drafter=drafter, k=4,
                            log=lambda s: _log(str(s)))
        out[drafter] = {"speedup": res.get("speedup"), "tau": res.get("mean_accepted_length"),
                        "tokens_per_s": res.get("spec_tokens_per_s"), "ar_tokens_per_s": res.get("ar_tokens_per_s")}
      except Exception as e:                      # noqa: BLE001 (no draft registered, weights missing)
        out[drafter] = {"error": f"{type(e).__name__}: {e}"}
      _log(f"speedup {model_name} {drafter}: {out[drafter]}")
    return out
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                                  model.init_params(cfg, jax.random.PRNGKey(0)))
  prompts, lens = _prompts(cfg.vocab_size, B, P, seed=1)
  times = {}
  for name, drafter, shape in (("plain", NoDrafter(), tree_shapes.chain(0)),
                               ("ngram", NgramDrafter(3), tree_shapes.chain(4))):
    run = lambda: _decode(cfg, params, (), None, drafter, shape, prompts, lens, max_new)  # noqa: E731
    outs, _ = run()                               # compile
    t = time.perf_counter()
    outs, st = run()
    times[name] = {"seconds": time.perf_counter() - t, "tokens": int(sum(len(o) for o in outs))}
  speedup = (times["ngram"]["tokens"] / times["ngram"]["seconds"]) / (times["plain"]["tokens"] / times["plain"]["seconds"])
  _log(f"speedup (random weights, n-gram chain:4): {speedup:.2f}x")
  return {"weights": "random (acceptance not representative)", "ngram_speedup": speedup, "runs": times}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model and small shapes (the CPU test)")
  ap.add_argument("--config", default="smollm2-135m", help="the preset whose shape the random model takes")
  ap.add_argument("--model", default=None, help="a model whose weights are in the cache, for real speedups")
  ap.add_argument("--device", default=None, help="the cost model's device spec (default: guessed, else h200)")
  ap.add_argument("--out", default=None, help="the JSON to write (default docs/results/device_check/<machine>.json)")
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  backend = jax.default_backend()
  kind = jax.devices()[0].device_kind
  if args.tiny:
    cfg = config.TINY.replace(name="device-check-tiny", num_layers=2, head_dim=16)   # Triton: E >= 16
    shapes = [(2, 4, 4, 2, 16, 64)]
    B, P, max_new, rows, mask_kinds = 2, 12, 8, (1, 8), ("tree",)
    exact_kw = dict(dtypes=("bfloat16",), only=("model branch:2,2",))   # 4 compiles: seconds, not minutes
  else:
    cfg = config.PRESETS[args.config]
    shapes = [(1, 1, 16, 4, 64, 512), (4, 8, 16, 4, 64, 1024), (8, 32, 32, 8, 128, 2048), (2, 64, 16, 4, 64, 4096)]
    B, P, max_new, rows, mask_kinds = 8, 64, 64, (1, 2, 4, 8, 16, 32, 64), ("tree", "chain")
    exact_kw = {}
  cfg = cfg.replace(backends=dispatch.resolve())
  draft_cfg = cfg
  spec_name = args.device or next((n for n in costmodel.DEVICES if n.split("-")[0] in kind.lower()), "h200")
  spec = costmodel.device_spec(spec_name)
  _log(f"{backend} ({kind}), jax {jax.__version__}, model shape {cfg.name}, cost model {spec_name}")
  paths = ["pallas", "xla"]                   # both on every device; interpret mode on the CPU
  result = {"backend": backend, "device_kind": kind, "machine": machine.cpu_name(), "jax": jax.__version__,
            "tiny": args.tiny, "config": cfg.name, "cost_model_device": spec_name}
  result["kernels"] = check_kernels(shapes, interpret=backend == "cpu", mask_kinds=mask_kinds)
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                                  model.init_params(cfg, jax.random.PRNGKey(0)))
  result["verify"] = check_verify_cost(cfg, params, spec, rows, context=32 if args.tiny else 512)
  result["exactness"] = check_exactness(cfg, draft_cfg, paths, B, P, max_new, **exact_kw)
  result["speedups"] = check_speedups(args.model, cfg, B, P, max_new)
  result["all_kernels_ok"] = all(r["ok"] for r in result["kernels"])
  result["all_exact"] = all(r["identical"] == r["sequences"] for r in result["exactness"])
  result["seconds"] = time.perf_counter() - t0
  out = Path(args.out) if args.out else ROOT / "docs" / "results" / "device_check" / (
      f"{'tiny-' if args.tiny else ''}{backend}-{kind.replace(' ', '_').lower()}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  _log(f"kernels {'ok' if result['all_kernels_ok'] else 'FAIL'}, exactness "
       f"{'all identical' if result['all_exact'] else 'MISMATCHES'}; {result['seconds']:.0f} s; wrote {out}")
  print(json.dumps({k: result[k] for k in ("backend", "all_kernels_ok", "all_exact", "seconds")}))
  return 0 if result["all_kernels_ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
