"""What a drafter directory is, from its config.json alone (``specjax models --draft DIR``): the layout, the
``--drafter`` kind that reads it, and what it expects of its target (width, vocabulary, the target layers it
reads, how deep it drafts).  ``check`` puts it against a target's config (no weights read) and raises the
loader's own one-line refusal on a mismatch.
"""
from __future__ import annotations

from pathlib import Path

from specjax.checkpoints import weights_file
from specjax.errors import SpecjaxError


def _eagle3(path: Path, config: dict) -> dict:
  from specjax.checkpoints import eagle3_io
  layout = eagle3_io.layout_of(config)
  layer = config.get("transformer_layer_config") or {} if layout == "speculators" else config
  ids = config.get("eagle_aux_hidden_state_layer_ids")
  if layout == "specforge" and ids is None:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  meaning = "hidden-state indices (i = output of layer i - 1)" if layout == "speculators" else "layer outputs"
  verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
  return {"layout": f"eagle3 ({layout})", "drafter": "eagle", "hidden_size": layer.get("hidden_size"),
          "vocab_size": layer.get("vocab_size"), "draft_vocab_size": config.get("draft_vocab_size"),
          "reads": f"{ids if ids is not None else 'the default three'} ({meaning})",
          "target": verifier or "not recorded"}


def _dflash(path: Path, config: dict) -> dict:
  from specjax.checkpoints import dflash_io
  dcfg = config.get("dflash_config") or {}
  return {"layout": f"dflash ({dflash_io.layout_of(config)})", "drafter": "dflash",
          "hidden_size": config.get("hidden_size") or (config.get("transformer_layer_config") or {}).get("hidden_size"),
          "vocab_size": config.get("vocab_size"), "block_size": dflash_io.block_size_of(config),
          "reads": str(dcfg.get("target_layer_ids", config.get("aux_hidden_state_layer_ids", "the default"))),
          "target": "not recorded"}


def _medusa(path: Path, config: dict) -> dict:
  return {"layout": "medusa-1", "drafter": "medusa", "heads": config.get("medusa_num_heads"),
          "blocks": config.get("medusa_num_layers"), "reads": "the final hidden state",
          "target": config.get("base_model_name_or_path") or "not recorded"}


def _eagle1(path: Path, config: dict) -> dict:
  return {"layout": "eagle1 (EAGLE-1/2)", "drafter": "eagle", "hidden_size": config.get("hidden_size"),
          "vocab_size": config.get("vocab_size"), "reads": "the final hidden state", "target": "not recorded"}


def _specjax(path: Path, config: dict) -> dict:
  t = config.get("target", {})
  return {"layout": "specjax", "drafter": "eagle-parallel" if config.get("parallel_positions") else "eagle",
          "hidden_size": t.get("d_model"), "vocab_size": t.get("vocab_size"),
          "draft_vocab_size": config.get("vocab_size"),
          "reads": str(config.get("feature_layers") or "the final hidden state"), "target": t.get("name")}


def describe(path) -> dict:
  """A dict of what the directory holds (config.json only); one line if it is not a drafter's."""
  from specjax.checkpoints import dflash_io, drafter_io, eagle1_io, eagle3_io, medusa_io
  path = Path(path).expanduser()
  config = weights_file.read_config(path)
  if config is None:
    raise SpecjaxError(f"{path}: no readable config.json (a drafter directory holds one)")
  for is_layout, what in ((dflash_io.is_dflash_dir, _dflash), (eagle3_io.is_eagle3_dir, _eagle3),
                          (medusa_io.is_medusa_dir, _medusa), (eagle1_io.is_eagle1_dir, _eagle1)):
    if is_layout(path):
      return {"path": str(path), **what(path, config)}
  return {"path": str(path), **_specjax(path, drafter_io.read_config(path))}


def check(path, target_cfg, target_name: str = "") -> None:
  """The drafter's config against ``target_cfg`` (no weights read): the loader's own one-line refusal."""
  from specjax.checkpoints import dflash_io, eagle1_io, eagle3_io
  path = Path(path).expanduser()
  info = describe(path)
  name = target_name or target_cfg.name
  if info["layout"].startswith("eagle3"):
    eagle3_io.describe(path, target_cfg, name)
  elif info["layout"].startswith("dflash"):
    dflash_io.describe(path, target_cfg, name)
  elif info["layout"].startswith("eagle1"):
    eagle1_io._check_config(path, weights_file.read_config(path), target_cfg)
  elif info["layout"] == "specjax" and (info["hidden_size"], info["vocab_size"]) != (target_cfg.d_model,
                                                                                     target_cfg.vocab_size):
    raise SpecjaxError(f"drafter {path} was trained for '{info['target']}' (vocabulary {info['vocab_size']}, "
                       f"width {info['hidden_size']}), the target '{name}' has {target_cfg.vocab_size} and "
                       f"{target_cfg.d_model}: use a drafter trained for this target")
