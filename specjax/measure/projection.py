"""Speculation priced on a device it did not run on: a τ (measured here, or published), the rows one iteration
verifies and the draft forwards it runs, each priced by the cost model on a device spec in an implementation
regime (``devices.REGIMES``).

Greedy acceptance does not depend on the chip, so a τ measured on this CPU is the τ a GPU would see; what
changes is the price of each piece.  One iteration is

  verify  a target forward over ``verify_rows`` rows (k + 1 for a chain, N + 1 for a tree: a compiled
          shape computes its dead rows too);
  draft   the drafter's sequential forwards (``DraftPass``: the network it runs, over how many rows, how
          often per iteration): none for a lookup, k for a chain of a draft model, one per depth for a tree;
  fixed   the regime's iteration floor (eager: the lookup, the acceptance and the cache cut are launches).

and the projected speedup is τ · t_plain ÷ (verify + draft + fixed), all at the same batch and context.
A head that is not a decoder (Medusa's, Hydra's) is priced as a network of that many matrix entries with no
layer (``head_network``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from specjax.models.config import ModelConfig
from specjax.measure import costmodel


@dataclasses.dataclass(frozen=True)
class DraftPass:
  """A draft forward of one iteration: ``cfg`` over ``rows`` rows per sequence, ``times`` times (sequential)."""
  cfg: ModelConfig
  rows: int = 1
  times: float = 1.0


def head_network(name: str, d_model: int, weights: float) -> ModelConfig:
  """A drafter network with no decoder layer — ``weights`` matrix entries read once per forward and multiplied
  by every row — as the cost model's config of a layerless model whose (tied) vocabulary holds them."""
  return ModelConfig(name=name, vocab_size=max(1, math.ceil(weights / d_model)), num_layers=0, d_model=d_model,
                     num_heads=1, num_kv_heads=1, head_dim=1, ffn_dim=1, tie_embeddings=True)


def chain_passes(draft_cfg: ModelConfig | None, k: int) -> tuple[DraftPass, ...]:
  """A draft model's chain of k: its root forward reads two tokens, then k − 1 single-row forwards
  (``costmodel.draft_time``); () for a lookup."""
  if draft_cfg is None or k <= 0:
    return ()
  return (DraftPass(draft_cfg, 2),) + ((DraftPass(draft_cfg, 1, k - 1),) if k > 1 else ())


def tree_passes(draft_cfg: ModelConfig | None, forwards: int, nodes: int) -> tuple[DraftPass, ...]:
  """``forwards`` sequential draft forwards spreading ``nodes`` draft nodes between them (a chain: one row
  each; a tree: its nodes per depth; a parallel drafter: all of them in one); () for a lookup."""
  if draft_cfg is None or forwards <= 0:
    return ()
  return (DraftPass(draft_cfg, max(1, math.ceil(nodes / forwards)), forwards),)


def projected(spec: costmodel.DeviceSpec, cfg: ModelConfig, tau: float, verify_rows: int,
              passes: Sequence[DraftPass] = (), *, B: int = 1, context: int = 256, dtype: str = "bfloat16",
              weights: str = "fp32", draft_weights: str | None = None) -> dict:
  """The iteration's pieces on ``spec`` and the speedup they give at ``tau`` (times in ms)."""
  step = lambda c, rows, w: costmodel.step_time(spec, c, B, rows, context, dtype, weights=w)  # noqa: E731
  plain = step(cfg, 1, weights)
  verify = step(cfg, verify_rows, weights)
  draft = sum(p.times * step(p.cfg, p.rows, draft_weights or weights) for p in passes)
  fixed = spec.iteration_floor_s
  return {"device": spec.name, "regime": spec.regime, "dtype": dtype, "batch": B, "context": context,
          "tau": tau, "verify_rows": verify_rows, "plain_ms": plain * 1e3, "verify_ms": verify * 1e3,
          "draft_ms": draft * 1e3, "iteration_floor_ms": fixed * 1e3,
          "speedup": tau * plain / (verify + draft + fixed)}


def project_measured(device: str, cfg: ModelConfig, tau: float, nodes: int, forwards: int,
                     draft_cfg: ModelConfig | None, *, acceptance: Sequence[float] | None = None,
                     draft_share: float = 1.0, B: int = 1, context: int = 256, weights: str = "fp32",
                     draft_weights: str | None = None) -> dict:
  """A measured run on the published spec ``device`` in each regime: its τ over N = ``nodes`` draft nodes (N + 1
  verified rows), ``forwards`` draft forwards of ``draft_cfg`` per iteration (None: a lookup), run on
  ``draft_share`` of the iterations (a hybrid's model steps), at bfloat16 with the weight type's bytes.  With a
  chain's per-position ``acceptance``, also the k ≤ N that pays best there (``tau_at``)."""
  from specjax.measure.devices import REGIMES, published_spec
  kind = lambda w: w if w in ("int8", "int4") else "fp32"      # noqa: E731  (fp32: the compute dtype's bytes)
  out = {"device": device, "nodes": nodes, "draft_forwards": forwards * draft_share,
         "draft": None if draft_cfg is None else draft_cfg.name}
  for regime in REGIMES:
    spec = published_spec(device, regime)

    def at(n: int, t: float) -> dict:
      if forwards == nodes:                # a chain, one forward per drafted token
        passes = chain_passes(draft_cfg, n)
      else:                                # one forward in all, or one per depth of a tree of the same depth
        passes = tree_passes(draft_cfg, forwards, n)
      passes = [dataclasses.replace(p, times=p.times * draft_share) for p in passes]
      return projected(spec, cfg, t, n + 1, passes, B=B, context=context, weights=kind(weights),
                       draft_weights=kind(draft_weights or weights))
    p = at(nodes, tau)
    out[regime] = {k: p[k] for k in ("speedup", "plain_ms", "verify_ms", "draft_ms", "iteration_floor_ms")}
    if acceptance:
      best = max(range(1, nodes + 1), key=lambda k: at(k, tau_at(tau, acceptance, nodes, k))["speedup"])
      out[regime].update(best_k=best, best_k_speedup=at(best, tau_at(tau, acceptance, nodes, best))["speedup"])
  return out


def tau_at(tau: float, acceptance: Sequence[float], nodes: int, k: int) -> float:
  """τ of a chain of k ≤ N from a run at N: the per-position acceptance gives the shape, the measured τ the
  scale.  The acceptance at a position counts only the steps that reached it, so a drafter that sometimes
  drafts nothing (a lookup without a match) has a τ below ``expected_accepted``; scaling keeps τ(N) = τ."""
  full = costmodel.expected_accepted(acceptance, nodes)
  return 1.0 + (tau - 1.0) * (costmodel.expected_accepted(acceptance, k) - 1.0) / (full - 1.0) if full > 1 else 1.0
