"""``specjax run CONFIG.gin``: bind an experiment with gin, run it, and write a run directory.

gin is confined to this entry point: experiments (in the top-level ``experiments`` package) are plain
functions; here they are registered as gin configurables under their short names.

A run directory holds config.gin (the resolved config), results.json, results.csv and PNG plots.
"""
from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Callable

import gin

from specjax.eval import report
from specjax.errors import ConfigError

_CONFIGURABLE_RUN: Callable | None = None
_CONFIGURABLE_TRAIN: Callable | None = None


def experiment_registry() -> dict[str, Callable]:
  from experiments import EXPERIMENTS
  return EXPERIMENTS


def training_registry() -> dict[str, Callable]:
  from specjax.training.medusa_train import train_medusa
  from specjax.training.recipes import distill_losses, train_draft_model, train_eagle
  return {"train_eagle": train_eagle, "train_draft_model": train_draft_model, "distill_losses": distill_losses,
          "train_medusa": train_medusa}


def _register() -> None:
  global _CONFIGURABLE_RUN, _CONFIGURABLE_TRAIN
  if _CONFIGURABLE_RUN is not None:
    return
  for name, fn in {**experiment_registry(), **training_registry()}.items():
    gin.external_configurable(fn, name=name)
  _CONFIGURABLE_RUN = gin.external_configurable(run_settings, name="run")
  _CONFIGURABLE_TRAIN = gin.external_configurable(train_settings, name="train")


def train_settings(recipe: Callable = gin.REQUIRED, name: str | None = None):
  """What a training config binds at the top: ``train.recipe = @train_eagle`` and an optional run name."""
  return recipe, name


def train_from_files(config_files: list[str], bindings: list[str], run_dir: str | None, resume: bool,
                     mesh: str | None = None):
  """``specjax train``: the recipe bound in the config, run into ``run_dir`` (default runs/<name>); the
  resolved config is saved there as config.gin.  ``mesh`` ('DATAxMODEL', --mesh) overrides the recipe's."""
  parse(config_files, bindings)
  try:
    recipe, name = _CONFIGURABLE_TRAIN()
  except Exception as e:
    raise ConfigError(f"invalid gin config: {e} (bind train.recipe = @train_eagle)") from e
  name = name or Path(config_files[0]).stem
  out_dir = Path(run_dir) if run_dir else Path("runs") / name
  summary = recipe(run_dir=str(out_dir), resume=resume, **({"mesh": mesh} if mesh else {}))
  (out_dir / "config.gin").write_text(gin.config_str(), encoding="utf-8")
  return summary


def run_settings(experiment: Callable = gin.REQUIRED, name: str | None = None):
  """What a config binds at the top: ``run.experiment = @quickstart`` and an optional run name."""
  return experiment, name


def parse(config_files: list[str], bindings: list[str]) -> None:
  _register()
  gin.clear_config()
  for f in config_files:
    if not Path(f).is_file():
      raise ConfigError(f"config file not found: {f}")
  try:
    gin.parse_config_files_and_bindings(config_files, bindings, finalize_config=True)
  except Exception as e:  # gin raises ValueError/KeyError/SyntaxError variants for unknown bindings
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(f"invalid gin config: {first} — check the binding names "
                      f"(experiments: {', '.join(sorted(experiment_registry()))}; training: "
                      f"{', '.join(sorted(training_registry()))})") from e


def run_from_files(config_files: list[str], bindings: list[str], out: str | None, log=print):
  parse(config_files, bindings)
  try:
    experiment, name = _CONFIGURABLE_RUN()
  except Exception as e:
    raise ConfigError(f"invalid gin config: {e} (bind run.experiment = @<experiment>)") from e
  name = name or Path(config_files[0]).stem
  out_dir = Path(out) if out else Path("runs") / f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
  out_dir.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  result = experiment(log=log)
  from specjax.measure import provenance
  result = {"experiment": name, "wall_s": time.perf_counter() - t0, "machine": provenance.describe(), **result}
  write_run(out_dir, result, gin.config_str())
  from experiments import PLOTTERS
  plotter = next((f for n, f in PLOTTERS.items() if getattr(experiment, "__name__", "") == n), None)
  if plotter is not None:
    plotter(result, out_dir)
  result["run_dir"] = str(out_dir)
  return result, out_dir


def write_run(out_dir: Path, result: dict, config_str: str) -> None:
  (out_dir / "config.gin").write_text(config_str, encoding="utf-8")
  (out_dir / "results.json").write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
  report.write_csv(result.get("rows", []), out_dir / "results.csv")
  for plot in result.get("plots", []):
    report.make_plot(result["rows"], plot, out_dir)
