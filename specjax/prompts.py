"""Prompt files: the project's JSON Lines (``{"id", "category", "prompt"}``), Spec-Bench's (``{"question_id",
"category", "turns"}``), HumanEval's (``{"task_id", "prompt", "entry_point", "test", ...}``) or plain text lines.

A HumanEval record's ``prompt`` is a function stub (signature and docstring), not a request, so it is wrapped
in a short instruction (``HUMANEVAL_INSTRUCTION``) before the model's chat template is applied: the model is
asked to reply with the whole function in one Python code block.  Its category is ``humaneval``; the record's
``test`` and ``entry_point`` stay on the prompt (``Prompt.task``) for ``specjax eval-code``.
"""
from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

from specjax.errors import SpecjaxError

DEFAULT_PROMPTS = "specjax-prompts"   # the project's own set, shipped in specjax/data/prompts.jsonl

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function, "
                         "including its signature and any imports it needs, in one ```python code block.\n\n"
                         "```python\n{stub}```")


def wrap_code_stub(stub: str) -> str:
  """The user message for a HumanEval-style function stub (documented in docs/guides/coder-pair-and-models.md)."""
  return HUMANEVAL_INSTRUCTION.format(stub=stub if stub.endswith("\n") else stub + "\n")


@dataclasses.dataclass(frozen=True)
class Prompt:
  question_id: int | str
  category: str
  text: str           # the first turn: the user message
  task: tuple = ()    # a code task's (("prompt", stub), ("entry_point", name), ("test", code)), for eval-code

  def task_field(self, name: str) -> str | None:
    return dict(self.task).get(name)


def load_prompts(path: str | Path = DEFAULT_PROMPTS, categories: tuple[str, ...] | list[str] | None = None,
                 limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
  """Read prompts from JSON Lines — the project's ``{"id", "category", "prompt"}`` or Spec-Bench's
  ``{"question_id", "category", "turns"}`` (first turn as the user message), given by path — or a plain-text
  file, one prompt per line.

  ``path`` may be ``"specjax-prompts"`` for the project's own set.  ``categories`` keeps only those
  categories (``"mt_bench"`` selects MT-bench's eight categories); ``per_category`` keeps the first N of each
  category, then ``limit`` the first N overall.
  """
  if str(path) == DEFAULT_PROMPTS:
    text = resources.files("specjax").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    where = "specjax/data/prompts.jsonl"
  else:
    p = Path(path)
    if not p.is_file():
      raise SpecjaxError(f"prompt file not found: {p} (give a Spec-Bench .jsonl or a text file, one prompt "
                         "per line)")
    text, where = p.read_text(encoding="utf-8"), str(p)
  jsonl = where.endswith(".jsonl")    # every line a record: a stray line is an error, never a prompt
  prompts: list[Prompt] = []
  for n, line in enumerate(text.splitlines(), 1):
    line = line.strip()
    if not line:
      continue
    if jsonl and not line.startswith("{"):
      raise SpecjaxError(f"{where}:{n}: not a JSON object ({line[:40]!r}): a .jsonl prompt file holds one JSON "
                         "record per line; fix the line, or give plain-text prompts in a .txt file")
    if line.startswith("{"):
      try:
        obj = json.loads(line)
        task: tuple = ()
        if "task_id" in obj and "prompt" in obj:   # HumanEval: a stub, wrapped in an instruction
          text, qid = wrap_code_stub(str(obj["prompt"])), obj["task_id"]
          obj.setdefault("category", "humaneval")
          task = tuple((k, str(obj[k])) for k in ("prompt", "entry_point", "test") if k in obj)
        elif "prompt" in obj:     # the project's own format: {"id", "category", "prompt"}
          text, qid = obj["prompt"], obj.get("id", n)
        else:                   # Spec-Bench / MT-bench: {"question_id", "category", "turns"}, first turn
          text, qid = obj["turns"][0], obj.get("question_id", n)
        prompts.append(Prompt(qid, str(obj.get("category", "")), str(text), task))
      except json.JSONDecodeError as e:
        raise SpecjaxError(f"{where}:{n}: not valid JSON ({e.msg} at column {e.colno}): fix the line") from None
      except (KeyError, IndexError, TypeError) as e:
        raise SpecjaxError(f"{where}:{n}: not a prompt record: expected a 'prompt' string (with 'task_id' "
                           f"for HumanEval) or a Spec-Bench non-empty 'turns' list ({e})") from e
    else:
      prompts.append(Prompt(n, "", line))
  if categories:
    wanted = set(categories)
    mt = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    prompts = [p for p in prompts if p.category in wanted or ("mt_bench" in wanted and p.category in mt)]
  if per_category:
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
      if seen.get(p.category, 0) < per_category:
        seen[p.category] = seen.get(p.category, 0) + 1
        kept.append(p)
    prompts = kept
  if limit is not None:
    prompts = prompts[:limit]
  if not prompts:
    raise SpecjaxError(f"no prompts selected from {where}" + (f" for categories {list(categories)}"
                                                                if categories else ""))
  return prompts
