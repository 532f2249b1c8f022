"""Append-only JSON Lines files that a kill may cut: read every complete record."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from specjax.errors import SpecjaxError


def read_records(path: str | Path, check: Callable[[dict], None], fix: str) -> list[dict]:
  """The records of ``path`` ([] if missing).  A bad last line (cut by a kill) is ignored; any other bad line
  (invalid JSON, or ``check`` raising ValueError) is an error naming it and ``fix``."""
  path = Path(path)
  if not path.exists():
    return []
  out = []
  lines = path.read_text(encoding="utf-8").split("\n")
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
      check(rec)
    except ValueError as e:          # json.JSONDecodeError is a ValueError
      if n == len(lines):
        break
      raise SpecjaxError(f"{path}:{n}: bad record ({e}); {fix}") from e
    out.append(rec)
  return out
