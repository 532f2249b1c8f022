"""Offline replay of the n-gram drafter reproduces the engine's own greedy run: τ, steps and rows per step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.speculative import Engine, NgramDrafter, NoDrafter, generate
from specjax.speculative.replay import replay_greedy

CFG = config.TINY.replace(num_layers=2)


@pytest.mark.parametrize("caps,K", [((), 4), ((1, 2), 4), ((0,), 3)])
def test_replay_matches_engine(caps, K):
  params = model.unstack_layers(model.init_params(CFG, jax.random.PRNGKey(3)))
  drafter = NgramDrafter(3, match_caps=caps)
  prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [11, 12, 13, 11, 12, 14, 11, 12, 13, 15, 11], [4, 4, 4, 4]]
  max_new = 40
  seqs, P, ends, tau_engine, rows_engine = [], [], [], [], []
  for pr in prompts:   # batch 1 per prompt: the replay's contract
    eng = Engine(cfg=CFG, drafter=drafter, k_max=K, sp=sampling.SamplingParams(), buckets=(16, 32, 64))
    st = generate(params, (), kv_cache.init_cache(CFG, 1, 128), jnp.asarray([pr], jnp.int32),
                  jnp.asarray([len(pr)]), jnp.asarray([max_new]), jnp.asarray([K]), jax.random.PRNGKey(0),
                  engine=eng)
    n = int(st.num_new_B[0])
    seqs.append(np.asarray(st.seq_BxS)[0, :len(pr) + n])
    P.append(len(pr))
    ends.append(len(pr) + n)
    tau_engine.append((int(st.stats.committed_B[0]), int(st.stats.verify_steps_B[0])))
    rows_engine.append(np.asarray(st.stats.verify_rows_N1))
  seq = np.zeros((len(prompts), max(ends) + K + 1), np.int32)
  for i, s in enumerate(seqs):
    seq[i, :len(s)] = s
  committed, rows = replay_greedy(drafter, seq, np.array(P), np.array(ends), K)
  assert committed.tolist() == [c for c, _ in tau_engine]
  assert len(rows) == sum(s for _, s in tau_engine)
  np.testing.assert_array_equal(np.bincount(rows, minlength=K + 2)[1:], np.sum(rows_engine, axis=0))
  assert sum(c for c, _ in tau_engine) > len(rows)   # drafts were accepted: the replay is not trivial


def test_replay_needs_spare_slots():
  with pytest.raises(ValueError, match="spare slots"):
    replay_greedy(NgramDrafter(2), np.zeros((1, 10), np.int32), np.array([3]), np.array([8]), 4)
