"""Token trees as static data: the shapes the engine verifies (chain, branching, Medusa-style rank paths).

Tree convention (the engine relies on it exactly).  A ``StaticTree`` has N+1 nodes: node 0 is the root (the
newest committed token, not a draft) and nodes 1..N are draft tokens; N is the node budget.  ``parents[0] == -1``
and ``0 <= parents[i] < i``.  Nodes are in BFS order: ``parents`` is non-decreasing over nodes 1..N (so depth is
non-decreasing and siblings are contiguous), and ``ranks[i]`` is node i's child rank among its siblings
(0 = the drafter's best guess, 1 = its second choice, ...): the siblings of one node carry ranks 0..c-1 in index
order.  ``ranks[0] == 0``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Iterable, Sequence

import numpy as np

from specjax.errors import SpecjaxError

Path = tuple[int, ...]


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
  require_int(k, "chain length", minimum=0)
  return StaticTree(parents=(-1,) + tuple(range(k)), ranks=(0,) * (k + 1))


def branching(widths: Sequence[int]) -> StaticTree:
  """Every node at depth i-1 has widths[i-1] children (ranks 0..w-1): N = W1 + W1*W2 + W1*W2*W3 + ..."""
  if not widths:
    raise SpecjaxError("branching tree needs at least one width, e.g. branch:4,2,2,1")
  parents, ranks, level = [-1], [0], [0]
  for w in widths:
    require_int(w, "branch width", minimum=1)
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
  data = read_json(file, "tree paths file")
  if not isinstance(data, list):
    raise SpecjaxError(f"tree paths file '{file}' must hold a JSON list of paths such as [[0], [1], [0, 0]]")
  return from_paths(data)


def _as_path(p) -> Path:
  if not isinstance(p, (list, tuple)) or not all(is_int(x) and x >= 0 for x in p):
    raise SpecjaxError(f"tree path {p!r} is not a list of non-negative integers: use e.g. [[0], [1], [0, 0]]")
  if not p:
    raise SpecjaxError("empty tree path []: the root is implicit, list only draft nodes such as [0]")
  return tuple(int(x) for x in p)


# ----------------------------------------------------------------------------------------------------------------
# Helpers (also used by sequoia.py and tree_shapes.py)


def read_json(file: str | os.PathLike, what: str):
  if not os.path.isfile(file):
    raise SpecjaxError(f"{what} '{file}' does not exist; check the path")
  try:
    with open(file, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise SpecjaxError(f"{what} '{file}' is not valid JSON ({e}); fix or regenerate it") from None


def is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def require_int(x, name: str, minimum: int) -> None:
  if not is_int(x) or x < minimum:
    raise SpecjaxError(f"{name} must be an integer >= {minimum}, got {x!r}")
