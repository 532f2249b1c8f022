"""What a served trace measured: throughput, time to first token, inter-token latency and token gaps as
percentiles, the k chosen over time; and the same split by a trace's rounds or phases.  Reads finished
``batcher.Request``s and ``batcher.StepRecord``s (by their fields; nothing here runs the engine)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def split_report(requests: Sequence, groups: Sequence) -> dict:
  """Per group (a trace's round or phase): requests, tokens, tokens per delivery (how many tokens a step
  gave the request: acceptance as the client sees it) and the inter-token latency percentiles."""
  out = {}
  for g in sorted({g for g in groups if g is not None}):
    rs = [r for r, x in zip(requests, groups) if x == g and r.done and r.tokens]
    deliveries = sum(len(set(r.token_times)) for r in rs)
    tpot = _tpot(rs)
    out[str(g)] = {"requests": len(rs), "tokens": sum(len(r.tokens) for r in rs),
                   "tokens_per_delivery": sum(len(r.tokens) for r in rs) / max(deliveries, 1),
                   "itl_s": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)}}
  return out


def _tpot(served: Sequence) -> list[float]:
  """Each request's time per output token after its first."""
  return [(r.token_times[-1] - r.first_token) / (len(r.tokens) - 1) for r in served if len(r.tokens) > 1]


def pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else None


def report(requests: Sequence, history: Sequence, start: float, end: float,
           refused=()) -> dict:
  """Throughput, time to first token, request latency (arrival to last token), inter-token latency
  (per-request time per output token after the first) and the gaps between token deliveries, as percentiles;
  the k chosen over time, and the drafts offered and accepted at each step."""
  served = [r for r in requests if r.done and r.tokens]
  ttft = [r.first_token - r.arrival for r in served]
  e2e = [r.finished - r.arrival for r in served]
  tpot = _tpot(served)
  gaps = [b - a for r in served for a, b in zip(r.token_times, r.token_times[1:]) if b > a]
  tokens = sum(len(r.tokens) for r in served)
  wall = max(end - start, 1e-9)
  ks = [h.k for h in history]
  return {"requests": len(requests), "served": len(served), "refused": len(refused),
          "refused_reasons": sorted({why for _, why in refused})[:5], "tokens": tokens, "wall_s": wall,
          "tokens_per_s": tokens / wall,
          "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
          "latency_s": {"p50": pct(e2e, 50), "p90": pct(e2e, 90), "p99": pct(e2e, 99)},
          "itl_s": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
          "token_gap_s": {"p50": pct(gaps, 50), "p90": pct(gaps, 90), "p99": pct(gaps, 99)},
          "steps": len(history), "mean_k": float(np.mean(ks)) if ks else 0.0,
          "k_share": {str(k): ks.count(k) / len(ks) for k in sorted(set(ks))} if ks else {},
          "k_over_time": [[round(h.t - start, 4), h.k, h.live] for h in history],
          "accept_over_time": [[round(h.t - start, 4), h.rows - h.live, h.accepted] for h in history],
          "mean_live": float(np.mean([h.live for h in history])) if history else 0.0,
          **_bucket_share(history)}


def _bucket_share(history: Sequence) -> dict:
  """With a tree among the buckets run: the share of steps of each bucket ("k=4", "branch:2,2,1")."""
  names = [getattr(h, "bucket", "") for h in history]
  if not any(n and not n.startswith("k=") for n in names):
    return {}
  return {"bucket_share": {n: names.count(n) / len(names) for n in sorted(set(names))}}
