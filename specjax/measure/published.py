"""Published speedups the projection is tested against, and the fit of the eager regime's floors to them.

Spec-Bench's A100 leaderboard for Vicuna-7B-v1.3 (hemingkx/Spec-Bench, Leaderboard.md: one A100 80GB, PyTorch
2.0.1, greedy, fp16, batch 1): each method's mean accepted length τ and overall speedup, with the shape of its
iteration as Spec-Bench runs it (its eval.sh and each method's defaults) — the rows it verifies and the draft
forwards it runs.  Given τ, the cost model prices the rest (``projection.projected``).

The implementations are PyTorch eager, so a step costs its roofline plus launch floors: ``fit_eager`` finds the
per-forward floor a and per-layer floor b (``devices.EAGER_FLOOR_S``, ``EAGER_FLOOR_PER_LAYER_S``) that
minimise the squared log error over the rows given, on a grid.  Every time in an iteration is floor-free
roofline + a · (forwards and host steps) + b · (layers they run), so the fit evaluates the whole grid at once.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax.models.config import ModelConfig
from specjax.measure import costmodel
from specjax.measure.projection import DraftPass, chain_passes, head_network, projected, tree_passes

SPEC_BENCH_SOURCE = "Spec-Bench Leaderboard.md, A100 80GB, Vicuna-7B-v1.3, greedy, FP16, batch 1"
SPEC_BENCH_DEVICE = "a100-sxm-80gb"
SPEC_BENCH_CONTEXT = 512     # a prompt of a few hundred tokens and a reply of up to 1024: about the mean context


@dataclasses.dataclass(frozen=True)
class PublishedRow:
  """A published speculative method: its τ and speedup, and the shape of one iteration."""
  method: str
  tau: float
  speedup: float
  verify_rows: int
  passes: tuple[DraftPass, ...]
  shape: str                 # where the shape comes from, in words


def spec_bench_vicuna7b(target: ModelConfig, sps_draft: ModelConfig) -> list[PublishedRow]:
  """The seven rows, for ``target`` = Vicuna-7B's config and ``sps_draft`` = Vicuna-68M's."""
  D, V = target.d_model, target.vocab_size
  # EAGLE-1's drafter: one decoder layer of the target's shape, its fc (2D → D, counted as 2D more rows of the
  # tied vocabulary matrix) and the target's LM head.
  eagle = target.as_llama(name="eagle-1", num_layers=1, vocab_size=V + 2 * D, tie_embeddings=True)
  prefix = target.as_llama(name="hydra-prefix", num_layers=1, vocab_size=1, tie_embeddings=True)
  return [
      PublishedRow("SpS", 2.28, 1.49, 6, chain_passes(sps_draft, 5),
                   "Hugging Face assisted generation: k = 5 (num_assistant_tokens) forwards of the 68M draft"),
      PublishedRow("PLD", 1.73, 1.59, 11, (), "prompt lookup: up to 10 candidate tokens, no draft forward"),
      PublishedRow("Medusa", 2.32, 1.78, 64,
                   (DraftPass(head_network("medusa-5-heads", D, 5 * (D * D + V * D)), 64),),
                   "5 heads (a residual block and an LM head each) over the 63-node tree mc_sim_7b_63"),
      PublishedRow("EAGLE", 3.61, 2.29, 26, tree_passes(eagle, 5, 25),
                   "EAGLE-1: 5 forwards of a one-layer drafter grow its 25-node tree"),
      PublishedRow("Hydra", 3.24, 2.09, 64,
                   (DraftPass(prefix, 4),
                    DraftPass(head_network("hydra-head", D, 10 * D * D + V * D), 16, 4)),
                   "Hydra++: a prefix layer, then 4 sequential heads (residual MLP + LM head) over mc_sim_7b_63"),
      PublishedRow("REST", 1.82, 1.48, 64, (), "retrieval from a datastore: up to 64 draft tokens, no forward"),
      PublishedRow("Lookahead", 1.66, 1.27, 57, (),
                   "level 5, window 7, guess 7: 1 + 4 · (7 + 7) rows, no draft forward"),
  ]


def predict(rows: Sequence[PublishedRow], spec: costmodel.DeviceSpec, target: ModelConfig,
            context: int = SPEC_BENCH_CONTEXT, dtype: str = "float16") -> list[dict]:
  """Each row's projection on ``spec`` and its error against the published speedup."""
  out = []
  for r in rows:
    p = projected(spec, target, r.tau, r.verify_rows, r.passes, context=context, dtype=dtype)
    out.append({"method": r.method, "tau": r.tau, "published": r.speedup, "predicted": p["speedup"],
                "error": p["speedup"] / r.speedup - 1.0})
  return out


def _floor_free(rows, spec, target, context, dtype) -> tuple[np.ndarray, np.ndarray]:
  """Per row, the plain step and the iteration as [roofline s, floors a, layers b]: the times are linear in a, b."""
  bare = dataclasses.replace(spec, floor_s=0.0, floor_per_layer_s=0.0, iteration_floor_s=0.0)
  t = lambda c, n: costmodel.step_time(bare, c, 1, n, context, dtype)   # noqa: E731
  L = target.num_layers
  plain = np.array([[t(target, 1), 1, L] for _ in rows])
  it = np.array([[t(target, r.verify_rows) + sum(p.times * t(p.cfg, p.rows) for p in r.passes),
                  2 + sum(p.times for p in r.passes), L + sum(p.times * p.cfg.num_layers for p in r.passes)]
                 for r in rows])        # 2 floors: the verify forward's and the iteration's own (tied to it)
  return plain, it


def fit_eager(rows: Sequence[PublishedRow], spec: costmodel.DeviceSpec, target: ModelConfig,
              context: int = SPEC_BENCH_CONTEXT, dtype: str = "float16", step_s: float = 5e-6,
              max_floor_s: float = 3e-3, max_per_layer_s: float = 1e-3) -> tuple[float, float]:
  """(a, b): the eager per-forward and per-layer floors on a ``step_s`` grid minimising Σ log²(predicted ÷
  published) over ``rows`` (``spec`` gives the roofline and the overlap; its floors are ignored)."""
  plain, it = _floor_free(rows, spec, target, context, dtype)
  a = np.arange(0.0, max_floor_s + step_s / 2, step_s)[:, None, None]
  b = np.arange(0.0, max_per_layer_s + step_s / 2, step_s)[None, :, None]
  tau = np.array([r.tau for r in rows])
  published = np.array([r.speedup for r in rows])
  pred = tau * (plain[:, 0] + a * plain[:, 1] + b * plain[:, 2]) / (it[:, 0] + a * it[:, 1] + b * it[:, 2])
  loss = (np.log(pred / published) ** 2).sum(axis=-1)
  i, j = np.unravel_index(np.argmin(loss), loss.shape)
  return float(a[i, 0, 0]), float(b[0, j, 0])


def leave_one_out(rows: Sequence[PublishedRow], spec: costmodel.DeviceSpec, target: ModelConfig,
                  **fit_kw) -> list[dict]:
  """Each row predicted by floors fitted to the other rows: the error on a row the fit never saw."""
  out = []
  for i, held in enumerate(rows):
    a, b = fit_eager([r for j, r in enumerate(rows) if j != i], spec, target, **fit_kw)
    fitted = dataclasses.replace(spec, floor_s=a, floor_per_layer_s=b, iteration_floor_s=a)
    context = fit_kw.get("context", SPEC_BENCH_CONTEXT)
    out.append({**predict([held], fitted, target, context)[0], "floor_s": a, "floor_per_layer_s": b})
  return out
