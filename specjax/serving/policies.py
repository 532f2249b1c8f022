"""Scheduling policies: how many tokens to draft next iteration, for the whole batch and per sequence.

A policy sees an ``Observation`` (which slots are live, each one's context, each one's smoothed acceptance per
position) and returns a ``Decision``: the k bucket whose compiled engine runs the step (0 = plain decoding)
and each sequence's k (≤ the bucket; the engine's ``k_active``, data).  The buckets are compiled once, so
switching policy or k compiles nothing.

  fixed        always k
  off-above    k while at most ``max_batch`` sequences are live, else 0 (vLLM's old disable-by-batch-size)
  adaptive     per sequence, the largest bucket whose last position is still reached with probability
               ≥ ``min_reach`` under its smoothed acceptance (easy text drafts deep, hard text shallow)
  goodput      the choice (bucket and per-sequence k) that maximises predicted committed tokens per second:
               Σ_b τ_b(k_b) ÷ (verify time of the rows Σ_b (k_b + 1) + draft time of the bucket), from
               the calibrated cost model and each sequence's smoothed acceptance; a tree bucket
               (``buckets.Bucket``) is priced at N + 1 rows per sequence and its per-depth acceptance

A bucket is a chain's k or a tree's spec text (``serving/buckets.py``); ``fixed`` and ``off-above`` may name a
tree (its N nodes are each sequence's k_active).  A request may pin its own bucket (its ``speculation``):
``apply_pins`` then moves the policy's decision to the bucket most rows want.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from specjax.errors import SpecjaxError


@dataclasses.dataclass
class Observation:
  live_B: np.ndarray          # bool [B]: slots holding a request that is still decoding
  context_B: np.ndarray       # int [B]: committed tokens per slot
  alpha_BxP: np.ndarray       # float [B, P]: smoothed P(position j accepted | j − 1 accepted), j = 1..P
  tree_alpha: dict = dataclasses.field(default_factory=dict)   # tree bucket → [B, D]: the same per tree depth

  @property
  def batch(self) -> int:
    return int(np.sum(self.live_B))


@dataclasses.dataclass(frozen=True)
class Decision:
  k: int | str                # the bucket (compiled engine) for this step: a chain's k or a tree's spec
  k_B: np.ndarray             # int [B]: each sequence's k_active (≤ the bucket's nodes; 0 for idle slots)


def _uniform(obs: Observation, k, nodes: int | None = None) -> Decision:
  return Decision(k, np.where(obs.live_B, k if nodes is None else nodes, 0).astype(np.int32))


class FixedK:
  """Always the bucket ``k`` (a chain's k, or a tree's spec with ``nodes`` its N)."""

  def __init__(self, k, nodes: int | None = None):
    self.k, self.nodes, self.name = k if nodes is not None else int(k), nodes, f"fixed-{k}"

  def choose(self, obs: Observation) -> Decision:
    return _uniform(obs, self.k, self.nodes)


class OffAboveBatch:
  def __init__(self, k, max_batch: int, nodes: int | None = None):
    self.k, self.nodes = k if nodes is not None else int(k), nodes
    self.max_batch, self.name = int(max_batch), f"off-above-{max_batch}"

  def choose(self, obs: Observation) -> Decision:
    return _uniform(obs, self.k, self.nodes) if obs.batch <= self.max_batch else _uniform(obs, 0)


def reach_probability(alpha_P: Sequence[float], k: int) -> float:
  """P(the chain's k-th draft is accepted) = Π_{j ≤ k} α_j."""
  return float(np.prod(np.asarray(alpha_P, float)[:k])) if k else 1.0


class AcceptanceAdaptive:
  def __init__(self, buckets: Sequence[int], min_reach: float = 0.3):
    self.buckets = sorted(int(b) for b in buckets)
    self.min_reach, self.name = float(min_reach), "adaptive"

  def choose(self, obs: Observation) -> Decision:
    k_B = np.zeros(len(obs.live_B), np.int32)
    for b in np.flatnonzero(obs.live_B):
      ok = [k for k in self.buckets if reach_probability(obs.alpha_BxP[b], k) >= self.min_reach]
      k_B[b] = max(ok) if ok else 0
    return Decision(int(k_B.max()) if k_B.size else 0, k_B)     # each k_b is a bucket, so is the largest


class GoodputOptimal:
  """Maximise predicted committed tokens per second.

  ``rows_s(total_rows [n], contexts of the live sequences)``: predicted seconds of a verify forward that
  computes each total number of rows (vectorised; the cost model's ``rows_step_time``); ``draft_s(k, batch)``:
  the drafter's seconds for a step of bucket k.  Runs every iteration, so it is numpy, not Python loops.

  ``computed_slots``: None where the forward computes only the live rows (the native CPU path); else the slot
  count, on a path that computes every row of the compiled step (XLA, Pallas, bf16, a mesh:
  ``dispatch.skips_dead_rows``): a step of bucket k then costs computed_slots × (k + 1) rows whoever is
  live and whatever each drafted, so within a bucket every live sequence drafts all k."""

  def __init__(self, buckets: Sequence[int], rows_s: Callable, draft_s: Callable, per_sequence: bool = True,
               computed_slots: int | None = None, trees: Sequence = ()):
    self.buckets = sorted(int(b) for b in buckets)
    self.trees = tuple(trees)         # ``buckets.Bucket`` of each tree: all N nodes for every live sequence
    self.rows_s, self.draft_s = rows_s, draft_s
    self.per_sequence, self.name = per_sequence, "goodput"
    self.computed_slots = computed_slots
    self.last_prediction: dict = {}

  def _rows(self, live_rows, k: int):
    """The rows a step is priced at: the live ones, or every slot's k + 1 on a path that computes them all."""
    if self.computed_slots is None:
      return np.asarray(live_rows)
    return np.full(np.shape(live_rows), self.computed_slots * (1 + k))

  def rate(self, obs: Observation, k_B: np.ndarray, k: int) -> float:
    """Predicted committed tokens per second of one choice."""
    live = np.flatnonzero(obs.live_B)
    reach = np.cumprod(np.clip(obs.alpha_BxP[live], 0, 1), axis=1)               # [n, P]
    kb = np.minimum(k_B[live], reach.shape[1])
    tokens = len(live) + sum(float(reach[i, :kb[i]].sum()) for i in range(len(live)))
    t = self.rows_s(self._rows([len(live) + int(k_B[live].sum())], k), obs.context_B[live])[0]
    return tokens / (t + (self.draft_s(k, obs.batch) if k else 0.0))

  def choose(self, obs: Observation) -> Decision:
    live = np.flatnonzero(obs.live_B)
    B, n = len(obs.live_B), len(live)
    none = np.zeros(B, np.int32)
    if not n:
      return Decision(0, none)
    ctx = obs.context_B[live]
    reach = np.cumprod(np.clip(obs.alpha_BxP[live], 0, 1), axis=1)                 # [n, P]: P(position j accepted)
    best = (n / self.rows_s(self._rows([n], 0), ctx)[0], 0, none)
    for k in (b for b in self.buckets if b > 0):
      kk = min(k, reach.shape[1])
      draft = self.draft_s(k, n)
      if not self.per_sequence or self.computed_slots is not None:   # all k rows are paid for anyway
        t = self.rows_s(self._rows([n * (1 + k)], k), ctx)[0]
        cand = ((n + reach[:, :kk].sum()) / (t + draft), k, np.where(obs.live_B, k, 0).astype(np.int32))
      else:
        # Add draft positions in order of their marginal expected tokens (each sequence's gains shrink with
        # depth, so the order keeps every sequence's positions 1..k_b); the best prefix wins.
        gains = reach[:, :kk].ravel()
        owner = np.repeat(np.arange(n), kk)
        order = np.argsort(-gains, kind="stable")
        tokens = n + np.cumsum(gains[order])
        rows = n + np.arange(1, len(order) + 1)
        rates = tokens / (self.rows_s(rows, ctx) + draft)
        i = int(np.argmax(rates))
        k_B = none.copy()
        np.add.at(k_B, live[owner[order[:i + 1]]], 1)
        cand = (float(rates[i]), k, k_B)
      if cand[0] > best[0]:
        best = cand
    for t in self.trees:
      cand = self._tree_rate(obs, t)
      if cand[0] > best[0]:
        best = cand
    self.last_prediction = {"tokens_per_s": best[0], "k": best[1]}
    return Decision(best[1], best[2])


  def _tree_rate(self, obs: Observation, t) -> tuple:
    """(rate, key, k_B) of tree bucket ``t``: every live sequence verifies its N + 1 rows and expects
    1 + Σ_d P(depth d reached) tokens (``obs.tree_alpha``); the drafter runs D forwards of its widest rows."""
    live = np.flatnonzero(obs.live_B)
    n = len(live)
    reach = np.cumprod(np.clip(obs.tree_alpha[t.key][live], 0, 1), axis=1)
    rows = self._rows([n * (1 + t.nodes)], t.nodes)
    secs = self.rows_s(rows, obs.context_B[live])[0] + self.draft_s(t.depth, n, t.max_width)
    return ((n + float(reach.sum())) / secs, t.key, np.where(obs.live_B, t.nodes, 0).astype(np.int32))


def _served(run, want, buckets: dict) -> bool:
  """A row that wants bucket ``want`` gets it from a step of ``run``: that bucket, or a chain at least as long."""
  return run == want or not (buckets[run].is_tree or buckets[want].is_tree) and run >= want


def apply_pins(dec: Decision, pins: Sequence, live_B: np.ndarray, waits_B: np.ndarray, buckets: dict,
               fallback) -> tuple[Decision, np.ndarray]:
  """The requests' own speculation over the policy's decision ``dec``; returns the step's decision and each
  slot's new wait.

  ``pins``: per slot, the bucket key its request pinned (``buckets.pin_key``; 0: off) or None (the policy
  decides); ``waits_B`` int [B]: steps since each row last got what it wants; ``buckets`` {key: Bucket};
  ``fallback``: the bucket when the policy names one not compiled.  Each live row wants a bucket, its pin or
  the policy's choice; a row pinned off takes any step (one token) and does not vote.  The step runs the
  bucket of the heaviest votes, each weighted 1 + its row's wait, so a pinned minority is not starved (ties:
  the policy's choice; no votes: plain).  Each row's k_active in a chain of k: min(its pin, k) pinned to a
  chain, the policy's k capped at k unpinned, 0 pinned to a tree or off; in a tree of N nodes: N for the rows
  that want that tree, 0 for the others; idle slots 0.  A row's wait goes back to 0 when the step served it
  (``_served``), else grows by one."""
  chosen = dec.k if dec.k in buckets else fallback
  live = [int(b) for b in np.flatnonzero(live_B)]
  if all(pins[b] is None for b in live):
    return Decision(chosen, dec.k_B), np.zeros_like(waits_B)
  want = {b: chosen if pins[b] is None else pins[b] for b in live}
  voters = [b for b in live if pins[b] is None or pins[b] != 0]
  votes: dict = {}
  for b in voters:
    votes[want[b]] = votes.get(want[b], 0) + 1 + int(waits_B[b])
  top = max(votes.values(), default=0)
  run = (0 if not votes else chosen if votes.get(chosen) == top else
         next(key for key in buckets if votes.get(key) == top))
  bucket = buckets[run]
  k_B = np.zeros(len(live_B), np.int32)
  waits = np.zeros_like(waits_B)
  for b in live:
    pin = pins[b]
    if bucket.is_tree:
      k_B[b] = bucket.nodes if want[b] == run else 0
    elif pin is None:
      k_B[b] = min(int(dec.k_B[b]), bucket.nodes)
    elif not buckets[pin].is_tree:
      k_B[b] = min(buckets[pin].nodes, bucket.nodes)
  for b in voters:
    waits[b] = 0 if _served(run, want[b], buckets) else waits_B[b] + 1
  return Decision(run, k_B), waits


POLICIES = ("fixed", "off-above", "adaptive", "goodput")


def make_policy(name: str, *, k=4, buckets: Sequence[int] = (0, 1, 2, 4, 8), max_batch: int = 4,
                min_reach: float = 0.3, rows_s: Callable | None = None, draft_s: Callable | None = None,
                per_sequence: bool = True, computed_slots: int | None = None, trees: Sequence = ()):
  """A policy by name (``--policy``); ``fixed`` and ``off-above`` use ``k`` (a chain's k, or the key of one
  of ``trees``), the others choose from ``buckets``; ``goodput`` also from ``trees`` (``buckets.Bucket``) and
  needs the cost functions."""
  nodes = {t.key: t.nodes for t in trees}.get(k)
  if name == "fixed":
    return FixedK(k, nodes)
  if name == "off-above":
    return OffAboveBatch(k, max_batch, nodes)
  if name == "adaptive":
    return AcceptanceAdaptive(buckets, min_reach)
  if name == "goodput":
    if rows_s is None or draft_s is None:
      raise SpecjaxError("the goodput policy needs the cost model's step and draft times")
    return GoodputOptimal(buckets, rows_s, draft_s, per_sequence, computed_slots, trees)
  raise SpecjaxError(f"unknown policy '{name}': choose one of {', '.join(POLICIES)}")


class AcceptanceTracker:
  """Per-slot smoothed acceptance by position, from what each step accepted.

  α_j = P(position j accepted | position j − 1 accepted), where a position the drafter left empty counts as
  not accepted (it yields nothing either).  A step that offered k_b and accepted n_b observes successes at
  positions 1..n_b and, if n_b < k_b, one failure at n_b + 1; later positions are unobserved.  A new request
  starts from the running average over all requests (``prior``)."""

  def __init__(self, slots: int, positions: int, decay: float = 0.7, prior: float = 0.5):
    self.decay = decay
    self.alpha = np.full((slots, positions), prior)
    self.prior = np.full(positions, prior)

  def reset(self, slot: int) -> None:
    self.alpha[slot] = self.prior

  def update(self, live_B: np.ndarray, offered_B: np.ndarray, accepted_B: np.ndarray) -> None:
    P = self.alpha.shape[1]
    for b in np.flatnonzero(live_B & (offered_B > 0)):
      n, k = int(accepted_B[b]), int(offered_B[b])
      for j in range(min(n, P)):
        self._observe(b, j, 1.0)
      if n < k and n < P:
        self._observe(b, n, 0.0)

  def _observe(self, b: int, j: int, x: float) -> None:
    self.alpha[b, j] = self.decay * self.alpha[b, j] + (1 - self.decay) * x
    self.prior[j] = 0.98 * self.prior[j] + 0.02 * x
