"""Pure helpers of the experiments (the experiments themselves run on the real model: see docs/BENCHMARKS.md)."""
from experiments.layerskip_search import default_candidates, describe


def test_describe_layer_subsets():
  assert describe((0, 1, 2, 3, 4), 30) == "first 5"
  assert describe(tuple(i for i in range(30) if not 15 <= i <= 21), 30) == "skip 15-21"
  assert describe((0, 2, 4), 6) == "skip 1,3,5"
  assert describe((1, 2, 3, 4, 5), 6) == "skip 0"


def test_default_candidates_are_distinct_valid_subsets():
  cands = default_candidates(30)
  assert len(cands) == len(set(cands)) >= 5
  for c in cands:
    assert 0 < len(c) < 30 and list(c) == sorted(set(c)) and all(0 <= i < 30 for i in c)


def test_tree_shape_specs_parse_with_the_budget():
  from experiments.tree_shapes import SHAPES, branch_widths, tree_spec
  from specjax.speculative.trees.specs import branching_num_nodes, parse_tree_spec
  for n in (1, 2, 3, 4, 8, 16, 32, 33):
    assert 0 < branching_num_nodes(branch_widths(n)) <= n
    for shape in SHAPES:
      spec = parse_tree_spec(tree_spec(shape, n))
      assert spec.kind == shape.removesuffix("_flat") and spec.num_nodes <= n
  for n in (2, 4, 8, 16, 32):                  # the default budgets: every shape spends exactly n nodes
    assert branching_num_nodes(branch_widths(n)) == n
  assert branch_widths(16) == (4, 1, 1, 1)


def test_every_shipped_config_parses():
  """Each configs/*.gin binds only names its experiment or training recipe knows."""
  from pathlib import Path

  from specjax.cli import runner
  configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.gin"))
  assert len(configs) >= 7
  for c in configs:
    runner.parse([str(c)], [])


def test_drafter_table_spreads_a_column_over_its_categories():
  from experiments.drafter_table import spread
  from specjax.prompts import Prompt
  ps = [Prompt(f"a{i}", "a", "x") for i in range(4)] + [Prompt(f"b{i}", "b", "x") for i in range(2)]
  assert [p.question_id for p in spread(ps, 5)] == ["a0", "b0", "a1", "b1", "a2"]
  assert [p.question_id for p in spread(ps, 100)] == ["a0", "b0", "a1", "b1", "a2", "a3"]
