"""Per-row sampling through the engine (``Engine(per_row=True)``: each sequence's settings and seed are data in
the state, the server's mode).  Rows with different settings decoded together are each lossless against plain
sampling with their own settings (chi-square, 20,000 samples per setting, fixed seeds; the test fails on a rule
without the residual update); greedy rows among them give exactly the greedy engine's tokens; a row gives the
same tokens alone or batched; the log-probabilities recorded are the target's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import kv_cache, decoder as model, sampling, sampling_rows
from specjax.speculative import Engine, ModelDrafter, SpeculativeSampling, generate
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import DynamicShape
from tests.helpers.lossless import MICRO, MICRO_PROMPT, N_SAMPLES, SETTINGS, _chi2_pvalue, _exact_joint, _micro_params

GREEDY = sampling.SamplingParams()
N_GREEDY = 64


def _run(target, draft, settings, seeds, shape, new=3, drafter=None, acceptance=None, S=16):
  B = len(settings)
  eng = Engine(cfg=MICRO, drafter=drafter or ModelDrafter(MICRO), k_max=shape.num_nodes, sp=GREEDY, tree=shape,
               acceptance=acceptance, per_row=True)
  prompt = jnp.tile(jnp.asarray(MICRO_PROMPT, jnp.int32), (B, 1))
  rows = sampling_rows.RowState.create(settings, seeds, S)
  return generate(target, draft, kv_cache.init_cache(MICRO, B, S), prompt, jnp.full((B,), 3), jnp.full((B,), new),
                  jnp.full((B,), shape.num_nodes), jax.random.PRNGKey(0), rows, engine=eng)


def _greedy_tokens(target, draft, shape, new=3, drafter=None, S=16):
  eng = Engine(cfg=MICRO, drafter=drafter or ModelDrafter(MICRO), k_max=shape.num_nodes, sp=GREEDY, tree=shape)
  prompt = jnp.asarray([MICRO_PROMPT], jnp.int32)
  st = generate(target, draft, kv_cache.init_cache(MICRO, 1, S), prompt, jnp.full((1,), 3), jnp.full((1,), new),
                jnp.full((1,), shape.num_nodes), jax.random.PRNGKey(0), engine=eng)
  return np.asarray(st.seq_BxS)[0, 3:3 + new]


def test_rows_with_different_settings_are_each_lossless(pair):
  """Two sampled settings and greedy rows share every step of one tree engine (3 children at the root: wider
  than top-k 2 and the nucleus); each setting's rows match its own plain-sampling joint."""
  target, draft = pair
  shape = tree_shapes.branching([3, 2])
  settings = [SETTINGS[0]] * N_SAMPLES + [SETTINGS[1]] * N_SAMPLES + [GREEDY] * N_GREEDY
  order = np.random.default_rng(0).permutation(len(settings))     # interleaved, not in blocks
  settings = [settings[i] for i in order]
  which = np.asarray([0 if s == SETTINGS[0] else 1 if s == SETTINGS[1] else 2 for s in settings])
  joints = [_exact_joint(target, sp) for sp in SETTINGS]
  greedy = _greedy_tokens(target, draft, shape)

  def pvalues(acceptance=None):
    seq = np.asarray(_run(target, draft, settings, range(len(settings)), shape, acceptance=acceptance).seq_BxS)[:, 3:6]
    return [_chi2_pvalue(seq[which == i], joints[i]) for i in range(2)], seq[which == 2]

  right, greedy_rows = pvalues()
  wrong, _ = pvalues(SpeculativeSampling(residual_update=False))
  print(f"per-row: p = {right} (the rule), {wrong} (no residual)")
  assert min(right) > 1e-3, right
  assert max(wrong) < 1e-6, wrong
  np.testing.assert_array_equal(greedy_rows, np.tile(greedy, (N_GREEDY, 1)))


MIXED = [sampling.SamplingParams(temperature=0.8), GREEDY, sampling.SamplingParams(temperature=1.2, top_k=3),
         sampling.SamplingParams(temperature=1.0, top_p=0.5)]


# (n-gram chains alone vs together: tests/serving/test_server.py, through the server)
@pytest.mark.parametrize("shape,drafter", [(tree_shapes.chain(3), None), (DynamicShape(6, top_k=2, max_depth=3), None)],
                         ids=["model-chain", "model-dynamic"])
def test_a_row_gives_the_same_tokens_alone_or_batched(shape, drafter):
  target, draft = _micro_params(6), _micro_params(7)
  seeds = [11, 22, 33, 44]
  together = _run(target, draft, MIXED, seeds, shape, new=12, drafter=drafter, S=32)
  seq = np.asarray(together.seq_BxS)[:, 3:15]
  for b in (0, 2, 3):                       # the sampled rows (the greedy one: against the greedy engine)
    alone = np.asarray(_run(target, draft, MIXED[b:b + 1], seeds[b:b + 1], shape, new=12, drafter=drafter,
                            S=32).seq_BxS)[0, 3:15]
    np.testing.assert_array_equal(alone, seq[b], err_msg=f"row {b} ({MIXED[b]})")
  np.testing.assert_array_equal(seq[1], _greedy_tokens(target, draft, shape, new=12, drafter=drafter, S=32))
  # another seed gives another sample (the seed is used)
  other = np.asarray(_run(target, draft, MIXED, [12, 22, 34, 44], shape, new=12, drafter=drafter, S=32).seq_BxS)
  assert (other[0, 3:15] != seq[0]).any() and (other[2, 3:15] != seq[2]).any()
  np.testing.assert_array_equal(other[3, 3:15], seq[3])          # its seed is unchanged


def test_recorded_logprobs_are_the_targets():
  """Each generated token's log-probability equals log_softmax of a plain forward over the output at that
  position (temperature 1, no filter: the model's own distribution)."""
  target, draft = _micro_params(6), _micro_params(7)
  st = _run(target, draft, MIXED, [1, 2, 3, 4], tree_shapes.chain(3), new=10, S=32)
  seq = np.asarray(st.seq_BxS)[:, :13]
  logits = model.forward(target, MICRO, jnp.asarray(seq), jnp.broadcast_to(jnp.arange(13), seq.shape),
                         kv_cache.init_cache(MICRO, len(MIXED), 16)).logits
  want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1))[:, 2:12], seq[:, 3:13, None], 2)[:, :, 0]
  np.testing.assert_allclose(np.asarray(st.rows.logprob_BxS)[:, 3:13], want, atol=1e-4)
  assert (np.asarray(st.rows.logprob_BxS)[:, :3] == 0).all()


def test_a_per_row_engine_without_rows_is_refused():
  target, draft = _micro_params(6), _micro_params(7)
  eng = Engine(cfg=MICRO, drafter=ModelDrafter(MICRO), k_max=2, sp=GREEDY, per_row=True)
  with pytest.raises(ValueError, match="rows=RowState"):
    generate(target, draft, kv_cache.init_cache(MICRO, 1, 16), jnp.asarray([MICRO_PROMPT]), jnp.full((1,), 3),
             jnp.full((1,), 3), jnp.full((1,), 2), jax.random.PRNGKey(0), engine=eng)
