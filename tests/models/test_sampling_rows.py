"""Per-sequence sampling settings (specjax/models/sampling_rows.py) equal the static ones row by row, and a row's
draws depend on its own key only."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import sampling, sampling_rows

SETTINGS = [sampling.SamplingParams(), sampling.SamplingParams(temperature=1.0),
            sampling.SamplingParams(temperature=0.7, top_k=5), sampling.SamplingParams(temperature=1.3, top_p=0.6),
            sampling.SamplingParams(temperature=0.9, top_k=8, top_p=0.5), sampling.SamplingParams(temperature=1.0, top_k=1)]


@pytest.fixture
def logits():
  return jnp.asarray(np.random.default_rng(0).standard_normal((len(SETTINGS), 40)) * 2, jnp.float32)


def test_each_row_gets_its_own_settings(logits):
  rs = sampling_rows.RowSampling.of(SETTINGS)
  got = sampling_rows.probs(logits, rs)
  for b, sp in enumerate(SETTINGS):
    np.testing.assert_allclose(got[b], sampling.probs(logits[b:b + 1], sp)[0], atol=1e-6, err_msg=str(sp))
  filt = sampling_rows.filtered_logits(logits, rs)
  for b, sp in enumerate(SETTINGS[1:], start=1):    # (meaningless for the greedy row)
    kept = np.asarray(sampling.filtered_logits(logits[b:b + 1], sp)[0]) > -1e30
    np.testing.assert_array_equal(np.asarray(filt[b]) > -1e30, kept, err_msg=str(sp))


def test_filters_work_on_tree_shaped_logits(logits):
  rs = sampling_rows.RowSampling.of(SETTINGS)
  lg = jnp.stack([logits, logits[:, ::-1]], axis=1)                        # [B, 2, V]
  got = sampling_rows.probs(lg, rs)
  for b, sp in enumerate(SETTINGS):
    np.testing.assert_allclose(got[b], sampling.probs(lg[b], sp), atol=1e-6)


def test_a_rows_draws_depend_on_its_key_alone(logits):
  rs = sampling_rows.RowSampling.of(SETTINGS)
  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(len(SETTINGS)))
  step_keys = sampling_rows.row_keys(keys, 3)
  tok = sampling_rows.sample(logits, step_keys, rs)
  # row 3 alone, with its own key: the same token
  alone = sampling_rows.sample(logits[3:4], step_keys[3:4], sampling_rows.RowSampling.of(SETTINGS[3:4]))
  assert int(alone[0]) == int(tok[3])
  assert int(tok[0]) == int(jnp.argmax(logits[0])) and int(tok[5]) == int(jnp.argmax(logits[5]))   # greedy, top-1
  # the draws follow the distribution: 4000 steps of row 1's key against its probabilities
  many = jax.vmap(lambda s: sampling_rows.sample(logits[1:2], sampling_rows.row_keys(keys[1:2], s),
                                                 sampling_rows.RowSampling.of(SETTINGS[1:2]))[0])(jnp.arange(4000))
  freq = np.bincount(np.asarray(many), minlength=40) / 4000
  p = np.asarray(sampling.probs(logits[1:2], SETTINGS[1])[0])
  assert np.abs(freq - p).max() < 0.03


@pytest.mark.parametrize("scale,peak", [(2.0, 12.0), (0.1, 0.0)], ids=["cut-among-the-top-candidates", "flat-falls-back-to-the-sort"])
def test_the_candidate_filter_equals_the_static_one_on_a_large_vocabulary(scale, peak):
  """V = 2000 > TOP_CANDIDATES: a peaked distribution is cut among the top candidates, a flat one's nucleus lies
  further down and the batch falls back to the sort; either way each row equals ``sampling.probs``."""
  x = np.random.default_rng(1).standard_normal((len(SETTINGS), 3, 2000)) * scale
  x[..., :20] += peak
  x = jnp.asarray(x, jnp.float32)
  assert x.shape[-1] > sampling_rows.TOP_CANDIDATES
  got = np.asarray(sampling_rows.probs(x, sampling_rows.RowSampling.of(SETTINGS)))
  for b, sp in enumerate(SETTINGS):
    want = np.asarray(sampling.probs(x[b], sp))
    np.testing.assert_allclose(got[b], want, atol=1e-6, err_msg=str(sp))
    np.testing.assert_array_equal(got[b] > 0, want > 0, err_msg=str(sp))


def test_the_bisection_cut_equals_the_sort_cut():
  """The fallback for cuts outside the top candidates (bisection on the values' bits) keeps the tokens the
  reference sort keeps, row by row, ties included (a nucleus cut can differ from the sort's only where
  summation rounding decides it, a token of ~1e-9 mass at top-p 0.999; not reached by these settings)."""
  settings = SETTINGS + [sampling.SamplingParams(1.0, 700, 0.95), sampling.SamplingParams(1.3, 0, 0.3)]
  rs = sampling_rows.RowSampling.of(settings)
  x = np.random.default_rng(2).standard_normal((len(settings), 4, 3000)).astype(np.float32)
  x[:, :, 7] = x[:, :, 8]                                                         # a tie
  x = jnp.asarray(x)
  got = np.asarray(sampling_rows._filter_by_search(x, rs)) > -1e30
  want = np.asarray(sampling_rows._filter_by_sort(x, rs)) > -1e30
  np.testing.assert_array_equal(got, want)
  assert 0 < got[3].sum() < want[0].sum()                          # the cuts did cut (and not everything)
