"""Published checkpoints saved as torch pickles (``.pt``, ``pytorch_model.bin``): specjax never unpickles a file
(it would run code from it); the refusal names the one-line conversion to safetensors, to run where torch is
installed."""
from __future__ import annotations

from pathlib import Path


def conversion_advice(pickled: Path, safetensors: Path) -> str:
  """The one-line refusal of ``pickled``, with the command that writes ``safetensors`` from it (tensors cloned:
  a state dict may share storage between keys, which safetensors refuses)."""
  return (f"{pickled}: a pickled torch file, which specjax does not unpickle; convert it once where torch is "
          f"installed: python -c \"import torch, safetensors.torch as s; s.save_file({{k: v.clone() for k, v in "
          f"torch.load('{pickled}', map_location='cpu').items()}}, '{safetensors}')\"")
