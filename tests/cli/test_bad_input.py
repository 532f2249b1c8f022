"""Bad input on every command: one line ``specjax: error: ...``, exit status 2, before any slow work.

The walk is generic: every numeric flag of every command declares its range (a ``specjax.cli.flags`` type),
and each is fed a value outside it.  Then the cases that need a model's size or a file's contents."""
import argparse
import json

import pytest

from specjax import cli
from specjax.errors import SpecjaxError
from tests.helpers import specjax_here

TOO_LATE = "the model began to load"


@pytest.fixture
def no_loading(monkeypatch):
  """Any attempt to load a model ends the command with a message the assertions reject."""
  from specjax import api

  def load(*a, **k):
    raise SpecjaxError(TOO_LATE)
  monkeypatch.setattr(api, "load", load)


def commands() -> dict[str, argparse.ArgumentParser]:
  parser = cli.build_parser()
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return dict(sub.choices)


def assert_one_line(proc, *needles, after_loading: bool = False):
  """Exit 2 and one error line; nothing else on stderr unless the check needed the model (its loading log)."""
  assert proc.returncode == 2, (proc.args, proc.returncode, proc.stderr)
  err = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr and err and err[-1].startswith("specjax: error:"), (proc.args, proc.stderr)
  assert after_loading or len(err) == 1, (proc.args, proc.stderr)
  assert sum(line.startswith("specjax: error") for line in err) == 1, (proc.args, proc.stderr)
  assert TOO_LATE not in err[-1], (proc.args, err[-1])
  for n in needles:
    assert n.lower() in err[-1].lower(), (proc.args, err[-1])


def numeric_actions(p: argparse.ArgumentParser):
  from specjax.cli import flags
  text = (str, flags.weight_kind, flags.weight_kinds, flags.verify_rules)   # types that parse words, not numbers
  return [a for a in p._actions if a.option_strings and a.type is not None and a.type not in text]


def test_every_numeric_flag_declares_its_range():
  cmds = commands()
  assert len(cmds) >= 15
  plain = [(name, a.option_strings[0]) for name, p in cmds.items() for a in numeric_actions(p)
           if not hasattr(a.type, "bounds")]
  assert not plain, f"flags parsed with a bare int/float (use a specjax.cli.flags type): {plain}"


def bad_values(t) -> list[str]:
  lo, hi = t.bounds
  out = ["many"]
  if lo is not None:
    out.append(str(lo - 1) if t.__name__ == "integer" else str(lo - 0.5))
  if hi is not None:
    out.append(str(hi + 1))
  if t.__name__ == "number":
    out.append("nan")
  return out


def test_walk_every_command_with_out_of_range_numbers(no_loading):
  walked = 0
  for name, p in commands().items():
    for a in numeric_actions(p):
      for v in bad_values(a.type):
        assert_one_line(specjax_here(name, a.option_strings[0], v), a.option_strings[0], v)
        walked += 1
  assert walked > 100


@pytest.mark.parametrize("argv,needles", [
    (("serve", "--port", "70000"), ("--port", "65535")),
    (("cost", "--k", "-1"), ("--k", ">= 0")),
    (("cost", "--weights", "fp32,int3"), ("--weights", "int3", "int4")),
    (("generate", "--prompt", "hi", "--top-p", "0"), ("--top-p", "(0, 1]")),
    (("generate", "--prompt", "hi", "--drafter", "ngram", "--tree", "dynamic:5000"), ("dynamic:5000", "116")),
    (("bench", "--drafter", "ngram", "--tree", "dynamic:8:0"), ("TOPK", "positive")),
    (("generate", "--prompt", "hi", "--drafter", "unknown"), ("unknown",)),
    (("generate", "--prompt", "hi", "--ngram-caps", "one"), ("--ngram-caps",)),
    (("serve-sim", "--buckets", "0,a"), ("--buckets",)),
    (("serve", "--buckets", "-1"), ("--buckets",)),
    (("generate", "--prompt", "hi", "--mesh", "2y3"), ("2y3",)),
    (("generate", "--prompt", "hi", "--drafter", "model", "--draft", "/no/such/draft"), ("/no/such/draft",)),
    (("generate", "--prompt", "hi", "--drafter", "ngram", "--draft", "x"), ("--draft",)),
    (("generate", "--prompt", "hi", "--drafter", "ngram", "--index-tokens", "64"), ("--index-tokens", "suffix")),
    (("serve", "--drafter", "ngram", "--index-tokens", "64"), ("--index-tokens", "suffix")),
    (("loadgen", "--url", "localhost:8000"), ("--url",)),
    (("bench", "--nope"), ("--nope",)),
    (("no-such-command",), ("no-such-command",)),
])
def test_known_bad_inputs(argv, needles, no_loading):
  assert_one_line(specjax_here(*argv), *needles)


def test_a_directory_that_is_not_a_drafter(tmp_path, no_loading):
  (tmp_path / "config.json").write_text(json.dumps({"hidden": 3}))
  proc = specjax_here("generate", "--prompt", "hi", "--drafter", "eagle", "--draft", tmp_path)
  assert_one_line(proc, str(tmp_path), "specjax_drafter")
  assert "None" not in proc.stderr


def test_sizes_that_cannot_fit_are_refused_with_the_bill(tiny_model, monkeypatch):  # noqa: F811
  """A batch or a slot count whose buffers exceed memory stops before any prompt is batched or compiled."""
  from specjax.eval import bench
  from specjax.serving import batcher

  def slow(*a, **k):
    raise AssertionError("slow work started")
  monkeypatch.setattr(bench, "make_batches", slow)
  monkeypatch.setattr(batcher.ContinuousBatcher, "__init__", slow)
  huge = str(10 ** 7)
  assert_one_line(specjax_here("bench", "--model", tiny_model, "--batch-size", huge, "--max-len", "256"),
                  f"batch {huge}", "--batch-size", after_loading=True)
  assert_one_line(specjax_here("bench", "--model", tiny_model, "--batch-size", huge, "--drafter", "ngram"),
                  f"batch {huge}", after_loading=True)
  assert_one_line(specjax_here("serve-sim", "--model", tiny_model, "--slots", huge, "--requests", "2"),
                  f"batch {huge}", "lower --slots", after_loading=True)
  assert_one_line(specjax_here("generate", "--model", tiny_model, "--prompt", "hi", "--batch-size", huge),
                  f"batch {huge}", after_loading=True)
