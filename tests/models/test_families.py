"""Model families against Hugging Face transformers: for each family, a small random checkpoint built from the
family's own transformers config class gives the same per-token log-probabilities (|Δ| ≤ 1e-4, fp32) and the
same greedy tokens through specjax.  The reference outputs were recorded by
scripts/record_family_references.py (transformers 5.25, torch 2.13); the weights are drawn here from the
recorded tensor names with the same seed (tests/helpers/family_weights.py)."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.errors import CheckpointError
from specjax.models import decoder as M
from specjax.models.kv_cache import init_cache
from tests.helpers.families import DATA, token_logprobs, write_family

FAMILIES = sorted(p.name for p in DATA.iterdir() if (p / "reference.json").is_file())


def test_every_family_recorded():
  assert set(FAMILIES) >= {"llama", "llama-linear", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"}


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_equal_transformers(tmp_path, name):
  d, ref = write_family(tmp_path, name)
  cfg, params, _ = load_hf_dir(d)
  assert cfg.family == name.split("-")[0]
  got = token_logprobs(params, cfg, ref["token_ids"])
  np.testing.assert_allclose(got, ref["logprobs"], atol=1e-4, rtol=0)


def to_transformers4(config: dict) -> dict:
  """The same config in transformers 4's spelling: rope_theta / rope_scaling (Gemma 3: rope_local_base_freq)."""
  config = dict(config)
  p = config.pop("rope_parameters")
  if "full_attention" in p:
    config["rope_local_base_freq"] = p["sliding_attention"]["rope_theta"]
    p = p["full_attention"]
  p = dict(p)
  config["rope_theta"] = p.pop("rope_theta")
  config["rope_scaling"] = None if p.get("rope_type") == "default" else p
  config.pop("layer_types", None)          # transformers 4 configs predate the list: the family's own rule
  return config


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "gemma2"])
def test_transformers4_spelling_loads_the_same(tmp_path, name):
  d, ref = write_family(tmp_path, name, to_transformers4)
  cfg, params, _ = load_hf_dir(d)
  np.testing.assert_allclose(token_logprobs(params, cfg, ref["token_ids"]), ref["logprobs"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_score_and_generate_through_the_api(tmp_path, name):
  """The product path: ``api.load`` (the native kernels where they apply), ``score`` over the text (in one
  forward, and fed 5 tokens at a time through the cache as a verification is) and greedy ``generate`` from its
  first tokens, equal to transformers."""
  d, ref = write_family(tmp_path, name)
  m = api.load(str(d))
  text = m.tokenizer.decode(ref["token_ids"], skip_special_tokens=False)
  for block in (None, 5):
    s = api.score(m, text, block=block)
    assert s.token_ids == ref["token_ids"]
    np.testing.assert_allclose(s.logprobs, ref["logprobs"], atol=1e-4, rtol=0, err_msg=f"block {block}")
  prefix = m.tokenizer.decode(ref["token_ids"][:ref["prefix"]], skip_special_tokens=False)
  gens, _ = api.generate(m, [prefix], max_new_tokens=len(ref["greedy"]), chat=False, ignore_eos=True)
  assert gens[0].token_ids == ref["greedy"]


_CHAIN, _TREE = dict(drafter="ngram", k=4), dict(drafter="ngram", tree="branch:2,2")
_MODEL, _LAYERS = dict(drafter="model", k=3), dict(drafter="layerskip", k=3, draft_layers="0,1")
# Two drafters a family (suite time), every drafter on a windowed family and a tree and a model everywhere else.
_DRAFTS_BY_FAMILY = {"gemma3": (_TREE, _LAYERS), "gemma2": (_CHAIN, _MODEL), "qwen2": (_TREE, _MODEL),
                     "mistral": (_CHAIN, _LAYERS), "default": (_TREE, _MODEL)}


@pytest.mark.parametrize("name", FAMILIES)
def test_speculation_is_greedy_exact_past_the_window(tmp_path, name):
  """Every family; prompts longer than the window where there is one; n-gram chains and trees, a model draft
  and layer-skip (``_DRAFTS_BY_FAMILY``): the speculative output is the plain greedy output."""
  d, ref = write_family(tmp_path, name)
  m = api.load(str(d))
  prompts = [m.tokenizer.decode(ref["token_ids"][:n], skip_special_tokens=False) for n in (40, 70)]
  kw = dict(max_new_tokens=24, chat=False, ignore_eos=True, batch_size=2)
  plain = [g.token_ids for g in api.generate(m, prompts, **kw)[0]]
  for settings in _DRAFTS_BY_FAMILY.get(name, _DRAFTS_BY_FAMILY["default"]):
    extra = {"draft": m} if settings["drafter"] == "model" else {}
    got, stats = api.generate(m, prompts, **kw, **settings, **extra)
    assert [g.token_ids for g in got] == plain, settings


def test_windows_and_rope_read_per_family(tmp_path):
  d, _ = write_family(tmp_path, "gemma3")
  cfg, _, _ = load_hf_dir(d)
  assert cfg.layer_windows == (16, 16, 16, 16, 16, 0, 16) and cfg.local_rope_theta == 10000.0
  assert cfg.rope_theta == 1e6 and cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 8.0
  assert cfg.qk_norm and cfg.sandwich_norms and cfg.activation == "gelu_tanh" and cfg.embed_scale == 8.0
  assert cfg.query_scale == pytest.approx(24 ** -0.5) and cfg.tie_embeddings
  d, _ = write_family(tmp_path, "qwen2")
  cfg, _, _ = load_hf_dir(d)
  assert cfg.layer_windows == (0, 16, 16) and cfg.rope_scaling.kind == "yarn" and cfg.qkv_bias


@pytest.mark.parametrize("edit,needle", [
    (lambda c: {**c, "architectures": ["Gemma3ForConditionalGeneration"]}, "architecture 'Gemma3ForConditionalGeneration'"),
    (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}}, "rope scaling on the sliding-window layers"),
    (lambda c: {**c, "layer_types": ["chunked_attention"] * 7}, "layer type(s) chunked_attention"),
    (lambda c: {**c, "use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    (lambda c: {**c, "hidden_activation": "relu"}, "hidden_activation='relu'"),
    (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "full_attention": {
        "rope_type": "longrope", "rope_theta": 1e6}}}, "rope type 'longrope'"),
])
def test_unsupported_options_refused_in_one_line(tmp_path, edit, needle):
  d, _ = write_family(tmp_path, "gemma3", edit)
  with pytest.raises(CheckpointError) as e:
    load_hf_dir(d)
  assert needle in str(e.value) and "supported" in str(e.value) and "\n" not in str(e.value)


def test_tensors_that_do_not_match_the_config_are_named(tmp_path):
  d, _ = write_family(tmp_path, "qwen3", lambda c: {**c, "head_dim": 16})
  with pytest.raises(CheckpointError, match="q_proj.*shape|shape.*q_proj"):
    load_hf_dir(d)


def test_quantized_weights_and_a_2x2_mesh(tmp_path):
  """Qwen3 and Gemma 3 at bf16, int8 and int4 weights on a 2x2 mesh (4 host devices, a process of its own):
  speculative greedy output (an n-gram tree) equals plain greedy output."""
  import os
  import subprocess
  import sys
  asked = {}
  for name in ("qwen3", "gemma3"):
    d, ref = write_family(tmp_path, name)
    tok = api.load(str(d)).tokenizer
    asked[str(d)] = [tok.decode(ref["token_ids"][:n], skip_special_tokens=False) for n in (30, 50)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",        # the suite's own compile flags (conftest) kept
         "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()}
  proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "helpers" / "families_mesh_child.py"),
                         json.dumps(asked)], capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert set(out) == set(asked)
  for path, by_weights in out.items():
    assert set(by_weights) == {"bf16", "int8", "int4"}
    for weights, runs in by_weights.items():
      for label, tokens in runs.items():
        mesh = label.split("@")[1]
        assert tokens == runs[f"plain@{mesh}"], (path, weights, label)
    assert all("tree@2x2" in runs for runs in by_weights.values())


def test_sampling_on_a_windowed_family_is_lossless():
  """The χ² harness of test_speculative on a micro model with Gemma's layer (sandwich norms, q/k norms,
  GeGLU, √D scale, soft-caps) and a window of 4 positions on its first layer (a 3-token prompt and 3 sampled
  tokens: the last ones no longer see the prompt's start): speculative samples have plain sampling's joint
  distribution; an accept-everything rule is caught."""
  from tests.helpers.lossless import MICRO, AcceptAlways, _chi2_pvalue, _exact_joint, _micro_params, _spec_samples
  from specjax.models.sampling import SamplingParams
  from specjax.speculative import ModelDrafter
  cfg = MICRO.replace(name="micro-gemma", family="gemma3", qk_norm=True, sandwich_norms=True,
                      activation="gelu_tanh", embed_scale=4.0, attn_softcap=3.0, final_softcap=5.0,
                      layer_windows=(4, 0), local_rope_theta=100.0)
  target, draft = _micro_params(0, cfg), _micro_params(7, cfg)
  sp = SamplingParams(temperature=1.0)
  joint = _exact_joint(target, sp, cfg)
  assert not np.allclose(joint, _exact_joint(target, sp, cfg.replace(layer_windows=())))   # the window bites
  assert _chi2_pvalue(_spec_samples(target, draft, sp, drafter=ModelDrafter(cfg), cfg=cfg), joint) > 1e-3
  broken = _spec_samples(target, draft, sp, drafter=ModelDrafter(cfg), acceptance=AcceptAlways(), cfg=cfg)
  assert _chi2_pvalue(broken, joint) < 1e-6


def test_long_prompts_prefill_in_chunks_like_one_block(monkeypatch):
  """A prompt bucket past ``PREFILL_CHUNK`` is prefilled in chunks (a scan; a windowed layer reads its window
  plus the chunk): the cache, the last prompt token's logits and the tapped features equal one block's."""
  import jax
  from specjax.models import config, decode
  cfg = config.TINY.replace(layer_windows=(8, 0), local_rope_theta=100.0, max_position=1024)
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  B, P = 2, 768
  toks = jax.random.randint(jax.random.PRNGKey(1), (B, P), 3, cfg.vocab_size)
  lens = jnp.asarray([700, 300])
  cache = init_cache(cfg, B, 1024)
  monkeypatch.setattr(decode, "PREFILL_CHUNK", 256)
  assert decode.prefill_chunk(P) == 256
  chunked = decode.prefill(params, cfg, cache, toks, lens, feature_layers=(0,))
  monkeypatch.setattr(decode, "PREFILL_CHUNK", 1 << 20)
  whole = decode.prefill(params, cfg, cache, toks, lens, feature_layers=(0,))
  np.testing.assert_allclose(chunked.last_logits_BxV, whole.last_logits_BxV, atol=1e-5)
  for b, n in enumerate([700, 300]):
    np.testing.assert_allclose(chunked.cache.k[:, b, :n], whole.cache.k[:, b, :n], atol=1e-5)
  np.testing.assert_allclose(chunked.features, whole.features, atol=1e-5)
  assert chunked.cache.lengths.tolist() == [700, 300]


@pytest.mark.parametrize("edit,needle", [
    (lambda c: {**c, "architectures": ["Qwen3MoeForCausalLM"]}, "Qwen3MoeForCausalLM"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "dynamic"),
])
def test_the_cli_refuses_before_reading_a_weight(tmp_path, edit, needle):
  """`specjax score` on an unsupported architecture or rope type: exit 2, one line naming what is supported,
  before any weight is read (the weights file here is not even a safetensors file)."""
  from tests.helpers import assert_clean_error, specjax_here
  d, _ = write_family(tmp_path, "qwen3", edit)
  (d / "model.safetensors").write_bytes(b"not weights")
  proc = specjax_here("score", "--model", d, "--text", "hello")
  assert proc.returncode == 2
  assert_clean_error(proc, needle, "supported")


def test_eagle_taps_and_the_server_on_gemma3(tmp_path):
  """Gemma 3 (windowed layers, its own norms): an EAGLE head (untrained, exported as `specjax train` writes it;
  a Llama layer over the target's fused features) in a chain and a tree, and the continuous batcher with
  n-gram drafts and requests arriving while others decode: plain greedy tokens every time."""
  import jax
  from specjax.checkpoints import drafter_io
  from specjax.serving import batcher as bt, factory
  from specjax.speculative import eagle
  d, ref = write_family(tmp_path, "gemma3")
  m = api.load(str(d))
  prompts = [m.tokenizer.decode(ref["token_ids"][:n], skip_special_tokens=False) for n in (40, 70)]
  kw = dict(max_new_tokens=16, chat=False, ignore_eos=True, batch_size=2)
  plain = [g.token_ids for g in api.generate(m, prompts, **kw)[0]]
  ecfg = eagle.EagleConfig(m.cfg, (1, 5), 0)
  head = drafter_io.save_drafter(tmp_path / "eagle", ecfg, eagle.init_trainable(ecfg, jax.random.PRNGKey(1)),
                                 target_name=m.source, tokenizer=m.tokenizer)
  for settings in (dict(k=3), dict(tree="branch:2,2")):
    got = api.generate(m, prompts, drafter="eagle", draft=str(head), **kw, **settings)[0]
    assert [g.token_ids for g in got] == plain, settings
  eng = factory.make_batcher(m, drafter="ngram", policy="fixed", k=3, buckets=(32, 64, 128), slots=2,
                             max_len=128)
  ids = [m.tokenizer.encode(p) for p in prompts]
  reqs = [bt.Request(e, 16, rid=i) for i, e in enumerate(ids + ids[:1])]
  pending = list(reqs)
  while pending or not all(r.done for r in reqs):
    if pending:
      eng.submit(pending.pop(0))
    eng.step()
  with_eos = [g.token_ids for g in api.generate(m, prompts, max_new_tokens=16, chat=False, batch_size=2)[0]]
  assert [r.tokens for r in reqs] == with_eos + with_eos[:1]
