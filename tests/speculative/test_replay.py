"""Offline replay (``speculative/replay.py``) reproduces the engine: greedy, every counter exactly for n-gram,
a draft model and an EAGLE head over a chain, a static tree and a dynamic tree; a sampled n-gram tree exactly;
sampled chains, the engine's
step count within the replay's stated error over the engine's own outputs and over plain sampling's, and a
wrongly recorded target (another temperature) caught by the same statistic."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.speculative import Engine, ModelDrafter, NgramDrafter, NoDrafter, eagle, generate
from specjax.speculative import replay as rp
from specjax.speculative.drafters import DynamicShape
from specjax.speculative.trees import specs as tree_shapes

CFG = config.TINY.replace(num_layers=3)
DRAFT_CFG = config.TINY.replace(name="tiny-draft", num_layers=1)
BUCKETS = (16, 32, 64)
S = 64
PROMPTS = np.array([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [9, 10, 11, 12, 13, 14, 9, 10, 0, 0], [3] + [0] * 9], np.int32)
LENS = np.array([10, 8, 1])
MAX_NEW = np.array([24, 19, 21], np.int32)
SHAPES = {"chain": tree_shapes.chain(3), "branch": tree_shapes.branching([3, 2, 1]),
          "dynamic": DynamicShape(6, top_k=2, max_depth=3)}
COUNTERS = ("committed_B", "verify_steps_B", "accepted_B", "drafted_B", "pos_accepted_D", "pos_reached_D",
            "verify_rows_N1", "node_accepted_N1", "draft_forwards")


@pytest.fixture(scope="module")
def target():
  return model.init_params(CFG, jax.random.PRNGKey(0))


def _drafter(name, target, shape):
  """(drafter, its params) built for ``shape``."""
  if name == "ngram":
    return NgramDrafter(2), ()
  if name == "model":   # the target's first layer with noise: drafts that are often, not always, right
    noisy = jax.tree_util.tree_map(lambda x: x + 0.02 * jax.random.normal(jax.random.PRNGKey(5), x.shape), target)
    return ModelDrafter(CFG.replace(num_layers=1), buckets=BUCKETS), model.unstack_layers(
        {**noisy, "layers": jax.tree_util.tree_map(lambda x: x[:1], noisy["layers"])})
  ecfg = eagle.EagleConfig(CFG, (0, 2), 0)
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(1))
  return (eagle.EagleDrafter(ecfg.layer_cfg, buckets=BUCKETS, ecfg=ecfg, max_depth=shape.max_depth),
          {**tr, **eagle.frozen_from_target(ecfg, target, None)})


def _engine_run(tparams, drafter, dp, shape, sp, prompts, lens, max_new, seed=0):
  eng = Engine(cfg=CFG, drafter=drafter, k_max=shape.num_nodes, sp=sp, buckets=BUCKETS, tree=shape)
  B = prompts.shape[0]
  st = generate(tparams, dp, kv_cache.init_cache(CFG, B, S), jnp.asarray(prompts), jnp.asarray(lens),
                jnp.asarray(max_new), jnp.full((B,), shape.num_nodes, jnp.int32), jax.random.PRNGKey(seed),
                engine=eng)
  return eng, st


def _known(tparams, eng, st, lens, sp):
  """The engine's (or plain decoding's) outputs, recorded by one teacher-forced pass."""
  ends = np.asarray(lens) + np.asarray(st.num_new_B)
  seq = np.where(np.arange(S)[None, :] < ends[:, None], np.asarray(st.seq_BxS), 0)
  return rp.record(tparams, CFG, seq, lens, ends, sp, taps=eng.forward_taps)


@pytest.mark.parametrize("drafter_name", ["ngram", "model", "eagle"])
def test_greedy_replay_gives_the_engines_counters(target, drafter_name):
  """From plain greedy outputs (decoded a few tokens past the engine's budget, so the last step's acceptance is
  known), replay gives every counter of the engine's own run, for a chain, a static and a dynamic tree."""
  tparams = model.unstack_layers(target)
  sp = sampling.SamplingParams()
  _, plain = _engine_run(tparams, NoDrafter(), (), tree_shapes.chain(0), sp, PROMPTS, LENS, MAX_NEW + 5)
  accepted = 0
  for name, shape in SHAPES.items():
    drafter, dp = _drafter(drafter_name, target, shape)
    eng, st = _engine_run(tparams, drafter, dp, shape, sp, PROMPTS, LENS, MAX_NEW)
    known = _known(tparams, eng, plain, LENS, sp)
    got = rp.replay(eng, tparams, dp, known, max_new_B=MAX_NEW)
    for c in COUNTERS:
      np.testing.assert_array_equal(np.asarray(getattr(got.stats, c)), np.asarray(getattr(st.stats, c)),
                                    err_msg=f"{drafter_name} {name}: {c}")
    np.testing.assert_array_equal(np.asarray(got.seq_BxS), np.asarray(st.seq_BxS))
    assert rp.tau(got.stats) == rp.tau(st.stats)
    accepted += int(np.sum(st.stats.accepted_B))
  assert accepted > 0      # drafts were accepted: the replay is not trivial


def _steps_z(tparams, eng, dp, known, engine_steps, repeats=40, broken=None):
  """(engine's total steps − the replay's mean) / the replay's standard error: the engine's steps are one
  draw of the replay's distribution given the outputs, so |z| stays small when replay is right."""
  draws = []
  for r in range(repeats):
    st = rp.replay(eng, tparams, dp, known, key=jax.random.PRNGKey(100 + r), broken=broken)
    draws.append(np.asarray(st.stats.verify_steps_B, np.float64))
  draws = np.stack(draws)                                        # [repeats, B]
  mean, var = draws.mean(0), draws.var(0, ddof=1)
  return float((np.sum(engine_steps) - mean.sum()) / np.sqrt(var.sum() + 1e-9)), mean


SAMPLED_B = 24


@pytest.mark.parametrize("drafter_name", ["ngram", "model", "eagle"])
def test_sampled_chain_replay_matches_the_engine_within_its_error(target, drafter_name):
  """At T = 1 (top-p 0.9) the engine's step count over 24 sequences is within 4 standard errors of replay's
  over the same outputs (the stated tolerance; fixed seeds), and the same holds for the engine's τ against
  replay over plain sampling's outputs of the same prompts.  The engine's rule applied to the given output
  (``broken="unconditioned"``: min(1, p/q) instead of min(1, q/p)) moves the statistic far outside: the check
  can fail."""
  tparams = model.unstack_layers(target)
  sp = sampling.SamplingParams(temperature=1.0, top_p=0.9)
  prompts = np.tile(PROMPTS, (SAMPLED_B // 3, 1))
  lens, max_new = np.tile(LENS, SAMPLED_B // 3), np.tile(MAX_NEW, SAMPLED_B // 3)
  shape = tree_shapes.chain(3)
  drafter, dp = _drafter(drafter_name, target, shape)
  eng, st = _engine_run(tparams, drafter, dp, shape, sp, prompts, lens, max_new, seed=7)
  z, _ = _steps_z(tparams, eng, dp, _known(tparams, eng, st, lens, sp), np.asarray(st.stats.verify_steps_B))
  assert abs(z) < 4, (drafter_name, z)
  assert int(np.sum(st.stats.accepted_B)) > 0
  # plain sampling's outputs (other draws of the same distribution): E[τ] the same within the error
  _, plain = _engine_run(tparams, NoDrafter(), (), tree_shapes.chain(0), sp, prompts, lens, max_new, seed=11)
  plain_known = _known(tparams, eng, plain, lens, sp)
  tau_replay = [rp.tau(rp.replay(eng, tparams, dp, plain_known, max_new_B=max_new,
                                 key=jax.random.PRNGKey(200 + r)).stats) for r in range(8)]
  tau_engine = [rp.tau(_engine_run(tparams, drafter, dp, shape, sp, prompts, lens, max_new, seed=s)[1].stats)
                for s in (7, 8, 9)]
  spread = np.std(tau_engine + tau_replay, ddof=1)
  assert abs(np.mean(tau_engine) - np.mean(tau_replay)) < 4 * spread * np.sqrt(1 / 3 + 1 / 8) + 1e-9, \
      (tau_engine, tau_replay)
  if drafter_name == "model":       # the wrong rule
    z_wrong, _ = _steps_z(tparams, eng, dp, _known(tparams, eng, st, lens, sp), np.asarray(st.stats.verify_steps_B),
                          repeats=10, broken="unconditioned")
    assert abs(z_wrong) > 6, z_wrong


def test_sampled_ngram_tree_replay_gives_the_engines_steps(target):
  """A deterministic drafter's sampled tree: the output's token is accepted exactly when it is a child (the
  trie's siblings are distinct), so replay over the engine's own outputs gives its steps and tokens exactly."""
  tparams = model.unstack_layers(target)
  sp = sampling.SamplingParams(temperature=0.7)
  shape = tree_shapes.branching([2, 2, 1])
  prompts = np.tile(PROMPTS, (4, 1))
  lens, max_new = np.tile(LENS, 4), np.tile(MAX_NEW, 4)
  eng, st = _engine_run(tparams, NgramDrafter(1), (), shape, sp, prompts, lens, max_new, seed=3)
  got = rp.replay(eng, tparams, (), _known(tparams, eng, st, lens, sp), key=jax.random.PRNGKey(9))
  for c in ("committed_B", "verify_steps_B", "drafted_B"):
    np.testing.assert_array_equal(np.asarray(getattr(got.stats, c)), np.asarray(getattr(st.stats, c)), err_msg=c)
  assert int(np.sum(st.stats.accepted_B)) > 0


def test_replay_refuses_what_it_cannot_reproduce(target):
  tparams = model.unstack_layers(target)
  sp = sampling.SamplingParams(temperature=1.0)
  tree = tree_shapes.branching([2, 1])
  drafter, dp = _drafter("model", target, tree)
  eng = Engine(cfg=CFG, drafter=drafter, k_max=tree.num_nodes, sp=sp, buckets=BUCKETS, tree=tree)
  seq = np.zeros((1, S), np.int32)
  seq[0, :10] = np.arange(1, 11)
  known = rp.record(tparams, CFG, seq, [4], [10], sp)
  with pytest.raises(ValueError, match="sampled replay of a sampling drafter covers chains"):
    rp.replay(eng, tparams, dp, known)
  eng = Engine(cfg=CFG, drafter=NgramDrafter(2), k_max=3, sp=sampling.SamplingParams(), buckets=BUCKETS)
  with pytest.raises(ValueError, match="does not fit buffers of S=16"):
    rp.replay(eng, tparams, (), rp.record(tparams, CFG, np.zeros((1, 16), np.int32), [4], [18],
                                            sampling.SamplingParams()))


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_acceptance_tables_from_replay_equal_the_decoded_ones(tiny, drafter, tmp_path):
  """``acceptance_vector(replay=True)`` (Sequoia's per-rank, per-depth tables from plain greedy outputs and the
  drafter alone) gives the table speculative decoding with the acceptance tree measures, count for count.  (The
  n-gram's ranks spread here; random tiny models agree on their first choice, so the model's row is 1, 0, 0.)"""
  from specjax import api
  from tests.helpers import CFG, random_hf_params, write_gguf
  prompts = ["hello world hello world hello", "the cat sat on the mat the cat", "a b c a b c a b"]
  draft = api.load(str(write_gguf(tmp_path / "draft.gguf", CFG, random_hf_params(CFG, seed=5)))) \
      if drafter == "model" else None
  kw = dict(drafter=drafter, ranks=3, depths=2, max_new_tokens=12, max_len=128, draft=draft)
  decoded = api.acceptance_vector(tiny, prompts, **kw)
  replayed = api.acceptance_vector(tiny, prompts, replay=True, **kw)
  assert replayed["measured_by"] == "replay" and decoded["measured_by"] == "speculative decoding"
  assert decoded["iterations"] > 0
  assert drafter == "model" or 0 < decoded["acceptance_vector"][0] < 1, decoded     # ranks that disagree
  for key in ("acceptance_vector", "acceptance_table", "iterations", "iterations_by_depth", "mean_accepted_length",
              "new_tokens"):
    assert replayed[key] == decoded[key], key
