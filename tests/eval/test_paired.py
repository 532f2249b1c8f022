"""Paired benchmarking: interleaving plain and speculative decoding prompt by prompt keeps the speedup
honest when the machine slows down during part of a run, where running one method after the other does not."""
import numpy as np
import pytest

from specjax.eval import bench
from specjax.measure import paired


def test_schedule_pairs_and_alternates():
  order = paired.schedule(2, 3, repeats=2)
  assert len(order) == 12
  pairs = [order[i:i + 2] for i in range(0, 12, 2)]
  for pair in pairs:                      # each prompt's two runs are back to back
    assert pair[0][:2] == pair[1][:2] and {pair[0][2], pair[1][2]} == {0, 1}
  firsts = [pair[0][2] for pair in pairs]
  assert firsts == [0, 1, 0, 1, 0, 1]     # which method goes first alternates
  blocked = paired.schedule(2, 3, repeats=1, paired=False)
  assert [m for _, _, m in blocked] == [0, 0, 0, 1, 1, 1]
  three = paired.schedule(3, 3)
  assert [three[i][2] for i in (0, 3, 6)] == [0, 1, 2]   # rotation: each method leads once


def _fake_runs(P, R, true_speedup, slow_factor, schedule_paired):
  """Drive bench.time_methods with a stubbed decode on a fake clock: every prompt has its own length, the
  speculative method is ``true_speedup`` times faster, and every run in the second half of each repeat's
  wall-clock order is ``slow_factor`` times slower (a neighbour's job comes and goes)."""
  rng = np.random.default_rng(0)
  base_s = rng.uniform(2.0, 6.0, size=P)
  methods = [bench.Method("ar", None, (), 0, {}), bench.Method("spec", None, (), 4, {})]
  per_repeat = 2 * P
  calls = []

  def run(method, batch):
    p = batch
    seconds = base_s[p] / (true_speedup if method.label == "spec" else 1.0)
    if len(calls) % per_repeat >= per_repeat // 2:
      seconds *= slow_factor
    calls.append((method.label, p))
    return bench.Run(seconds=seconds, tokens=100, stats=None, contexts=[1.0])

  timed = bench.time_methods(None, methods, list(range(P)), 0, 0, repeats=R, paired=schedule_paired,
                             log=lambda *_: None, run=run)
  secs, toks = timed["seconds"], timed["tokens"]
  return paired.summarize(secs[0], toks[0], secs[1], toks[1])


@pytest.mark.parametrize("R", [1, 3])
def test_paired_ratio_survives_a_slowdown_that_moves_the_unpaired_one(R):
  P, true = 8, 1.4
  quiet_paired = _fake_runs(P, R, true, 1.0, True)
  slow_paired = _fake_runs(P, R, true, 1.6, True)
  slow_blocked = _fake_runs(P, R, true, 1.6, False)
  assert quiet_paired["speedup_median"] == pytest.approx(true)
  assert slow_paired["speedup_median"] == pytest.approx(true)          # unaffected
  lo, hi = slow_paired["speedup_ci95"]
  assert lo == pytest.approx(true) and hi == pytest.approx(true)
  # Blocked: plain decoding ran in the quiet half, speculative in the slow one.
  assert slow_blocked["speedup_median"] == pytest.approx(true / 1.6)
  assert abs(slow_blocked["speedup"] - true) > 0.3


def test_summary_statistics():
  base = np.array([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])      # [R=2, P=3] seconds
  spec = np.array([[0.5, 2.0, 2.0], [1.0, 1.0, 2.0]])
  toks = np.full((2, 3), 10)
  s = paired.summarize(base, toks, spec, toks)
  r = base / spec                                          # per-run speedups: 2,1,2 / 1,2,2
  assert s["speedup_median"] == pytest.approx(np.median(r))
  assert s["speedup_iqr"] == pytest.approx(list(np.quantile(r, [0.25, 0.75])))
  assert s["speedup"] == pytest.approx(base.sum() / spec.sum())
  assert s["ar_tokens_per_s_spread"] == pytest.approx([30 / 7, 30 / 7, 30 / 7])
  assert s["spec_tokens_per_s_spread"] == pytest.approx([30 / 4.5, np.median([30 / 4.5, 30 / 4.0]), 30 / 4.0])
  lo, hi = s["speedup_ci95"]
  assert 1.0 <= lo <= s["speedup_median"] <= hi <= 2.0
  assert paired.bootstrap_median_ci(r) == (lo, hi)          # fixed seed: reproducible


def test_a_prompt_without_decoded_tokens_has_no_ratio():
  """A prompt whose first token ends the reply decodes nothing (0 tokens in 0 s): it is left out of the median
  and the interval instead of making them NaN."""
  base_s, base_t = np.array([[1.0, 1.0, 0.0]]), np.array([[10, 10, 0]])
  spec_s, spec_t = np.array([[0.5, 0.25, 0.0]]), np.array([[10, 10, 0]])
  out = paired.summarize(base_s, base_t, spec_s, spec_t)
  assert out["speedup_median"] == 3.0 and np.isfinite(out["speedup_ci95"]).all()
  assert out["speedup_by_prompt"] == [2.0, 4.0, None] and out["prompts_without_decode"] == 1
