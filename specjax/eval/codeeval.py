"""Functional correctness of generated code: HumanEval-style pass@1, every test in its own subprocess.

A code task (a HumanEval record, ``Prompt.task``) carries the function stub, the entry point's name and a test
that defines ``check(candidate)``.  For a model's reply:

  1. the code is the reply's first fenced block (```python … ``` or ``` … ```), else the whole reply;
  2. if it does not define the entry point, the model wrote only the body: the stub is put in front of it;
  3. the program ``code + test + check(entry_point)`` runs in a fresh ``python -I`` subprocess, in an empty
     temporary directory, with a timeout; it passes when it exits with status 0.

Generated code never runs in the specjax process.  This is not a sandbox: run untrusted models' code on a
machine you can afford to lose.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

from specjax import settings
from specjax.errors import SpecjaxError
from specjax.prompts import Prompt

DEFAULT_TIMEOUT_S = 10.0
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)


@dataclasses.dataclass(frozen=True)
class Outcome:
  task_id: str
  passed: bool
  status: str          # passed | failed | timeout | no-code
  detail: str = ""     # the last line the program wrote to stderr (the assertion or exception), if any


def extract_code(reply: str, stub: str, entry_point: str) -> str:
  """The program text a reply proposes for ``entry_point`` (see the module docstring)."""
  blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
  python = [b for lang, b in blocks if lang in ("python", "py", "python3")]
  code = (python or [b for _, b in blocks] or [reply])[0]
  if not re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M):
    code = stub + code          # only the body: the stub gives the signature (and its imports)
  return code


def test_program(code: str, test: str, entry_point: str) -> str:
  return f"{code}\n\n{test}\n\ncheck({entry_point})\n"


def run_program(program: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[str, str]:
  """Run ``program`` in a fresh isolated interpreter: (status passed | failed | timeout, last stderr line)."""
  with tempfile.TemporaryDirectory(prefix="specjax-code-") as tmp:
    path = os.path.join(tmp, "program.py")
    with open(path, "w", encoding="utf-8") as f:
      f.write(program)
    env = {"PATH": settings.get("PATH", ""), "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
      done = subprocess.run([sys.executable, "-I", path], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
      return "timeout", f"no result within {timeout_s:g}s"
  lines = [l for l in done.stderr.strip().splitlines() if l.strip()]
  return ("passed" if done.returncode == 0 else "failed"), (lines[-1][:300] if lines else "")


def evaluate(task: Prompt, reply: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Outcome:
  """Run one task's test against one reply."""
  stub, entry, test = task.task_field("prompt"), task.task_field("entry_point"), task.task_field("test")
  if not (entry and test):
    raise SpecjaxError(f"prompt {task.question_id} is not a code task: eval-code needs HumanEval records "
                       "(task_id, prompt, entry_point, test)")
  if not reply.strip():
    return Outcome(str(task.question_id), False, "no-code", "empty reply")
  status, detail = run_program(test_program(extract_code(reply, stub or "", entry), test, entry), timeout_s)
  return Outcome(str(task.question_id), status == "passed", status, detail)


def evaluate_all(tasks: Sequence[Prompt], replies: Iterable[tuple[str, str, str]],
                 timeout_s: float = DEFAULT_TIMEOUT_S, workers: int | None = None) -> dict:
  """pass@1 per method for (method, task id, reply) triples over ``tasks`` (ids not among them are an error).

  Returns {"methods": {method: {"pass_at_1", "passed", "total", "outcomes": [...]}}, "timeout_s": ...}; the
  tests run ``workers`` at a time (default: the number of cores)."""
  by_id = {str(t.question_id): t for t in tasks}
  jobs = []
  for method, task_id, reply in replies:
    if str(task_id) not in by_id:
      raise SpecjaxError(f"completion for '{task_id}' has no task among the prompts given: pass the prompt "
                         "file the completions were generated from (--prompts)")
    jobs.append((method, by_id[str(task_id)], reply))
  if not jobs:
    raise SpecjaxError("no completions to evaluate")
  with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
    outcomes = list(pool.map(lambda j: evaluate(j[1], j[2], timeout_s), jobs))
  methods: dict = {}
  for (method, _, _), out in zip(jobs, outcomes):
    row = methods.setdefault(method, {"passed": 0, "total": 0, "outcomes": []})
    row["passed"] += int(out.passed)
    row["total"] += 1
    row["outcomes"].append(dataclasses.asdict(out))
  for row in methods.values():
    row["pass_at_1"] = row["passed"] / row["total"]
  return {"methods": methods, "timeout_s": timeout_s}
