"""Request traces for the serving engine: Poisson arrivals over a prompt set, or a JSONL file of arrivals."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError


def poisson(prompts: list[str], rate: float, n: int, seed: int = 0, max_tokens: int = 64) -> list[dict]:
  """``n`` requests with exponential gaps of mean 1/rate seconds (rate = requests per second; ``inf`` or
  0 → all at t = 0), prompts drawn in order (cycling)."""
  if n < 1:
    raise SpecjaxError(f"--requests must be >= 1, got {n}")
  if rate < 0:
    raise SpecjaxError(f"--rate must be >= 0 requests/s (0: all at once), got {rate}")
  if not prompts:
    raise SpecjaxError("no prompts for the trace")
  rng = np.random.default_rng(seed)
  gaps = np.zeros(n) if rate == 0 or not np.isfinite(rate) else rng.exponential(1.0 / rate, n)
  t = np.cumsum(gaps) - gaps[0]
  return [{"arrival": float(t[i]), "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens}
          for i in range(n)]


def load(path: str, default_max_tokens: int = 64) -> list[dict]:
  """A JSONL trace: one object per line with ``arrival`` (seconds from the start), ``prompt`` and optional
  ``max_tokens``."""
  p = Path(path)
  if not p.is_file():
    raise SpecjaxError(f"trace file not found: {path}")
  out = []
  for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      d = json.loads(line)
      out.append({"arrival": float(d["arrival"]), "prompt": str(d["prompt"]),
                  "max_tokens": int(d.get("max_tokens", default_max_tokens))})
    except (ValueError, KeyError, TypeError) as e:
      raise SpecjaxError(f"{path}:{i}: a trace line needs 'arrival' (seconds) and 'prompt': {e}") from e
  if not out:
    raise SpecjaxError(f"trace file {path} holds no requests")
  return sorted(out, key=lambda d: d["arrival"])
