"""Record Medusa-1 heads as the ``medusa`` package (``medusa-llm`` 0.1 on PyPI) builds and saves them, and their
logits, for tests/checkpoints/test_medusa.py.

The base model is the tiny Llama of tests/data/hf_families/llama (its weights drawn by tests/helpers/family_weights.py,
loaded into transformers' LlamaForCausalLM).  The heads are built exactly as ``medusa.model.medusa_model.
MedusaModel`` builds them (``nn.Sequential(*([ResBlock(D)] * R), nn.Linear(D, V, bias=False))`` per head, the
package's own ``ResBlock``), given random weights (ResBlock starts at zero: the identity), and saved with
their ``state_dict`` as ``medusa_lm_head.safetensors`` beside a Medusa ``config.json``.  Recorded, in float32:
every head's logits at 8 positions of the family's 96-token text (from the base model's final hidden states,
``MedusaModel.forward``'s input) and every head's top-1 token at all 96.  Into tests/data/medusa/<variant>/.

  python -m venv /tmp/hfref && /tmp/hfref/bin/pip install torch==2.13.0 transformers safetensors
  /tmp/hfref/bin/pip install --no-deps medusa-llm==0.1
  /tmp/hfref/bin/python scripts/record_medusa_reference.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from medusa.model.medusa_model import ResBlock
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from hf_family_target import family_target  # noqa: E402

OUT = ROOT / "tests" / "data" / "medusa"
VARIANTS = {"k3r1": (3, 1), "k2r2": (2, 2)}     # heads, residual blocks per head
POSITIONS = [10, 20, 30, 40, 50, 60, 70, 95]


def main() -> None:
  model, ids = family_target("llama")
  D, V = model.config.hidden_size, model.config.vocab_size
  with torch.no_grad():
    hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]     # [T, D], final-normed
  for seed, (name, (K, R)) in enumerate(VARIANTS.items()):
    torch.manual_seed(100 + seed)
    heads = nn.ModuleList([nn.Sequential(*([ResBlock(D)] * R), nn.Linear(D, V, bias=False)) for _ in range(K)])
    with torch.no_grad():
      for pname, p in heads.named_parameters():
        p.copy_(torch.randn_like(p) * (0.1 if pname.endswith("bias") else D ** -0.5))
      logits = torch.stack([h(hidden) for h in heads])                            # [K, T, V]
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().clone() for k, v in heads.state_dict().items()}, str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": K, "medusa_num_layers": R,
                                               "base_model_name_or_path": "tests/data/hf_families/llama"}, indent=1))
    (d / "reference.json").write_text(json.dumps({
        "medusa": "medusa-llm 0.1", "transformers": transformers.__version__, "torch": torch.__version__,
        "positions": POSITIONS, "logits": logits[:, POSITIONS].tolist(),
        "top1": logits.argmax(-1).tolist()}))
    print(name, K, R, sorted(heads.state_dict())[:4], "...")


if __name__ == "__main__":
  main()
