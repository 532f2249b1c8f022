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
