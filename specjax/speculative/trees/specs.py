"""Tree specs: the ``--tree`` / gin text of a token-tree shape, parsed and checked (``TreeSpec``).

Tree specs (CLI / gin): ``chain:K``, ``branch:W1,W2,...`` (the root has W1 children, each depth-1 node W2, ...),
``paths:FILE`` (Medusa-style JSON list of rank paths), ``sequoia:N[:D]`` (needs an acceptance vector) and
``dynamic:N[:TOPK[:D]]`` (built per step by the engine; TOPK defaults to 4 and the depth limit D to
min(N, 8): each level is one sequential draft forward, so a fast-drafting model wants a shallower tree).

The shapes themselves are ``static_tree.py``; the Sequoia tree and acceptance vectors are ``sequoia.py``.  This
module hands both on, so ``tree_shapes`` is the one name callers import.
"""
from __future__ import annotations

import dataclasses
import re

from specjax.errors import SpecjaxError
from specjax.speculative.trees.sequoia import (acceptance_tuple, choose_budget, expected_accepted,
                                         load_acceptance_vector, predicted_tau, sequoia, sequoia_with_value,
                                         validate_acceptance)
from specjax.speculative.trees.static import (Path, StaticTree, branching, branching_num_nodes, chain,
                                             from_paths, is_chain, load_paths)

__all__ = ["DYNAMIC_DEFAULT_DEPTH", "DYNAMIC_DEFAULT_TOPK", "Path", "StaticTree", "TreeSpec", "acceptance_tuple",
           "branching", "branching_num_nodes", "chain", "choose_budget", "expected_accepted", "from_paths", "is_chain",
           "load_acceptance_vector", "load_paths", "parse_tree_spec", "predicted_tau", "sequoia", "sequoia_with_value",
           "validate_acceptance"]

DYNAMIC_DEFAULT_TOPK = 4
DYNAMIC_DEFAULT_DEPTH = 8     # dynamic:N trees are at most min(N, 8) levels deep


# ----------------------------------------------------------------------------------------------------------------
# Tree specs


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
    candidates = top_k + (depth - 1) * top_k * top_k      # what DynamicShape scores before keeping the best N
    if n > candidates:
      raise SpecjaxError(f"tree shape '{text}': a dynamic tree keeps the best N of the {candidates} nodes it "
                         f"scores (TOPK {top_k}, depth {depth}); lower N or raise TOPK or the depth, e.g. "
                         f"dynamic:{min(n, candidates)}:{top_k}:{depth}")
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
