"""Prompt files: the built-in set, the project's JSONL, Spec-Bench JSONL and plain text."""
import pytest

from specjax.errors import SpecjaxError
from specjax.prompts import load_prompts


def test_builtin_set():
  ps = load_prompts("specjax-prompts")
  assert len(ps) == 52 and len({p.category for p in ps}) == 12 and all(p.text for p in ps)
  assert len(load_prompts("specjax-prompts", per_category=1)) == 12


def test_both_jsonl_formats_and_text(tmp_path):
  own = tmp_path / "own.jsonl"
  own.write_text('{"id": "a", "category": "qa", "prompt": "hello"}\n')
  sb = tmp_path / "sb.jsonl"
  sb.write_text('{"question_id": 3, "category": "summarization", "turns": ["first", "second"]}\n')
  txt = tmp_path / "p.txt"
  txt.write_text("one\n\ntwo\n")
  assert [(p.question_id, p.category, p.text) for p in load_prompts(own)] == [("a", "qa", "hello")]
  assert [(p.question_id, p.category, p.text) for p in load_prompts(sb)] == [(3, "summarization", "first")]
  assert [p.text for p in load_prompts(txt)] == ["one", "two"]
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"category": "qa"}\n')
  with pytest.raises(SpecjaxError, match="bad.jsonl:1"):
    load_prompts(bad)
