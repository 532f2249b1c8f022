"""Sampled trees through the engine are lossless: the joint distribution of the first three tokens equals plain
sampling's (enumerated exactly on a micro model), also when top-k or a top-p nucleus is narrower than the tree,
where the drafter cannot draw as many distinct children as the tree has slots (those slots are filler and
must not be offered).  Not yet shown: that this test catches the old rule that offered the filler (its bias
was too small to detect in the settings tried)."""
import jax
import pytest

from specjax import sampling
from specjax.speculative import Engine, ModelDrafter, generate, tree as tree_lib, tree_shapes
from specjax import kv_cache
from test_speculative import MICRO, MICRO_PROMPT, N_SAMPLES, _chi2_pvalue, _exact_joint, _micro_params

import jax.numpy as jnp
import numpy as np


def _tree_samples(target, draft, sp, shape):
  N = shape.num_nodes
  eng = Engine(cfg=MICRO, drafter=ModelDrafter(MICRO), k_max=N, sp=sp, tree=shape)
  B = N_SAMPLES
  cache = kv_cache.init_cache(MICRO, B, 16)
  prompt = jnp.tile(jnp.asarray(MICRO_PROMPT, jnp.int32), (B, 1))
  st = generate(target, draft, cache, prompt, jnp.full((B,), 3), jnp.full((B,), 3), jnp.full((B,), N),
                jax.random.PRNGKey(4321), engine=eng)
  return np.asarray(st.seq_BxS)[:, 3:6]


@pytest.mark.parametrize("sp", [sampling.SamplingParams(temperature=1.0, top_k=2),
                                sampling.SamplingParams(temperature=0.7, top_p=0.35)],
                         ids=["topk2", "topp0.35"])
def test_a_model_drafter_tree_wider_than_the_filter_is_lossless(sp):
  target, draft = _micro_params(0), _micro_params(7)
  draft = {**draft, "embed": draft["embed"] * 12}   # a confident draft: its filtered q holds 1-2 tokens
  shape = tree_shapes.branching([3, 2])          # 3 children at the root: wider than top-k 2 / the nucleus
  joint = _exact_joint(target, sp)
  samples = _tree_samples(target, draft, sp, shape)
  assert _chi2_pvalue(samples, joint) > 1e-3


def test_filler_children_are_marked_undrawn():
  """top-k 2 and 3 children: the third is filler (q = 0), flagged, and the drafter's tree marks it invalid."""
  logits = jnp.asarray([[[3.0, 0.0, 2.0, 1.0, -1.0]]])
  toks, q, drawn = tree_lib.sample_children(jax.random.PRNGKey(0), logits, 3,
                                            sampling.SamplingParams(temperature=1.0, top_k=2))
  assert sorted(np.asarray(toks[0, 0, :2]).tolist()) == [0, 2] and np.asarray(drawn).tolist() == [[[True, True, False]]]
  assert float(q[0, 0, toks[0, 0, 2]]) == 0.0
  _, _, greedy_drawn = tree_lib.sample_children(jax.random.PRNGKey(0), logits, 3, sampling.SamplingParams())
  assert bool(greedy_drawn.all())
