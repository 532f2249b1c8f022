"""A family reference checkpoint (tests/data/hf_families/<family>) as a transformers model, for the scripts that
record drafter references against it (run beside torch and transformers, not specjax)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))   # the module alone (numpy only), not the tests package
from family_weights import family_tensors  # noqa: E402


def family_target(name: str = "llama"):
  """(the family's transformers model in float32 with the recorded weights, eval mode; the recorded token ids)."""
  d = ROOT / "tests" / "data" / "hf_families" / name
  ref = json.loads((d / "reference.json").read_text())
  model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d),
                                                        dtype=torch.float32).eval()
  weights = family_tensors([(n, s) for n, s in ref["tensors"]], ref["seed"], ref["norm_center"])
  model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
  return model, ref["token_ids"]


def draft_vocab(V: int, Vd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
  """A draft vocabulary of Vd target ids (ascending), as EAGLE-3 and speculators' DFlash store it: (d2t
  offsets [Vd]: target id = draft id + d2t[draft id], t2d mask [V])."""
  g = torch.Generator().manual_seed(seed)
  ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
  t2d = torch.zeros(V, dtype=torch.bool)
  t2d[ids] = True
  return ids - torch.arange(Vd), t2d
