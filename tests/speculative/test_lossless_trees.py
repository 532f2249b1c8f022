"""Sampled trees through the engine are lossless: the joint distribution of the first three tokens equals plain
sampling's (enumerated exactly on a micro model), also when top-k or a top-p nucleus is narrower than the tree,
where the drafter cannot draw as many distinct children as the tree has slots (those slots are filler and
must not be offered).  Static trees with a model drafter, with EAGLE and with the parallel drafter, dynamic
trees with all three.  Each test
has power: it fails on a rule without the residual update, and a static tree's test also fails on the old rule
that offered the filler.  (A dynamic tree has no filler: its children are chosen, the top ones by cumulative
draft log-probability, not drawn; each is a point mass accepted with the residual's probability of its token,
which is right whatever q gives that token.)

The pair is chosen so that the rules differ a lot: a confident draft whose filtered q holds tokens outside the
target's filtered p (every drafted child is rejected), and a target whose p gives mass to the lowest ids, which
are what ``lax.top_k`` fills the undrawn child slots with."""
import jax
import pytest

from specjax.models import sampling
from specjax.speculative import ModelDrafter
from specjax.speculative.trees import device as tree_lib
from specjax.speculative import eagle
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import DynamicShape
from tests.helpers.lossless import MICRO, SETTINGS, _check

import jax.numpy as jnp
import numpy as np

# ``pair``, the micro target and its sharpened model draft: tests/speculative/conftest.py.

ECFG = eagle.EagleConfig(MICRO)      # a one-layer feature drafter over the micro target, its whole vocabulary


@pytest.fixture(scope="module")
def eagle_pair(pair):
  """The same target and an untrained EAGLE drafter (seed 0) whose head, the target's, is sharpened 6x: as
  confident as the model draft above, so that under the top-p 0.35 nucleus its q and p differ a lot."""
  target, _ = pair
  dp = {**eagle.init_trainable(ECFG, jax.random.PRNGKey(0)), **eagle.frozen_from_target(ECFG, target)}
  return target, {**dp, "lm_head": dp["lm_head"] * 6}


def _model_drafter(name="model"):
  return ModelDrafter(MICRO, name=name)


def _eagle_drafter(name="eagle", depth=2):
  return eagle.EagleDrafter(ECFG.layer_cfg, ecfg=ECFG, max_depth=depth, name=name)


@pytest.mark.parametrize("sp", SETTINGS, ids=["topk2", "topp0.35"])
def test_a_model_drafter_tree_wider_than_the_filter_is_lossless(sp, pair, monkeypatch):
  # 3 children at the root: wider than top-k 2 / the nucleus
  _check(*pair, sp, tree_shapes.branching([3, 2]), _model_drafter, monkeypatch)


def test_an_eagle_tree_wider_than_the_nucleus_is_lossless(eagle_pair, monkeypatch):
  _check(*eagle_pair, SETTINGS[1], tree_shapes.branching([3, 2]), _eagle_drafter, monkeypatch)


# 3 candidates per node, more than top-k 2 or the nucleus keeps, and 8 of the 12 kept: at most 2 + 2 x 2 = 6
# candidates have draft mass under top-k 2, so the tree also holds children that q gives no mass.
DYNAMIC = DynamicShape(8, top_k=3, max_depth=2)


def test_a_dynamic_model_drafter_tree_is_lossless(pair, monkeypatch):
  _check(*pair, SETTINGS[0], DYNAMIC, _model_drafter, monkeypatch)


def test_a_dynamic_eagle_tree_is_lossless(eagle_pair, monkeypatch):
  _check(*eagle_pair, SETTINGS[1], DYNAMIC, _eagle_drafter, monkeypatch)


ECFG_PAR = eagle.EagleConfig(MICRO, parallel=2)    # a parallel drafter: both depths from one forward


@pytest.fixture(scope="module")
def parallel_pair(pair):
  """The target and an untrained parallel drafter whose head is sharpened 6x, like ``eagle_pair``."""
  target, _ = pair
  dp = {**eagle.init_trainable(ECFG_PAR, jax.random.PRNGKey(0)), **eagle.frozen_from_target(ECFG_PAR, target)}
  return target, {**dp, "lm_head": dp["lm_head"] * 6}


def _parallel_drafter(name="eagle-parallel"):
  from specjax.speculative.eagle_parallel import ParallelEagleDrafter
  return ParallelEagleDrafter(ECFG_PAR.layer_cfg, ecfg=ECFG_PAR, max_depth=2, name=name)


def test_a_parallel_drafter_tree_wider_than_the_nucleus_is_lossless(parallel_pair, monkeypatch):
  _check(*parallel_pair, SETTINGS[1], tree_shapes.branching([3, 2]), _parallel_drafter, monkeypatch)


def test_a_dynamic_parallel_drafter_tree_is_lossless(parallel_pair, monkeypatch):
  _check(*parallel_pair, SETTINGS[0], DYNAMIC, _parallel_drafter, monkeypatch)


def test_filler_children_are_marked_undrawn():
  """top-k 2 and 3 children: the third is filler (q = 0), flagged, and the drafter's tree marks it invalid."""
  logits = jnp.asarray([[[3.0, 0.0, 2.0, 1.0, -1.0]]])
  toks, q, drawn = tree_lib.sample_children(jax.random.PRNGKey(0), logits, 3,
                                            sampling.SamplingParams(temperature=1.0, top_k=2))
  assert sorted(np.asarray(toks[0, 0, :2]).tolist()) == [0, 2] and np.asarray(drawn).tolist() == [[[True, True, False]]]
  assert float(q[0, 0, toks[0, 0, 2]]) == 0.0
  _, _, greedy_drawn = tree_lib.sample_children(jax.random.PRNGKey(0), logits, 3, sampling.SamplingParams())
  assert bool(greedy_drawn.all())
