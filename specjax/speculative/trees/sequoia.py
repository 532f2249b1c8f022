"""The Sequoia-optimal token tree for a measured acceptance vector (or a per-depth table of them).

The Sequoia model.  ``acc[r]`` is the probability that the target's token at a node is the drafter's r-th choice
(r = 0..K-1; ranks >= K are never accepted).  Under this position-independent model a draft node v is accepted
with probability  P(v) = prod over the edges e on the root->v path of acc[rank(e)],  so the expected number of
accepted drafts is  E(tree) = sum_v P(v),  and the predicted mean accepted length per step is tau = 1 + E (the
bonus / correction token).

Depth-conditioned acceptance (an extension).  Drafters are not position independent: an n-gram match that was
right once is likely right again (on 12 summarization prompts the n-gram drafter's best guess was accepted 0.27
of the time at depth 1, 0.36 at depth 2 and 0.80 at depth 3 given that the guesses above it were).  ``acc`` may
therefore be a table ``acc[d][r]``: row d is the acceptance vector at depth d + 1 given that the path above was
accepted (measured along the best-guess path, ``specjax acceptance-vector --depths D``); depths past the last
row use the last row.  A 1-D vector is the one-row table.  Every formula below reads row depth(v) - 1 for the edge into v.

The optimal tree with n draft nodes and depth <= D comes from two nested DPs.  F(m, d) is the best value of the
nodes hanging below one node, using exactly m nodes within d levels.  G(r, m, d) is the best value of its
children of ranks r, r+1, ... sharing m nodes: child r with a subtree of s nodes (itself + s-1 below) is worth
acc[r] * (1 + F(s-1, d-1)), so  G(r, m, d) = max_s acc[r] * (1 + F(s-1, d-1)) + G(r+1, m-s, d),  G(., 0, d) = 0,
G(K, m, d) = 0 (spare nodes become zero-value leaves of rank >= K), and F(m, d) = G(0, m, d).  With d levels
left of D the children sit at depth D - d + 1, so a depth-conditioned table uses its row D - d there.  Every
value is >= 0 and one more leaf never lowers it, so "exactly m" is as good as "at most m": the tree always
spends the whole budget, which keeps the verification width equal to N.  Cost: O(D * K * n^2) with the inner
max over s vectorised in numpy (K = min(len(acc), n)); about 0.01 s for n=128, D=16, K=8 and 0.2 s for K=128.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from specjax.errors import SpecjaxError
from specjax.speculative.trees.static import Path, StaticTree, from_paths, is_number, read_json, require_int

_SUM_TOL = 1e-6               # slack on sum(acc) <= 1 for rounded JSON
_TIE_TOL = 1e-12              # DP ties within this go to the better-ranked child


# ----------------------------------------------------------------------------------------------------------------
# The Sequoia model


def validate_acceptance(acc) -> np.ndarray:
  """acc as a float64 table [rows, K]: a 1-D vector is one row, a list of equal-length vectors one row per
  depth.  SpecjaxError unless non-empty, entries in [0, 1] and every row's sum <= 1."""
  try:
    a = np.asarray(acc, dtype=np.float64)
  except (TypeError, ValueError):
    raise SpecjaxError(f"acceptance vector {acc!r} is not a list of numbers (or of equal-length lists of "
                       "numbers, one per depth)") from None
  if a.ndim == 1:
    a = a[None, :]
  if a.ndim != 2 or a.size == 0:
    raise SpecjaxError("acceptance must be a non-empty list of numbers, or a list of equal-length lists (one "
                       f"per depth), got shape {a.shape}")
  if not np.all(np.isfinite(a)) or np.any(a < 0) or np.any(a > 1):
    raise SpecjaxError("acceptance vector entries must be probabilities in [0, 1]; regenerate it with "
                       "`specjax acceptance-vector ... --json`")
  sums = a.sum(axis=1)
  if np.any(sums > 1 + _SUM_TOL):
    d = int(np.argmax(sums))
    raise SpecjaxError(f"acceptance vector (depth {d + 1}) sums to {sums[d]:.6f} > 1: acc[r] are probabilities "
                       "of disjoint events (the target's token is the drafter's r-th choice)")
  return a


def _row(a_DxK: np.ndarray, depth: int) -> np.ndarray:
  """The acceptance vector of the edges into nodes at ``depth`` (1-based); the last row repeats."""
  return a_DxK[min(depth, a_DxK.shape[0]) - 1]


def expected_accepted(tree: StaticTree, acc) -> float:
  """Expected number of accepted draft nodes: sum over nodes of the product of acc[rank] along its path (the
  row of each edge's depth for a depth-conditioned table)."""
  a = validate_acceptance(acc)
  depths = tree.depths
  p = [1.0] * (tree.num_nodes + 1)
  for i in range(1, tree.num_nodes + 1):
    r, row = tree.ranks[i], _row(a, depths[i])
    p[i] = p[tree.parents[i]] * (float(row[r]) if r < row.size else 0.0)
  return float(sum(p[1:]))


def predicted_tau(tree: StaticTree, acc) -> float:
  """Predicted mean accepted length per step: 1 + expected_accepted (the bonus / correction token)."""
  return 1.0 + expected_accepted(tree, acc)


@dataclasses.dataclass(frozen=True)
class _Tables:
  acc: np.ndarray        # effective acc[:, :K] (rows by depth)
  value: np.ndarray      # [D+1, n+1]: F(m, d); -inf where infeasible (m > 0, d = 0)
  choice: np.ndarray     # [D+1, K, n+1]: nodes s given to the rank-r child in G(r, m, d)


def _sequoia_tables(a_DxK: np.ndarray, n: int, depth: int) -> _Tables:
  """The two DPs of the module docstring, for every budget m <= n and levels left d <= depth (the root's
  children at depth 1)."""
  nz = np.flatnonzero(a_DxK.max(axis=0) > 0)
  K = min(int(nz[-1]) + 1 if nz.size else 0, n)   # ranks past the last non-zero entry are worth 0
  a_DxK = a_DxK[:, :K]
  F = np.full((depth + 1, n + 1), -np.inf)
  F[0, 0] = 0.0
  choice = np.zeros((depth + 1, K, n + 1), np.int32)
  m_all = np.arange(n + 1)
  rest_all = m_all[:, None] - m_all[None, :]      # [m, s]: nodes left for ranks > r
  valid_all = (m_all[None, :] >= 1) & (rest_all >= 0)
  rest_all = np.clip(rest_all, 0, n)
  for d in range(1, depth + 1):
    a = _row(a_DxK, depth - d + 1)                # children made with d levels left sit at depth D - d + 1
    k = n - depth + d + 1                         # a node with d levels left sits at depth >= depth - d: m < k
    m_idx, rest, valid = m_all[:k], rest_all[:k, :k], valid_all[:k, :k]
    below = F[d - 1, :k - 1]                      # F(s-1, d-1) for s = 1..k-1
    feasible = np.isfinite(below)
    below_0 = np.where(feasible, below, 0.0)      # no 0 * inf below
    g = np.zeros(k)                               # G(K, m, d) = 0: spare nodes are zero-value leaves
    for r in range(min(K, k - 1) - 1, -1, -1):    # at most m children
      child = np.full(k, -np.inf)
      child[1:] = np.where(feasible, a[r] * (1.0 + below_0), -np.inf)
      total = np.where(valid, child[None, :] + g[rest], -np.inf)
      best = total.max(axis=1)
      best[0] = 0.0
      near = total >= (best - _TIE_TOL * np.maximum(1.0, best))[:, None]
      pick = k - 1 - np.argmax(near[:, ::-1], axis=1)   # largest s among the (near-)ties: favour better ranks
      pick[0] = 0
      g = np.where(m_idx == 0, 0.0, total[m_idx, pick])
      choice[d, r, :k] = pick
    F[d, :k] = g
  return _Tables(acc=a_DxK, value=F, choice=choice)


def _reconstruct(t: _Tables, n: int, depth: int) -> StaticTree:
  K = t.acc.shape[1]
  paths: list[Path] = []

  def grow(prefix: Path, m: int, d: int) -> None:
    r = 0
    while m > 0:
      if r >= K:   # the rest are leaves of rank >= K
        paths.extend(prefix + (r + j,) for j in range(m))
        return
      s = int(t.choice[d, r, m])
      paths.append(prefix + (r,))
      grow(prefix + (r,), s - 1, d - 1)
      m -= s
      r += 1

  grow((), n, depth)
  return from_paths(paths)


def _sequoia_args(acc, n, max_depth) -> tuple[np.ndarray, int]:
  a = validate_acceptance(acc)
  require_int(n, "node budget", minimum=1)
  if max_depth is not None:
    require_int(max_depth, "depth limit", minimum=1)
  return a, min(n, max_depth if max_depth is not None else n)


def sequoia_with_value(acc, n: int, max_depth: int | None = None) -> tuple[StaticTree, float]:
  """The Sequoia-optimal tree with n draft nodes and depth <= max_depth (None: no limit) and its predicted tau."""
  a, depth = _sequoia_args(acc, n, max_depth)
  t = _sequoia_tables(a, n, depth)
  return _reconstruct(t, n, depth), 1.0 + float(t.value[depth, n])


def sequoia(acc, n: int, max_depth: int | None = None) -> StaticTree:
  """The tree with n draft nodes and depth <= max_depth maximising ``expected_accepted``."""
  return sequoia_with_value(acc, n, max_depth)[0]


def choose_budget(acc, cost_by_n: dict[int, float],
                  max_depth: int | None = None) -> tuple[int, list[tuple[int, float, float, float]]]:
  """Hardware-aware budget: the n maximising predicted tau(n) / cost(n), cost = measured seconds of one
  speculative iteration (draft + verify) with n nodes.  Returns (n_best, [(n, tau, cost, tau/cost), ...])."""
  if not cost_by_n:
    raise SpecjaxError("choose_budget needs measured costs for at least one node budget n")
  for n, c in cost_by_n.items():
    require_int(n, "node budget", minimum=1)
    if not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
      raise SpecjaxError(f"cost for n={n} is {c!r}: costs must be positive seconds per iteration")
  n_max = max(cost_by_n)
  a, depth = _sequoia_args(acc, n_max, max_depth)
  F = _sequoia_tables(a, n_max, depth).value[depth]   # one DP serves every budget m <= n_max
  table = []
  for n in sorted(cost_by_n):
    tau, cost = 1.0 + float(F[n]), float(cost_by_n[n])
    table.append((n, tau, cost, tau / cost))
  best = max(table, key=lambda row: row[3])
  return best[0], table


# ----------------------------------------------------------------------------------------------------------------
# Tree specs (CLI / gin)


# ----------------------------------------------------------------------------------------------------------------
# Acceptance-vector files


def acceptance_tuple(acc):
  """acc validated, as hashable data: a flat tuple for one row, a tuple of row tuples for a depth table."""
  a = validate_acceptance(acc)
  rows = tuple(tuple(float(x) for x in row) for row in a)
  return rows[0] if len(rows) == 1 else rows


def load_acceptance_vector(file: str | os.PathLike):
  """Read {"acceptance_table": [[...], ...]} (depth-conditioned, preferred when present),
  {"acceptance_vector": [...]} or a bare JSON list; validated as in ``validate_acceptance``."""
  data = read_json(file, "acceptance file")
  vec = data
  if isinstance(data, dict):
    vec = data.get("acceptance_table") or data.get("acceptance_vector")
  flat = isinstance(vec, list) and all(is_number(x) for x in vec)       # [] fails validation: "non-empty"
  table = isinstance(vec, list) and vec and all(isinstance(r, list) and all(is_number(x) for x in r)
                                                 for r in vec)
  if not (flat or table):
    raise SpecjaxError(f"acceptance file '{file}' must hold a list of numbers or {{\"acceptance_vector\": [...]}}; "
                       "write it with `specjax acceptance-vector ... --json`")
  try:
    return acceptance_tuple(vec)
  except SpecjaxError as e:
    raise SpecjaxError(f"acceptance file '{file}': {e}") from None
