"""Distillation losses against plain float64 numpy, with masked positions and excluded tokens."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.training import losses

N, V = 7, 11
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
EXCLUDED = (-1e30, MASK_VALUE)


def _logits(seed, excluded=(), value=-1e30):
  rng = np.random.default_rng(seed)
  x = rng.normal(0, 2.0, (N, V)).astype(np.float32)
  for n, v in excluded:
    x[n, v] = value
  return x


def _mask():
  m = np.ones(N, bool)
  m[[2, 5]] = False
  return m


def _garbage_at_masked(x):
  x = x.copy()
  x[2] = np.nan            # a masked position: never contributes, even as nan
  x[5, :] = -np.inf
  return x


def _logp(x):
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _kl(logp, logq):
  p = np.exp(logp)
  with np.errstate(all="ignore"):
    return np.where(p > 0, p * (logp - logq), 0).sum(-1)


def _ref(kind, p_logits, q_logits, beta=0.5):
  lp, lq = _logp(p_logits), _logp(q_logits)
  p, q = np.exp(lp), np.exp(lq)
  if kind == "fkl":
    return _kl(lp, lq)
  if kind == "rkl":
    return _kl(lq, lp)
  if kind == "jsd":
    with np.errstate(divide="ignore"):
      lm = np.log(beta * p + (1 - beta) * q)
    return beta * _kl(lp, lm) + (1 - beta) * _kl(lq, lm)
  return 0.5 * np.abs(p - q).sum(-1)


def _masked_mean(x, mask):
  return x[mask].mean()


# Excluded (position, token) pairs, chosen so each divergence stays finite: both sides exclude BOTH; the
# target alone excludes P_ONLY (fine for KL(p‖q), infinite for KL(q‖p)); the draft alone excludes Q_ONLY.
BOTH = [(0, 3), (1, 0), (1, 1), (6, 10)]
P_ONLY = [(0, 4), (3, 7)]
Q_ONLY = [(4, 2), (6, 0)]
CASES = {"fkl": (BOTH + P_ONLY, BOTH), "rkl": (BOTH, BOTH + Q_ONLY),
         "jsd": (BOTH + P_ONLY, BOTH + Q_ONLY), "tvd": (BOTH + P_ONLY, BOTH + Q_ONLY)}


@pytest.mark.parametrize("value", EXCLUDED)
@pytest.mark.parametrize("kind", losses.KINDS)
def test_divergence_matches_numpy(kind, value):
  p_ex, q_ex = CASES[kind]
  p, q = _logits(0, p_ex, value), _logits(1, q_ex, value)
  mask = _mask()
  got = losses.divergence(kind, _garbage_at_masked(p), _garbage_at_masked(q), mask)
  want = _masked_mean(_ref(kind, p, q), mask)
  assert np.isfinite(float(got))
  np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6)
  per = losses.divergence_per_position(kind, p, q)
  np.testing.assert_allclose(np.asarray(per), _ref(kind, p, q), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalised_jsd_beta(beta):
  p, q = _logits(2, BOTH + P_ONLY), _logits(3, BOTH + Q_ONLY)
  got = losses.divergence("jsd", p, q, _mask(), beta=beta)
  np.testing.assert_allclose(float(got), _masked_mean(_ref("jsd", p, q, beta), _mask()), rtol=1e-5, atol=1e-6)


def test_jsd_symmetric_and_zero_when_equal():
  p, q = _logits(4, BOTH + P_ONLY), _logits(5, BOTH + Q_ONLY)
  mask = _mask()
  np.testing.assert_allclose(float(losses.divergence("jsd", p, q, mask)),
                             float(losses.divergence("jsd", q, p, mask)), rtol=1e-6)
  for kind in losses.KINDS:
    assert abs(float(losses.divergence(kind, p, p, mask))) < 1e-6, kind
    assert abs(float(losses.divergence(kind, p, p + 3.0, mask))) < 1e-6, kind   # same distribution


def test_cross_entropy_matches_numpy():
  q = _logits(6, BOTH, MASK_VALUE)
  labels = np.array([0, 5, -1, 7, 2, 99, 9])           # -1 / 99 at masked positions: ignored
  mask = _mask()
  got = losses.cross_entropy(labels, _garbage_at_masked(q), mask)
  lq = _logp(q)
  want = -np.mean([lq[n, labels[n]] for n in range(N) if mask[n]])
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize("beta", [1.0, 0.3, 0.0])
def test_smooth_l1_matches_torch_definition(beta):
  rng = np.random.default_rng(7)
  pred, target = rng.normal(0, 1.5, (N, 5)), rng.normal(0, 1.5, (N, 5))
  mask = _mask()
  d = np.abs(pred - target)
  per = d if beta == 0 else np.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
  want = per.mean(-1)[mask].mean()
  got = losses.smooth_l1(pred.astype(np.float32), target.astype(np.float32), mask, beta=beta)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_acceptance_is_one_minus_tvd():
  p, q = _logits(8, BOTH + P_ONLY), _logits(9, BOTH + Q_ONLY)
  acc = np.asarray(losses.acceptance_from_tvd(p, q))
  assert acc.shape == (N,)
  np.testing.assert_allclose(acc, np.minimum(np.exp(_logp(p)), np.exp(_logp(q))).sum(-1), rtol=1e-5, atol=1e-6)


def test_weights_leading_dims_and_empty_mask():
  p, q = _logits(10), _logits(11)
  w = np.linspace(0.0, 1.0, N).astype(np.float32)
  got = losses.divergence("fkl", p, q, w)
  np.testing.assert_allclose(float(got), (_ref("fkl", p, q) * w).sum() / w.sum(), rtol=1e-5)
  # [B, T, V] works like the flattened positions
  p3, q3 = np.concatenate([p, p[:1]]).reshape(2, 4, V), np.concatenate([q, q[:1]]).reshape(2, 4, V)
  m3 = np.ones((2, 4), bool)
  np.testing.assert_allclose(float(losses.divergence("tvd", p3, q3, m3)),
                             np.concatenate([_ref("tvd", p, q), _ref("tvd", p[:1], q[:1])]).mean(), rtol=1e-5)
  assert float(losses.divergence("rkl", p, q, np.zeros(N, bool))) == 0.0


@pytest.mark.parametrize("kind", losses.KINDS)
def test_gradients_finite_with_excluded_tokens(kind):
  p_ex, q_ex = CASES[kind]
  p = _garbage_at_masked(_logits(12, p_ex, MASK_VALUE))
  q = _garbage_at_masked(_logits(13, q_ex, -1e30))
  mask = _mask()
  f = jax.jit(jax.grad(functools.partial(losses.divergence, kind), argnums=(0, 1)))
  gp, gq = f(jnp.asarray(p), jnp.asarray(q), mask)
  assert np.all(np.isfinite(np.asarray(gp))) and np.all(np.isfinite(np.asarray(gq)))
  assert np.all(np.asarray(gq)[~mask] == 0)
  g_ce = jax.grad(losses.cross_entropy, argnums=1)(np.array([0, 1, 0, 2, 3, 0, 4]), jnp.asarray(q), mask)
  assert np.all(np.isfinite(np.asarray(g_ce)))


def test_unknown_kind_names_the_choices():
  with pytest.raises(ValueError, match="fkl, rkl, jsd, tvd"):
    losses.divergence("kl", _logits(0), _logits(1), _mask())
