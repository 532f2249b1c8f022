"""A decode described, and checked once, before any model work: ``DecodeSpec``.

Everything about the drafter, its settings and the tree that can be wrong without a model is refused when the
spec is made (one line, naming the setting and the fix): an unknown drafter, a setting its kind does not take,
k, the n-gram settings, the suffix index, a head's weight type, the tree and its acceptance vector.  The
builder (``runtime/builder.py``) then checks only what needs the model or the request: the draft's vocabulary,
the layers, the buffer and the memory bill.  The token tree of a decode lives here too: ``--tree`` and
``--acceptance`` resolved (``resolve_tree`` → ``TreeChoice``) and the statistics a tree reports.

  ds = DecodeSpec(drafter="ngram", k=5, ngram_caps="1,3")      # or tree="sequoia:16", acceptance=FILE
  ds.kind, ds.choice                                             # the registry's Kind, the resolved tree
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from specjax.errors import SpecjaxError
from specjax.models import buffers, sampling
from specjax.models.buffers import DEFAULT_MAX_LEN
from specjax.speculative import registry as drafter_registry
from specjax.speculative.drafters import DynamicShape, shape_for
from specjax.speculative.acceptance import VERIFY_RULES
from specjax.speculative.trees import specs as tree_shapes

# ----------------------------------------------------------------------------------------------------------
# The token tree of a decode: ``--tree`` and ``--acceptance`` checked, and the statistics a tree reports

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
    raise SpecjaxError(f"{flag} needs a drafter to fill the tree: pass {drafter_registry.speculating_help()}")
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


# ----------------------------------------------------------------------------------------------------------
# The decode

# Draft at most 1 token after a 1-token n-gram match and 3 after a 2-token one (k after longer matches).
# Chosen by replaying prompt lookup on greedy outputs (docs/benchmarks-log.md, "Choosing the n-gram caps").
DEFAULT_NGRAM_CAPS = (1, 3)


def parse_ngram_caps(caps) -> tuple[int, ...]:
  """``--ngram-caps``: counts separated by commas ("1,3"), 'none' or '' (no caps), or a sequence of counts."""
  if caps is None:
    return ()
  if isinstance(caps, str):
    if caps.strip().lower() in ("", "none"):
      return ()
    try:
      caps = [int(c) for c in caps.split(",")]
    except ValueError:
      raise SpecjaxError(f"--ngram-caps takes counts separated by commas, like 1,3 (or 'none'), got "
                         f"'{caps}'") from None
  out = tuple(int(c) for c in caps)
  if any(c < 0 for c in out):
    raise SpecjaxError(f"--ngram-caps must be counts >= 0, got {','.join(map(str, out))}")
  return out


def check_index_tokens(kind: drafter_registry.Kind, index_tokens: int | None) -> None:
  """``--index-tokens`` sizes a learning drafter's index: refused with any other drafter, or below 1."""
  if index_tokens is None:
    return
  if not kind.learns:
    learning = ", ".join(n for n, k in drafter_registry.KINDS.items() if k.learns)
    raise SpecjaxError(f"--index-tokens sizes the index of --drafter {learning}; drafter '{kind.name}' keeps "
                       "none: drop it")
  if index_tokens < 1:
    raise SpecjaxError(f"--index-tokens must be >= 1 token slot, got {index_tokens}")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """A decode, described: the drafter and its settings, k drafts per step or a tree, the sampling rule.
  Made once per decode (or per comparison method); every model-free check runs here, once."""
  drafter: str = "none"
  k: int = 4                                   # drafts per step (a chain); a tree's N replaces it
  tree: Any = None                             # a spec text (chain:K, branch:…, sequoia:N, dynamic:N) or TreeSpec
  acceptance: Any = None                       # sequoia's acceptance vector: a file or a list
  ngram: int = 3                               # n-gram / hybrid: the match length looked up
  ngram_caps: Sequence[int] | str | None = DEFAULT_NGRAM_CAPS   # normalized to a tuple (() for other kinds)
  draft_layers: Any = None                     # layer-skip: a count or layer indices
  sampling: sampling.SamplingParams = sampling.SamplingParams()
  index_tokens: int | None = None              # suffix: the index's token slots (None: the drafter's default)
  head_weights: str | None = None              # eagle*: the trained head's weight type (None: the target's)
  verify: str = "tokenwise"                    # how sampled drafts are judged: tokenwise or block (chains)
  synthetic_alpha: float | None = None         # not lossless: each draft kept with this probability (chains)
  choice: TreeChoice | None = dataclasses.field(default=None, init=False, compare=False, repr=False)
  """The tree resolved (None: the chain of k), checked against the largest buffer ``buffers`` allows."""

  def __post_init__(self):
    kind = self.kind                                     # an unknown name: one line listing the names
    caps = parse_ngram_caps(self.ngram_caps)             # refused when malformed, whatever the drafter
    object.__setattr__(self, "ngram_caps", caps if kind.ngram_caps else ())
    check_index_tokens(kind, self.index_tokens)
    if self.head_weights is not None and not kind.head:
      raise SpecjaxError(f"--draft-weights for drafter '{self.drafter}' is a trained head's weight type; drafter "
                         f"'{self.drafter}' has no head: drop it (a draft model takes its type when loaded)")
    choice = resolve_tree(self.tree, self.acceptance, drafter=self.drafter, max_len=buffers.AUTO_MAX_LEN_LIMIT)
    object.__setattr__(self, "choice", choice)
    if not kind.speculates:
      return
    if choice is None and self.k < 1:
      raise SpecjaxError(f"--k must be >= 1 for drafter '{self.drafter}', got {self.k}")
    if kind.ngram and self.ngram < 1:
      raise SpecjaxError(f"--ngram must be >= 1, got {self.ngram}")
    tree = choice is not None and choice.shape.max_depth != choice.num_nodes   # more than a chain
    if not kind.trees and tree:
      raise SpecjaxError(f"drafter '{self.drafter}' drafts chains only: drop --tree (or give chain:K)")
    if self.verify not in VERIFY_RULES:
      raise SpecjaxError(f"unknown verification rule '{self.verify}': use {' or '.join(VERIFY_RULES)}")
    if self.synthetic_alpha is not None:
      if not 0.0 <= self.synthetic_alpha <= 1.0:
        raise SpecjaxError(f"--synthetic-alpha is a probability: give a value in [0, 1], got {self.synthetic_alpha}")
      if tree:
        raise SpecjaxError("--synthetic-alpha keeps each draft of a chain with that probability, and --tree drafts "
                           "a tree: drop --tree (or give chain:K)")
    if self.verify == "block" and tree:
      raise SpecjaxError("--verify block judges a chain of drafts, and --tree drafts a tree: drop --tree (or "
                         "give chain:K), or verify the tree token by token (--verify tokenwise)")

  @property
  def kind(self) -> drafter_registry.Kind:
    return drafter_registry.get(self.drafter)

  @property
  def nodes(self) -> int:
    """Draft nodes per step: the tree's N, else k (0 for plain decoding)."""
    if not self.kind.speculates:
      return 0
    return self.choice.num_nodes if self.choice is not None else self.k

  def check_room(self, max_len: int) -> None:
    """Refuse a tree or k that a KV buffer of ``max_len`` slots cannot verify (node i is verified at slot
    length + i, and one slot stays for the next token)."""
    if self.choice is not None:
      self.choice.spec.check_budget(max_len - 2)
    elif self.kind.speculates and self.nodes + 2 > max_len:
      raise SpecjaxError(f"--k {self.nodes} needs {self.nodes + 1} speculative slots per step, more than the KV "
                         f"cache of {max_len} positions allows: lower --k or raise --max-len")


def _check_head_dir(ds: DecodeSpec, draft) -> None:
  """A head kind's ``--draft``: a published layout (DFlash, EAGLE-3, EAGLE-1/2, Medusa) recognised from its
  config.json alone (a DFlash block checked against the depth asked), else specjax's own drafter directory
  (its config read and checked)."""
  from specjax.checkpoints import dflash_io, drafter_io, eagle1_io, eagle3_io, medusa_io
  if not os.path.isdir(draft):
    drafter_io.read_config(draft)                 # its one line: not found
  wants_dflash = ds.kind.dflash
  if wants_dflash != dflash_io.is_dflash_dir(draft):
    dflash = ", ".join(n for n, k in drafter_registry.KINDS.items() if k.dflash)
    raise SpecjaxError(f"--drafter {ds.drafter} with --draft {draft}: " + (
        "not a DFlash drafter's directory (config.json with dflash_config)" if wants_dflash
        else f"a DFlash drafter's directory, which --drafter {dflash} reads"))
  if wants_dflash:
    dflash_io.check_depth(draft, ds.choice.shape.max_depth if ds.choice is not None else ds.nodes)
  published = (dflash_io.is_dflash_dir, eagle3_io.is_eagle3_dir, eagle1_io.is_eagle1_dir, medusa_io.is_medusa_dir)
  if not any(is_layout(draft) for is_layout in published):
    drafter_io.read_config(draft)


def check_draft(ds: DecodeSpec, draft) -> None:
  """What ``--draft`` names, checked before any model loads: only a kind that takes one; a drafter's directory
  that holds one (a published layout, or specjax's own with its config read); a draft model's registry name or
  a path that exists."""
  kind = ds.kind
  if not draft:
    return
  if kind.draft is None:
    raise SpecjaxError(f"--draft is only used with {drafter_registry.draft_flag_help()} (got --drafter "
                       f"{ds.drafter})")
  if kind.head:
    _check_head_dir(ds, draft)
  elif kind.draft_model and not hasattr(draft, "cfg"):
    from specjax.checkpoints import catalog
    if draft not in catalog.KNOWN_MODELS:
      catalog.resolve(draft)
