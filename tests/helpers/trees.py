"""The tiny target, prompts and tree shapes of the token-tree tests (test_trees.py), and ``_run``, a batch decoded
through the engine with a tree: shared with test_suffix.py.  (The ``target`` fixture: tests/speculative/conftest.py.)"""
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import config, kv_cache, sampling
from specjax.speculative import Engine, generate
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import DynamicShape

CFG = config.TINY.replace(num_layers=2)
DRAFT_CFG = config.TINY.replace(name="tiny-draft", num_layers=1)
BUCKETS = (16, 32, 64)


ACC = (0.55, 0.2, 0.1, 0.05)
SHAPES = {
    "chain": tree_shapes.chain(3),
    "branch": tree_shapes.branching([3, 2, 1]),
    "paths": tree_shapes.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "sequoia": tree_shapes.sequoia(ACC, 7, 4),
    "dynamic": DynamicShape(6, top_k=2, max_depth=3),
}


def _run(target, drafter, dparams, shape, prompts, lens, max_new, sp=sampling.SamplingParams(), eos=()):
  B = prompts.shape[0]
  N = shape.num_nodes
  eng = Engine(cfg=CFG, drafter=drafter, k_max=N, sp=sp, eos_ids=eos, buckets=BUCKETS, tree=shape)
  st = generate(target, dparams, kv_cache.init_cache(CFG, B, 64), jnp.asarray(prompts), jnp.asarray(lens),
                jnp.asarray(max_new), jnp.full((B,), N, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  seq = np.asarray(st.seq_BxS)
  return [seq[i, lens[i]:lens[i] + int(st.num_new_B[i])].tolist() for i in range(B)], st


PROMPTS = np.array([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [9, 10, 11, 12, 13, 14, 9, 10, 0, 0], [3] + [0] * 9],
                   np.int32)
LENS = np.array([10, 8, 1])
MAX_NEW = np.array([18, 13, 15], np.int32)
