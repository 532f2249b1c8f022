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
