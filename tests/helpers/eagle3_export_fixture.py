"""The EAGLE-3 head that tests/data/eagle3/exported holds: drawn from a fixed seed for the tiny Llama of
tests/data/hf_families/gemma3 (7 layers) and written by specjax's exporter (``speculators_io.save_speculators``), then read
by the ``speculators`` package in scripts/record_eagle3_references.py (``speculators-export``), which records
its logits beside it.  ``tests/checkpoints/test_eagle3_layout.py`` checks that the exporter still writes these bytes.

  .venv/bin/python tests/helpers/eagle3_export_fixture.py          # writes tests/data/eagle3/exported
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "eagle3" / "exported"


def head(cfg, params):
  """(EagleConfig, parameters): taps (0, 2, 4), 64 draft tokens, fc_norm, norm_before_residual; every weight
  drawn by numpy (the bytes must not depend on XLA's flags)."""
  from specjax.speculative import eagle
  ecfg = eagle.EagleConfig(cfg, (0, 2, 4), 64, layout="eagle3", norm_before_residual=True)
  rng = np.random.default_rng(9)
  ids = np.sort(rng.permutation(cfg.vocab_size)[:64])
  shapes = eagle.init_eagle3(ecfg, jax.random.PRNGKey(0), head_ids=ids)
  shapes["fuse_norm"] = np.zeros((3, cfg.d_model))

  def draw(path, x):
    name = jax.tree_util.keystr(path)
    if "head_ids" in name:
      return x
    if "norm" in name:
      return (1.0 + 0.1 * rng.standard_normal(np.shape(x))).astype(np.float32)
    return (rng.standard_normal(np.shape(x)) / np.sqrt(np.shape(x)[-1])).astype(np.float32)
  p = jax.tree_util.tree_map_with_path(draw, shapes)
  return ecfg, {**p, "embed": params["embed"]}


def write(path: Path, family_dir: Path) -> Path:
  from specjax.checkpoints import speculators_io
  from specjax.checkpoints.safetensors_loader import load_hf_dir
  cfg, params, _ = load_hf_dir(family_dir)
  ecfg, p = head(cfg, params)
  return speculators_io.save_speculators(path, ecfg, p, verifier=None)


if __name__ == "__main__":
  import tempfile
  sys.path.insert(0, str(ROOT))
  from tests.helpers.families import write_family
  d, _ = write_family(Path(tempfile.mkdtemp()), "gemma3")
  print(write(OUT, d))
