"""Token-tree shapes as static data, and the Sequoia-optimal tree for a measured acceptance vector.

Tree convention (the engine relies on it exactly).  A ``StaticTree`` has N+1 nodes: node 0 is the root (the
newest committed token, not a draft) and nodes 1..N are draft tokens; N is the node budget.  ``parents[0] == -1``
and ``0 <= parents[i] < i``.  Nodes are in BFS order: ``parents`` is non-decreasing over nodes 1..N (so depth is
non-decreasing and siblings are contiguous), and ``ranks[i]`` is node i's child rank among its siblings
(0 = the drafter's best guess, 1 = its second choice, ...): the siblings of one node carry ranks 0..c-1 in index
order.  ``ranks[0] == 0``.

The Sequoia model.  ``acc[r]`` is the probability that the target's token at a node is the drafter's r-th choice
(r = 0..R-1; ranks >= R are never accepted).  Under this position-independent model a draft node v is accepted
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
G(R, m, d) = 0 (spare nodes become zero-value leaves of rank >= R), and F(m, d) = G(0, m, d).  With d levels
left of D the children sit at depth D - d + 1, so a depth-conditioned table uses its row D - d there.  Every
value is >= 0 and one more leaf never lowers it, so "exactly m" is as good as "at most m": the tree always
spends the whole budget, which keeps the verification width equal to N.  Cost: O(D * R * n^2) with the inner
max over s vectorised in numpy (R = min(len(acc), n)); about 0.01 s for n=128, D=16, R=8 and 0.2 s for R=128.

Tree specs (CLI / gin): ``chain:K``, ``branch:W1,W2,...`` (the root has W1 children, each depth-1 node W2, ...),
``paths:FILE`` (Medusa-style JSON list of rank paths), ``sequoia:N[:D]`` (needs an acceptance vector) and
``dynamic:N[:TOPK[:D]]`` (built per step by the engine; TOPK defaults to 4 and the depth limit D to
min(N, 8): each level is one sequential draft forward, so a fast-drafting model wants a shallower tree).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from typing import Iterable, Sequence

import numpy as np

from specjax.errors import SpecjaxError

Path = tuple[int, ...]

DYNAMIC_DEFAULT_TOPK = 4
DYNAMIC_DEFAULT_DEPTH = 8     # dynamic:N trees are at most min(N, 8) levels deep
_SUM_TOL = 1e-6               # slack on sum(acc) <= 1 for rounded JSON
_TIE_TOL = 1e-12              # DP ties within this go to the better-ranked child


# ----------------------------------------------------------------------------------------------------------------
# StaticTree


@dataclasses.dataclass(frozen=True)
class StaticTree:
  """A token tree in the BFS convention above; hashable, so usable as a jit static argument."""
  parents: tuple[int, ...]
  ranks: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
    object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
    problem = _tree_problem(self.parents, self.ranks)
    if problem:
      raise ValueError(f"malformed StaticTree: {problem}")

  @property
  def num_nodes(self) -> int:
    """N: the number of draft nodes (the root excluded)."""
    return len(self.parents) - 1

  @functools.cached_property
  def depths(self) -> tuple[int, ...]:
    """Depth of every node (root = 0), length N+1."""
    d = [0] * len(self.parents)
    for i in range(1, len(d)):
      d[i] = d[self.parents[i]] + 1
    return tuple(d)

  @property
  def max_depth(self) -> int:
    return self.depths[-1]

  @functools.cached_property
  def num_children(self) -> tuple[int, ...]:
    """Children count of every node, length N+1."""
    c = [0] * len(self.parents)
    for p in self.parents[1:]:
      c[p] += 1
    return tuple(c)

  @property
  def max_children(self) -> int:
    """Children of the widest node."""
    return max(self.num_children)

  @property
  def width_by_depth(self) -> tuple[int, ...]:
    """Number of nodes at each depth 1..max_depth."""
    w = [0] * self.max_depth
    for d in self.depths[1:]:
      w[d - 1] += 1
    return tuple(w)

  def ancestors(self) -> np.ndarray:
    """[N1, N1] bool: anc[i, j] = j is i or an ancestor of i (the tree's attention mask over its own slots)."""
    anc = np.eye(self.num_nodes + 1, dtype=bool)
    for i in range(1, self.num_nodes + 1):
      anc[i] |= anc[self.parents[i]]
    return anc

  def paths(self) -> tuple[Path, ...]:
    """Rank path of every draft node (node i -> paths()[i-1]): the Medusa format ``from_paths`` reads back."""
    out: list[Path] = [()]
    for p, r in zip(self.parents[1:], self.ranks[1:]):
      out.append(out[p] + (r,))
    return tuple(out[1:])

  def leaf_paths(self) -> tuple[Path, ...]:
    """Root-to-leaf rank paths only (leaves in node order)."""
    kids = self.num_children
    return tuple(p for i, p in enumerate(self.paths(), 1) if kids[i] == 0)


def is_chain(shape) -> bool:
  """A static tree that is one path (node i's parent is i - 1): nothing moves at commit, one row per depth."""
  return isinstance(shape, StaticTree) and shape.parents == (-1,) + tuple(range(shape.num_nodes))


def _tree_problem(parents: tuple[int, ...], ranks: tuple[int, ...]) -> str:
  """Empty string for a well-formed tree, else what is wrong."""
  if len(parents) != len(ranks):
    return f"{len(parents)} parents but {len(ranks)} ranks"
  if not parents or parents[0] != -1 or ranks[0] != 0:
    return "node 0 must be the root: parents[0] == -1 and ranks[0] == 0"
  next_rank = [0] * len(parents)
  for i in range(1, len(parents)):
    p = parents[i]
    if not 0 <= p < i:
      return f"parents[{i}] = {p} is not in [0, {i})"
    if i > 1 and p < parents[i - 1]:
      return f"node {i} (parent {p}) after node {i - 1} (parent {parents[i - 1]}): nodes must be in BFS order"
    if ranks[i] != next_rank[p]:
      return f"node {i} has rank {ranks[i]} but its siblings' ranks must be 0, 1, ... in index order"
    next_rank[p] += 1
  return ""


# ----------------------------------------------------------------------------------------------------------------
# Constructors


def chain(k: int) -> StaticTree:
  """k drafts in a line, each the top-1 continuation of the previous."""
  _require_int(k, "chain length", minimum=0)
  return StaticTree(parents=(-1,) + tuple(range(k)), ranks=(0,) * (k + 1))


def branching(widths: Sequence[int]) -> StaticTree:
  """Every node at depth i-1 has widths[i-1] children (ranks 0..w-1): N = W1 + W1*W2 + W1*W2*W3 + ..."""
  if not widths:
    raise SpecjaxError("branching tree needs at least one width, e.g. branch:4,2,2,1")
  parents, ranks, level = [-1], [0], [0]
  for w in widths:
    _require_int(w, "branch width", minimum=1)
    nxt = []
    for p in level:
      for r in range(w):
        nxt.append(len(parents))
        parents.append(p)
        ranks.append(r)
    level = nxt
  return StaticTree(tuple(parents), tuple(ranks))


def branching_num_nodes(widths: Sequence[int]) -> int:
  """N of ``branching(widths)`` without building it."""
  return sum(math.prod(widths[:i + 1]) for i in range(len(widths)))


def from_paths(paths: Iterable[Sequence[int]]) -> StaticTree:
  """Tree from Medusa-style rank paths, e.g. [[0], [1], [0, 0], [0, 1], [0, 0, 0]]: every prefix of a path
  must be listed, sibling ranks must be 0..c-1 without gaps, and no path may repeat."""
  norm = [_as_path(p) for p in paths]
  if not norm:
    raise SpecjaxError("tree paths list is empty: give at least one path, e.g. [[0]]")
  seen: set[Path] = set()
  for p in norm:
    if p in seen:
      raise SpecjaxError(f"duplicate path {list(p)} in the tree paths: list each node once")
    seen.add(p)
  for p in norm:
    if len(p) > 1 and p[:-1] not in seen:
      raise SpecjaxError(f"path {list(p)} needs its prefix {list(p[:-1])}, which is missing: every prefix of a "
                         "path must be listed too")
    if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
      raise SpecjaxError(f"path {list(p)} has no sibling {list(p[:-1] + (p[-1] - 1,))}: sibling ranks must be "
                         "0, 1, ..., c-1 without gaps")
  index: dict[Path, int] = {(): 0}
  parents, ranks = [-1], [0]
  for p in sorted(seen, key=lambda q: (len(q), q)):   # BFS: by depth, then by the parent's order, then by rank
    index[p] = len(parents)
    parents.append(index[p[:-1]])
    ranks.append(p[-1])
  return StaticTree(tuple(parents), tuple(ranks))


def load_paths(file: str | os.PathLike) -> StaticTree:
  """``from_paths`` on a JSON file holding a list of rank paths."""
  data = _read_json(file, "tree paths file")
  if not isinstance(data, list):
    raise SpecjaxError(f"tree paths file '{file}' must hold a JSON list of paths such as [[0], [1], [0, 0]]")
  return from_paths(data)


def _as_path(p) -> Path:
  if not isinstance(p, (list, tuple)) or not all(_is_int(x) and x >= 0 for x in p):
    raise SpecjaxError(f"tree path {p!r} is not a list of non-negative integers: use e.g. [[0], [1], [0, 0]]")
  if not p:
    raise SpecjaxError("empty tree path []: the root is implicit, list only draft nodes such as [0]")
  return tuple(int(x) for x in p)


# ----------------------------------------------------------------------------------------------------------------
# The Sequoia model


def validate_acceptance(acc) -> np.ndarray:
  """acc as a float64 table [rows, R]: a 1-D vector is one row, a list of equal-length vectors one row per
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


def _row(a_DxR: np.ndarray, depth: int) -> np.ndarray:
  """The acceptance vector of the edges into nodes at ``depth`` (1-based); the last row repeats."""
  return a_DxR[min(depth, a_DxR.shape[0]) - 1]


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
  acc: np.ndarray        # effective acc[:, :R] (rows by depth)
  value: np.ndarray      # [D+1, n+1]: F(m, d); -inf where infeasible (m > 0, d = 0)
  choice: np.ndarray     # [D+1, R, n+1]: nodes s given to the rank-r child in G(r, m, d)


def _sequoia_tables(a_DxR: np.ndarray, n: int, depth: int) -> _Tables:
  """The two DPs of the module docstring, for every budget m <= n and levels left d <= depth (the root's
  children at depth 1)."""
  nz = np.flatnonzero(a_DxR.max(axis=0) > 0)
  R = min(int(nz[-1]) + 1 if nz.size else 0, n)   # ranks past the last non-zero entry are worth 0
  a_DxR = a_DxR[:, :R]
  F = np.full((depth + 1, n + 1), -np.inf)
  F[0, 0] = 0.0
  choice = np.zeros((depth + 1, R, n + 1), np.int32)
  m_all = np.arange(n + 1)
  rest_all = m_all[:, None] - m_all[None, :]      # [m, s]: nodes left for ranks > r
  valid_all = (m_all[None, :] >= 1) & (rest_all >= 0)
  rest_all = np.clip(rest_all, 0, n)
  for d in range(1, depth + 1):
    a = _row(a_DxR, depth - d + 1)                # children made with d levels left sit at depth D - d + 1
    k = n - depth + d + 1                         # a node with d levels left sits at depth >= depth - d: m < k
    m_idx, rest, valid = m_all[:k], rest_all[:k, :k], valid_all[:k, :k]
    below = F[d - 1, :k - 1]                      # F(s-1, d-1) for s = 1..k-1
    feasible = np.isfinite(below)
    below_0 = np.where(feasible, below, 0.0)      # no 0 * inf below
    g = np.zeros(k)                               # G(R, m, d) = 0: spare nodes are zero-value leaves
    for r in range(min(R, k - 1) - 1, -1, -1):    # at most m children
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
  return _Tables(acc=a_DxR, value=F, choice=choice)


def _reconstruct(t: _Tables, n: int, depth: int) -> StaticTree:
  R = t.acc.shape[1]
  paths: list[Path] = []

  def grow(prefix: Path, m: int, d: int) -> None:
    r = 0
    while m > 0:
      if r >= R:   # the rest are leaves of rank >= R
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
  _require_int(n, "node budget", minimum=1)
  if max_depth is not None:
    _require_int(max_depth, "depth limit", minimum=1)
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
    _require_int(n, "node budget", minimum=1)
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

_SPEC_HELP = "use chain:K, branch:W1,W2,..., paths:FILE, sequoia:N[:D] or dynamic:N[:TOPK[:D]]"


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """A parsed tree shape.  ``num`` is K for chain and N for sequoia / dynamic; ``tree`` is the loaded paths tree."""
  kind: str                                  # chain | branch | paths | sequoia | dynamic
  num: int = 0
  widths: tuple[int, ...] = ()
  path: str = ""
  tree: StaticTree | None = None
  max_depth: int | None = None               # sequoia: None = no limit; dynamic: min(N, 8) unless given
  top_k: int = DYNAMIC_DEFAULT_TOPK          # dynamic only

  @property
  def is_static(self) -> bool:
    return self.kind != "dynamic"

  @property
  def num_nodes(self) -> int:
    """N, the draft-node budget (the verification width)."""
    if self.kind == "branch":
      return branching_num_nodes(self.widths)
    if self.kind == "paths":
      return self.tree.num_nodes
    return self.num

  def build(self, acc=None) -> StaticTree:
    """The static tree; sequoia needs ``acc``."""
    if self.kind == "chain":
      return chain(self.num)
    if self.kind == "branch":
      return branching(self.widths)
    if self.kind == "paths":
      return self.tree
    if self.kind == "sequoia":
      if acc is None:
        raise SpecjaxError(f"tree shape '{self}' needs an acceptance vector: run `specjax acceptance-vector ... "
                           "--json` and pass `--acceptance FILE`")
      return sequoia(acc, self.num, self.max_depth)
    raise SpecjaxError(f"tree shape '{self}' is built per step by the engine and has no static shape; use chain:K, "
                       "branch:..., paths:FILE or sequoia:N for a static tree")

  def check_budget(self, max_nodes: int) -> None:
    """SpecjaxError when the tree needs more draft nodes than the buffers leave room for."""
    if self.num_nodes > max_nodes:
      raise SpecjaxError(f"tree '{self}' needs {self.num_nodes} draft nodes but the KV buffer leaves room for "
                         f"{max_nodes}; use a smaller tree or a larger --max-len")

  def __str__(self) -> str:
    if self.kind == "chain":
      return f"chain:{self.num}"
    if self.kind == "branch":
      return "branch:" + ",".join(map(str, self.widths))
    if self.kind == "paths":
      return f"paths:{self.path}"
    if self.kind == "sequoia":
      return f"sequoia:{self.num}" + (f":{self.max_depth}" if self.max_depth is not None else "")
    default_depth = min(self.num, DYNAMIC_DEFAULT_DEPTH)
    return f"dynamic:{self.num}:{self.top_k}" + (f":{self.max_depth}" if self.max_depth != default_depth else "")


def parse_tree_spec(text: str) -> TreeSpec:
  """Parse ``chain:K``, ``branch:W1,W2,...``, ``paths:FILE``, ``sequoia:N[:D]`` or ``dynamic:N[:TOPK[:D]]``."""
  text = str(text).strip()
  kind, _, rest = text.partition(":")
  kind = kind.strip().lower()
  if kind == "paths":
    return _parse_paths(text, rest.strip())
  parts = [p.strip() for p in rest.split(":")] if rest.strip() else []
  if kind == "chain":
    _expect_parts(text, parts, 1, 1, "chain:K, e.g. chain:4")
    return TreeSpec("chain", num=_spec_int(text, parts[0], "K", "chain:4"))
  if kind == "branch":
    _expect_parts(text, parts, 1, 1, "branch:W1,W2,..., e.g. branch:4,2,2,1")
    widths = tuple(_spec_int(text, w.strip(), "each width", "branch:4,2,2,1") for w in parts[0].split(","))
    return TreeSpec("branch", widths=widths)
  if kind == "sequoia":
    _expect_parts(text, parts, 1, 2, "sequoia:N or sequoia:N:D, e.g. sequoia:32:6")
    n = _spec_int(text, parts[0], "N", "sequoia:32")
    depth = None
    if len(parts) == 2:
      depth = _spec_int(text, parts[1], "the depth limit D", f"sequoia:{n}:6 (omit D for no limit)")
    return TreeSpec("sequoia", num=n, max_depth=depth)
  if kind == "dynamic":
    _expect_parts(text, parts, 1, 3, "dynamic:N, dynamic:N:TOPK or dynamic:N:TOPK:D, e.g. dynamic:32:4:6")
    n = _spec_int(text, parts[0], "N", "dynamic:32")
    top_k = DYNAMIC_DEFAULT_TOPK
    if len(parts) >= 2:
      top_k = _spec_int(text, parts[1], "TOPK", f"dynamic:{n}:4")
    depth = min(n, DYNAMIC_DEFAULT_DEPTH)
    if len(parts) == 3:
      depth = _spec_int(text, parts[2], "the depth limit D", f"dynamic:{n}:{top_k}:5")
    return TreeSpec("dynamic", num=n, top_k=top_k, max_depth=depth)
  raise SpecjaxError(f"unknown tree shape '{text}': {_SPEC_HELP}")


def _parse_paths(text: str, file: str) -> TreeSpec:
  if not file:
    raise SpecjaxError(f"tree shape '{text}' names no file: use paths:FILE with a JSON list such as [[0], [1]]")
  return TreeSpec("paths", path=file, tree=load_paths(file))


def _expect_parts(text: str, parts: list[str], lo: int, hi: int, form: str) -> None:
  if not lo <= len(parts) <= hi or any(not p for p in parts):
    raise SpecjaxError(f"malformed tree shape '{text}': expected {form}")


def _spec_int(text: str, part: str, name: str, example: str) -> int:
  if not re.fullmatch(r"[+-]?\d+", part):
    raise SpecjaxError(f"tree shape '{text}': '{part}' is not an integer; {name} must be a positive integer, "
                       f"e.g. {example}")
  v = int(part)
  if v <= 0:
    raise SpecjaxError(f"tree shape '{text}': {name} must be a positive integer, got {v}; e.g. {example}")
  return v


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
  data = _read_json(file, "acceptance file")
  vec = data
  if isinstance(data, dict):
    vec = data.get("acceptance_table") or data.get("acceptance_vector")
  flat = isinstance(vec, list) and all(_is_number(x) for x in vec)       # [] fails validation: "non-empty"
  table = isinstance(vec, list) and vec and all(isinstance(r, list) and all(_is_number(x) for x in r)
                                                 for r in vec)
  if not (flat or table):
    raise SpecjaxError(f"acceptance file '{file}' must hold a list of numbers or {{\"acceptance_vector\": [...]}}; "
                       "write it with `specjax acceptance-vector ... --json`")
  try:
    return acceptance_tuple(vec)
  except SpecjaxError as e:
    raise SpecjaxError(f"acceptance file '{file}': {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _read_json(file: str | os.PathLike, what: str):
  if not os.path.isfile(file):
    raise SpecjaxError(f"{what} '{file}' does not exist; check the path")
  try:
    with open(file, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise SpecjaxError(f"{what} '{file}' is not valid JSON ({e}); fix or regenerate it") from None


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _require_int(x, name: str, minimum: int) -> None:
  if not _is_int(x) or x < minimum:
    raise SpecjaxError(f"{name} must be an integer >= {minimum}, got {x!r}")
