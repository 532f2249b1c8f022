"""Static token-tree shapes: constructors, the Sequoia DP against brute force, budget choice and spec parsing."""
import json

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.speculative.trees import specs as ts
from specjax.speculative.trees.specs import StaticTree

ACCS = {
  "decreasing": [0.55, 0.2, 0.1, 0.05],
  "non_monotone": [0.2, 0.45, 0.05, 0.25],
  "zeros": [0.6, 0.0, 0.3],
  "short": [0.7],
  "long_flat": [0.12] * 8,
  # depth-conditioned tables (row d: the vector at depth d + 1; the last row repeats below)
  "depth_rising": [[0.3, 0.1, 0.05], [0.7, 0.1, 0.0], [0.85, 0.05, 0.0]],
  "depth_falling": [[0.6, 0.3], [0.2, 0.1]],
}


def _forests(m, d):
  """Every ordered forest (tuple of child forests) with exactly m nodes and depth <= d."""
  if m == 0:
    yield ()
    return
  if d == 0:
    return
  for s in range(1, m + 1):
    for first in _forests(s - 1, d - 1):
      for rest in _forests(m - s, d):
        yield (first,) + rest


def _forest_paths(forest, prefix=()):
  for r, child in enumerate(forest):
    yield prefix + (r,)
    yield from _forest_paths(child, prefix + (r,))


def _brute_force(acc, n, d):
  """Best expected_accepted over all trees with at most n draft nodes and depth <= d."""
  best = 0.0
  for m in range(1, n + 1):
    for f in _forests(m, d):
      best = max(best, ts.expected_accepted(ts.from_paths(list(_forest_paths(f))), acc))
  return best


# -- StaticTree and constructors ----------------------------------------------------------------------------------

def test_chain():
  t = ts.chain(4)
  assert t.parents == (-1, 0, 1, 2, 3) and t.ranks == (0,) * 5
  assert t.num_nodes == 4 and t.max_depth == 4 and t.max_children == 1 and t.width_by_depth == (1, 1, 1, 1)
  assert t.paths() == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)) and t.leaf_paths() == ((0, 0, 0, 0),)


def test_branching_counts_and_bfs():
  t = ts.branching([4, 2, 2, 1])
  assert t.num_nodes == 4 + 8 + 16 + 16 == ts.branching_num_nodes([4, 2, 2, 1])
  assert t.width_by_depth == (4, 8, 16, 16) and t.max_depth == 4 and t.max_children == 4
  assert list(t.depths) == sorted(t.depths)
  small = ts.branching([2, 2])
  assert small.parents == (-1, 0, 0, 1, 1, 2, 2) and small.ranks == (0, 0, 1, 0, 1, 0, 1)
  assert hash(small) == hash(ts.branching([2, 2])) and small == ts.branching([2, 2])


@pytest.mark.parametrize("parents,ranks", [
  ((0, 0), (0, 0)),                      # no root
  ((-1, 0, 0), (0, 0, 0)),               # sibling ranks repeat
  ((-1, 0, 0), (0, 1, 1)),               # ... or skip
  ((-1, 0, 2), (0, 0, 0)),               # parent not earlier
  ((-1, 0, 0, 1, 0), (0, 0, 1, 0, 2)),   # not BFS
  ((-1, 0), (0,)),                       # length mismatch
])
def test_malformed_static_tree(parents, ranks):
  with pytest.raises(ValueError):
    StaticTree(parents, ranks)


@pytest.mark.parametrize("bad", [lambda: ts.chain(-1), lambda: ts.branching([]), lambda: ts.branching([2, 0])])
def test_constructor_errors(bad):
  with pytest.raises(SpecjaxError):
    bad()


def test_from_paths_bfs_order():
  t = ts.from_paths([[0, 0, 0], [1], [0, 1], [0], [0, 0]])
  assert t.parents == (-1, 0, 0, 1, 1, 3) and t.ranks == (0, 0, 1, 0, 1, 0)


@pytest.mark.parametrize("tree", [ts.chain(3), ts.branching([3, 2, 1]), ts.from_paths([[0], [1], [0, 0], [1, 0]])])
def test_from_paths_round_trip(tree):
  assert ts.from_paths(tree.paths()) == tree
  assert ts.from_paths([list(p) for p in reversed(tree.paths())]) == tree


@pytest.mark.parametrize("paths,match", [
  ([[0], [0, 1]], r"no sibling \[0, 0\]"),
  ([[0], [1, 0]], r"prefix \[1\], which is missing"),
  ([[0], [0]], r"duplicate path \[0\]"),
  ([[1]], r"no sibling \[0\]"),
  ([[0], []], "empty tree path"),
  ([[0], [-1]], "non-negative integers"),
  ([[0], [True]], "non-negative integers"),
  ([[0], 3], "non-negative integers"),
  ([], "empty"),
])
def test_from_paths_errors(paths, match):
  with pytest.raises(SpecjaxError, match=match):
    ts.from_paths(paths)


def test_load_paths(tmp_path):
  f = tmp_path / "tree.json"
  f.write_text(json.dumps([[0], [1], [0, 0]]))
  assert ts.load_paths(f).parents == (-1, 0, 0, 1)
  f.write_text("[[0], [1")
  with pytest.raises(SpecjaxError, match="not valid JSON"):
    ts.load_paths(f)
  f.write_text('{"paths": [[0]]}')
  with pytest.raises(SpecjaxError, match="JSON list"):
    ts.load_paths(f)
  f.write_text('[[0], [0.5]]')
  with pytest.raises(SpecjaxError, match="non-negative integers"):
    ts.load_paths(f)
  with pytest.raises(SpecjaxError, match="does not exist"):
    ts.load_paths(tmp_path / "missing.json")


# -- The Sequoia model --------------------------------------------------------------------------------------------

def test_expected_accepted_by_hand():
  acc = [0.5, 0.3]
  t = ts.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
  # 0.5 + 0.3 + 0 + 0.25 + 0.15 + 0.15 + 0.125
  assert ts.expected_accepted(t, acc) == pytest.approx(1.475, abs=1e-12)
  assert ts.predicted_tau(t, acc) == pytest.approx(2.475, abs=1e-12)
  assert ts.expected_accepted(ts.chain(3), [0.5]) == pytest.approx(0.875)


def test_expected_accepted_with_a_depth_table():
  t = ts.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
  table = [[0.5, 0.3], [0.8, 0.1]]                     # depth 3 reuses the depth-2 row
  assert ts.expected_accepted(t, table) == pytest.approx(0.5 + 0.3 + 0.4 + 0.05 + 0.32, abs=1e-12)
  assert ts.expected_accepted(t, [[0.5, 0.3]] * 3) == pytest.approx(ts.expected_accepted(t, [0.5, 0.3]))


def test_sequoia_follows_a_depth_table():
  """A drafter that is much better once its first guess was right wants a deeper tree than its first row says."""
  flat = [0.3, 0.1, 0.05]
  table = [flat, [0.8, 0.05, 0.0]]
  t_flat, t_deep = ts.sequoia(flat, 12), ts.sequoia(table, 12)
  assert t_deep.max_depth > t_flat.max_depth
  assert ts.expected_accepted(t_deep, table) > ts.expected_accepted(t_flat, table)
  assert ts.sequoia([flat] * 4, 12) == t_flat          # identical rows: the position-independent tree
  n_best, rows = ts.choose_budget(table, {4: 1.0, 8: 1.0, 12: 1.0})
  assert rows[-1][1] == pytest.approx(ts.sequoia_with_value(table, 12)[1])


def test_acceptance_tuple_round_trip():
  assert ts.acceptance_tuple([0.5, 0.25]) == (0.5, 0.25)
  assert ts.acceptance_tuple([[0.5, 0.25], [0.7, 0.1]]) == ((0.5, 0.25), (0.7, 0.1))
  assert ts.acceptance_tuple([[0.5, 0.25]]) == (0.5, 0.25)


@pytest.mark.parametrize("bad", [[], [0.5, -0.1], [1.2], [0.7, 0.5], [[0.5], [0.2, 0.1]], [[[0.5]]],
                                 [[0.5, 0.2], [0.6, 0.5]], ["x"], [float("nan")]])
def test_bad_acceptance(bad):
  with pytest.raises(SpecjaxError):
    ts.expected_accepted(ts.chain(1), bad)


@pytest.mark.parametrize("name", sorted(ACCS))
def test_sequoia_equals_brute_force(name):
  acc = ACCS[name]
  for n in range(1, 7):
    for d in range(1, n + 1):
      tree, tau = ts.sequoia_with_value(acc, n, d)
      assert tree.num_nodes == n and tree.max_depth <= d
      assert abs(ts.expected_accepted(tree, acc) - (tau - 1)) < 1e-9
      assert abs((tau - 1) - _brute_force(acc, n, d)) < 1e-9, (n, d)
  assert ts.sequoia(acc, 6) == ts.sequoia(acc, 6, 6)


def test_sequoia_star_and_chain():
  acc = [0.3, 0.2, 0.15, 0.1, 0.05, 0.05]
  star = ts.sequoia(acc, 4, max_depth=1)
  assert star.parents == (-1, 0, 0, 0, 0) and star.ranks == (0, 0, 1, 2, 3)
  chain_like = ts.sequoia([0.9] + [0.01] * 5, 8)
  assert chain_like == ts.chain(8)


def test_sequoia_uses_whole_budget_with_zero_acceptance():
  t, tau = ts.sequoia_with_value([0.0, 0.0], 5)
  assert t.num_nodes == 5 and tau == 1.0
  t, tau = ts.sequoia_with_value([0.8], 10, max_depth=3)
  assert t.num_nodes == 10 and tau == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_sequoia_large_budget():
  # ~0.2 s on an idle 2-core machine; no wall-clock assertion (it failed at 6.8 s on a loaded one): speed
  # belongs in benchmarks, and an exponential DP would still stall the suite here.
  acc = np.full(128, 0.9 / 128)
  t = ts.sequoia(acc, 128, max_depth=16)
  t2 = ts.sequoia([0.6, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01], 128, max_depth=16)
  assert t.num_nodes == 128 and t2.num_nodes == 128 and t2.max_depth <= 16


@pytest.mark.parametrize("n,depth", [(0, None), (4, 0), (2.5, None)])
def test_sequoia_bad_args(n, depth):
  with pytest.raises(SpecjaxError):
    ts.sequoia([0.5], n, depth)


def test_choose_budget():
  acc = [0.6, 0.15, 0.08, 0.05]
  costs = {4: 1.0, 8: 1.1, 16: 1.25, 32: 1.9, 64: 3.5}
  n_best, table = ts.choose_budget(acc, costs, max_depth=6)
  assert [row[0] for row in table] == sorted(costs)
  for n, tau, cost, ratio in table:
    assert tau == pytest.approx(ts.sequoia_with_value(acc, n, 6)[1]) and cost == costs[n]
    assert ratio == pytest.approx(tau / cost)
  assert n_best == max(table, key=lambda row: row[3])[0]
  assert ts.choose_budget(acc, {4: 1.0, 8: 100.0})[0] == 4
  assert ts.choose_budget(acc, {4: 1.0, 8: 1.0})[0] == 8
  for bad in ({}, {4: 0.0}, {0: 1.0}):
    with pytest.raises(SpecjaxError):
      ts.choose_budget(acc, bad)


# -- Specs --------------------------------------------------------------------------------------------------------

def test_parse_static_specs(tmp_path):
  s = ts.parse_tree_spec("chain:5")
  assert s.kind == "chain" and s.num_nodes == 5 and s.build() == ts.chain(5) and str(s) == "chain:5"
  s = ts.parse_tree_spec(" branch:4,2,2,1 ")
  assert s.num_nodes == 44 and s.build() == ts.branching([4, 2, 2, 1]) and str(s) == "branch:4,2,2,1"
  f = tmp_path / "p.json"
  f.write_text("[[0], [1], [0, 0]]")
  s = ts.parse_tree_spec(f"paths:{f}")
  assert s.num_nodes == 3 and s.build() == ts.from_paths([[0], [1], [0, 0]])
  assert hash(s) == hash(ts.parse_tree_spec(f"paths:{f}"))


def test_parse_sequoia_and_dynamic():
  acc = [0.6, 0.2]
  s = ts.parse_tree_spec("sequoia:16")
  assert s.num_nodes == 16 and s.max_depth is None and s.build(acc) == ts.sequoia(acc, 16)
  s = ts.parse_tree_spec("sequoia:16:3")
  assert s.max_depth == 3 and s.build(acc).max_depth <= 3 and str(s) == "sequoia:16:3"
  with pytest.raises(SpecjaxError, match="acceptance-vector .* `--acceptance FILE"):
    s.build()
  d = ts.parse_tree_spec("dynamic:32")
  assert (d.kind, d.num_nodes, d.top_k, d.max_depth, d.is_static) == ("dynamic", 32, 4, 8, False)
  d = ts.parse_tree_spec("dynamic:5:2")
  assert (d.top_k, d.max_depth) == (2, 5)
  with pytest.raises(SpecjaxError, match="built per step"):
    d.build()


def test_check_budget():
  s = ts.parse_tree_spec("branch:4,2")
  s.check_budget(12)
  with pytest.raises(SpecjaxError, match="needs 12 draft nodes but the KV buffer leaves room for 11; use a smaller "
                                         "tree or a larger --max-len"):
    s.check_budget(11)


@pytest.mark.parametrize("text,match", [
  ("foo:3", r"unknown tree shape 'foo:3': use chain:K, branch:W1,W2,\.\.\., paths:FILE, sequoia:N\[:D\] or "
            r"dynamic:N\[:TOPK\[:D\]\]"),
  ("", "unknown tree shape"),
  ("chain:x", "'x' is not an integer"),
  ("chain:2.5", "'2.5' is not an integer"),
  ("chain:0", "must be a positive integer, got 0"),
  ("chain:-2", "must be a positive integer, got -2"),
  ("chain", "expected chain:K"),
  ("chain:3:4", "expected chain:K"),
  ("branch:4,,2", "'' is not an integer"),
  ("branch:4,0", "each width must be a positive integer"),
  ("sequoia:0", "N must be a positive integer"),
  ("sequoia:8:0", "the depth limit D must be a positive integer"),
  ("sequoia:8:2:1", "expected sequoia:N"),
  ("dynamic:8:0", "TOPK must be a positive integer"),
  ("dynamic:abc", "'abc' is not an integer"),
  ("paths:", "names no file"),
  ("paths:/nonexistent/tree.json", "does not exist"),
])
def test_spec_errors(text, match):
  with pytest.raises(SpecjaxError, match=match) as e:
    ts.parse_tree_spec(text)
  assert "\n" not in str(e.value)


def test_paths_spec_not_a_tree(tmp_path):
  f = tmp_path / "bad.json"
  f.write_text("[[0], [0, 0], [2]]")
  with pytest.raises(SpecjaxError, match=r"no sibling \[1\]"):
    ts.parse_tree_spec(f"paths:{f}")


def test_load_acceptance_vector(tmp_path):
  f = tmp_path / "acc.json"
  f.write_text(json.dumps({"acceptance_vector": [0.5, 0.25], "model": "x"}))
  assert ts.load_acceptance_vector(f) == (0.5, 0.25)
  f.write_text("[0.6, 0.4000001]")
  assert ts.load_acceptance_vector(f) == pytest.approx((0.6, 0.4))
  f.write_text(json.dumps({"acceptance_vector": [0.5, 0.25], "acceptance_table": [[0.5, 0.25], [0.75, 0.0]]}))
  assert ts.load_acceptance_vector(f) == ((0.5, 0.25), (0.75, 0.0))     # the depth table wins
  for text, match in [("[0.7, 0.5]", "sums to"), ("[1.5]", r"in \[0, 1\]"), ("[-0.1]", r"in \[0, 1\]"),
                      ('{"acc": [0.5]}', "list of numbers"), ('["a"]', "list of numbers"),
                      ("[true]", "list of numbers"), ("[[0.5], [0.5, 0.1]]", "equal-length"),
                      ('{"acceptance_table": [[0.5, 0.1], [0.9, 0.2]]}', r"depth 2\) sums to"),
                      ("[]", "non-empty"), ("{", "not valid JSON")]:
    f.write_text(text)
    with pytest.raises(SpecjaxError, match=match):
      ts.load_acceptance_vector(f)
  with pytest.raises(SpecjaxError, match="does not exist"):
    ts.load_acceptance_vector(tmp_path / "none.json")


def test_dynamic_spec_takes_an_optional_depth():
  from specjax.speculative.drafters import shape_for
  spec = ts.parse_tree_spec("dynamic:8:4:5")
  assert (spec.num, spec.top_k, spec.max_depth) == (8, 4, 5) and str(spec) == "dynamic:8:4:5"
  assert shape_for(spec).max_depth == 5
  assert ts.parse_tree_spec("dynamic:8:4").max_depth == 8
  assert str(ts.parse_tree_spec("dynamic:16")) == "dynamic:16:4"
  with pytest.raises(SpecjaxError):
    ts.parse_tree_spec("dynamic:8:4:5:1")
