"""The eagle-hybrid drafter (prompt lookup where the context repeats, the trained head elsewhere): greedy output
equals plain greedy with both sources drafting, the head's cache stays what a teacher-forced pass over the
committed tokens gives (lookup steps skip its depth forwards, never its root), sampling stays lossless
(chi-square, and a broken rule is caught), and the registry builds it and refuses what it cannot do."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.errors import SpecjaxError
from specjax.speculative import Engine, NoDrafter, eagle, generate, registry
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.eagle_lookup import EagleLookupDrafter
from tests.helpers import lossless as ts
from tests.helpers.eagle import _drafter_params

CFG = config.TINY.replace(num_layers=3)
BUCKETS = (16, 32, 64)
PROMPTS = np.array([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [9, 10, 11, 12, 13, 14, 9, 10, 0, 0], [3] + [0] * 9], np.int32)
LENS = np.array([10, 8, 1])


@pytest.fixture(scope="module")
def target():
  return model.init_params(CFG, jax.random.PRNGKey(0))


def _run(tparams, drafter, dp, K, rows):
  B = len(rows)
  N = K if drafter is not None else 0
  eng = Engine(cfg=CFG, drafter=drafter or NoDrafter(), k_max=N, sp=sampling.SamplingParams(), buckets=BUCKETS,
               tree=tree_shapes.chain(N))
  st = generate(tparams, dp, kv_cache.init_cache(CFG, B, 64), jnp.asarray(PROMPTS[rows]), jnp.asarray(LENS[rows]),
                jnp.full((B,), 30, jnp.int32), jnp.full((B,), N, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  seq = np.asarray(st.seq_BxS)
  return [seq[i, LENS[r]:LENS[r] + int(st.num_new_B[i])].tolist() for i, r in enumerate(rows)], st


@pytest.mark.parametrize("rows", [[0], [0, 1, 2]], ids=["one", "batch3"])
def test_greedy_equals_plain_with_both_sources_and_the_head_cache_exact(target, rows):
  """Greedy output equals plain greedy; lookup and head steps both occurred (with one sequence, whole steps of
  each: both branches of the cond); every head-cache entry before its length equals a fresh ``init`` over the
  committed tokens with the target's features (what the pure head would hold)."""
  tparams = model.unstack_layers(target)
  ecfg = eagle.EagleConfig(CFG, (0, 2), 0)
  _, dp = _drafter_params(ecfg, target)
  plain, _ = _run(tparams, None, (), 0, rows)
  d = EagleLookupDrafter(ecfg.layer_cfg, buckets=BUCKETS, ecfg=ecfg, max_depth=4, min_match=2)
  out, st = _run(tparams, d, dp, 4, rows)
  assert out == plain
  lookups, iters = np.asarray(st.draft.lookup_steps_B), np.asarray(st.stats.verify_steps_B)
  assert lookups.sum() > 0 and np.any(lookups < iters), (lookups, iters)
  seq, c = np.asarray(st.seq_BxS), np.asarray(st.draft.head.cache.lengths)
  for i, r in enumerate(rows):
    n = int(c[i])
    assert n > LENS[r]
    feats = model.forward(target, CFG, jnp.asarray(seq[i:i + 1, :n]), jnp.arange(n)[None],
                          kv_cache.init_cache(CFG, 1, 64), feature_layers=ecfg.feature_layers).features
    pure = eagle.EagleDrafter(ecfg.layer_cfg, buckets=BUCKETS, ecfg=ecfg, max_depth=4)
    ref = pure.init(dp, jnp.asarray(seq[i:i + 1, :n]), jnp.asarray([n]), 64, feats).cache
    for got, want in ((st.draft.head.cache.k, ref.k), (st.draft.head.cache.v, ref.v)):
      np.testing.assert_allclose(np.asarray(got)[:, i, :n], np.asarray(want)[:, 0, :n], atol=3e-4)


def test_a_head_that_never_matches_drafts_like_the_pure_head(target):
  """With a match longer than any repeat, every step is the head's: the same accepted counts as ``eagle``."""
  tparams = model.unstack_layers(target)
  ecfg = eagle.EagleConfig(CFG, (), 0)
  _, dp = _drafter_params(ecfg, target)
  _, st_h = _run(tparams, EagleLookupDrafter(ecfg.layer_cfg, buckets=BUCKETS, ecfg=ecfg, max_depth=3,
                                             min_match=40), dp, 3, [0, 1, 2])
  _, st_e = _run(tparams, eagle.EagleDrafter(ecfg.layer_cfg, buckets=BUCKETS, ecfg=ecfg, max_depth=3), dp, 3,
                 [0, 1, 2])
  assert int(np.asarray(st_h.draft.lookup_steps_B).sum()) == 0
  np.testing.assert_array_equal(np.asarray(st_h.stats.accepted_B), np.asarray(st_e.stats.accepted_B))


@pytest.mark.parametrize("sp", [sampling.SamplingParams(temperature=1.0),
                                sampling.SamplingParams(temperature=0.8, top_k=8, top_p=0.8)],
                         ids=["t1", "t0.8_topk8_topp0.8"])
def test_sampling_is_lossless(sp):
  """A 1-token match is common among 12 tokens, so lookup chains (point masses) and head chains (the head's q,
  a reduced vocabulary) mix within each step; the first three tokens' joint equals plain sampling's."""
  tgt = ts._micro_params(0)
  ecfg = eagle.EagleConfig(ts.MICRO, (0, 1), 6)
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(3))
  dp = {**tr, **eagle.frozen_from_target(ecfg, tgt, np.array([0, 2, 3, 5, 8, 11]))}
  drafter = EagleLookupDrafter(ecfg.layer_cfg, ecfg=ecfg, max_depth=2, min_match=1)
  joint = ts._exact_joint(tgt, sp)
  p_ok = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter), joint)
  assert p_ok > 1e-3, p_ok
  if sp.top_k == 0:            # the test has power: a wrong rule is caught
    p_broken = ts._chi2_pvalue(ts._spec_samples(tgt, dp, sp, drafter=drafter, acceptance=ts.AcceptAlways()), joint)
    assert p_broken < 1e-6, p_broken


def test_registry_builds_it_and_refuses_trees_and_parallel_heads(target):
  kind = registry.get("eagle-hybrid")
  assert kind.draft == "head" and not kind.trees and kind.ngram and not kind.priced
  ecfg = eagle.EagleConfig(CFG, (0, 2), 0)
  _, dp = _drafter_params(ecfg, target)
  d, _ = registry.build(kind, CFG, target, k=3, depth=None, buckets=BUCKETS, ngram=2, head=(ecfg, dp))
  assert isinstance(d, EagleLookupDrafter) and d.min_match == 2 and d.max_depth == 3
  seq = jnp.zeros((1, 16), jnp.int32)
  with pytest.raises(ValueError, match="chains only"):
    d.propose(dp, None, seq, jnp.asarray([3]), seq[:, 3], tree_shapes.branching([2, 1]), None,
              sampling.SamplingParams())
  par = eagle.EagleConfig(CFG, (0, 2), 0, parallel=3)
  with pytest.raises(SpecjaxError, match="eagle-parallel"):
    registry.build(kind, CFG, target, k=3, depth=None, buckets=BUCKETS, head=(par, dp))


def test_heads_on_a_quantized_target_are_greedy_exact_through_the_api(tmp_path):
  """``--weights int8``: the head's decoder layer is quantized like the target's; ``eagle`` and ``eagle-hybrid``
  decode what plain greedy decoding of the same quantized target does."""
  from specjax import api
  from specjax.models import quant
  from specjax.runtime import builder
  from tests.helpers import CFG as GGUF_CFG, eagle_dir, random_hf_params, write_gguf
  path = write_gguf(tmp_path / "target.gguf", GGUF_CFG, random_hf_params(GGUF_CFG, seed=3))
  m = api.load(str(path), dtype="float32", weights="int8")
  head = eagle_dir(m, tmp_path)
  assert quant.holds_quantized(builder._eagle_head(m, head)[1]["layers"])
  prompts = ["a b c a b c a b", "hello world hello"]
  plain, _ = api.generate(m, prompts, max_new_tokens=12, ignore_eos=True)
  for drafter in ("eagle", "eagle-hybrid"):
    out, _ = api.generate(m, prompts, drafter=drafter, draft=head, k=3, ngram=1, max_new_tokens=12,
                          ignore_eos=True, batch_size=2)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain], drafter


def test_a_head_at_its_own_weight_type_is_greedy_exact_and_labelled(tmp_path):
  """``--draft-weights int8/int4`` with a trained head over an fp32 target: its layer, ``fc``, ``fuse`` and head
  rows are quantized (int4 keeps the rows int8), decoding stays plain greedy's, the method is labelled with the
  head's type, and a head type on a drafter without a head, or an unknown type, is refused."""
  from specjax import api
  from specjax.models import quant
  from specjax.checkpoints import drafter_io
  from specjax.runtime import builder
  from tests.helpers import CFG as GGUF_CFG, random_hf_params, write_gguf
  path = write_gguf(tmp_path / "target.gguf", GGUF_CFG, random_hf_params(GGUF_CFG, seed=3))
  m = api.load(str(path), dtype="float32", weights="fp32")
  ecfg = eagle.EagleConfig(m.cfg, (0, 1), 8)          # fused taps and a reduced head of 8 rows
  head = str(tmp_path / "head")
  drafter_io.save_drafter(head, ecfg, eagle.init_trainable(ecfg, jax.random.PRNGKey(1)), target_name=m.source,
                          tokenizer=m.tokenizer, head_ids=np.arange(8) * 2)
  assert not quant.holds_quantized(builder._eagle_head(m, head)[1])
  prompts = ["a b c a b c a b", "hello world hello"]
  plain, _ = api.generate(m, prompts, max_new_tokens=12, ignore_eos=True)
  for w, rows in (("int8", "int8"), ("int4", "int8")):
    p = builder._eagle_head(m, head, w)[1]
    assert [p[n].kind for n in ("fc", "fuse", "lm_head")] == [w, w, rows]
    assert p["layers"][0]["w_gate_up"].kind == w
    for drafter in ("eagle", "eagle-hybrid"):
      out, _ = api.generate(m, prompts, drafter=drafter, draft=head, k=3, ngram=1, max_new_tokens=12,
                            ignore_eos=True, batch_size=2, head_weights=w)
      assert [o.token_ids for o in out] == [o.token_ids for o in plain], (drafter, w)
  d = builder.build(m, builder.DecodeSpec(drafter="eagle", k=3, head_weights="int8"), max_len=64, draft=head)
  assert d.label == "eagle@int8 k=3" and d.settings()["head_weights"] == "int8"
  with pytest.raises(SpecjaxError, match="has no head"):
    builder.build(m, builder.DecodeSpec(drafter="ngram", k=3, head_weights="int8"), max_len=64)
  with pytest.raises(SpecjaxError, match="unknown head weight type 'int3'"):
    builder.build(m, builder.DecodeSpec(drafter="eagle", k=3, head_weights="int3"), max_len=64, draft=head)
