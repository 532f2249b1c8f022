"""Token trees in continuous batching (the ``tiny`` model: tests/conftest.py): tree buckets beside chain buckets over one state, requests arriving while
others decode get plain greedy's tokens with a fixed tree and under the goodput policy (which moves between
trees, chains and plain steps), nothing compiles after warm-up, the memory bill and the headroom cover the
tree's nodes, the tree tracker and the goodput pricing, and the refusals."""
import jax
import numpy as np
import pytest

from specjax import api
from specjax.errors import SpecjaxError
from specjax.serving import batcher as bt, buckets as bk, factory, policies as pol
from tests.helpers.serving import serve_overlapping

TREES = ("branch:2,2,1", "dynamic:6:2:3")
PROMPTS = ["hello world " * (i % 4 + 1) + str(i) for i in range(7)]


@pytest.fixture(scope="module")
def plain(tiny):
  return [api.generate(tiny, [p], max_new_tokens=12)[0][0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("drafter,tree", [("ngram", "branch:2,2,1"), ("model", "branch:2,2,1"),
                                          ("model", "dynamic:6:2:3"), ("eagle", "branch:2,1")])
def test_a_served_tree_gives_plain_greedy_tokens(tiny, plain, drafter, tree, tmp_path):
  kw = {}
  if drafter == "model":
    kw = {"draft": tiny}
  elif drafter == "eagle":
    from specjax.checkpoints import drafter_io
    from specjax.speculative import eagle
    ecfg = eagle.EagleConfig(tiny.cfg, (), 0)       # an untrained head, exported as `specjax train` does
    tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(1))
    kw = {"draft": str(drafter_io.save_drafter(tmp_path / "eagle", ecfg, tr, target_name=tiny.source,
                                               tokenizer=tiny.tokenizer))}
  eng = factory.make_batcher(tiny, drafter=drafter, policy="fixed", trees=[tree], slots=3, max_len=128, **kw)
  assert set(eng.engines) == {0, tree} and eng.engines[tree].tree is not None
  reqs, (compiles, names), _ = serve_overlapping(tiny, eng, PROMPTS)
  assert compiles == 0, names
  assert [r.tokens for r in reqs] == plain
  assert {h.bucket for h in eng.history} == {tree}
  assert sum(h.accepted for h in eng.history) > 0 or drafter == "eagle"   # (an untrained head may accept none)


def _toy_costs(weights_s=0.02, ridge_rows=8):
  def rows_s(total_rows, ctx):
    R = np.asarray(total_rows, float)
    return np.maximum(weights_s, weights_s * R / ridge_rows)
  return rows_s, (lambda k, B, rows=1: 0.0)


def test_goodput_with_trees_serves_plain_greedy_and_moves_between_buckets(tiny, plain):
  """Chains of 0/2/4 and two trees compiled over one state; the goodput policy's choice changes with the load
  and the tracked acceptance, and whatever it picks the tokens are plain greedy's, with nothing compiled."""
  step_s, draft_s = _toy_costs(ridge_rows=6)
  trees = [bk.tree_bucket(t, "model", 128) for t in TREES]
  policy = pol.GoodputOptimal((0, 2, 4), step_s, draft_s, trees=trees)
  eng = bt.ContinuousBatcher(tiny, slots=3, max_len=128, drafter="model", draft=tiny, buckets=(0, 2, 4),
                             policy=policy, trees=TREES)
  assert eng.n_top == 10 and eng.headroom() == 12              # branch:2,2,1 has 2 + 4 + 4 nodes
  reqs, (compiles, names), _ = serve_overlapping(tiny, eng, PROMPTS)
  assert compiles == 0, names
  assert [r.tokens for r in reqs] == plain
  used = {h.bucket for h in eng.history}
  assert any(not b.startswith("k=") for b in used), used          # a tree was chosen at some load
  assert len(used) >= 2, used


def test_tree_tracker_prior_and_updates():
  t = bk.tree_bucket("branch:3,2,1", "model", 128)
  assert (t.nodes, t.depth, t.widths, t.max_width) == (3 + 6 + 6, 3, (3, 2, 1), 3)
  tr = bk.TreeTracker(2, [t], decay=0.5)
  chain = np.array([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]])
  np.testing.assert_allclose(tr.alphas(t.key, chain)[0], [1 - 0.5 ** 3, 1 - 0.5 ** 2, 0.5])
  tr.update(t.key, np.array([True, False]), np.array([15, 0]), np.array([1, 0]), chain)
  # slot 0 starts from its prior: depth 1 accepted, depth 2 failed, depth 3 unobserved
  np.testing.assert_allclose(tr.alphas(t.key, chain)[0], [0.5 * 0.875 + 0.5, 0.5 * 0.75, 0.5])
  np.testing.assert_allclose(tr.alphas(t.key, chain)[1], 1 - 0.1 ** np.array([3, 2, 1]))   # still its prior
  tr.reset(0)
  np.testing.assert_allclose(tr.alphas(t.key, chain)[0], [1 - 0.5 ** 3, 1 - 0.5 ** 2, 0.5])


def test_goodput_prices_a_tree_against_chains():
  """Below the ridge a wide tree's extra candidates are free, so a lone sequence with middling acceptance takes
  the tree; sixteen sequences past the ridge make every extra row cost and drafting stops."""
  step_s, draft_s = _toy_costs(ridge_rows=16)
  t = bk.tree_bucket("branch:3,2,1", "model", 128)
  g = pol.GoodputOptimal((0, 2, 4), step_s, draft_s, trees=[t])
  one = pol.Observation(np.ones(1, bool), np.full(1, 100), np.full((1, 4), 0.5),
                        {t.key: np.full((1, 3), 0.8)})
  assert g.choose(one).k == t.key and g.choose(one).k_B.tolist() == [t.nodes]
  many = pol.Observation(np.ones(16, bool), np.full(16, 100), np.full((16, 4), 0.3),
                         {t.key: np.full((16, 3), 0.5)})
  assert g.choose(many).k == 0


def test_tree_refusals_and_memory_bill(tiny):
  with pytest.raises(SpecjaxError, match="runs one bucket"):
    factory.make_batcher(tiny, drafter="ngram", policy="fixed", trees=list(TREES), slots=2, max_len=128)
  with pytest.raises(SpecjaxError, match="adaptive chooses chain lengths"):
    factory.make_batcher(tiny, drafter="ngram", policy="adaptive", trees=["branch:2,2"], slots=2, max_len=128)
  with pytest.raises(SpecjaxError, match="tree"):
    factory.make_batcher(tiny, drafter="ngram", policy="fixed", trees=["branch:x"], slots=2, max_len=128)
  # the bill counts the tree's nodes: a budget between the chain of 4's bill and 15 nodes' refuses the tree
  from specjax.runtime.checks import memory_bill
  chain, tree = (memory_bill(tiny, 128, n).total(2) for n in (4, 15))
  assert tree > chain
  budget = (chain + tree) / 2
  bt.ContinuousBatcher(tiny, slots=2, max_len=128, drafter="ngram", buckets=(0, 4), memory_budget=budget)
  with pytest.raises(SpecjaxError, match="memory budget"):
    bt.ContinuousBatcher(tiny, slots=2, max_len=128, drafter="ngram", buckets=(0, 4), trees=["branch:3,2,1"],
                         memory_budget=budget)
  eng = factory.make_batcher(tiny, drafter="ngram", policy="fixed", trees=["branch:3,2,1"], slots=2, max_len=64)
  with pytest.raises(bt.AdmissionError, match="17 speculative slots"):
    eng.submit(bt.Request(list(range(3, 40)), 20))      # 37 + 20 + 15 + 2 > 64
