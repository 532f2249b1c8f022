"""The drafter registry (specjax/speculative/registry.py): every name builds through the API with what its
kind says it needs, every drafter it builds satisfies ``protocol.Drafter``, and no module outside the registry
compares a drafter's name (or what a kind's ``--draft`` names)."""
import ast
from pathlib import Path

import jax
import pytest

from specjax.models import config, decoder as model
from specjax.errors import SpecjaxError
from specjax.speculative import dflash, medusa, drafters, eagle, registry, suffix
from specjax.speculative.protocol import Drafter, FeatureDrafter, LearningDrafter

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_is_consistent():
  assert registry.NAMES[0] == "none" and not registry.get("none").speculates
  for name, kind in registry.KINDS.items():
    assert kind.name == name
    assert kind.draft in (None, "model", "head")
    assert not (kind.ngram_caps and not kind.ngram), name
  assert set(registry.DRAFT_MODEL_NAMES) == {"model", "hybrid"}
  assert "hybrid" not in registry.TREE_NAMES and "ngram" in registry.TREE_NAMES
  with pytest.raises(SpecjaxError, match="unknown drafter 'lookahead': choose one of none, ngram"):
    registry.get("lookahead")
  assert {k.head_layout for k in registry.KINDS.values()} == {"specjax", "medusa", "dflash"}


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


def test_kind_properties_say_what_draft_names():
  assert [n for n, k in registry.KINDS.items() if k.head] == ["eagle", "eagle-parallel", "eagle-hybrid", "medusa",
                                                             "dflash"]
  assert all(not (k.head and k.draft_model) for k in registry.KINDS.values())
  assert registry.speculating_help() == "--drafter " + ", ".join(n for n in registry.NAMES if n != "none")
  assert registry.speculating_help().startswith("--drafter ngram, layerskip, model, hybrid, eagle")


def _built(name: str, cfg, params):
  """The drafter the registry builds for ``name`` (a head's params are not read while building)."""
  parallel = 3 if name == "eagle-parallel" else 0
  head = (eagle.EagleConfig(cfg, (), 0, parallel=parallel), {})
  if registry.get(name).head_layout == "medusa":
    head = (medusa.MedusaConfig(cfg, num_heads=3), {})
  if name == "dflash":
    head = (dflash.DFlashConfig(cfg, cfg.replace(num_layers=1), (0,), block_size=4, mask_token_id=3), {})
  return registry.build(registry.get(name), cfg, params, k=3, depth=None, buckets=(64,), layers=(0,),
                        draft_cfg=cfg, draft_params=params, head=head)[0]


def test_every_built_drafter_satisfies_the_protocol():
  cfg = config.TINY.replace(name="tiny-registry")
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  for name, kind in registry.KINDS.items():
    d = _built(name, cfg, params)
    assert isinstance(d, Drafter), name
    assert isinstance(d, FeatureDrafter) == kind.head, name        # the heads read the target's features
    assert isinstance(d, LearningDrafter) == kind.learns == registry.learns(d), name
    assert registry.built_name(name, d) == name
    hash(d)                                                          # a jit static argument (through Engine)
  assert not isinstance(object(), Drafter)


# What a kind's ``--draft`` names is asked of the kind (``kind.head``, ``kind.draft_model``), not compared.
_DRAFT_VALUES = ("head", "model")


def _name_comparisons(path: Path) -> list[str]:
  """Comparisons of a drafter-ish expression with a drafter's name ('model', 'hybrid', ...), and of a
  ``.draft`` attribute (a kind's) with what it names ('head', 'model')."""
  text = path.read_text(encoding="utf-8")
  found = []
  for node in ast.walk(ast.parse(text)):
    if not isinstance(node, ast.Compare):
      continue
    sides = [node.left, *node.comparators]
    consts = [c.value for side in sides for c in ast.walk(side)
              if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    source = ast.get_source_segment(text, node) or ""
    on_draft = any(isinstance(side, ast.Attribute) and side.attr == "draft" for side in sides)
    if (("drafter" in source and any(c in registry.NAMES for c in consts))
        or (on_draft and any(c in _DRAFT_VALUES for c in consts))):
      where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
      found.append(f"{where}:{node.lineno}: {source}")
  return found


def test_no_drafter_name_is_compared_outside_the_registry():
  files = [p for pkg in ("specjax", "experiments", "scripts") for p in sorted((ROOT / pkg).rglob("*.py"))
           if p.name != "registry.py" or p.parent.name != "speculative"]
  assert any(p.parent.name == "scripts" for p in files)
  found = [hit for p in files for hit in _name_comparisons(p)]
  assert not found, "ask specjax.speculative.registry instead:\n" + "\n".join(found)


def test_the_check_sees_a_comparison(tmp_path):
  bad = tmp_path / "probe.py"
  bad.write_text("def f(drafter):\n  return drafter in ('model', 'hybrid')\n")
  assert _name_comparisons(bad)


def test_the_check_sees_a_kind_draft_comparison(tmp_path):
  for line in ('kind.draft == "head"', 'registry.get(name).draft != "head"', '"model" == k.draft',
               'spec.kind.draft in ("head", "model")'):
    bad = tmp_path / "probe.py"
    bad.write_text(f"def f(kind, k, registry, name, spec):\n  return {line}\n")
    assert _name_comparisons(bad), line
  fine = tmp_path / "fine.py"
  fine.write_text("def f(kind, args):\n  return kind.head or kind.draft is None or args.draft == 'x.gguf'\n")
  assert not _name_comparisons(fine)
