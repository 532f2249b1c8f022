"""How large should a feature drafter's reduced head be?  Coverage against cost, measured.

  python scripts/probes/head_size_check.py DATA_DIR [--model qwen2.5-coder-1.5b] [--sizes 8192 16384 32768 0] [--json]

A reduced head keeps the Vr target tokens most frequent on the training data; a draft can never propose a
token outside them, so (under greedy decoding) the share of the target's next tokens inside the set bounds the
first-position acceptance from above.  For each size this prints:

  coverage     the share of the target's first choices (at the positions a drafter predicts) inside the set,
               with the set chosen on a training split of the data's sequences and counted on the rest (the
               same split as training's held-out set);
  head_ms      one drafter forward's head (rows x Vr x D) timed on this machine at 1 and 8 rows (a chain step
               and a tree depth), beside the decoder layer's time, so the head's share of a draft step shows;
  train_gflop  the head's share of the training FLOPs per token and unroll step.

Size 0 means the full vocabulary.  Reads a complete feature store (``features/``).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import decoder as model_lib
from specjax.measure import provenance
from specjax.training import eagle_train


def _time(fn, *args, reps: int = 20) -> float:
  jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  for _ in range(reps):
    jax.block_until_ready(fn(*args))
  return (time.perf_counter() - t) / reps * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("data_dir")
  ap.add_argument("--model", default="qwen2.5-coder-1.5b")
  ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 0])
  ap.add_argument("--held-out", type=float, default=0.1)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  from specjax import api
  m = api.load(args.model)
  cfg = m.cfg
  store = eagle_train.FeatureData(args.data_dir)
  train_idx, held_idx = store.split(args.held_out, 0)
  pred = store.predicted_positions()
  offsets = np.asarray(store.offsets)
  in_held = np.zeros(len(store.tokens), bool)
  for s in held_idx:
    in_held[offsets[s]:offsets[s + 1]] = True
  first = np.asarray(store.topk_ids[:, 0])
  toks = np.asarray(store.tokens)
  counts = (np.bincount(first[pred & ~in_held], minlength=cfg.vocab_size)
            + np.bincount(toks[~in_held], minlength=cfg.vocab_size))
  held_first = first[pred & in_held]
  D = cfg.d_model
  head_full = m.params["embed"] if cfg.tie_embeddings else m.params["lm_head"]
  layer_flops = 2 * D * ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim
                         + 3 * cfg.ffn_dim) + 2 * D * 2 * D          # + fc
  rows = []
  for size in args.sizes:
    vr = size or cfg.vocab_size
    keep = eagle_train.reduced_vocabulary(counts, vr, always=cfg.eos_token_ids)
    coverage = float(np.isin(held_first, keep).mean())
    w = jnp.asarray(np.asarray(head_full)[keep] if size else np.asarray(head_full), jnp.float32)
    # the head as the engine's drafter runs it (the native CPU matmul where the kernel paths chose it)
    head = jax.jit(lambda x, w: model_lib.linear(x, w, backends=cfg.backends))
    ms = {r: _time(head, jnp.ones((1, r, D), jnp.float32), w) for r in (1, 8)}
    rows.append({"size": vr, "coverage": round(coverage, 5), "head_ms_1row": round(ms[1], 3),
                 "head_ms_8rows": round(ms[8], 3), "head_share_of_train_flops":
                 round(2 * D * vr / (2 * D * vr + layer_flops), 3)})
  out = {"data_dir": args.data_dir, "model": args.model, "held_out_sequences": int(len(held_idx)),
         "held_out_positions": int(len(held_first)), "rows": rows, "machine": provenance.describe()}
  if args.json:
    print(json.dumps(out, indent=1))
  else:
    print(f"{args.model}: held-out {len(held_idx)} sequences, {len(held_first)} predicted positions")
    print(f"{'size':>8} {'coverage':>9} {'head 1 row ms':>14} {'head 8 rows ms':>15} {'head share of train':>20}")
    for r in rows:
      print(f"{r['size']:>8} {r['coverage']:>9.4f} {r['head_ms_1row']:>14.2f} {r['head_ms_8rows']:>15.2f} "
            f"{r['head_share_of_train_flops']:>20.2f}")


if __name__ == "__main__":
  main()
