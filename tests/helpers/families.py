"""The model families' reference checkpoints (tests/data/hf_families/: the recorded config, the weights drawn
again from the recorded names and seed, the tiny tokenizer) written as a Hugging Face directory, and a
sequence's per-token log-probabilities: shared by the families' tests and the published drafter layouts' tests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from specjax.models import decoder as M
from specjax.models.kv_cache import init_cache
from tests.helpers.family_weights import family_tensors

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_families"


def write_family(tmp: Path, name: str, config_edit=None) -> tuple[Path, dict]:
  """The recorded config (optionally edited), the weights drawn from the recorded names, the tokenizer."""
  ref = json.loads((DATA / name / "reference.json").read_text())
  d = tmp / name
  d.mkdir(parents=True)
  config = json.loads((DATA / name / "config.json").read_text())
  if config_edit is not None:
    config = config_edit(config)
  (d / "config.json").write_text(json.dumps(config))
  weights = family_tensors([(n, s) for n, s in ref["tensors"]], ref["seed"], ref["norm_center"])
  save_file(weights, str(d / "model.safetensors"))
  shutil.copy(DATA / "tokenizer.json", d / "tokenizer.json")
  return d, ref


def token_logprobs(params, cfg, ids) -> np.ndarray:
  T = len(ids)
  out = M.forward(params, cfg, jnp.asarray([ids]), jnp.arange(T)[None], init_cache(cfg, 1, T + 8))
  logp = np.asarray(out.logits[0].astype(jnp.float32))
  logp = logp - np.log(np.exp(logp - logp.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logp.max(-1, keepdims=True)
  return logp[np.arange(T - 1), ids[1:]]
