"""The drafter registry (specjax/speculative/registry.py): every name builds through the API with what its
kind says it needs, and no module outside the registry compares a drafter's name."""
import ast
from pathlib import Path

import jax
import pytest

from specjax.models import config, decoder as model
from specjax.errors import SpecjaxError
from specjax.speculative import drafters, registry, suffix

ROOT = Path(__file__).resolve().parents[1]


def test_every_kind_is_consistent():
  assert registry.NAMES[0] == "none" and not registry.get("none").speculates
  for name, kind in registry.KINDS.items():
    assert kind.name == name
    assert kind.draft in (None, "model", "head")
    assert not (kind.ngram_caps and not kind.ngram), name
  assert set(registry.DRAFT_MODEL_NAMES) == {"model", "hybrid"}
  assert "hybrid" not in registry.TREE_NAMES and "ngram" in registry.TREE_NAMES
  with pytest.raises(SpecjaxError, match="unknown drafter 'medusa': choose one of none, ngram"):
    registry.get("medusa")


def test_build_gives_what_each_kind_says():
  cfg = config.TINY.replace(name="tiny-registry")
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  buckets = (64,)
  d, p = registry.build(registry.get("none"), cfg, params, k=0, depth=None, buckets=buckets)
  assert isinstance(d, drafters.NoDrafter) and p == ()
  d, p = registry.build(registry.get("ngram"), cfg, params, k=4, depth=None, buckets=buckets, ngram=2,
                        ngram_caps=(1, 3))
  assert isinstance(d, drafters.NgramDrafter) and d.max_ngram == 2 and d.match_caps == (1, 3)
  d, p = registry.build(registry.get("layerskip"), cfg, params, k=4, depth=None, buckets=buckets, layers=(0,))
  assert d.cfg.num_layers == 1 and d.name == "layerskip"
  d, p = registry.build(registry.get("model"), cfg, params, k=4, depth=None, buckets=buckets, draft_cfg=cfg,
                        draft_params=params)
  assert d.cfg is cfg and p is params
  d, p = registry.build(registry.get("suffix"), cfg, params, k=4, depth=None, buckets=buckets)
  assert isinstance(d, suffix.SuffixDrafter) and p["corpus_C"].shape == (suffix.DEFAULT_CORPUS_TOKENS,)
  for name, kind in registry.KINDS.items():
    if kind.stateless:
      assert name in ("none", "ngram", "suffix")
    assert kind.learns == (name == "suffix")
  assert registry.draft_config(registry.get("ngram"), cfg) is None
  assert registry.draft_config(registry.get("layerskip"), cfg, layers=(0,)).num_layers == 1
  assert registry.draft_config(registry.get("eagle"), cfg).num_layers == 1
  assert registry.draft_config(registry.get("model"), cfg, cfg) is cfg


def _name_comparisons(path: Path) -> list[str]:
  """Comparisons of a drafter-ish expression with a drafter's name ('model', 'hybrid', ...)."""
  text = path.read_text(encoding="utf-8")
  found = []
  for node in ast.walk(ast.parse(text)):
    if not isinstance(node, ast.Compare):
      continue
    consts = [c.value for side in [node.left, *node.comparators] for c in ast.walk(side)
              if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    source = ast.get_source_segment(text, node) or ""
    if "drafter" in source and any(c in registry.NAMES for c in consts):
      where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
      found.append(f"{where}:{node.lineno}: {source}")
  return found


def test_no_drafter_name_is_compared_outside_the_registry():
  files = [p for pkg in ("specjax", "experiments") for p in sorted((ROOT / pkg).rglob("*.py"))
           if p.name != "registry.py" or p.parent.name != "speculative"]
  found = [hit for p in files for hit in _name_comparisons(p)]
  assert not found, "ask specjax.speculative.registry instead:\n" + "\n".join(found)


def test_the_check_sees_a_comparison(tmp_path):
  bad = tmp_path / "probe.py"
  bad.write_text("def f(drafter):\n  return drafter in ('model', 'hybrid')\n")
  assert _name_comparisons(bad)
