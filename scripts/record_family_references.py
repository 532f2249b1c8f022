"""Record Hugging Face transformers' outputs for one small random checkpoint per model family, the reference
that tests/models/test_families.py holds specjax to.

For each family below, transformers builds the model from that family's own config class (sizes chosen so
every feature is exercised: windows shorter than the text, llama3 / yarn / linear rope scaling, tied and
untied heads, q/k norms, sandwich norms, soft-caps, a query scale other than 1/sqrt(E)), loads weights drawn
by ``tests/helpers/family_weights.py`` from the model's own tensor names and shapes, and records, in float32 with eager
attention:
  * the config.json transformers writes (``save_pretrained``: transformers 5 spells rope as rope_parameters);
  * the tensor names and shapes (the test draws the same weights from them);
  * per-token log-probabilities of a 96-token text, and the greedy 16-token continuation of its first 24.
Into tests/data/hf_families/<family>/{config.json,reference.json}.  The text is tokenized with
tests/data/hf_families/tokenizer.json (the tests' tiny byte-level BPE vocabulary).

Run with a Python that has transformers, torch and tokenizers (not a specjax dependency):
  python -m venv /tmp/hfref && /tmp/hfref/bin/pip install torch==2.13.0 transformers tokenizers
  /tmp/hfref/bin/python scripts/record_family_references.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))   # the module alone (numpy only), not the tests package
from family_weights import family_tensors  # noqa: E402

OUT = ROOT / "tests" / "data" / "hf_families"
TEXT = ("The old lighthouse keeper counted ships each night, writing their names in a blue ledger; "
        "by spring the ledger held 412 names, three of them twice, and one he could not read at all.")
N_TOKENS, PREFIX, NEW = 96, 24, 16
SIZES = dict(vocab_size=270, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)

FAMILIES = {
    # Llama 3.2: tied embeddings, llama3 rope scaling (a short original context so it bites at 96 tokens).
    "llama": (transformers.LlamaConfig, dict(
        num_hidden_layers=3, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))),
    # Llama with linear position interpolation, untied head.
    "llama-linear": (transformers.LlamaConfig, dict(
        num_hidden_layers=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    # Mistral v0.1: every layer windowed (16 positions, the text is 96).
    "mistral": (transformers.MistralConfig, dict(
        num_hidden_layers=3, sliding_window=16, tie_word_embeddings=False, head_dim=16)),
    # Qwen2.5 with yarn and its sliding window on the layers from max_window_layers on.
    "qwen2": (transformers.Qwen2Config, dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1,
        tie_word_embeddings=False, rope_parameters=dict(
            rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=64))),
    # Qwen3 (dense): q/k norms, head_dim * heads != hidden, tied head.
    "qwen3": (transformers.Qwen3Config, dict(
        num_hidden_layers=3, head_dim=32, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # Gemma 3 (text): 5 local layers (window 16, base 10k) per global one (base 1M, linear x8 as the 4B+
    # models have), q/k norms, sandwich norms, GeGLU, sqrt(D) embedding scale, query_pre_attn_scalar != E.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=7, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
        rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Gemma 2: alternating local/global layers, attention and final logit soft-caps (small, so they bite).
    "gemma2": (transformers.Gemma2Config, dict(
        num_hidden_layers=4, head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
}
GEMMA = ("gemma3", "gemma2")


def record(name: str, cls, kwargs: dict, ids: list[int], seed: int) -> None:
  config = cls(**{**SIZES, **kwargs})
  config._attn_implementation = "eager"
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32,
                                                        attn_implementation="eager").eval()
  state = model.state_dict()
  names_shapes = [(k, list(v.shape)) for k, v in state.items()
                  if not (config.tie_word_embeddings and k == "lm_head.weight")]
  weights = family_tensors(names_shapes, seed, norm_center=0.0 if name in GEMMA else 1.0)
  missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()},
                                              strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  with torch.no_grad():
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
    token_logp = logp[:-1].gather(1, x[0, 1:, None])[:, 0].tolist()
    out = model.generate(x[:, :PREFIX], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                         pad_token_id=0, eos_token_id=None)
  d = OUT / name
  d.mkdir(parents=True, exist_ok=True)
  config.architectures = [type(model).__name__]    # as model.save_pretrained would write it
  config.save_pretrained(d)
  ref = {"transformers": transformers.__version__, "torch": torch.__version__, "seed": seed,
         "norm_center": 0.0 if name in GEMMA else 1.0, "tensors": names_shapes, "token_ids": ids,
         "logprobs": token_logp, "prefix": PREFIX, "greedy": out[0, PREFIX:].tolist()}
  (d / "reference.json").write_text(json.dumps(ref))
  print(f"{name:13s} {type(model).__name__:22s} mean logp {np.mean(token_logp):.4f} greedy {ref['greedy'][:6]}...")


def main() -> None:
  tok = tokenizers.Tokenizer.from_file(str(OUT / "tokenizer.json"))
  ids = tok.encode(TEXT).ids
  assert len(ids) >= N_TOKENS, len(ids)
  ids = ids[:N_TOKENS]
  for seed, (name, (cls, kwargs)) in enumerate(FAMILIES.items()):
    record(name, cls, kwargs, ids, seed)


if __name__ == "__main__":
  main()
