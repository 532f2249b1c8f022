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


def test_a_jsonl_line_that_is_not_json_is_named_not_read_as_a_prompt(tmp_path):
  """Before, a stray line of a .jsonl file became a prompt of its own; now it is refused in one line that names
  the file and the line, as is a line that starts like a record but does not parse."""
  f = tmp_path / "mixed.jsonl"
  f.write_text('{"id": "a", "category": "qa", "prompt": "hello"}\n\nplain words\n')
  with pytest.raises(SpecjaxError, match=r"mixed\.jsonl:3: not a JSON object \('plain words'\)") as e:
    load_prompts(f)
  assert "\n" not in str(e.value) and ".txt" in str(e.value)
  broken = tmp_path / "broken.jsonl"
  broken.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": \n')
  with pytest.raises(SpecjaxError, match=r"broken\.jsonl:2: not valid JSON"):
    load_prompts(broken)
  text = tmp_path / "p.txt"            # a text file keeps one prompt per line, whatever the line looks like
  text.write_text("plain words\n[1, 2]\n")
  assert [p.text for p in load_prompts(text)] == ["plain words", "[1, 2]"]
