"""The continuous batcher's compiled buckets: chains of k drafts (k = 0: plain decoding) and token trees.

Every bucket is one compiled engine over the same ``SpecState`` (its counters sized for the most nodes any
bucket verifies), so a step of any bucket follows a step of any other without a copy or a compile.  A tree
bucket verifies all N nodes of each live sequence (k_active N; 0 leaves a sequence at a plain step, as every
idle slot).  ``TreeTracker`` keeps each slot's smoothed acceptance per tree depth for every tree bucket, from
the steps that drafted that tree, and until a slot has drafted it, a prior from the slot's chain acceptance
and the tree's widths (each depth's w candidates as w independent tries of the chain's α).

A request may name its own bucket (its ``speculation``: "off", "k=N" or a tree spec): ``pin_key`` finds the
bucket key that text names among the compiled ones, or refuses it in one line listing what is offered."""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from specjax.errors import SpecjaxError
from specjax.runtime.request import resolve_tree
from specjax.speculative.trees.specs import parse_tree_spec
from specjax.speculative.drafters import DynamicShape


@dataclasses.dataclass(frozen=True)
class Bucket:
  key: int | str               # a chain's k, or a tree's spec text ("branch:2,2,1", "dynamic:8:2:4")
  nodes: int                   # draft nodes a step verifies per sequence (N; a chain's k)
  depth: int                   # the deepest node
  widths: tuple[int, ...]      # candidates at each depth 1..D (the most children of one node; a chain's 1s)
  shape: object = None         # the tree's shape (StaticTree or DynamicShape); None for a chain

  @property
  def is_tree(self) -> bool:
    return self.shape is not None

  @property
  def label(self) -> str:      # what reports call it: "k=4", or the tree's spec
    return str(self.key) if self.is_tree else f"k={self.key}"

  @property
  def max_width(self) -> int:  # the most rows one drafter forward of this bucket runs
    return max(self.widths, default=1)


def chain_bucket(k: int) -> Bucket:
  return Bucket(int(k), int(k), int(k), (1,) * int(k))


def tree_bucket(spec, drafter: str, max_len: int) -> Bucket:
  """A ``--tree`` spec resolved for the batcher's drafter and buffers (a bad spec: one-line SpecjaxError)."""
  choice = resolve_tree(spec, drafter=drafter, max_len=max_len)
  shape = choice.shape
  if isinstance(shape, DynamicShape):
    widths = (shape.top_k,) * shape.max_depth
  else:
    parents, depths = np.asarray(shape.parents), np.asarray(shape.depths)
    widths = tuple(int(np.bincount(parents[depths == d], minlength=len(parents)).max())
                   for d in range(1, shape.max_depth + 1))
  return Bucket(choice.label, shape.num_nodes, shape.max_depth, widths, shape)


def make_buckets(ks: Sequence[int], trees: Sequence, drafter: str, max_len: int) -> dict:
  """{key: Bucket}: the chains of ``ks`` (0 always) and the trees of ``trees`` (spec texts)."""
  out = {k: chain_bucket(k) for k in sorted({int(k) for k in ks} | {0})}
  for t in trees:
    b = tree_bucket(t, drafter, max_len)
    out[b.key] = b
  return out


OFF = 0       # a request pinned "off" decodes plainly: the plain bucket's key


def offered(buckets: dict) -> str:
  """What a request's ``speculation`` may name here, e.g. "off, k=1, k=2, k=4, branch:2,2,1"."""
  return ", ".join(["off"] + [b.label for k, b in buckets.items() if k != OFF])


def tree_label(text: str) -> str:
  """A tree spec's canonical text (``Bucket.label`` of the tree ``tree_bucket`` resolves it to); a ``paths:``
  spec is named by its file, which is not read.  A malformed spec: the tree parser's one-line SpecjaxError."""
  kind, _, rest = text.strip().partition(":")
  return f"paths:{rest.strip()}" if kind.strip().lower() == "paths" else str(parse_tree_spec(text))


def pin_key(text: str, buckets: dict) -> int | str:
  """The key of the bucket among ``buckets`` ({key: Bucket}) that a request's ``speculation`` names: "off" (or
  "k=0") → OFF, "k=N" → N, a tree spec → its label.  A text naming a bucket not compiled here, or malformed:
  one SpecjaxError line naming what was asked, what this server offers and the fix."""
  t, head, offers = str(text).strip(), f"'speculation' = {text!r}", f"this server offers {offered(buckets)}"
  chain = re.fullmatch(r"k\s*=\s*(\d+)", t)
  if t.lower() == "off" or (chain and int(chain.group(1)) == OFF):
    return OFF
  if chain:
    k = int(chain.group(1))
    if k in buckets:
      return k
    raise SpecjaxError(f"{head}: the chain of {k} drafts is not compiled here; {offers} (restart with --k {k} "
                       f"for --policy fixed or off-above, or {k} in --buckets for adaptive or goodput, to serve it)")
  try:
    if t.lower().startswith("k="):
      raise SpecjaxError("a chain is k=N with N a whole number, e.g. k=4")
    label = tree_label(t)
  except SpecjaxError as e:
    raise SpecjaxError(f"{head} is not off, k=N or a tree spec ({e}); {offers}") from None
  if label in buckets:          # (a chain's key is an int: a str key is a tree's label)
    return label
  raise SpecjaxError(f"{head}: the tree {label} is not served here; {offers} (restart with --tree {label} to "
                     "serve that tree)")


class TreeTracker:
  """Per slot and tree bucket, the smoothed P(depth j accepted | depth j − 1 accepted), j = 1..D."""

  def __init__(self, slots: int, trees: Sequence[Bucket], decay: float = 0.7):
    self.decay, self.trees = decay, {t.key: t for t in trees}
    self.alpha = {t.key: np.full((slots, t.depth), 0.5) for t in trees}
    self.seen = {t.key: np.zeros(slots, bool) for t in trees}

  def reset(self, slot: int) -> None:
    for key in self.seen:
      self.seen[key][slot] = False

  def prior(self, key, chain_alpha_BxP: np.ndarray) -> np.ndarray:
    """[B, D]: each depth's w candidates as w independent tries of the slot's chain α at that position."""
    t = self.trees[key]
    P = chain_alpha_BxP.shape[1]
    chain = np.clip(chain_alpha_BxP[:, [min(j, P - 1) for j in range(t.depth)]], 0, 1)
    return 1.0 - (1.0 - chain) ** np.asarray(t.widths, float)[None, :]

  def update(self, key, live_B: np.ndarray, drafted_B: np.ndarray, accepted_B: np.ndarray,
             chain_alpha_BxP: np.ndarray) -> None:
    """A step of tree ``key``: each live slot that drafted it accepted ``accepted_B`` depths (a slot's first
    step of this tree starts from its prior)."""
    a, D = self.alpha[key], self.trees[key].depth
    prior = self.prior(key, chain_alpha_BxP)
    for b in np.flatnonzero(live_B & (drafted_B > 0)):
      if not self.seen[key][b]:
        self.seen[key][b], a[b] = True, prior[b]
      n = int(accepted_B[b])
      for j in range(min(n, D)):
        a[b, j] = self.decay * a[b, j] + (1 - self.decay)
      if n < D:
        a[b, n] = self.decay * a[b, n]

  def alphas(self, key, chain_alpha_BxP: np.ndarray) -> np.ndarray:
    """[B, D]: the tracked acceptance where the slot drafted this tree, else the prior."""
    return np.where(self.seen[key][:, None], self.alpha[key], self.prior(key, chain_alpha_BxP))
