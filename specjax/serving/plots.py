"""Figures for serving runs: the k the policy chose over time, with the live batch beside it."""
from __future__ import annotations


def k_over_time(report: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  pts = report.get("k_over_time", [])
  fig, ax = plt.subplots(figsize=(8, 3.5))
  if pts:
    t, k, live = zip(*pts)
    ax.step(t, k, where="post", label="k chosen", color="C0")
    ax2 = ax.twinx()
    ax2.plot(t, live, color="C1", alpha=0.6, label="live sequences")
    ax2.set_ylabel("live sequences", color="C1")
  ax.set_xlabel("time (s)")
  ax.set_ylabel("k (drafted tokens)", color="C0")
  ax.set_title(f"policy {report.get('policy')}: {report.get('tokens_per_s', 0):.1f} tok/s")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def windowed_acceptance(points, window_s: float) -> tuple[list[float], list[float]]:
  """(times, acceptance): accepted ÷ offered drafts over the steps of each ``window_s``-second window
  (``points``: a report's ``accept_over_time`` rows [t, offered, accepted]); windows with nothing offered
  are left out."""
  import numpy as np
  if not points:
    return [], []
  t, off, acc = (np.asarray(x, float) for x in zip(*points))
  edges = np.arange(0.0, t.max() + window_s, window_s)
  times, rates = [], []
  for a, b in zip(edges, edges[1:]):
    sel = (t >= a) & (t < b)
    if off[sel].sum() > 0:
      times.append(float((a + b) / 2))
      rates.append(float(acc[sel].sum() / off[sel].sum()))
  return times, rates


def acceptance_over_time(runs: dict, path: str, window_s: float = 10.0, shift_s: float | None = None,
                         paired=()) -> None:
  """Draft acceptance by time for several served runs of one trace (``runs``: label -> report), in windows
  of ``window_s`` seconds; the shift of a shifted trace and each run's adaptation steps marked; ``paired``:
  (arrival, acceptance difference) per request, drawn as points."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 3.8))
  for i, (label, rep) in enumerate(runs.items()):
    t, a = windowed_acceptance(rep.get("accept_over_time", []), window_s)
    ax.plot(t, a, marker="o", ms=3, color=f"C{i}", label=label)
    steps = [s["t"] for s in rep.get("adapt", {}).get("log", [])]
    if steps:
      ax.plot(steps, [0.02] * len(steps), "|", color=f"C{i}", alpha=0.5, ms=8,
              label=f"{label}: adaptation steps")
  if shift_s is not None:
    ax.axvline(shift_s, color="gray", ls="--", label="traffic shifts")
  if paired:
    t, d = zip(*paired)
    ax.plot(t, d, "k.", ms=4, alpha=0.7, label="per request: on − off (same request)")
    ax.axhline(0, color="k", lw=0.6)
  ax.set_xlabel("time (s)")
  ax.set_ylabel(f"drafts accepted ({window_s:g} s windows)")
  ax.set_ylim(-0.3 if paired else 0, 1)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
