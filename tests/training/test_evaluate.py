"""training/evaluate.py: 1 − TVD(p, q) at the engine's first draft position is the expected acceptance of
speculative sampling there, so on the very sequences a sampled EAGLE run produced, scored at that run's
iteration starts, it must match the acceptance the engine measured (within sampling error); and the greedy
first-choice agreement is a rate in [0, 1] that a drafter equal in its choices to the target would max out."""
import types

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.speculative import Engine, eagle, generate
from specjax.speculative.trees import specs as tree_shapes
from specjax.training import evaluate

CFG = config.TINY.replace(num_layers=2)


def _sampled_eagle_run(target, dp, ecfg, temperature, B=256, P=8, max_new=24):
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, CFG.vocab_size, (B, P)).astype(np.int32)
  lens = np.full((B,), P, np.int32)
  drafter = eagle.EagleDrafter(ecfg.layer_cfg, ecfg=ecfg, max_depth=1)
  eng = Engine(cfg=CFG, drafter=drafter, k_max=1, sp=sampling.SamplingParams(temperature=temperature),
               tree=tree_shapes.chain(1))
  st = generate(model.unstack_layers(target), dp, kv_cache.init_cache(CFG, B, P + max_new + 2),
                jnp.asarray(prompts), jnp.asarray(lens), jnp.full((B,), max_new, jnp.int32),
                jnp.full((B,), 1, jnp.int32), jax.random.PRNGKey(3), engine=eng)
  seq, n, starts = np.asarray(st.seq_BxS), np.asarray(st.num_new_B), np.asarray(st.starts_BxS)
  tokens = [seq[b, :P + n[b]].tolist() for b in range(B)]
  at = [np.flatnonzero(starts[b, :P + n[b]]).tolist() for b in range(B)]
  alpha = float(st.stats.pos_accepted_D[0]) / float(st.stats.pos_reached_D[0])
  return tokens, [P] * B, at, alpha, int(st.stats.pos_reached_D[0])


def test_tvd_at_iteration_starts_predicts_the_measured_first_position_acceptance():
  target = model.init_params(CFG, jax.random.PRNGKey(0))
  ecfg = eagle.EagleConfig(CFG)
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(1))
  dp = {**tr, **eagle.frozen_from_target(ecfg, target)}
  T = 0.6
  tokens, plens, at, alpha, n = _sampled_eagle_run(target, dp, ecfg, T)
  m = types.SimpleNamespace(cfg=CFG, params=target, prefill_params=target)
  res = evaluate.sequence_tvd(m, ecfg, dp, tokens, plens, positions=1, at=at, temperature=T)
  predicted = res["tvd_acceptance_by_position"][0]
  assert res["eval_positions_scored"] == n            # exactly the engine's first-draft decisions
  sigma = np.sqrt(alpha * (1 - alpha) / n)
  print(f"measured {alpha:.4f} over {n} drafts, predicted {predicted:.4f} (sigma {sigma:.4f})")
  assert 0.05 < alpha < 0.95                           # a drafter that is neither useless nor perfect
  assert abs(predicted - alpha) < 4 * sigma + 2e-3, (predicted, alpha, sigma)
  # the test has power: scored at another temperature (what evaluate did before it took one) it is off
  wrong = evaluate.sequence_tvd(m, ecfg, dp, tokens, plens, positions=1, at=at)["tvd_acceptance_by_position"][0]
  assert abs(wrong - alpha) > 6 * sigma, (wrong, alpha, sigma)
  # every response position, not only the starts: a different set of contexts, a different number of them
  full = evaluate.sequence_tvd(m, ecfg, dp, tokens, plens, positions=2, temperature=T)
  assert full["eval_positions_scored"] == sum(len(t) - p - 0 for t, p in zip(tokens, plens))
  assert len(full["tvd_acceptance_by_position"]) == 2
  assert all(0 <= g <= 1 for g in full["greedy_match_by_position"])

