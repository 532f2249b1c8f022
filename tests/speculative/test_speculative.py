"""The speculative engine: greedy exactness for every drafter and k, losslessness tested statistically."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import kv_cache, decoder as model, sampling
from specjax.speculative import (Engine, ModelDrafter, NgramDrafter, NoDrafter,
                                 generate, layer_subset)
from specjax.speculative.drafters import propose_chain
from specjax.speculative.hybrid import HybridDrafter, _SyncingModel
from tests.helpers.engine import BUCKETS, CFG, DRAFT_CFG, LENS, PROMPTS
from tests.helpers.lossless import MICRO, AcceptAlways, _chi2_pvalue, _exact_joint, _micro_params, _spec_samples


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
# Losslessness: the joint distribution of the first three sampled tokens equals plain sampling's
# (tests/helpers/lossless.py).


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
