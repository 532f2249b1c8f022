"""The parallel feature drafter (all K draft positions in one forward): the engine's one forward equals the
training forward at every position (before and after a commit), greedy output equals plain greedy for
chains, static trees and dynamic trees, sampling stays lossless (chi-square; a broken rule is caught), export
and load keep the placeholders (and a Qwen2 layer's biases), one forward per step, and clear errors."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import kv_cache, decoder as model, sampling
from specjax.checkpoints import drafter_io
from specjax.errors import SpecjaxError
from specjax.runtime import builder
from specjax.speculative import NoDrafter, eagle, registry
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import DynamicShape
from specjax.speculative.eagle_parallel import ParallelEagleDrafter
from specjax.training import eagle_train
from tests.helpers import eagle as te
from tests.helpers import lossless as ts

CFG = te.CFG
K = 4


@pytest.fixture(scope="module")
def target():
  return model.init_params(CFG, jax.random.PRNGKey(0))


def _drafter(ecfg, depth=None, buckets=(32,)):
  return ParallelEagleDrafter(ecfg.layer_cfg, buckets=buckets, ecfg=ecfg, max_depth=depth or ecfg.parallel)


def _positions_equal_training(cfg, target, ecfg):
  _, dp = te._drafter_params(ecfg, target)
  assert dp["placeholders"].shape == (K - 1, cfg.d_model)
  seq = np.array([[5, 9, 7, 3, 11, 12, 4, 20, 33, 17, 8, 6, 2, 14]], np.int32)
  T, P = seq.shape[1], 7
  G = model.forward(target, cfg, jnp.asarray(seq), jnp.arange(T)[None], kv_cache.init_cache(cfg, 1, 32),
                    feature_layers=ecfg.feature_layers).features
  batch = {"tokens": jnp.asarray(seq), "pos": jnp.arange(T)[None], "seg": jnp.ones((1, T), jnp.int32), "feats": G}
  full = eagle.to_target_vocab(dp, ecfg, eagle_train.train_forward(dp, ecfg, batch, unroll=K)[0])   # [K,1,T,V]
  d = _drafter(ecfg)
  st = d.init(dp, jnp.asarray(seq[:, :P]), jnp.array([P]), 32, G[:, :P])
  S = jnp.zeros((1, 32), jnp.int32).at[:, :T].set(seq)
  logits, cache = d.draft_positions(dp, st, S, jnp.array([P]), K)
  for s in range(K):       # depth s + 1 = training step s + 1 at the row of position P + s
    np.testing.assert_allclose(logits[0, s], full[s, 0, P + s], atol=3e-5, err_msg=f"depth {s + 1}")
  # Two drafts accepted (root at P, then P+1, P+2 committed): the next forward re-feeds them with the
  # target's features and overwrites the placeholders' entries.
  st2 = d.commit(st.replace(cache=cache), jnp.array([P]), None, jnp.array([P + 2]), G[:, P:P + 3])
  logits2, _ = d.draft_positions(dp, st2, S, jnp.array([P + 2]), K)
  for s in range(K):
    np.testing.assert_allclose(logits2[0, s], full[s, 0, P + 2 + s], atol=3e-5, err_msg=f"after commit, {s + 1}")


@pytest.mark.parametrize("variant", ["final", "fused", "reduced"])
def test_one_forward_equals_the_training_forward_at_every_position(target, variant):
  layers, vocab = te.VARIANTS[variant]
  _positions_equal_training(CFG, target, eagle.EagleConfig(CFG, layers, vocab, parallel=K))


def test_one_forward_equals_training_with_qkv_biases():
  cfg = CFG.replace(name="tiny-qwen", qkv_bias=True)
  _positions_equal_training(cfg, model.init_params(cfg, jax.random.PRNGKey(4)), eagle.EagleConfig(cfg, (0, 2), 0,
                                                                                                   parallel=K))


SHAPES = {"chain": tree_shapes.chain(4), "chain2": tree_shapes.chain(2), "branch": tree_shapes.branching([3, 2, 1]),
          "dynamic": DynamicShape(6, top_k=2, max_depth=3)}


@pytest.mark.parametrize("variant", ["fused", "reduced"])
def test_greedy_parallel_decoding_equals_plain_greedy(target, variant):
  tparams = model.unstack_layers(target)
  plain, _ = te._run(tparams, NoDrafter(), (), tree_shapes.chain(0))
  layers, vocab = te.VARIANTS[variant]
  ecfg = eagle.EagleConfig(CFG, layers, vocab, parallel=K)
  _, dp = te._drafter_params(ecfg, target)
  accepted = 0
  for name, shape in SHAPES.items():
    out, st = te._run(tparams, _drafter(ecfg, buckets=te.BUCKETS), dp, shape)
    assert out == plain, (variant, name)
    accepted += int(st.stats.accepted_B.sum())
    assert int(st.stats.draft_forwards) == int(st.stats.iterations)      # one drafter forward per step
  assert accepted > 0


def test_parallel_sampling_is_lossless_and_a_broken_rule_is_caught():
  sp = sampling.SamplingParams(temperature=1.0)
  tgt = ts._micro_params(0)
  ecfg = eagle.EagleConfig(ts.MICRO, (0, 1), 6, parallel=2)
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(3))
  dp = {**tr, **eagle.frozen_from_target(ecfg, tgt, np.array([0, 2, 3, 5, 8, 11]))}
  drafter = ParallelEagleDrafter(ecfg.layer_cfg, ecfg=ecfg, max_depth=2)
  joint = ts._exact_joint(tgt, sp)
  p_ok = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter), joint)
  p_broken = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter, acceptance=ts.AcceptAlways()), joint)
  assert p_ok > 1e-3, p_ok
  assert p_broken < 1e-6, p_broken


def test_export_round_trip_keeps_placeholders_and_biases(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  cfg = CFG.replace(name="tiny-qwen", qkv_bias=True)
  target = model.init_params(cfg, jax.random.PRNGKey(4))
  ecfg = eagle.EagleConfig(cfg, (0, 2), 16, parallel=3)
  tr, dp = te._drafter_params(ecfg, target)
  tok = te._Tok(cfg.vocab_size)
  path = drafter_io.save_drafter(tmp_path / "d", ecfg, tr, target_name="tiny", tokenizer=tok,
                                 head_ids=np.asarray(dp["head_ids"]))
  ecfg2, dp2, conf = drafter_io.load_drafter(path, cfg, target, tok)
  assert ecfg2 == ecfg and conf["parallel_positions"] == 3
  np.testing.assert_array_equal(np.asarray(dp2["placeholders"]), np.asarray(dp["placeholders"]))
  np.testing.assert_array_equal(np.asarray(dp2["layers"]["b_qkv"]), np.asarray(dp["layers"]["b_qkv"]))
  # the registry: `eagle` builds the parallel drafter from its directory; `eagle-parallel` refuses a sequential
  # one and a chain deeper than its positions
  build = lambda kind, head, k: registry.build(registry.get(kind), cfg, target, k=k, depth=None, buckets=None,
                                              ngram=3, ngram_caps=(), head=head)
  d, _ = build("eagle", (ecfg2, dp2), 3)
  assert isinstance(d, ParallelEagleDrafter) and d.max_depth == 3
  # a result names what ran: `eagle` given a parallel head's directory is labelled eagle-parallel
  label = lambda drafter, **kw: builder.Decode(builder.DecodeSpec("eagle", **kw), SimpleNamespace(drafter=drafter),
                                               None, 3, None, 64).label
  assert label(d) == "eagle-parallel k=3" and label(d, head_weights="int8") == "eagle-parallel@int8 k=3"
  assert label(eagle.EagleDrafter(cfg, ecfg=ecfg2)) == "eagle k=3"
  with pytest.raises(SpecjaxError, match="3 positions per forward"):
    build("eagle-parallel", (ecfg2, dp2), 4)
  seq_cfg = eagle.EagleConfig(cfg, (0, 2), 16)
  with pytest.raises(SpecjaxError, match="holds a sequential one"):
    build("eagle-parallel", (seq_cfg, dp2), 3)


def test_a_parallel_drafter_needs_two_positions():
  with pytest.raises(ValueError, match="K >= 2"):
    eagle.EagleConfig(CFG, (), 0, parallel=1)
