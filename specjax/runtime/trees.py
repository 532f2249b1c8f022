"""The token tree of a decode: ``--tree`` and ``--acceptance`` checked before any model work, and the
statistics a tree reports."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from specjax.models.buffers import DEFAULT_MAX_LEN
from specjax.errors import SpecjaxError
from specjax.speculative import registry as drafter_registry
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import DynamicShape, shape_for


@dataclasses.dataclass(frozen=True)
class TreeChoice:
  """A ``--tree`` spec resolved: the parsed spec, the engine's shape and the acceptance vector (if given)."""
  spec: tree_shapes.TreeSpec
  shape: Any                               # StaticTree | DynamicShape
  acc: tuple | None = None                 # a vector, or a per-depth table of them

  @property
  def label(self) -> str:
    return str(self.spec)

  @property
  def num_nodes(self) -> int:
    return self.shape.num_nodes


def load_acceptance(acceptance):
  """An acceptance vector (or depth-conditioned table) from a file written by ``specjax acceptance-vector``,
  or from a list of numbers (or of per-depth lists); None passes through."""
  if acceptance is None:
    return None
  if isinstance(acceptance, (str, os.PathLike)):
    return tree_shapes.load_acceptance_vector(acceptance)
  return tree_shapes.acceptance_tuple(acceptance)


def resolve_tree(tree, acceptance=None, *, drafter: str = "ngram",
                 max_len: int = DEFAULT_MAX_LEN) -> TreeChoice | None:
  """Parse and check a ``--tree`` spec (text or ``TreeSpec``) before any model work; None when no tree is
  given (the chain of ``--k``).  Node i is verified at KV slot length + i, so N + 2 <= max_len."""
  if not drafter_registry.get(drafter).speculates and (tree is not None or acceptance is not None):
    flag = "--tree" if tree is not None else "--acceptance"
    raise SpecjaxError(f"{flag} needs a drafter to fill the tree: pass --drafter ngram, layerskip or model")
  acc = load_acceptance(acceptance)
  if tree is None:
    return None
  spec_ = tree if isinstance(tree, tree_shapes.TreeSpec) else _parse_tree(str(tree))
  spec_.check_budget(max_len - 2)
  if not spec_.is_static and acc is not None:
    raise SpecjaxError(f"--acceptance is not used by the dynamic tree '{spec_}' (chosen every step): drop it "
                       "or use --tree sequoia:N")
  return TreeChoice(spec_, shape_for(spec_, acc), acc)


def _parse_tree(text: str) -> tree_shapes.TreeSpec:
  """``parse_tree_spec``, naming the file when a ``paths:`` file does not hold a tree."""
  try:
    return tree_shapes.parse_tree_spec(text)
  except SpecjaxError as e:
    kind, _, file = text.partition(":")
    if kind.strip().lower() != "paths" or file.strip() in str(e):
      raise
    raise SpecjaxError(f"tree paths file '{file.strip()}' is not a tree: {e}") from None


def tree_stats(choice: TreeChoice | None, k_max: int, acceptance=None) -> dict:
  """The tree keys of a result: spec text (``chain:K`` without a tree), nodes N, and τ predicted from the
  acceptance vector for a static tree."""
  if choice is None:
    acc = load_acceptance(acceptance)
    out = {"tree": f"chain:{k_max}", "nodes": k_max}
    shape = tree_shapes.chain(k_max)
  else:
    acc, shape = choice.acc, choice.shape
    out = {"tree": choice.label, "nodes": choice.num_nodes}
  if acc is not None and not isinstance(shape, DynamicShape) and k_max > 0:
    out["predicted_mean_accepted_length"] = tree_shapes.predicted_tau(shape, acc)
  return out


def acceptance_tree(ranks: int, depths: int = 1) -> tree_shapes.StaticTree:
  """The measuring tree: the drafter's ``ranks`` best choices under the root and, for ``depths`` > 1, under
  each node of its best-guess path down to depth ``depths`` (``ranks`` x ``depths`` nodes)."""
  return tree_shapes.from_paths([(0,) * d + (r,) for d in range(depths) for r in range(ranks)])
