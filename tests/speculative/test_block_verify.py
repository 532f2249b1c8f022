"""Block verification (``--verify block``, speculative/trees/block_verify.py) is lossless and accepts at least
as much as token-wise verification: the joint distribution of the first three tokens equals plain sampling's
(enumerated exactly on a micro model) for a model drafter's sampled chain and a deterministic drafter's chain,
and the test fails on a variant that stops at the first failed coin (no rescue of an earlier draft by a later
one, as token-wise verification stops); over 20,000 sequences, block verification's mean accepted drafts per
iteration is at least token-wise's (2.09 against 1.97 at temperature 1 here).  Over 12 pairs and settings
tried when it was written, the rule's p-values ranged 0.12-0.68."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import kv_cache, sampling
from specjax.speculative import Engine, ModelDrafter, SpeculativeSampling, generate
from specjax.speculative.acceptance import BlockVerification, rule_for
from specjax.speculative.suffix import SuffixDrafter
from specjax.speculative.trees import specs as tree_shapes
from tests.helpers.lossless import MICRO, MICRO_PROMPT, N_SAMPLES, SETTINGS, _chi2_pvalue, _exact_joint, _micro_params
from specjax.speculative.suffix import absorb, empty_index

K = 3


def _run(target, draft, sp, acceptance, drafter=None):
  eng = Engine(cfg=MICRO, drafter=drafter or ModelDrafter(MICRO), k_max=K, sp=sp, acceptance=acceptance)
  B = N_SAMPLES
  cache = kv_cache.init_cache(MICRO, B, 16)
  prompt = jnp.tile(jnp.asarray(MICRO_PROMPT, jnp.int32), (B, 1))
  st = generate(target, draft, cache, prompt, jnp.full((B,), 3), jnp.full((B,), 3), jnp.full((B,), K),
                jax.random.PRNGKey(2468), engine=eng)
  s = st.stats
  return np.asarray(st.seq_BxS)[:, 3:6], float(np.sum(s.accepted_B)) / float(np.sum(s.verify_steps_B))


@pytest.fixture(scope="module")
def pair():
  """The target (seed 6) and a draft (seed 8) sharpened 2x: close enough that chains are often accepted in
  part, far enough that the rules differ."""
  target, d = _micro_params(6), _micro_params(8)
  return target, {**d, "embed": d["embed"] * 2}


@pytest.mark.parametrize("sp", [sampling.SamplingParams(temperature=1.0), SETTINGS[0]], ids=["t1", "topk2"])
def test_block_verification_of_a_sampled_chain_is_lossless_and_accepts_more(sp, pair):
  target, draft = pair
  joint = _exact_joint(target, sp)
  got, acc_block = _run(target, draft, sp, BlockVerification())
  broken, _ = _run(target, draft, sp, BlockVerification(broken="no_rescue"))
  _, acc_tokenwise = _run(target, draft, sp, SpeculativeSampling())
  p_right, p_broken = _chi2_pvalue(got, joint), _chi2_pvalue(broken, joint)
  print(f"{sp}: p = {p_right:.3g} (block), {p_broken:.3g} (no rescue); accepted per iteration "
        f"{acc_block:.3f} (block) vs {acc_tokenwise:.3f} (token-wise)")
  assert p_right > 1e-3, p_right
  assert p_broken < 1e-6, p_broken
  assert acc_block >= acc_tokenwise - 0.01, (acc_block, acc_tokenwise)


def _sampled_index(joint, n=200):
  """Earlier 'requests' that are samples of the target itself (the prompt, then three sampled tokens): the
  suffix drafter's chains are then often right, so that accepting or not matters."""
  V = MICRO.vocab_size
  flat = np.random.default_rng(5).choice(V ** 3, size=n, p=joint.reshape(-1) / joint.sum())
  seqs = [list(MICRO_PROMPT) + [int(f // (V * V)), int(f // V % V), int(f % V)] for f in flat]
  return absorb(empty_index(1024), seqs)


def test_block_verification_of_a_deterministic_chain_is_lossless():
  """A suffix drafter's chain: its drafts are point masses (no q), each weighed by the target's p alone.  (Its
  acceptance here is low, ~0.13 drafts per iteration, so the variant without the rescue is only weakly
  told apart, p ~1e-4: the power of the harness is shown on the sampled chains above.)"""
  target, sp = _micro_params(6), sampling.SamplingParams(temperature=0.5)
  joint = _exact_joint(target, sp)
  drafter = SuffixDrafter(cross_rows=False, min_prob=0.0, spec_factor=8.0)
  index = _sampled_index(joint)
  got, acc = _run(target, index, sp, BlockVerification(), drafter=drafter)
  p_right = _chi2_pvalue(got, joint)
  print(f"suffix chain: p = {p_right:.3g} (block); accepted {acc:.3f}")
  assert p_right > 1e-3, p_right
  assert acc > 0.05, acc


def test_block_verification_refuses_trees_and_unknown_rules():
  eng = Engine(cfg=MICRO, drafter=ModelDrafter(MICRO), k_max=6, sp=SETTINGS[0],
               tree=tree_shapes.branching([2, 2]), acceptance=BlockVerification())
  with pytest.raises(ValueError, match="judges a chain"):
    eng.rule
  assert Engine(cfg=MICRO, drafter=ModelDrafter(MICRO), k_max=3, sp=SETTINGS[0], tree=tree_shapes.chain(3),
                acceptance=BlockVerification()).rule == BlockVerification()
  with pytest.raises(ValueError, match="unknown verification rule 'joint'"):
    rule_for(SETTINGS[0], "joint")
  assert isinstance(rule_for(sampling.SamplingParams(temperature=0.0), "block"), type(rule_for(
      sampling.SamplingParams(temperature=0.0))))


def test_verify_flag_reaches_the_engine(tiny_model):
  """``--verify`` names the rules the engine has; ``--verify block`` with a tree, or an unknown name, is one
  line; through the API, ``verify="block"`` builds the block rule into the engine, decodes a sampled chain
  and greedy output is unchanged."""
  from specjax import api
  from specjax.cli import flags
  from specjax.errors import SpecjaxError
  from specjax.runtime import builder
  from specjax.speculative.acceptance import VERIFY_RULES
  assert flags.VERIFY == VERIFY_RULES
  with pytest.raises(SpecjaxError, match="judges a chain of drafts, and --tree drafts a tree"):
    api.decode_spec(drafter="ngram", tree="branch:2,2", verify="block", temperature=1.0)
  with pytest.raises(SpecjaxError, match="unknown verification rule 'joint'"):
    api.decode_spec(drafter="ngram", verify="joint")
  engine = builder.make_engine(api.load(tiny_model), None, 3, sampling.SamplingParams(temperature=1.0), (), 64,
                               verify="block")
  assert engine.rule == BlockVerification()
  m = api.load(tiny_model)
  prompts = ["a b a b a b", "c d c d"]
  plain, _ = api.generate(m, prompts, max_new_tokens=12)
  greedy, _ = api.generate(m, prompts, max_new_tokens=12, drafter="ngram", k=3, verify="block")
  assert [g.token_ids for g in greedy] == [p.token_ids for p in plain]
  sampled, stats = api.generate(m, prompts, max_new_tokens=12, drafter="ngram", k=3, verify="block",
                                temperature=1.0, seed=1)
  assert all(len(g.token_ids) > 0 for g in sampled) and stats["drafted_tokens"] > 0


def test_bench_compares_both_rules_under_sampling_in_one_paired_run(tiny_model):
  """``bench --temperature 1 --verify tokenwise,block``: plain decoding and both rules on the same prompts, each
  prompt batch sampled from one key for every method (``batch_key``); τ and α per rule; at temperature 0 the
  block rule is greedy acceptance (identical outputs)."""
  from specjax import api
  from specjax.eval import bench
  m = api.load(tiny_model)
  prompts = [api.Prompt(i, "qa", f"the world the world {i}") for i in range(2)]
  r = bench.bench(m, prompts, drafter="model", draft=m, k=3, max_new_tokens=8, bandwidth={"best": 10.0},
                  temperature=1.0, verify=["tokenwise", "block"], seed=5, log=lambda *a: None)
  assert r["temperature"] == 1.0 and r["seed"] == 5
  rules = [t.get("verify", "tokenwise") for t in r["methods"]]
  assert rules == ["tokenwise", "block"], rules
  assert [t["method"] for t in r["methods"]] == ["model k=3", "model k=3 verify=block"]
  for t in r["methods"]:
    assert t["drafted_tokens"] > 0 and 1.0 <= t["mean_accepted_length"] <= 4.0 and 0 <= t["acceptance_rate"] <= 1
  g = bench.bench(m, prompts, drafter="model", draft=m, k=3, max_new_tokens=8, bandwidth={"best": 10.0},
                  verify="block", log=lambda *a: None)
  assert g["outputs_identical"] == g["outputs_compared"] == 2
  a, b = bench.batch_key(5, np.zeros((1, 4), np.int32)), bench.batch_key(5, np.ones((1, 4), np.int32))
  assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_synthetic_acceptance_keeps_each_draft_with_probability_alpha(tiny_model):
  """``bench --synthetic-alpha A`` (not lossless): at α = 0 nothing is accepted, at α = 1 every draft, and in
  between the first position's acceptance is α within 4σ over 20,000 sequences (micro model); α outside [0, 1]
  and a tree are refused in one line."""
  from specjax import api
  from specjax.errors import SpecjaxError
  from specjax.eval import bench
  from specjax.speculative.acceptance import SyntheticAcceptance
  target, draft = _micro_params(6), _micro_params(8)
  sp = sampling.SamplingParams()

  def first_position(alpha):
    eng = Engine(cfg=MICRO, drafter=ModelDrafter(MICRO), k_max=K, sp=sp, acceptance=SyntheticAcceptance(alpha))
    cache = kv_cache.init_cache(MICRO, N_SAMPLES, 16)
    prompt = jnp.tile(jnp.asarray(MICRO_PROMPT, jnp.int32), (N_SAMPLES, 1))
    st = generate(target, draft, cache, prompt, jnp.full((N_SAMPLES,), 3), jnp.full((N_SAMPLES,), 3),
                  jnp.full((N_SAMPLES,), 8), jax.random.PRNGKey(11), engine=eng)
    s = st.stats
    return float(s.pos_accepted_D[0]) / float(np.sum(s.verify_steps_B)), s
  assert first_position(0.0)[0] == 0.0
  one, s = first_position(1.0)
  assert one == 1.0 and int(s.pos_accepted_D[K - 1]) > 0
  got, _ = first_position(0.6)
  assert abs(got - 0.6) < 4 * np.sqrt(0.6 * 0.4 / N_SAMPLES), got
  with pytest.raises(SpecjaxError, match="--synthetic-alpha is a probability"):
    api.decode_spec(drafter="ngram", synthetic_alpha=1.5)
  with pytest.raises(SpecjaxError, match="--tree drafts a tree"):
    api.decode_spec(drafter="ngram", tree="branch:2,2", synthetic_alpha=0.5)
  m = api.load(tiny_model)
  prompts = [api.Prompt(i, "qa", f"the world the world {i}") for i in range(2)]
  r = bench.bench(m, prompts, drafter="model", draft=m, k=3, max_new_tokens=12, bandwidth={"best": 10.0},
                  synthetic_alpha=1.0, log=lambda *a: None)
  assert r["synthetic_alpha"] == 1.0 and r["method"].endswith("synthetic α=1")
  assert r["acceptance_rate"] > 0.9, r["acceptance_rate"]
