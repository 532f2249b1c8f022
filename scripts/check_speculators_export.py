"""An EAGLE-3 head trained by specjax and exported (``train_eagle.architecture = 'eagle3'``), read by the
``speculators`` package beside the real target: its draft logits, from the package's model on transformers'
target, against specjax's, from specjax's engine forward on specjax's target — both ends whole.

  # 1. in the speculators venv (see scripts/record_eagle3_references.py): the target from its GGUF (transformers
  #    dequantizes it) saved where the package's loader reads its verifier, the head loaded, logits recorded
  HF_HUB_OFFLINE=1 /tmp/specref/bin/python scripts/check_speculators_export.py record RUN/drafter \\
      ~/.cache/specjax/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/speculators_check.json
  # 2. in specjax's venv: the same tokens through specjax, the difference printed
  .venv/bin/python scripts/check_speculators_export.py compare RUN/drafter smollm2-135m /tmp/speculators_check.json

Teacher-forced as the package trains (step i reads the text's token i + 1 places on), three steps, every
position of a ~100-token text; printed: the largest |Δ logit| per step and the share of equal top-1 drafts.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

TEXT = ("The quick brown fox jumps over the lazy dog. Speculative decoding lets a small drafter propose "
        "several tokens that the large model then checks in a single forward pass, so that the output is "
        "exactly what the large model would have written, only sooner. def add(a, b):\n    return a + b\n")
STEPS = 3


def record(drafter_dir: str, gguf: str, out: str) -> None:
  import torch
  import transformers
  from speculators.models.eagle3 import Eagle3DraftModel
  gguf = Path(gguf).expanduser()
  tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
  target = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()
  tmp = Path(tempfile.mkdtemp())
  config = target.config                        # a plain copy of the dequantized model: GGUF ones do not save
  if hasattr(config, "quantization_config"):
    del config.quantization_config
  plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  plain.load_state_dict(target.state_dict())
  plain.save_pretrained(tmp / "target")
  config = json.loads((Path(drafter_dir) / "config.json").read_text())
  shutil.copytree(drafter_dir, tmp / "drafter")
  (tmp / "drafter" / "config.json").write_text(json.dumps(
      {**config, "transformer_layer_config": {**config["transformer_layer_config"], "attn_implementation": "eager"},
       "speculators_config": {**config["speculators_config"],
                              "verifier": {"name_or_path": str(tmp / "target"),
                                           "architectures": ["LlamaForCausalLM"]}}}))
  drafter = Eagle3DraftModel.from_pretrained(tmp / "drafter").eval()
  ids = tok(TEXT)["input_ids"]
  x = torch.tensor([ids])
  steps = []
  hook = drafter.lm_head.register_forward_hook(lambda m, i, o: steps.append(o.detach().clone()))
  with torch.no_grad():
    hs = target(input_ids=x, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in config["eagle_aux_hidden_state_layer_ids"]], -1)
    n = x.shape[1] - 1
    drafter(hidden_states=aux[:, :n], input_ids=x[:, 1:n + 1], document_ids=torch.zeros(1, n, dtype=torch.long),
            ttt_steps=STEPS)
  hook.remove()
  Path(out).write_text(json.dumps({"token_ids": ids, "logits": [s[0].tolist() for s in steps],
                                   "torch": torch.__version__, "transformers": transformers.__version__}))
  print(f"{len(ids)} tokens, {len(steps)} steps -> {out}")


def compare(drafter_dir: str, model: str, recorded: str) -> None:
  import jax.numpy as jnp
  import numpy as np
  from specjax import api
  from specjax.checkpoints import drafter_io
  from specjax.models import decoder as M
  from specjax.models.kv_cache import init_cache
  from specjax.training import eagle_train
  rec = json.loads(Path(recorded).read_text())
  m = api.load(model)
  ecfg, dp, _ = drafter_io.load_drafter(drafter_dir, m.cfg, m.params, m.tokenizer, model)
  ids = jnp.asarray([rec["token_ids"]])
  T = ids.shape[1]
  feats = M.forward(m.params, m.cfg, ids, jnp.arange(T)[None], init_cache(m.cfg, 1, T),
                    feature_layers=ecfg.feature_layers).features
  batch = {"tokens": ids, "pos": jnp.arange(T)[None], "seg": jnp.ones((1, T), jnp.int32), "feats": feats}
  logits_S, _ = eagle_train.train_forward(dp, ecfg, batch, unroll=STEPS)
  for i in range(STEPS):
    ref = np.asarray(rec["logits"][i])                     # row t: the pair (feature t, token t + 1 + i)
    got = np.asarray(logits_S[i, 0, 1 + i:])[:len(ref) - i]
    ref = ref[:len(got)]
    top = float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1)))
    print(f"step {i + 1}: {len(got)} positions, max |Δ logit| {np.abs(got - ref).max():.2e}, "
          f"top-1 equal {top:.3f} (logits up to {np.abs(ref).max():.1f})")


if __name__ == "__main__":
  {"record": record, "compare": compare}[sys.argv[1]](*sys.argv[2:])
