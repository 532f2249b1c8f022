"""The suffix drafter's device lookup alone: milliseconds per propose for an index of C token slots (filled with
random 400-token documents), rows of 1,024 positions, a chain of 8, at batch 1 and 4.

  python scripts/probes/suffix_lookup_cost.py [--slots 65536]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import sampling
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.suffix import SuffixDrafter, absorb, empty_index


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--slots", type=int, default=65536)
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  r = np.random.default_rng(0)
  dp = absorb(empty_index(args.slots), [r.integers(0, 5000, 400).tolist() for _ in range(args.slots // 400)])
  d = SuffixDrafter()
  for B in (1, 4):
    seq = jnp.asarray(r.integers(0, 5000, (B, 1024)), jnp.int32)
    L = jnp.full((B,), 700, jnp.int32)
    f = jax.jit(lambda dp, seq, L: d.propose(dp, (), seq, L, seq[:, 0], tree_shapes.chain(8), None,
                                             sampling.SamplingParams())[1].tokens_BxN1)
    jax.block_until_ready(f(dp, seq, L))
    t = time.perf_counter()
    for _ in range(args.iters):
      jax.block_until_ready(f(dp, seq, L))
    print(f"index {args.slots} slots, batch {B}: {(time.perf_counter() - t) / args.iters * 1e3:.2f} ms a propose")


if __name__ == "__main__":
  main()
