"""GGUF files of the model families against Hugging Face transformers: each family's reference checkpoint
(tests/data/hf_families/, the weights drawn again from the recorded names and seed: tests/helpers/family_weights.py)
written as llama.cpp's converter (convert_hf_to_gguf.py) writes it — its architecture name and metadata keys,
its tensor names (``gguf``'s own name map), ``1 + w`` for every Gemma norm, q/k rows permuted for ``llama``
only — loads through ``load_gguf`` into the per-token log-probabilities transformers recorded (|Δ| ≤ 1e-4).

Two departures, both named where they happen: the vocabulary is the tiny byte-level BPE every family reference
shares (tests/helpers/__init__.py; the real Gemma files carry SentencePiece, tested in
tests/checkpoints/test_gemma3_gguf.py), and the Gemma 3 reference's query_pre_attn_scalar (24, head dim 32), which
no GGUF key carries, is folded into its q-norm weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.helpers.family_weights import family_tensors
from specjax.checkpoints import load_gguf, permute_qk_llamacpp
from specjax.checkpoints.gguf_loader import open_gguf
from tests.helpers import BOS, EOS, MERGES, TOKEN_TYPES, TOKENS
from tests.helpers.families import token_logprobs

DATA = Path(__file__).parents[1] / "data" / "hf_families"

# family reference -> llama.cpp architecture
ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "mistral": "llama"}
GEMMAS = ("gemma2", "gemma3")


def _reference(name: str) -> tuple[dict, dict]:
  config = json.loads((DATA / name / "config.json").read_text())
  return config, json.loads((DATA / name / "reference.json").read_text())


def _rope(config: dict) -> dict:
  """The global layers' rope parameters (transformers 5 nests them per layer type for Gemma 3)."""
  p = config["rope_parameters"]
  return p.get("full_attention", p)


def _metadata(w: gguf.GGUFWriter, name: str, config: dict, window: bool) -> None:
  """The keys the converter's ``set_gguf_parameters`` writes for this family (TextModel's shared ones, then
  the family's), and the vocabulary as ``_set_vocab_gpt2`` writes it."""
  E = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
  w.add_block_count(config["num_hidden_layers"])
  w.add_context_length(config["max_position_embeddings"])
  w.add_embedding_length(config["hidden_size"])
  w.add_feed_forward_length(config["intermediate_size"])
  w.add_head_count(config["num_attention_heads"])
  w.add_head_count_kv(config["num_key_value_heads"])
  w.add_layer_norm_rms_eps(config["rms_norm_eps"])
  w.add_key_length(E)
  w.add_value_length(E)
  w.add_file_type(gguf.LlamaFileType.ALL_F32)
  if name != "gemma2":                           # Gemma2Model writes no rope base: llama.cpp's 10000 it is
    w.add_rope_freq_base(_rope(config)["rope_theta"])
  if name == "mistral":                          # LlamaModel
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(E)
    if window:                                   # not the converter's: a file that carries Mistral's window
      w.add_sliding_window(config["sliding_window"])
  if name in GEMMAS and window:
    w.add_sliding_window(config["sliding_window"])
  if name == "gemma2" and window:                # the soft-caps ride with the window in the "as written" file
    w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    w.add_final_logit_softcapping(config["final_logit_softcapping"])
  if name == "gemma3" and _rope(config).get("rope_type") == "linear":
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(_rope(config)["factor"])
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt2")
  w.add_token_list(TOKENS)
  w.add_token_types(TOKEN_TYPES)
  w.add_token_merges([f"{a} {b}" for a, b in MERGES])
  w.add_bos_token_id(BOS)
  w.add_eos_token_id(EOS)


def _converted(name: str, config: dict, hf_name: str, x: np.ndarray) -> np.ndarray | None:
  """One tensor as the converter's ``modify_tensors`` leaves it (None: not written)."""
  H, K = config["num_attention_heads"], config["num_key_value_heads"]
  if name == "mistral" and hf_name.endswith("q_proj.weight"):
    return permute_qk_llamacpp(x, H)
  if name == "mistral" and hf_name.endswith("k_proj.weight"):
    return permute_qk_llamacpp(x, K)
  if name in GEMMAS and hf_name == "lm_head.weight":
    return None
  if name in GEMMAS and hf_name.endswith("norm.weight"):
    x = x + np.float32(1.0)                      # Gemma's RMSNorm multiplies by 1 + w: the file holds 1 + w
  E = config["head_dim"]
  scalar = config.get("query_pre_attn_scalar", E)
  if name == "gemma3" and hf_name.endswith("q_norm.weight") and scalar != E:
    # Not the converter's: llama.cpp scales Gemma 3 queries by 1/sqrt(head dim) and no key says otherwise,
    # so the reference's 1/sqrt(24) goes into q's norm (exact: the norm scales q before a linear RoPE).
    x = x * np.float32(np.sqrt(E / scalar))
  return x


def write_family_gguf(path: Path, name: str, window: bool = True) -> tuple[Path, dict]:
  """The family reference ``name`` as a GGUF file (F32 tensors); returns (path, reference)."""
  config, ref = _reference(name)
  arch = ARCH[name]
  names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                   config["num_hidden_layers"])
  weights = family_tensors([(n, s) for n, s in ref["tensors"]], ref["seed"], ref["norm_center"])
  w = gguf.GGUFWriter(str(path), arch)
  _metadata(w, name, config, window)
  for hf_name, x in weights.items():
    x = _converted(name, config, hf_name, x)
    if x is not None:
      w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), np.ascontiguousarray(x, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path, ref


@pytest.mark.parametrize("name", sorted(ARCH))
def test_logprobs_equal_transformers(tmp_path, name):
  path, ref = write_family_gguf(tmp_path / f"{name}.gguf", name)
  cfg, params, tok = load_gguf(path)
  assert tok.vocab_size == cfg.vocab_size == len(TOKENS)
  np.testing.assert_allclose(token_logprobs(params, cfg, ref["token_ids"]), ref["logprobs"], atol=1e-4, rtol=0)


def test_configs_read_per_architecture(tmp_path):
  """What each file says, and what llama.cpp assumes where it is silent."""
  qwen3 = open_gguf(write_family_gguf(tmp_path / "qwen3.gguf", "qwen3")[0]).cfg
  assert (qwen3.family, qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim) == ("qwen3", True, False, 32)
  assert qwen3.layer_windows == () and not qwen3.sandwich_norms and qwen3.activation == "silu"
  assert qwen3.rope_theta == 1e6 and qwen3.norm_eps == 1e-6 and qwen3.tie_embeddings

  gemma2 = open_gguf(write_family_gguf(tmp_path / "gemma2.gguf", "gemma2")[0]).cfg
  assert (gemma2.family, gemma2.layer_windows, gemma2.attn_softcap, gemma2.final_softcap) == (
      "gemma2", (16, 0, 16, 0), 2.0, 3.0)
  assert gemma2.sandwich_norms and not gemma2.qk_norm and gemma2.activation == "gelu_tanh"
  assert gemma2.embed_scale == 8.0 and gemma2.query_scale == 16 ** -0.5 and gemma2.local_rope_theta is None
  assert gemma2.rope_theta == 10000.0 and gemma2.rope_scaling is None

  gemma3 = open_gguf(write_family_gguf(tmp_path / "gemma3.gguf", "gemma3")[0]).cfg
  assert gemma3.layer_windows == (16, 16, 16, 16, 16, 0, 16) and gemma3.local_rope_theta == 10000.0
  assert gemma3.rope_scaling.kind == "linear" and gemma3.rope_scaling.factor == 8.0
  assert gemma3.attn_softcap is None and gemma3.final_softcap is None and gemma3.query_scale == 32 ** -0.5

  mistral = open_gguf(write_family_gguf(tmp_path / "mistral.gguf", "mistral")[0]).cfg
  assert mistral.family == "llama" and mistral.layer_windows == (16, 16, 16) and not mistral.tie_embeddings


def test_silent_files_take_llama_cpps_defaults(tmp_path):
  """A gemma2 file without soft-caps or window: llama.cpp's 50, 30 and 4096 (a window past the 256-token
  context: none).  A llama file without a window (what llama.cpp's converter writes for Mistral): none."""
  gemma2 = open_gguf(write_family_gguf(tmp_path / "gemma2.gguf", "gemma2", window=False)[0]).cfg
  assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.layer_windows) == (50.0, 30.0, ())
  mistral = open_gguf(write_family_gguf(tmp_path / "mistral.gguf", "mistral", window=False)[0]).cfg
  assert mistral.layer_windows == ()
