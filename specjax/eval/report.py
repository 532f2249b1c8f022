"""Printing tables, writing CSV files and plots of experiment results."""
from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any, Sequence


def _fmt(v: Any) -> str:
  if isinstance(v, float):
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
  if isinstance(v, (list, tuple)):
    return ", ".join(_fmt(x) for x in v)
  return str(v)


def print_table(rows: Sequence[dict], title: str = "", file=None) -> None:
  """A table of dict rows (union of keys as columns) with rich, to stdout by default."""
  from rich.console import Console
  from rich.table import Table
  console = Console(file=file or sys.stdout, width=200)
  table = Table(title=title)
  cols = columns(rows)
  for c in cols:
    table.add_column(c)
  for r in rows:
    table.add_row(*[_fmt(r.get(c, "")) for c in cols])
  console.print(table)


def columns(rows: Sequence[dict]) -> list[str]:
  cols: list[str] = []
  for r in rows:
    cols += [k for k in r if k not in cols and not isinstance(r[k], dict)]
  return cols


def write_csv(rows: Sequence[dict], path: Path) -> None:
  cols = columns(rows)
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({c: (_fmt(r[c]) if isinstance(r.get(c), (list, tuple)) else r.get(c, "")) for c in cols})


def write_json_files(files: dict[str, Any], out_dir: Path) -> None:
  """Extra JSON files an experiment returns under ``"files"`` (name -> object), written into its run
  directory (e.g. the acceptance vector a tree experiment measured, for ``--acceptance FILE``)."""
  import json
  for name, obj in files.items():
    if Path(name).name != name:
      raise ValueError(f"experiment file name '{name}' must be a plain file name, without directories")
    (Path(out_dir) / name).write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")


def make_plot(rows: list[dict], spec: dict, out_dir: Path) -> None:
  """A declarative plot: {"file", "x", "y", "group" (optional), "kind": "bar" | "line", "title"}."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  x, y, group = spec["x"], spec["y"], spec.get("group")
  rows = [r for r in rows if r.get(y) is not None and r.get(x) is not None]
  fig, ax = plt.subplots(figsize=(7, 4))
  groups = sorted({r.get(group) for r in rows}, key=str) if group else [None]
  for gi, g in enumerate(groups):
    sel = [r for r in rows if group is None or r.get(group) == g]
    xs, ys = [r[x] for r in sel], [r[y] for r in sel]
    if spec.get("kind", "line") == "bar":
      width = 0.8 / len(groups)
      pos = [i + gi * width for i in range(len(xs))]
      ax.bar(pos, ys, width=width, label=str(g) if group else None)
      ax.set_xticks([i + 0.4 - width / 2 for i in range(len(xs))], [str(v) for v in xs], rotation=30,
                    ha="right")
    else:
      ax.plot(xs, ys, marker="o", label=str(g) if group else None)
  ax.set_xlabel(spec.get("xlabel", x))
  ax.set_ylabel(spec.get("ylabel", y))
  ax.set_title(spec.get("title", f"{y} vs {x}"))
  if group:
    ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_dir / spec["file"], dpi=120)
  plt.close(fig)
