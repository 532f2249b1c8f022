"""Record an EAGLE-1/2 drafter as the ``eagle`` package (``eagle-llm`` 1.2.1 on PyPI) builds and saves it, and
its logits, for tests/checkpoints/test_eagle1_layout.py.

The target is the tiny Llama of tests/data/hf_families/llama (weights drawn by tests/helpers/family_weights.py, loaded
into transformers' LlamaForCausalLM).  The drafter is the package's own ``eagle.model.cnets.Model`` (one
decoder layer without an input norm, ``fc`` with a bias over [embedding; feature]) on an ``EConfig`` of the
target's sizes, its embedding the target's, its other weights random; it is saved with ``state_dict`` as
``model.safetensors`` beside the EConfig's ``config.json``.  Recorded, float32: for prefixes of the family's
96-token text, the drafter's logits (through the target's head) at the prefix's last position — depth 1, from
the target's features — and at depth 2, feeding its own output hidden state with its top-1 token, as
``Model.generate`` does.  Into tests/data/eagle1/.

  /tmp/hfref/bin/pip install --no-deps eagle-llm==1.2.1     # beside torch and transformers
  /tmp/hfref/bin/python scripts/record_eagle1_reference.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from eagle.model.cnets import Model
from eagle.model.configs import EConfig
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from hf_family_target import family_target  # noqa: E402

OUT = ROOT / "tests" / "data" / "eagle1"
PREFIXES = [8, 23, 40, 64, 90]


def main() -> None:
  base, ids = family_target("llama")
  c = base.config
  econfig = EConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                    max_position_embeddings=c.max_position_embeddings, pad_token_id=0, hidden_act="silu")
  econfig.rope_scaling = None      # transformers 5 fills in a default dict the package's code does not read
  torch.manual_seed(7)
  drafter = Model(econfig, bias=True).eval()
  with torch.no_grad():
    for name, p in drafter.named_parameters():
      if name == "embed_tokens.weight":
        p.copy_(base.model.embed_tokens.weight)
      elif name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(torch.randn_like(p) * (0.1 if name.endswith("bias") else p.shape[-1] ** -0.5))
    x = torch.tensor([ids])
    feats = base.model(input_ids=x).last_hidden_state               # [1, T, D]: the target's final hidden
    head = base.lm_head
    cases = []
    for n in PREFIXES:
      # Feature f_i with token x_{i+1} (i < n - 1): the drafter's last row predicts x_{n+1}'s... after x_n.
      out, past = drafter(feats[:, :n - 1], input_ids=x[:, 1:n], use_cache=True)
      logits1 = head(out[:, -1])[0]
      token = int(torch.argmax(logits1))
      out2, _ = drafter(out[:, -1:], input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
      logits2 = head(out2[:, -1])[0]
      cases.append({"prefix": n, "depth1_logits": logits1.tolist(), "depth1_top1": token,
                    "depth2_logits": logits2.tolist(), "depth2_top1": int(torch.argmax(logits2))})
  OUT.mkdir(parents=True, exist_ok=True)
  save_file({k: v.detach().clone() for k, v in drafter.state_dict().items()}, str(OUT / "model.safetensors"))
  econfig.save_pretrained(OUT)
  (OUT / "reference.json").write_text(json.dumps({"eagle": "eagle-llm 1.2.1", "torch": torch.__version__,
                                                  "transformers": transformers.__version__, "cases": cases}))
  print(sorted(drafter.state_dict()), [(c["prefix"], c["depth1_top1"], c["depth2_top1"]) for c in cases])


if __name__ == "__main__":
  main()
