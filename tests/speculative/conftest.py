"""Fixtures several test files of this folder share (a test file's own fixture of the same name wins)."""
import jax
import pytest

from specjax.models import decoder as model
from tests.helpers import trees
from tests.helpers.lossless import _micro_params


@pytest.fixture(scope="module")
def target():
  """The tiny target of the token-tree tests (``tests.helpers.trees.CFG``): test_trees.py, test_suffix.py."""
  return model.unstack_layers(model.init_params(trees.CFG, jax.random.PRNGKey(0)))


@pytest.fixture(scope="module")
def pair():
  """Target seed 6, and seed 7 sharpened 6x as the draft: after the first token (sampled from the target at
  prefill) the draft's filtered q mostly holds 1-2 tokens the target's filtered p does not, and p gives mass to
  the ids the filler takes; about half the probability mass of the tree step differs between the rules (a
  search over seed pairs by that measure chose it).  test_lossless_trees.py, test_per_row_sampling.py."""
  target, d = _micro_params(6), _micro_params(7)
  return target, {**d, "embed": d["embed"] * 6}
