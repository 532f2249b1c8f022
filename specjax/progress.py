"""Progress output for long work (data generation, feature passes, training).

On a terminal: a rich progress bar.  Redirected to a file (``nohup ... > run.log``), rich draws nothing until
the end, so there ``progress`` prints a plain line instead, at most every ``every_s`` seconds and at the end:
``[train] 120/300 (40%) loss 2.1 … elapsed 0:18:02 eta 0:27:03``.  Both take the same three calls:
``add_task(description, total=, completed=, info=)``, ``update(task, completed= | advance=, info=)`` and the
``with`` block.  ``say`` is the one-line ``[specjax] ...`` note on stderr that library code prints.
"""
from __future__ import annotations

import sys
import time


def say(message: str) -> None:
  """``[specjax] message`` on stderr, in one write (helper threads may log too)."""
  sys.stderr.write(f"[specjax] {message}\n")
  sys.stderr.flush()


def _hms(seconds: float) -> str:
  s = int(max(seconds, 0))
  return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LineProgress:
  """rich.progress.Progress's calls used here, written as lines to ``stream`` (``clock``: seconds)."""

  def __init__(self, stream=None, every_s: float = 30.0, enabled: bool = True, clock=time.monotonic):
    self.stream = stream if stream is not None else sys.stderr
    self.every_s = every_s
    self.enabled = enabled
    self.clock = clock
    self.tasks: list[dict] = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def add_task(self, description: str, total: int, completed: int = 0, info: str = "") -> int:
    now = self.clock()
    self.tasks.append(dict(description=description, total=total, completed=completed, start=completed, info=info,
                           t0=now, last=now))
    return len(self.tasks) - 1

  def update(self, task: int, completed: int | None = None, advance: int | None = None, info: str | None = None):
    t = self.tasks[task]
    if completed is not None:
      t["completed"] = completed
    if advance is not None:
      t["completed"] += advance
    if info is not None:
      t["info"] = info
    now = self.clock()
    done = t["completed"] >= t["total"]
    if self.enabled and (done or now - t["last"] >= self.every_s):
      t["last"] = now
      self.stream.write(self.line(task, now) + "\n")
      self.stream.flush()

  def line(self, task: int, now: float) -> str:
    t = self.tasks[task]
    n, total, elapsed = t["completed"], t["total"], now - t["t0"]
    pct = 100.0 * n / total if total else 100.0
    text = f"[{t['description']}] {n}/{total} ({pct:.0f}%)"
    if t["info"]:
      text += f" {t['info']}"
    text += f" elapsed {_hms(elapsed)}"
    rate = (n - t["start"]) / elapsed if elapsed > 0 else 0.0
    if n < total and rate > 0:
      text += f" eta {_hms((total - n) / rate)}"
    return text


def progress(enabled: bool = True, stream=None):
  """A rich bar when ``stream`` (stderr by default) is a terminal, else a ``LineProgress``."""
  stream = stream if stream is not None else sys.stderr
  if not (hasattr(stream, "isatty") and stream.isatty()):
    return LineProgress(stream, enabled=enabled)
  from rich.console import Console
  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                             TimeRemainingColumn)
  return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"),
                  TimeRemainingColumn(), console=Console(file=stream), disable=not enabled)
