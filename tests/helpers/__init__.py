"""What many test files share: a tiny checkpoint (a byte-level BPE vocabulary, random weights, written as a
GGUF file or a Hugging Face directory), and the CLI run as a process or in this one.

Every helper of the tests lives in this package (no test file imports another): this module, and beside it
``engine`` (the tiny target of the engine tests), ``lossless`` (the micro model and the chi-square test of
losslessness), ``trees``, ``eagle``, ``quant`` and ``families`` (what several test files of those subjects
share), ``reference`` (a numpy forward), ``family_weights``, ``compile_counter``, ``config_keys`` (the config
keys recorder: ``python -m tests.helpers.config_keys``), ``isa_outputs``, ``eagle3_export_fixture``, and the
scripts that tests run in processes of their own (``*_child.py``).  Shared fixtures: tests/conftest.py and the
folders' conftest.py."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from specjax.checkpoints import Tokenizer, permute_qk_llamacpp
from specjax.models import decoder as M
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.kv_cache import init_cache

ROOT = Path(__file__).resolve().parents[2]

jax.config.update("jax_enable_x64", False)

# ----------------------------------------------------------------------------------------------------------
# A tiny byte-level BPE vocabulary: 3 control tokens, the 256 byte symbols, a few merges.

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"),
          ("o", "r"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES]
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS))
BOS, EOS, IM_END = 1, 2, 2
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CFG = ModelConfig(name="tiny-ckpt", vocab_size=len(TOKENS), num_layers=2, d_model=32, num_heads=4,
                  num_kv_heads=2, head_dim=8, ffn_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                  max_position=256, bos_token_id=BOS, eos_token_ids=(EOS,))
PROMPT = [1, 40, 77, 100, 5, 200, 263, 7]


def random_hf_params(cfg: ModelConfig, seed: int = 0) -> dict:
  """Random weights in Hugging Face naming and [out, in] orientation (numpy float32)."""
  rng = np.random.default_rng(seed)
  D, H, K, E, F, V = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim,
                      cfg.vocab_size)

  def w(*shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

  def norm(n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  layers = []
  for _ in range(cfg.num_layers):
    layer = dict(q_proj=w(H * E, D), k_proj=w(K * E, D), v_proj=w(K * E, D), o_proj=w(D, H * E),
                 gate_proj=w(F, D), up_proj=w(F, D), down_proj=w(D, F), input_layernorm=norm(D),
                 post_attention_layernorm=norm(D))
    if cfg.qkv_bias:
      layer.update(q_bias=0.1 * w(H * E), k_bias=0.1 * w(K * E), v_bias=0.1 * w(K * E))
    layers.append(layer)
  return dict(embed=rng.standard_normal((V, D)).astype(np.float32), final_norm=norm(D), layers=layers,
              lm_head=None if cfg.tie_embeddings else w(V, D))


def reference_params(cfg: ModelConfig, hf: dict):
  return M.params_from_hf_layout(cfg, hf["embed"], hf["final_norm"], hf["layers"], hf["lm_head"])


def logits_of(params, cfg: ModelConfig, tokens=PROMPT) -> np.ndarray:
  cache = init_cache(cfg, 1, 16)
  out = M.forward(params, cfg, jnp.asarray([tokens]), jnp.arange(len(tokens))[None], cache)
  return np.asarray(out.logits)


# ----------------------------------------------------------------------------------------------------------
# Writers


def q8_roundtrip(x: np.ndarray) -> np.ndarray:
  return gguf.dequantize(gguf.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)


def add_gguf_sizes(w: "gguf.GGUFWriter", cfg: ModelConfig) -> None:
  """The size and RoPE-base keys every architecture's GGUF header carries (llama.cpp's names)."""
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position)
  w.add_embedding_length(cfg.d_model)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)


def write_gguf(path: Path, cfg: ModelConfig, hf: dict, arch: str = "llama", permute: bool = True,
               quantized: tuple[str, ...] = (), rope_freqs: np.ndarray | None = None,
               pre: str = "gpt2", quant_type: str = "Q8_0") -> Path:
  """A GGUF file laid out as llama.cpp's converter writes it (q/k rows permuted for llama); the tensors
  named in ``quantized`` stored as ``quant_type`` (any type ``gguf.quantize`` writes)."""
  w = gguf.GGUFWriter(str(path), arch)
  add_gguf_sizes(w, cfg)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(TOKENS)
  w.add_token_types(TOKEN_TYPES)
  w.add_token_merges([f"{a} {b}" for a, b in MERGES])
  w.add_bos_token_id(BOS)
  w.add_eos_token_id(EOS)
  w.add_add_bos_token(False)
  w.add_chat_template(CHAT_TEMPLATE)

  def add(name, x):
    if name in quantized:
      qt = getattr(gguf.GGMLQuantizationType, quant_type)
      w.add_tensor(name, gguf.quantize(np.ascontiguousarray(x, dtype=np.float32), qt), raw_dtype=qt)
    else:
      w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))

  add("token_embd.weight", hf["embed"])
  add("output_norm.weight", hf["final_norm"])
  if hf["lm_head"] is not None:
    add("output.weight", hf["lm_head"])
  if rope_freqs is not None:
    add("rope_freqs.weight", rope_freqs.astype(np.float32))
  names = dict(q_proj="attn_q.weight", k_proj="attn_k.weight", v_proj="attn_v.weight",
               o_proj="attn_output.weight", gate_proj="ffn_gate.weight", up_proj="ffn_up.weight",
               down_proj="ffn_down.weight", input_layernorm="attn_norm.weight",
               post_attention_layernorm="ffn_norm.weight", q_bias="attn_q.bias", k_bias="attn_k.bias",
               v_bias="attn_v.bias")
  for i, layer in enumerate(hf["layers"]):
    for key, x in layer.items():
      if permute and key in ("q_proj", "q_bias"):
        x = permute_qk_llamacpp(x, cfg.num_heads)
      if permute and key in ("k_proj", "k_bias"):
        x = permute_qk_llamacpp(x, cfg.num_kv_heads)
      add(f"blk.{i}.{names[key]}", x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def build_hf_tokenizer() -> tokenizers.Tokenizer:
  vocab = {t: i for i, t in enumerate(TOKENS)}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
  return tok


def hf_config_json(cfg: ModelConfig, arch: str, rope_scaling: dict | None = None) -> dict:
  return {"architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_dim,
          "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps, "rope_scaling": rope_scaling,
          "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_position,
          "bos_token_id": BOS, "eos_token_id": [EOS, 0], "head_dim": cfg.head_dim}


def write_hf_dir(path: Path, cfg: ModelConfig, hf: dict, arch: str = "LlamaForCausalLM",
                 rope_scaling: dict | None = None) -> Path:
  """config.json, two safetensors shards with an index, tokenizer.json and tokenizer_config.json."""
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(hf_config_json(cfg, arch, rope_scaling)))
  tensors = {"model.embed_tokens.weight": hf["embed"], "model.norm.weight": hf["final_norm"]}
  if hf["lm_head"] is not None:
    tensors["lm_head.weight"] = hf["lm_head"]
  hf_names = dict(q_proj="self_attn.q_proj.weight", k_proj="self_attn.k_proj.weight",
                  v_proj="self_attn.v_proj.weight", o_proj="self_attn.o_proj.weight",
                  gate_proj="mlp.gate_proj.weight", up_proj="mlp.up_proj.weight",
                  down_proj="mlp.down_proj.weight", input_layernorm="input_layernorm.weight",
                  post_attention_layernorm="post_attention_layernorm.weight",
                  q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias",
                  v_bias="self_attn.v_proj.bias")
  for i, layer in enumerate(hf["layers"]):
    tensors.update({f"model.layers.{i}.{hf_names[k]}": x for k, x in layer.items()})
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  weight_map = {}
  for fname, keys in shards.items():
    save_file({k: np.ascontiguousarray(tensors[k]) for k in keys}, str(path / fname))
    weight_map.update({k: fname for k in keys})
  (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  build_hf_tokenizer().save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
  return path


def llama3_freq_factors(cfg: ModelConfig, s: RopeScaling) -> np.ndarray:
  """The divisors llama.cpp's converter stores as rope_freqs.weight for Llama-3 RoPE scaling."""
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
  wavelen = 2 * np.pi / inv
  low_wl = s.original_max_position_embeddings / s.low_freq_factor
  high_wl = s.original_max_position_embeddings / s.high_freq_factor
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  return np.where(wavelen < high_wl, 1.0,
                  np.where(wavelen > low_wl, s.factor, 1.0 / ((1 - smooth) / s.factor + smooth)))


def gguf_tokenizer(pre: str = "gpt2", template: str | None = CHAT_TEMPLATE) -> Tokenizer:
  fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": TOKENS,
            "tokenizer.ggml.token_type": TOKEN_TYPES,
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES],
            "tokenizer.ggml.bos_token_id": BOS, "tokenizer.ggml.eos_token_id": 0}
  if template is not None:
    fields["tokenizer.chat_template"] = template
  return Tokenizer.from_gguf_fields(fields)


# ----------------------------------------------------------------------------------------------------------
# The CLI


def specjax(*args, cache=None):
  env = dict(os.environ)
  if cache is not None:
    env["SPECJAX_CACHE"] = str(cache)
  return subprocess.run([sys.executable, "-m", "specjax.cli", *args], capture_output=True, text=True,
                        cwd=ROOT, env=env, timeout=600)


def specjax_here(*args):
  """The CLI's ``main`` in this process, as a finished process (return code, stdout, stderr): for the many
  bad-input cases that stop before anything compiles, without paying an interpreter and jax start-up each.
  The tests that run ``specjax`` above keep checking the real process contract."""
  from specjax import cli
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      rc = cli.main([str(a) for a in args])
    except SystemExit as e:                       # argparse's own errors
      rc = e.code if isinstance(e.code, int) else 1
  return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


def assert_clean_error(proc, *needles):
  assert proc.returncode != 0
  err = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr, proc.stderr
  assert err and err[-1].startswith("specjax: error:"), proc.stderr
  for n in needles:
    assert n.lower() in err[-1].lower(), err[-1]


def varied_tiny_gguf(path) -> str:
  """A tiny random GGUF whose greedy replies differ from prompt to prompt and move from token to token (with
  the embedding at full scale the random model repeats one token whatever the prompt, which would let a
  broken sharding pass), and on which n-gram drafts are partly accepted."""
  hf = random_hf_params(CFG, seed=1)
  hf["embed"] = hf["embed"] * 0.3
  return str(write_gguf(path, CFG, hf))


def wrong_weights(w):
  """Variants of a quantized weight a kernel test must tell apart from ``w`` (its check has power): each
  group's scale moved to the next group, and for int4 the offsets moved too and the two nibbles swapped."""
  import dataclasses
  import jax.numpy as jnp
  import numpy as np
  roll = lambda a: jnp.asarray(np.roll(np.asarray(a), 1, axis=1))   # noqa: E731
  wrong = [dataclasses.replace(w, scale=roll(w.scale))]
  if w.kind == "int4":
    p = np.asarray(w.data)
    wrong += [dataclasses.replace(w, offset=roll(w.offset)),
              dataclasses.replace(w, data=jnp.asarray((p >> 4) | ((p & 15) << 4)))]
  return wrong


# ----------------------------------------------------------------------------------------------------------
# A loaded model's untrained EAGLE head, and the single device's tokens of a mesh test


def eagle_dir(m, d, parallel=0):
  from specjax.checkpoints import drafter_io
  from specjax.speculative import eagle
  ecfg = eagle.EagleConfig(m.cfg, (), 0, parallel)
  path = d / f"eagle{parallel or ''}-{m.dtype.__name__ if hasattr(m.dtype, '__name__') else m.dtype}"
  if not path.exists():
    drafter_io.save_drafter(path, ecfg, eagle.init_trainable(ecfg, jax.random.PRNGKey(1)), target_name=m.source,
                            tokenizer=m.tokenizer)
  return str(path)


def _single_device_tokens(path: str, prompts_file) -> list[list[int]]:
  """What `specjax generate` gives on one device, computed in this (one-device) process."""
  from specjax import api
  from specjax.prompts import load_prompts
  outs, _ = api.generate(api.load(path), load_prompts(str(prompts_file)), max_new_tokens=12, batch_size=4,
                         drafter="ngram", k=3)
  return [o.token_ids for o in outs]
