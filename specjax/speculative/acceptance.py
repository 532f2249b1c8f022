"""Acceptance rules over a token tree (a chain of k drafts is the tree whose parents are 0, 1, ..., k-1).

  GreedyAcceptance      the longest root path whose nodes equal the target's argmax; output identical to
                        greedy decoding.
  SpeculativeSampling   recursive rejection sampling over siblings (Leviathan et al. 2023 and Chen et al. 2023
                        for a chain; SpecInfer / SpecTr / Sequoia for trees): lossless.  p and q are the
                        *filtered* distributions (temperature, top-k, top-p via ``sampling.filtered_logits``),
                        so the output is distributed exactly as plain sampling with the same settings.
  BlockVerification     block verification of a chain (Sun et al. 2024, ``trees/block_verify.py``): lossless,
                        and accepts at least as many tokens as token-wise rejection in expectation; chains
                        only (``--verify block``).
  SyntheticAcceptance   not lossless: each draft of a chain kept with probability α (``trees/synthetic.py``),
                        to measure the system's cost at a chosen acceptance (``bench --synthetic-alpha``).

A rule is called as ``rule(tree, target_logits_BxN1xV, q_BxN1xV, key, sp, without_replacement)`` and returns
``tree.TreeAcceptance``; the rules themselves live in ``tree.py`` beside the tree data.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from specjax.speculative.trees.block_verify import accept_block
from specjax.speculative.trees.device import Tree, TreeAcceptance, accept_greedy, accept_sampling
from specjax.speculative.trees.synthetic import accept_synthetic

VERIFY_RULES = ("tokenwise", "block")   # --verify: how sampled drafts are judged (greedy is greedy either way)


class AcceptanceRule(Protocol):
  """What the engine calls: the accepted path and the next token of each sequence's tree."""

  def __call__(self, tree: Tree, target_logits_BxN1xV: jax.Array, q_BxN1xV: jax.Array | None,
               key: jax.Array, sp, without_replacement: bool) -> TreeAcceptance:
    """``q_BxN1xV``: the distribution each node's children were drawn from (``Draft.q``; None:
    deterministic); ``key``: one, or one per row; ``sp``: ``SamplingParams`` or per-row ``RowSampling``."""


@dataclasses.dataclass(frozen=True)
class GreedyAcceptance:
  def __call__(self, tree, target_logits, q, key, sp, without_replacement) -> TreeAcceptance:
    del q, key, sp, without_replacement
    return accept_greedy(tree, target_logits)


@dataclasses.dataclass(frozen=True)
class SpeculativeSampling:
  """``residual_update=False`` is a deliberately wrong variant (tests show they catch it)."""
  residual_update: bool = True
  assume_without_replacement: bool | None = None   # a wrong override, for the same reason (None: the drafter's)

  def __call__(self, tree, target_logits, q, key, sp, without_replacement) -> TreeAcceptance:
    if self.assume_without_replacement is not None:
      without_replacement = self.assume_without_replacement
    return accept_sampling(tree, target_logits, q, key, sp, without_replacement, self.residual_update)


@dataclasses.dataclass(frozen=True)
class BlockVerification:
  """``broken``: a deliberately wrong variant (``accept_block`` names them; tests show they catch them)."""
  broken: str | None = None

  def __call__(self, tree, target_logits, q, key, sp, without_replacement) -> TreeAcceptance:
    del without_replacement   # one child per node
    return accept_block(tree, target_logits, q, key, sp, self.broken)


@dataclasses.dataclass(frozen=True)
class SyntheticAcceptance:
  """Each draft of a chain kept with probability ``alpha`` (0 <= alpha <= 1), whatever p and q say."""
  alpha: float

  def __post_init__(self):
    if not 0.0 <= self.alpha <= 1.0:
      raise ValueError(f"synthetic acceptance must be in [0, 1], got {self.alpha}")

  def __call__(self, tree, target_logits, q, key, sp, without_replacement) -> TreeAcceptance:
    del q, without_replacement
    return accept_synthetic(tree, target_logits, key, sp, self.alpha)


CHAIN_ONLY = (BlockVerification, SyntheticAcceptance)   # rules defined for one drafted sequence


def rule_for(sp, verify: str = "tokenwise") -> GreedyAcceptance | SpeculativeSampling | BlockVerification:
  """The rule for sampling settings ``sp`` and a verification rule name (``VERIFY_RULES``)."""
  if verify not in VERIFY_RULES:
    raise ValueError(f"unknown verification rule {verify!r}: choose one of {', '.join(VERIFY_RULES)}")
  if sp.greedy:
    return GreedyAcceptance()
  return BlockVerification() if verify == "block" else SpeculativeSampling()
