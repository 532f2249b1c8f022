"""Prompt files: Spec-Bench JSON Lines (``{"question_id", "category", "turns"}``) or plain text lines."""
from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

from specjax.errors import SpecjaxError

DEFAULT_PROMPTS = "specjax-prompts"   # the project's own set, shipped in specjax/data/prompts.jsonl


@dataclasses.dataclass(frozen=True)
class Prompt:
  question_id: int | str
  category: str
  text: str           # the first turn: the user message


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
  prompts: list[Prompt] = []
  for n, line in enumerate(text.splitlines(), 1):
    line = line.strip()
    if not line:
      continue
    if line.startswith("{"):
      try:
        obj = json.loads(line)
        if "prompt" in obj:     # the project's own format: {"id", "category", "prompt"}
          text, qid = obj["prompt"], obj.get("id", n)
        else:                   # Spec-Bench / MT-bench: {"question_id", "category", "turns"}, first turn
          text, qid = obj["turns"][0], obj.get("question_id", n)
        prompts.append(Prompt(qid, str(obj.get("category", "")), str(text)))
      except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise SpecjaxError(f"{where}:{n}: not a prompt record: expected a 'prompt' string or a Spec-Bench "
                           f"non-empty 'turns' list ({e})") from e
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
