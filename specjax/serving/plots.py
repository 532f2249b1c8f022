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
