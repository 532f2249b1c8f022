"""Request traces for the serving engine: Poisson arrivals over a prompt set, a repeated-task trace (the same
tasks asked again, reworded), a shifted trace (the traffic moves from one prompt set to another), or a JSONL
file of arrivals (``save`` writes one)."""
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
  t = _arrivals(n, rate, np.random.default_rng(seed))
  return [{"arrival": float(t[i]), "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens}
          for i in range(n)]


# How a repeated task is reworded: the request differs, the task does not (as when a user or an agent asks
# again).  Variation 0 is the task as written.
REWORDINGS = ("{p}", "Please help with this.\n\n{p}", "{p}\n\nAnswer again, carefully.",
              "Here is the task once more:\n{p}", "{p}\n\n(Another attempt.)")


def _arrivals(n: int, rate: float, rng) -> np.ndarray:
  gaps = np.zeros(n) if rate == 0 or not np.isfinite(rate) else rng.exponential(1.0 / rate, n)
  return np.cumsum(gaps) - gaps[0]


def repeated(prompts: list[str], tasks: int, repeats: int, rate: float, seed: int = 0,
             max_tokens: int = 64) -> list[dict]:
  """``tasks`` prompts, each asked ``repeats`` times: round r asks every task in a shuffled order, reworded
  by ``REWORDINGS[r % 5]``, after round r - 1 (Poisson arrivals at ``rate``).  Each item records its task
  and round (``task``, ``round``) so a report can split first asks from repeats."""
  if tasks < 1 or repeats < 1:
    raise SpecjaxError(f"a repeated trace needs --tasks and --repeats >= 1, got {tasks} and {repeats}")
  if len(prompts) < tasks:
    raise SpecjaxError(f"--tasks {tasks} but the prompt file holds {len(prompts)}: lower --tasks")
  if rate < 0:
    raise SpecjaxError(f"--rate must be >= 0 requests/s (0: all at once), got {rate}")
  rng = np.random.default_rng(seed)
  order = [(r, int(t)) for r in range(repeats) for t in rng.permutation(tasks)]
  t = _arrivals(len(order), rate, rng)
  return [{"arrival": float(t[i]), "prompt": REWORDINGS[r % len(REWORDINGS)].format(p=prompts[task]),
           "max_tokens": max_tokens, "task": task, "round": r} for i, (r, task) in enumerate(order)]


def shifted(first: list[str], second: list[str], n: int, rate: float, seed: int = 0,
            max_tokens: int = 64) -> list[dict]:
  """``n`` requests: the first half drawn from ``first``, the rest from ``second`` (the traffic shifts at
  request n // 2); each item records its ``phase`` (0 or 1)."""
  if n < 2:
    raise SpecjaxError(f"a shifted trace needs --requests >= 2, got {n}")
  if not first or not second:
    raise SpecjaxError("a shifted trace needs prompts before and after the shift")
  rng = np.random.default_rng(seed)
  t = _arrivals(n, rate, rng)
  half = n // 2
  return [{"arrival": float(t[i]), "prompt": (first[i % len(first)] if i < half else second[(i - half) % len(second)]),
           "max_tokens": max_tokens, "phase": int(i >= half)} for i in range(n)]


def save(trace: list[dict], path: str) -> None:
  """Write a trace as JSONL (what ``load``, ``serve-sim --trace`` and ``loadgen --trace`` read back)."""
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  Path(path).write_text("".join(json.dumps(item) + "\n" for item in trace), encoding="utf-8")


def load(path: str, default_max_tokens: int = 64) -> list[dict]:
  """A JSONL trace: one object per line with ``arrival`` (seconds from the start), ``prompt`` and optional
  ``max_tokens`` and ``speculation`` (the request's own bucket: "off", "k=4", "branch:2,2,1")."""
  p = Path(path)
  if not p.is_file():
    raise SpecjaxError(f"trace file not found: {path}")
  out = []
  for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      d = json.loads(line)
      item = {"arrival": float(d["arrival"]), "prompt": str(d["prompt"]),
              "max_tokens": int(d.get("max_tokens", default_max_tokens))}
      out.append({**{k: d[k] for k in ("task", "round", "phase", "speculation") if k in d}, **item})
    except (ValueError, KeyError, TypeError) as e:
      raise SpecjaxError(f"{path}:{i}: a trace line needs 'arrival' (seconds) and 'prompt': {e}") from e
  if not out:
    raise SpecjaxError(f"trace file {path} holds no requests")
  return sorted(out, key=lambda d: d["arrival"])
