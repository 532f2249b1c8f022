"""Losslessness, tested statistically on a micro model: the joint distribution of the first three sampled tokens
of plain sampling, enumerated exactly (``_exact_joint``), against speculative samples (``_spec_samples`` for
chains, ``_tree_samples`` for trees) by a chi-square test (``_chi2_pvalue``); ``AcceptAlways``, a wrong rule the
test must catch, and ``_check``, a tree's rule against the rule without the residual update (and, for a static
tree, the old rule that offered filler children).  Shared by the drafters' and trees' tests."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.speculative import Engine, ModelDrafter, SpeculativeSampling, drafters, generate
from specjax.speculative.drafters import DynamicShape
from specjax.speculative.trees.device import TreeAcceptance

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




# ----------------------------------------------------------------------------------------------------------
# Trees (test_lossless_trees.py)

SETTINGS = [sampling.SamplingParams(temperature=1.0, top_k=2), sampling.SamplingParams(temperature=0.7, top_p=0.35)]


def _tree_samples(target, draft, sp, shape, drafter=None, acceptance=None):
  N = shape.num_nodes
  eng = Engine(cfg=MICRO, drafter=drafter or ModelDrafter(MICRO), k_max=N, sp=sp, tree=shape,
               acceptance=acceptance)
  B = N_SAMPLES
  cache = kv_cache.init_cache(MICRO, B, 16)
  prompt = jnp.tile(jnp.asarray(MICRO_PROMPT, jnp.int32), (B, 1))
  st = generate(target, draft, cache, prompt, jnp.full((B,), 3), jnp.full((B,), 3), jnp.full((B,), N),
                jax.random.PRNGKey(4321), engine=eng)
  return np.asarray(st.seq_BxS)[:, 3:6]


def _check(target, draft, sp, shape, make_drafter, monkeypatch):
  """p-values of the rule, of the rule without the residual update and (static trees) of the old filler rule."""
  joint = _exact_joint(target, sp)
  p_right = _chi2_pvalue(_tree_samples(target, draft, sp, shape, drafter=make_drafter()), joint)
  p_no_residual = _chi2_pvalue(_tree_samples(target, draft, sp, shape, drafter=make_drafter(),
                                             acceptance=SpeculativeSampling(residual_update=False)), joint)
  static = not isinstance(shape, DynamicShape)
  p_old = None
  if static:
    real = drafters.sample_children         # the old rule: every child slot offered, drawn or not

    def offer_filler(*a, **k):
      tokens, q, drawn = real(*a, **k)
      return tokens, q, jnp.ones_like(drawn)
    monkeypatch.setattr(drafters, "sample_children", offer_filler)
    # a drafter of another name: a new engine, traced again with the old rule (not the cached executable)
    p_old = _chi2_pvalue(_tree_samples(target, draft, sp, shape, drafter=make_drafter("offers-filler")), joint)
    monkeypatch.undo()
  print(f"{sp}: p = {p_right:.3g} (the rule), {p_old} (filler offered), {p_no_residual:.3g} (no residual)")
  assert p_right > 1e-3, p_right
  assert p_no_residual < 1e-6, p_no_residual
  if static:
    assert p_old < 1e-6, p_old
