"""The one builder (specjax/runtime/builder.py): a DecodeSpec in, a Decode out; every caller that decodes builds
through it, and its checks fail before anything is compiled."""
import ast
from pathlib import Path

import jax
import pytest

from specjax import speculative as spec
from specjax.models import config, decoder as model
from specjax.errors import SpecjaxError
from specjax.runtime.builder import DecodeSpec, build
from specjax.runtime.loaded import Model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
  cfg = config.TINY.replace(name="tiny-builder")
  return Model(cfg=cfg, params=model.init_params(cfg, jax.random.PRNGKey(0)), tokenizer=None, source="tiny")


def test_build_a_chain_a_tree_and_plain_decoding(tiny):
  d = build(tiny, DecodeSpec(drafter="ngram", k=5), eos_ids=(2,), prompt_lens=[40, 90], max_new_tokens=64)
  assert d.k_max == 5 and d.engine.k_max == 5 and d.label == "ngram k=5" and d.choice is None
  assert d.max_len == 256 and d.engine.eos_ids == (2,)                  # 90 + 64 + 7, to a bucket
  assert d.settings()["drafter"] == "ngram" and d.settings()["k"] == 5
  t = build(tiny, DecodeSpec(drafter="ngram", tree="branch:2,2"), max_len=256)
  assert t.k_max == 6 and t.label == "ngram branch:2,2" and t.engine.tree is not None
  plain = build(tiny, DecodeSpec(), max_len=256)
  assert plain.k_max == 0 and isinstance(plain.engine.drafter, spec.NoDrafter)
  ls = build(tiny, DecodeSpec(drafter="layerskip", k=3, draft_layers=1), max_len=256)
  assert ls.draft_layers == (0,) and ls.settings()["draft_layers"] == [0]


def test_engine_for_another_k_keeps_the_drafter(tiny):
  d = build(tiny, DecodeSpec(drafter="ngram", k=4), max_len=256)
  assert d.engine_for(2, stats_nodes=4).k_max == 2 and d.engine_for(2, stats_nodes=4).stats_nodes == 4
  assert isinstance(d.engine_for(0, stats_nodes=4).drafter, spec.NoDrafter)      # n-gram keeps no cache
  ls = build(tiny, DecodeSpec(drafter="layerskip", k=4, draft_layers=1), max_len=256)
  assert ls.engine_for(0, stats_nodes=4).k_max == 1                              # its cache stays in step


def test_bad_settings_fail_in_one_line(tiny):
  with pytest.raises(SpecjaxError, match="prompt of 300 tokens"):
    build(tiny, DecodeSpec(drafter="ngram"), max_len=256, prompt_lens=[300], max_new_tokens=8)
  with pytest.raises(SpecjaxError, match="unknown drafter"):
    build(tiny, DecodeSpec(drafter="lookahead"), max_len=256)
  with pytest.raises(SpecjaxError, match="drafter 'medusa' needs Medusa heads: pass --draft DIR"):
    build(tiny, DecodeSpec(drafter="medusa"), max_len=256)
  with pytest.raises(SpecjaxError, match="needs 17 draft nodes"):
    build(tiny, DecodeSpec(drafter="ngram", tree="chain:17"), max_len=18)
  with pytest.raises(SpecjaxError, match="at most batch"):
    build(tiny, DecodeSpec(drafter="ngram"), max_len=256, batch_size=4, memory_budget=1e5)


def _calls(path: Path, names: set[str]) -> list[str]:
  hits = []
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Call):
      f = node.func
      name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
      if name in names:
        hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
  return hits


def test_every_caller_that_decodes_builds_through_the_builder():
  inside = (ROOT / "specjax" / "runtime", ROOT / "specjax" / "speculative")
  files = [p for pkg in ("specjax", "experiments") for p in (ROOT / pkg).rglob("*.py")
           if not any(p.is_relative_to(d) for d in inside)]
  found = [hit for p in files for hit in _calls(p, {"build_drafter", "make_engine", "Engine"})]
  assert not found, "build the decode with specjax.runtime.builder.build:\n" + "\n".join(found)
