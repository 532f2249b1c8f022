"""The speculative engine: greedy exactness for every drafter and k, losslessness tested statistically."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.speculative import (Engine, ModelDrafter, NgramDrafter, NoDrafter,
                                 generate, layer_subset)
from specjax.speculative.drafters import propose_chain
from specjax.speculative.hybrid import HybridDrafter, _SyncingModel
from specjax.speculative.trees.device import TreeAcceptance

CFG = config.TINY.replace(num_layers=3)
DRAFT_CFG = config.TINY.replace(name="tiny-draft", num_layers=1)
BUCKETS = (16, 32, 64)


@pytest.fixture(scope="module")
def target():
  return model.unstack_layers(model.init_params(CFG, jax.random.PRNGKey(0)))


def _drafters(target):
  return {
      "ngram": (NgramDrafter(3), ()),
      "ngram_capped": (NgramDrafter(3, match_caps=(1, 2)), ()),   # verifications with fewer live rows
      "model": (ModelDrafter(DRAFT_CFG, buckets=BUCKETS),
                model.unstack_layers(model.init_params(DRAFT_CFG, jax.random.PRNGKey(1)))),
      "layerskip": (ModelDrafter(CFG.replace(num_layers=2), buckets=BUCKETS), layer_subset(target, (0, 2))),
      "self": (ModelDrafter(CFG, buckets=BUCKETS), target),   # every draft accepted: the bonus-token path
      # lookup where 2 tokens repeat, the model elsewhere; catch-up chunks of 3 (several per step at K = 8)
      "hybrid": (HybridDrafter(_SyncingModel(DRAFT_CFG, buckets=BUCKETS, window=3), min_match=2),
                 model.unstack_layers(model.init_params(DRAFT_CFG, jax.random.PRNGKey(1)))),
      "hybrid_self": (HybridDrafter(_SyncingModel(CFG, buckets=BUCKETS, window=3), min_match=2), target),
  }


def _run(target, drafter, dparams, K, prompts, lens, max_new, sp=sampling.SamplingParams(), eos=(),
         seed=0, k_active=None):
  B = prompts.shape[0]
  eng = Engine(cfg=CFG, drafter=drafter, k_max=K, sp=sp, eos_ids=eos, buckets=BUCKETS)
  cache = kv_cache.init_cache(CFG, B, 64)
  k_act = jnp.full((B,), K if k_active is None else k_active, jnp.int32)
  st = generate(target, dparams, cache, jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(max_new),
                k_act, jax.random.PRNGKey(seed), engine=eng)
  seq = np.asarray(st.seq_BxS)
  return [seq[i, lens[i]:lens[i] + int(st.num_new_B[i])].tolist() for i in range(B)], st


PROMPTS = np.array([[5, 6, 7, 8, 5, 6, 0, 0], [9, 10, 11, 12, 13, 14, 9, 10], [3, 0, 0, 0, 0, 0, 0, 0]],
                   np.int32)
LENS = np.array([6, 8, 1])


@pytest.mark.parametrize("name", ["ngram", "ngram_capped", "model", "layerskip", "self", "hybrid", "hybrid_self"])
def test_greedy_output_equals_plain_greedy(target, name):
  drafter, dparams = _drafters(target)[name]
  max_new = np.array([20, 13, 17], np.int32)
  base, _ = _run(target, NoDrafter(), (), 0, PROMPTS, LENS, max_new)
  eos = (base[1][6],)   # stop sequence 1 early, mid-iteration
  base_eos, _ = _run(target, NoDrafter(), (), 0, PROMPTS, LENS, max_new, eos=eos)
  for K in (1, 6):      # one draft slot, and several (each K compiles the 30-odd-op step once more)
    out, st = _run(target, drafter, dparams, K, PROMPTS, LENS, max_new)
    assert out == base, (name, K)
    if K == 6:
      out, _ = _run(target, drafter, dparams, K, PROMPTS, LENS, max_new, eos=eos)
      assert out == base_eos, (name, K)
    s = st.stats
    assert int(s.accepted_B.sum()) <= int(s.drafted_B.sum())
    assert np.all(np.asarray(s.pos_accepted_D) <= np.asarray(s.pos_reached_D))
  if name in ("self", "hybrid_self") and K == 6:
    assert int(s.accepted_B.sum()) > 0
  if name == "self":
    assert int(s.accepted_B.sum()) == int(s.drafted_B.sum()) > 0
  if name == "ngram_capped":   # verifications with fewer live rows happened, and full ones too
    steps = np.asarray(s.verify_rows_N1)
    assert steps[:-1].sum() > 0 and steps[-1] > 0, steps


def test_ngram_caps_limit_proposals_by_match_length():
  seq = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 9, 8, 7, 0, 0, 0]], jnp.int32)
  # newest token 3 at index 9: a 3-gram match (1 2 3) -> up to K; caps for 1- and 2-token matches only.
  sp = sampling.SamplingParams()
  _, toks, limit = propose_chain(NgramDrafter(3, match_caps=(0, 1)), (), (), seq, jnp.asarray([9]), seq[:, 9], 4,
                                 None, sp)
  assert limit.tolist() == [4] and toks[0].tolist() == [4, 5, 6, 7]
  # newest token 7 at index 12 (after 9 8): only a 1-token match (the 7 at index 6) -> capped to 0 / 2.
  for caps, want in (((0, 1), 0), ((2, 1), 2), ((), 4)):
    _, toks, limit = propose_chain(NgramDrafter(3, match_caps=caps), (), (), seq, jnp.asarray([12]), seq[:, 12],
                                   4, None, sp)
    assert limit.tolist() == [want], caps
    assert toks[0, :want].tolist() == [1, 2, 3, 9][:want]


def test_hybrid_uses_both_sources_and_keeps_its_draft_cache_exact(target):
  """After lookup steps (the draft model skipped) and model steps (catching up first), the draft cache holds,
  at every position it calls synced, exactly what one prefill of the draft model over the tokens gives."""
  drafter, dparams = _drafters(target)["hybrid_self"]
  max_new = np.array([24, 24, 24], np.int32)
  base, _ = _run(target, NoDrafter(), (), 0, PROMPTS, LENS, max_new)
  out, st = _run(target, drafter, dparams, 4, PROMPTS, LENS, max_new)
  assert out == base
  lookups, iters = np.asarray(st.draft.lookup_steps_B), int(st.stats.iterations)
  assert lookups.sum() > 0 and np.any(lookups < iters), (lookups, iters)   # both sources drafted
  seq, synced = np.asarray(st.seq_BxS), np.asarray(st.draft.synced_B)
  ref = kv_cache.init_cache(CFG, 3, 64)
  T = int(synced.max())
  ref = model.forward(dparams, CFG, jnp.asarray(seq[:, :T]), jnp.broadcast_to(jnp.arange(T), (3, T)), ref).cache
  for b in range(3):
    assert synced[b] >= LENS[b] + 1, synced
    n = int(synced[b])
    np.testing.assert_allclose(np.asarray(st.draft.cache.k)[:, b, :n], np.asarray(ref.k)[:, b, :n], atol=2e-4)
    np.testing.assert_allclose(np.asarray(st.draft.cache.v)[:, b, :n], np.asarray(ref.v)[:, b, :n], atol=2e-4)


def test_hybrid_refuses_trees():
  from specjax.speculative.trees import specs as tree_shapes
  d = HybridDrafter(_SyncingModel(DRAFT_CFG), min_match=2)
  seq = jnp.zeros((1, 16), jnp.int32)
  with pytest.raises(ValueError, match="chains only"):
    d.propose((), None, seq, jnp.asarray([3]), seq[:, 3], tree_shapes.parse_tree_spec("branch:2,1").build(None),
              None, sampling.SamplingParams())


def test_k_active_masks_slots(target):
  drafter, dparams = _drafters(target)["self"]
  max_new = np.array([16, 16, 16], np.int32)
  base, _ = _run(target, NoDrafter(), (), 0, PROMPTS, LENS, max_new)
  out, st = _run(target, drafter, dparams, 8, PROMPTS, LENS, max_new, k_active=2)
  assert out == base
  pos = np.asarray(st.stats.pos_reached_D)
  assert pos[2:].sum() == 0 and pos[:2].sum() > 0


# ----------------------------------------------------------------------------------------------------------
# Losslessness: the joint distribution of the first three sampled tokens equals plain sampling's.

MICRO = config.ModelConfig(name="micro", vocab_size=12, num_layers=2, d_model=16, num_heads=2, num_kv_heads=1,
                           head_dim=8, ffn_dim=32, max_position=64)
MICRO_PROMPT = [1, 2, 3]
N_SAMPLES = 20_000


def _micro_params(seed, cfg=MICRO):
  p = model.init_params(cfg, jax.random.PRNGKey(seed))
  p["embed"] = p["embed"] * 0.3      # softer distributions: many tokens have real probability
  return p


def _exact_joint(params, sp, cfg=MICRO):
  """p(t1, t2, t3) of plain sampling, by enumerating every prefix (V^2 forwards, one batch)."""
  V = cfg.vocab_size
  pairs = np.array(list(itertools.product(range(V), repeat=2)), np.int32)           # [V^2, 2]
  toks = np.concatenate([np.tile(MICRO_PROMPT, (len(pairs), 1)), pairs], axis=1)     # [V^2, 5]
  cache = kv_cache.init_cache(cfg, len(toks), 8)
  logits = model.forward(params, cfg, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(5), toks.shape),
                         cache).logits
  probs = lambda lg: np.asarray(sampling.probs(lg, sp), np.float64)
  p1 = probs(logits[0, 2][None])[0]                                                  # [V]
  p2 = probs(logits[:, 3]).reshape(V, V, V)[:, 0, :]                                 # p(t2 | t1)
  p3 = probs(logits[:, 4]).reshape(V, V, V)                                          # p(t3 | t1, t2)
  return p1[:, None, None] * p2[:, :, None] * p3


def _spec_samples(target, draft, sp, K=2, acceptance=None, drafter=None, cfg=MICRO):
  drafter = drafter or ModelDrafter(cfg)
  eng = Engine(cfg=cfg, drafter=drafter, k_max=K, sp=sp, acceptance=acceptance)
  B = N_SAMPLES
  cache = kv_cache.init_cache(cfg, B, 16)
  prompt = jnp.tile(jnp.asarray(MICRO_PROMPT, jnp.int32), (B, 1))
  st = generate(target, draft, cache, prompt, jnp.full((B,), 3), jnp.full((B,), 3), jnp.full((B,), K),
                jax.random.PRNGKey(1234), engine=eng)
  return np.asarray(st.seq_BxS)[:, 3:6]


def _chi2_pvalue(samples_Nx3, joint):
  V = MICRO.vocab_size
  idx = samples_Nx3[:, 0] * V * V + samples_Nx3[:, 1] * V + samples_Nx3[:, 2]
  observed = np.bincount(idx, minlength=V ** 3).astype(float)
  expected = joint.reshape(-1) * len(samples_Nx3)
  if observed[expected == 0].sum() > 0:
    return 0.0                        # a token that plain sampling can never produce
  big = expected >= 5                # pool the rare cells so the chi-square approximation holds
  obs, exp = observed[big], expected[big]
  if expected[~big].sum() > 0:
    obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
  exp *= obs.sum() / exp.sum()       # float rounding in the enumerated probabilities
  return stats.chisquare(obs, exp).pvalue


@dataclasses.dataclass(frozen=True)
class AcceptAlways:
  """A deliberately wrong rule: keep the deepest draft, bonus from p."""

  def __call__(self, tree, target_logits, q, key, sp, without_replacement):
    leaf = jnp.argmax(jnp.where(tree.valid_BxN1, tree.depth_BxN1, -1), axis=1).astype(jnp.int32)
    p = jax.nn.softmax(sampling.filtered_logits(
        jnp.take_along_axis(target_logits, leaf[:, None, None], axis=1)[:, 0], sp), axis=-1)
    nxt = jax.random.categorical(key, jnp.log(p + 1e-30)).astype(jnp.int32)
    return TreeAcceptance(leaf, nxt, jnp.take_along_axis(tree.anc_BxN1xN1, leaf[:, None, None], axis=1)[:, 0])


@pytest.mark.parametrize("sp", [sampling.SamplingParams(temperature=1.0),
                                sampling.SamplingParams(temperature=0.8, top_k=8, top_p=0.8)],
                         ids=["t1", "t0.8_topk8_topp0.8"])
def test_speculative_sampling_is_lossless(sp):
  target, draft = _micro_params(0), _micro_params(7)
  joint = _exact_joint(target, sp)
  p_model = _chi2_pvalue(_spec_samples(target, draft, sp), joint)
  p_ngram = _chi2_pvalue(_spec_samples(target, (), sp, drafter=NgramDrafter(2)), joint)
  # hybrid: a 1-token match is common among 12 tokens, so lookup, model and mixed steps all occur
  p_hybrid = _chi2_pvalue(_spec_samples(target, draft, sp, drafter=HybridDrafter(_SyncingModel(MICRO), 1)), joint)
  assert p_model > 1e-3, p_model
  assert p_ngram > 1e-3, p_ngram
  assert p_hybrid > 1e-3, p_hybrid
  if sp.top_k == 0:                       # once is enough to show the test has power: a wrong rule is caught
    p_broken = _chi2_pvalue(_spec_samples(target, draft, sp, acceptance=AcceptAlways()), joint)
    assert p_broken < 1e-6, p_broken


def test_plain_sampling_matches_exact_joint():
  """The k = 0 path (plain sampling through the same step) against the enumerated distribution."""
  sp = sampling.SamplingParams(temperature=1.0)
  target = _micro_params(0)
  assert _chi2_pvalue(_spec_samples(target, (), sp, K=0, drafter=NoDrafter()), _exact_joint(target, sp)) > 1e-3
