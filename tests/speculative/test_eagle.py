"""The EAGLE-style feature drafter: the engine's drafting equals the training forward (root, tree depths,
after a commit), greedy exactness for every variant and shape, lossless sampling with a reduced vocabulary
(statistically, with a broken rule caught), export/load and its errors, and a tiny training run end to end
(loss falls; kill and resume continues the same run)."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import kv_cache, decoder as model, sampling
from specjax.checkpoints import drafter_io
from specjax.errors import SpecjaxError
from specjax.speculative import NoDrafter
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative import eagle
from specjax.speculative.drafters import DynamicShape
from specjax.training import data as data_lib, eagle_train
from tests.helpers import lossless as ts
from tests.helpers.eagle import (BUCKETS, CFG, LENS, PROMPTS, VARIANTS, _Tok, _drafter_params, _engine_equals_training,
                                 _run, make_store)


@pytest.fixture(scope="module")
def target():
  return model.init_params(CFG, jax.random.PRNGKey(0))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_drafting_equals_the_training_forward(target, variant):
  """The engine's root, depth-1 and depth-2 drafts and its root after a commit give exactly the training
  forward's logits at unroll steps 1, 2, 3 (so training optimises what the engine runs)."""
  _engine_equals_training(CFG, target, eagle.EagleConfig(CFG, *VARIANTS[variant]))


def test_engine_drafting_equals_the_training_forward_with_qkv_biases():
  """A Qwen2-style target (q/k/v biases): the drafter's layer has them in the engine and in training."""
  cfg = CFG.replace(name="tiny-qwen", qkv_bias=True)
  target = model.init_params(cfg, jax.random.PRNGKey(4))
  ecfg = eagle.EagleConfig(cfg, (0, 2), 0)
  _, dp = _drafter_params(ecfg, target)
  assert "b_qkv" in dp["layers"] and float(jnp.abs(dp["layers"]["b_qkv"]).max()) > 0
  _engine_equals_training(cfg, target, ecfg)


def test_bfloat16_training_matmuls_stay_close_to_float32(target):
  """``matmul_dtype='bfloat16'`` (the fast CPU training path) computes nearly the float32 forward, and its
  gradients point the same way."""
  ecfg = eagle.EagleConfig(CFG, (0, 2), 16)
  tr, dp = _drafter_params(ecfg, target)
  seq = jnp.asarray([[5, 9, 7, 3, 11, 12, 4, 20, 33, 17, 8]], jnp.int32)
  T = seq.shape[1]
  G = model.forward(target, CFG, seq, jnp.arange(T)[None], kv_cache.init_cache(CFG, 1, 32), feature_layers=(0, 2)).features
  batch = {"tokens": seq, "pos": jnp.arange(T)[None], "seg": jnp.ones((1, T), jnp.int32), "feats": G}
  f32, _ = eagle_train.train_forward(dp, ecfg, batch, unroll=2)
  b16, _ = eagle_train.train_forward(dp, ecfg, batch, unroll=2, matmul_dtype=jnp.bfloat16)
  assert float(jnp.abs(f32 - b16).max()) < 0.05 * float(jnp.abs(f32).max())
  assert float(jnp.abs(f32 - b16).max()) > 0          # it did run in bfloat16


SHAPES = {"chain": tree_shapes.chain(3), "branch": tree_shapes.branching([3, 2, 1]),
          "dynamic": DynamicShape(6, top_k=2, max_depth=3)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_eagle_decoding_equals_plain_greedy(target, variant):
  tparams = model.unstack_layers(target)
  plain, _ = _run(tparams, NoDrafter(), (), tree_shapes.chain(0))
  ecfg = eagle.EagleConfig(CFG, *VARIANTS[variant])
  _, dp = _drafter_params(ecfg, target)
  accepted = 0
  for name, shape in SHAPES.items():
    d = eagle.EagleDrafter(ecfg.layer_cfg, buckets=BUCKETS, ecfg=ecfg, max_depth=shape.max_depth)
    out, st = _run(tparams, d, dp, shape)
    assert out == plain, (variant, name)
    accepted += int(st.stats.accepted_B.sum())
    # every live iteration marked its root's position (what eval-draft scores 1 - TVD at)
    np.testing.assert_array_equal(np.asarray(st.starts_BxS).sum(1), np.asarray(st.stats.verify_steps_B))
    assert all(bool(st.starts_BxS[b, LENS[b]]) for b in range(3))
  assert accepted > 0      # the accept-and-refeed path ran


def test_eagle_sampling_with_a_reduced_vocabulary_is_lossless():
  """Under sampling the reduced drafter's q is zero outside its vocabulary; the chain and tree rules stay
  lossless (chi-square against the enumerated joint of plain sampling), and a broken rule is caught."""
  sp = sampling.SamplingParams(temperature=1.0)
  tgt = ts._micro_params(0)
  ecfg = eagle.EagleConfig(ts.MICRO, (0, 1), 6)
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(3))
  dp = {**tr, **eagle.frozen_from_target(ecfg, tgt, np.array([0, 2, 3, 5, 8, 11]))}
  drafter = eagle.EagleDrafter(ecfg.layer_cfg, ecfg=ecfg, max_depth=2)
  joint = ts._exact_joint(tgt, sp)
  p_ok = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter), joint)
  p_broken = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter, acceptance=ts.AcceptAlways()), joint)
  assert p_ok > 1e-3, p_ok
  assert p_broken < 1e-6, p_broken


# ----------------------------------------------------------------------------------------------------------
# Export and load


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_and_errors(tmp_path, target, variant, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  ecfg = eagle.EagleConfig(CFG, *VARIANTS[variant])
  tr, dp = _drafter_params(ecfg, target)
  tok = _Tok(CFG.vocab_size)
  path = drafter_io.save_drafter(tmp_path / "d", ecfg, tr, target_name="tiny", tokenizer=tok,
                                 head_ids=np.asarray(dp["head_ids"]) if ecfg.reduced else None)
  ecfg2, dp2, conf = drafter_io.load_drafter(path, CFG, target, tok)
  assert ecfg2 == ecfg and conf["target"]["name"] == "tiny"
  for k in dp:
    np.testing.assert_array_equal(np.asarray(jax.tree_util.tree_leaves(dp[k])[0]),
                                  np.asarray(jax.tree_util.tree_leaves(dp2[k])[0]))
  assert [d["path"] for d in drafter_io.list_drafters()] == [str(path.resolve())]
  with pytest.raises(SpecjaxError, match="another tokenizer"):
    drafter_io.load_drafter(path, CFG, target, _Tok(CFG.vocab_size, "u"))
  other = CFG.replace(vocab_size=80)
  with pytest.raises(SpecjaxError, match="vocabulary 64"):
    drafter_io.load_drafter(path, other, model.init_params(other, jax.random.PRNGKey(0)), tok)
  with pytest.raises(SpecjaxError, match="not found"):
    drafter_io.load_drafter(tmp_path / "nope", CFG, target, tok)
  st = path / "model.safetensors"
  st.write_bytes(st.read_bytes()[:100])
  with pytest.raises(SpecjaxError, match="damaged"):
    drafter_io.load_drafter(path, CFG, target, tok)
  (path / "config.json").write_text("{not json")
  with pytest.raises(SpecjaxError, match="not valid JSON"):
    drafter_io.load_drafter(path, CFG, target, tok)
  (path / "config.json").unlink()
  with pytest.raises(SpecjaxError, match="no config.json"):
    drafter_io.load_drafter(path, CFG, target, tok)


# ----------------------------------------------------------------------------------------------------------
# Training on a tiny feature store


def test_generation_order_answers_a_fair_sample_first():
  """Prompts are answered in random chunks, each sorted by length: a stage stopped early has long and short
  prompts alike (sorting everything by length would leave only the shortest)."""
  lengths = np.random.default_rng(0).integers(1, 500, 1000).tolist()
  order = data_lib.generation_order(lengths, 64, seed=0)
  assert sorted(order) == list(range(1000)) and order == data_lib.generation_order(lengths, 64, seed=0)
  for a in range(0, 1000, 64):
    chunk = [lengths[i] for i in order[a:a + 64]]
    assert chunk == sorted(chunk)
  first = [lengths[i] for i in order[:192]]
  assert abs(np.mean(first) / np.mean(lengths) - 1) < 0.1 and max(first) > np.percentile(lengths, 95)


def test_feature_store_and_batches(tmp_path, target):
  d = make_store(tmp_path, target, n=6)
  store = eagle_train.FeatureData(d)
  assert store.meta["fused_layers"] == [0, 2] and store.num_sequences == 6
  b = eagle_train.PackedBatcher(store, store.final, np.arange(6), batch_size=2, seq_len=64, seed=0)
  batch = b.next()
  pos1 = b.position()
  nxt = b.next()
  b.seek(pos1)
  np.testing.assert_array_equal(b.next()["tokens"], nxt["tokens"])
  # every loss position predicts a response token of its own sequence
  seg, m = batch["seg"], batch["loss_mask"]
  assert m.any() and np.all(seg[m] > 0) and np.all(seg[:, 1:][m[:, :-1]] == seg[:, :-1][m[:, :-1]])
  (d / "features" / "meta.json").unlink()
  with pytest.raises(SpecjaxError, match="no complete feature store"):
    eagle_train.FeatureData(d)


TRAIN_SCRIPT = r"""
import json, sys, time, jax, numpy as np
sys.path.insert(0, {root!r})
from specjax.models import config, decoder as model
from specjax.training import recipes
from specjax.speculative import eagle
CFG = config.TINY.replace(num_layers=3)
target = model.init_params(CFG, jax.random.PRNGKey(0))
import specjax.training.recipes as R
stall = {stall}
if stall:
  import specjax.training.loop as L
  orig = L._MetricsWriter.write
  def write(self, rec):
    orig(self, rec)
    if rec.get("step") == stall:
      time.sleep(600)
  L._MetricsWriter.write = write
out = R.train_eagle_on(target, CFG, data_dir={data!r}, run_dir={run!r}, resume={resume}, steps=12,
                       batch_size=2, seq_len=64, learning_rate=3e-3, warmup_steps=2, checkpoint_every=4,
                       log_every=1, unroll=2, w_reg=0.1, progress=False, features="fused", fused_layers=(0, 2))
print(json.dumps(out["final_loss"]))
"""


def _train(tmp_path, data, run, resume=False, stall=0):
  script = tmp_path / f"train_{run.name}_{int(resume)}.py"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  script.write_text(TRAIN_SCRIPT.format(root=root, data=str(data), run=str(run), resume=resume, stall=stall))
  return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _losses(run):
  return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_training_lowers_the_loss_and_resumes_exactly_after_a_kill(tmp_path, target):
  data = make_store(tmp_path, target)
  full = _train(tmp_path, data, tmp_path / "full")
  out, err = full.communicate(timeout=600)
  assert full.returncode == 0, err[-2000:]
  ref = _losses(tmp_path / "full")
  assert ref[12] < ref[1]
  # Kill a second run after its step-4 checkpoint (it stalls at step 6), then resume it.
  run = tmp_path / "killed"
  p = _train(tmp_path, data, run, stall=6)
  t0 = time.time()
  while time.time() - t0 < 300:
    if (run / "metrics.jsonl").exists() and 6 in _losses(run):
      break
    time.sleep(0.2)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert 6 in _losses(run)
  again = _train(tmp_path, data, run, resume=True)
  out, err = again.communicate(timeout=600)
  assert again.returncode == 0, err[-2000:]
  assert "resumed at step 4" in err
  got = _losses(run)
  assert sorted(got) == list(range(1, 13))
  for s in range(1, 13):
    assert abs(got[s] - ref[s]) < 1e-5 * max(1.0, abs(ref[s])), (s, got[s], ref[s])


def test_small_draft_model_trains_and_exports_a_loadable_checkpoint(tmp_path, target):
  """The small draft model: initialised from target layers, the loss falls on the tiny store, and the
  exported Hugging Face directory loads back (same parameters) and drafts exactly in the engine."""
  from specjax.checkpoints.safetensors_loader import load_hf_dir
  from specjax.speculative import ModelDrafter
  from specjax.training import draft_model, recipes
  from tests.helpers import gguf_tokenizer
  store = eagle_train.FeatureData(make_store(tmp_path, target, n=12))
  layers = (0, 2)
  dcfg = draft_model.draft_config(CFG, layers)
  trainable, frozen = draft_model.split(draft_model.init_from_target(target, layers), True)
  head = target["embed"]
  loss_of = lambda tr, fz, b: draft_model.loss_fn(tr, {"embed": fz["embed"]}, dcfg, "fkl", b, fz["head"])
  batch = eagle_train.PackedBatcher(store, store.final, np.arange(12), batch_size=4, seq_len=64).next()
  before = float(loss_of(trainable, {**frozen, "head": head}, batch)[0])     # (training donates trainable)
  res = recipes._fit(loss_of, trainable, {**frozen, "head": head}, store, store.final, run_dir=tmp_path / "run",
                     resume=False, fingerprint={"drafter": "model"}, settings={}, steps=10, batch_size=2,
                     seq_len=64, learning_rate=1e-3, warmup_steps=2, checkpoint_every=5, log_every=1,
                     progress=False)
  after = float(loss_of(res["params"], {**frozen, "head": head}, batch)[0])
  assert after < before
  params = {**jax.device_get(res["params"]), **frozen}
  tok = gguf_tokenizer()
  cfg_tok = dcfg.replace(vocab_size=tok.vocab_size)       # the test tokenizer's vocabulary
  emb = np.asarray(params["embed"])
  emb = emb[:tok.vocab_size] if tok.vocab_size <= len(emb) else np.pad(emb, ((0, tok.vocab_size - len(emb)), (0, 0)))
  params_tok = {**params, "embed": emb}
  path = draft_model.export_hf(tmp_path / "drafter", cfg_tok, params_tok, tok)
  cfg2, params2, tok2 = load_hf_dir(path)
  assert cfg2.num_layers == len(layers) and tok2.vocab_size == tok.vocab_size
  for name in ("w_qkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm"):
    np.testing.assert_array_equal(np.asarray(params2["layers"][name]), np.asarray(params_tok["layers"][name]))
  # The trained draft (full tiny vocabulary) drafts for the tiny target: greedy output unchanged.
  plain, _ = _run(model.unstack_layers(target), NoDrafter(), (), tree_shapes.chain(0))
  out, _ = _run(model.unstack_layers(target), ModelDrafter(dcfg, buckets=BUCKETS), model.unstack_layers(params),
                SHAPES["branch"])
  assert out == plain


def test_small_draft_model_with_a_reduced_vocabulary(tmp_path, target):
  """A reduced head on the small draft model: its loss falls, nothing outside the vocabulary can be drafted,
  greedy output is unchanged for every tree shape, and the Hugging Face export (lm_head [Vr, D] + d2t)
  loads back with its map; a d2t that does not fit gives a one-line error."""
  from specjax.checkpoints.safetensors_loader import load_hf_dir
  from specjax.errors import CheckpointError
  from specjax.speculative import ModelDrafter
  from specjax.training import draft_model, recipes
  from tests.helpers import gguf_tokenizer
  tok = gguf_tokenizer()
  store = eagle_train.FeatureData(make_store(tmp_path, target, n=12))
  V = min(CFG.vocab_size, tok.vocab_size)      # ids the test tokenizer also has
  head_ids, t2d = recipes._reduced_head(store, CFG.replace(vocab_size=V), 16)
  t2d = jnp.pad(t2d, (0, CFG.vocab_size - V), constant_values=-1)
  assert len(head_ids) == 16 and 2 in head_ids        # EOS always kept
  layers = (0, 2)
  dcfg = draft_model.draft_config(CFG, layers, reduced=True)
  trainable, frozen = draft_model.split(draft_model.init_from_target(target, layers, head_ids), True)
  assert set(frozen) == {"embed", "lm_head", "head_ids"} and frozen["lm_head"].shape == (16, CFG.d_model)
  head = jnp.take(target["embed"], jnp.asarray(head_ids), axis=0)
  aux = {"head": head, "t2d": t2d}
  loss_of = lambda tr, fz, b: draft_model.loss_fn(tr, {k: fz[k] for k in ("embed", "lm_head", "head_ids")},
                                                  dcfg, "fkl", b, fz["head"], fz["t2d"])
  batch = eagle_train.PackedBatcher(store, store.final, np.arange(12), batch_size=4, seq_len=64).next()
  before = float(loss_of(trainable, {**frozen, **aux}, batch)[0])
  ce = draft_model.loss_fn(trainable, frozen, dcfg, "ce", batch, head, t2d)[0]
  assert np.isfinite(float(ce))
  res = recipes._fit(loss_of, trainable, {**frozen, **aux}, store, store.final, run_dir=tmp_path / "run",
                     resume=False, fingerprint={"drafter": "model"}, settings={}, steps=10, batch_size=2,
                     seq_len=64, learning_rate=1e-3, warmup_steps=2, checkpoint_every=5, log_every=1,
                     progress=False)
  assert float(loss_of(res["params"], {**frozen, **aux}, batch)[0]) < before
  params = {**jax.device_get(res["params"]), **frozen}
  # In the engine: draft logits over the target's vocabulary, zero probability outside head_ids.
  d = ModelDrafter(dcfg, buckets=BUCKETS)
  prompt = jnp.asarray(PROMPTS[:1])
  st = d.init(params, prompt, jnp.array([10]), 64)
  lg, _, _ = d._root(params, st, jnp.zeros((1, 64), jnp.int32).at[:, :10].set(prompt), jnp.array([10]),
                     jnp.array([5]))
  assert lg.shape == (1, CFG.vocab_size)
  outside = np.setdiff1d(np.arange(CFG.vocab_size), head_ids)
  assert float(jax.nn.softmax(lg)[0, outside].sum()) == 0.0
  plain, _ = _run(model.unstack_layers(target), NoDrafter(), (), tree_shapes.chain(0))
  for name, shape in SHAPES.items():
    out, _ = _run(model.unstack_layers(target), ModelDrafter(dcfg, buckets=BUCKETS), model.unstack_layers(params),
                  shape)
    assert out == plain, name
  # Export (EAGLE-3's convention: draft_vocab_size, d2t) and load back.
  cfg_tok = dcfg.replace(vocab_size=tok.vocab_size)
  emb = np.asarray(params["embed"])
  emb = emb[:tok.vocab_size] if tok.vocab_size <= len(emb) else np.pad(emb, ((0, tok.vocab_size - len(emb)), (0, 0)))
  path = draft_model.export_hf(tmp_path / "drafter", cfg_tok, {**params, "embed": emb}, tok)
  conf = json.loads((path / "config.json").read_text())
  assert conf["draft_vocab_size"] == 16 and conf["tie_word_embeddings"] is False
  cfg2, params2, _ = load_hf_dir(path)
  np.testing.assert_array_equal(np.asarray(params2["head_ids"]), head_ids)
  np.testing.assert_array_equal(np.asarray(params2["lm_head"]), np.asarray(params["lm_head"]))
  conf["draft_vocab_size"] = 17
  (path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(CheckpointError, match="draft_vocab_size=17 but 'lm_head.weight' is"):
    load_hf_dir(path)
  del conf["draft_vocab_size"]
  (path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(CheckpointError, match="'lm_head.weight' has shape"):
    load_hf_dir(path)


def test_small_draft_model_sampling_with_a_reduced_vocabulary_is_lossless():
  """Under sampling a reduced draft model's q is zero outside its vocabulary; the chain rule stays lossless
  (chi-square against the enumerated joint of plain sampling), and a broken rule is caught."""
  from specjax.speculative import ModelDrafter
  from specjax.training import draft_model
  sp = sampling.SamplingParams(temperature=1.0)
  tgt = ts._micro_params(0)
  other = ts._micro_params(7)       # a draft that differs from the target
  dp = draft_model.init_from_target(other, (0,), np.array([0, 2, 3, 5, 8, 11]))
  drafter = ModelDrafter(draft_model.draft_config(ts.MICRO, (0,), reduced=True))
  joint = ts._exact_joint(tgt, sp)
  p_ok = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter), joint)
  p_broken = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter, acceptance=ts.AcceptAlways()), joint)
  assert p_ok > 1e-3, p_ok
  assert p_broken < 1e-6, p_broken


DP_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, {root!r})
import jax, numpy as np
from specjax.models import config, decoder as model
from specjax.training import recipes
CFG = config.TINY.replace(num_layers=3)
target = model.init_params(CFG, jax.random.PRNGKey(0))
kw = dict(data_dir={data!r}, run_dir={run!r}, batch_size=2, seq_len=64, learning_rate=3e-3, warmup_steps=1,
          checkpoint_every=2, log_every=1, unroll=2, progress=False, mesh={mesh!r})
recipes.train_eagle_on(target, CFG, steps=4, **kw)
out = recipes.train_eagle_on(target, CFG, steps=6, resume=True, **kw)     # resumed at step 4, on the same mesh
print(json.dumps({{"devices": jax.device_count(), "loss": out["final_loss"]}}))
"""


def test_training_is_data_parallel_over_a_mesh_and_resumes_on_it(tmp_path, target):
  """The trainer's own loop on 8 host devices, a 2x4 mesh (batch over data, parameters over model by
  sharding.RULES), checkpointed and resumed on that mesh: the losses equal the one-device run's."""
  data = make_store(tmp_path, target, n=8)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  res = {}
  for n, mesh in ((1, None), (8, "2x4")):
    script = tmp_path / f"dp{n}.py"
    script.write_text(DP_SCRIPT.format(root=root, data=str(data), run=str(tmp_path / f"run{n}"), mesh=mesh))
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res[n] = json.loads(p.stdout.strip().splitlines()[-1])
    assert res[n]["devices"] == n
    if mesh:
      assert "resumed at step 4" in p.stderr
  one, eight = _losses(tmp_path / "run1"), _losses(tmp_path / "run8")
  assert sorted(one) == sorted(eight) == list(range(1, 7))
  for s in one:
    assert abs(one[s] - eight[s]) < 1e-5 * max(1.0, abs(one[s])), (s, one[s], eight[s])
