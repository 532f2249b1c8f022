"""Scheduling policies on synthetic inputs, the acceptance tracker, and the continuous-batching engine: requests
arriving while others decode get exactly what plain greedy decoding gives each prompt alone, under every
policy; nothing recompiles once warm; refusals, cancellation and a full queue."""
import jax
import numpy as np
import pytest

from specjax import api
from specjax.serving import batcher as bt, factory, policies as pol, trace as trace_lib
from tests.helpers.serving import serve_overlapping
from tests.helpers import CFG, random_hf_params, write_gguf

BUCKETS = (0, 1, 2, 4)


def _obs(alpha_rows, live=None, ctx=100):
  alpha = np.asarray(alpha_rows, float)
  B = alpha.shape[0]
  live = np.ones(B, bool) if live is None else np.asarray(live)
  return pol.Observation(live, np.full(B, ctx), alpha)


def test_fixed_and_off_above():
  obs = _obs([[0.5] * 4] * 3, live=[True, False, True])
  d = pol.FixedK(4).choose(obs)
  assert d.k == 4 and d.k_B.tolist() == [4, 0, 4]
  off = pol.OffAboveBatch(4, max_batch=2)
  assert off.choose(obs).k == 4
  assert off.choose(_obs([[0.5] * 4] * 3)).k == 0           # 3 live > 2


def test_adaptive_follows_each_sequence_acceptance():
  obs = _obs([[0.95] * 4, [0.6, 0.5, 0.5, 0.5], [0.1] * 4])
  d = pol.AcceptanceAdaptive(BUCKETS, min_reach=0.3).choose(obs)
  # 0.95^4 = 0.81 → 4; 0.6 then 0.3 (reach at 2 = 0.3) → 2; 0.1 < 0.3 → 0.
  assert d.k_B.tolist() == [4, 2, 0] and d.k == 4


def _toy_costs(weights_s=0.02, ridge_rows=8):
  """A step of R rows costs max(weights_s, weights_s × R / ridge_rows): memory-bound below ridge_rows rows."""
  def rows_s(total_rows, ctx):
    R = np.asarray(total_rows, float)
    return np.maximum(weights_s, weights_s * R / ridge_rows)
  return rows_s, (lambda k, B: 0.0)


def test_goodput_speculates_while_memory_bound_and_stops_past_the_ridge():
  step_s, draft_s = _toy_costs(ridge_rows=8)
  g = pol.GoodputOptimal(BUCKETS, step_s, draft_s)
  # One live sequence with good acceptance: 5 rows are below the ridge, so k = 4 is free.
  assert g.choose(_obs([[0.8] * 4], ctx=100)).k == 4
  # Sixteen sequences: every extra row costs time; at α = 0.3 drafting loses.
  d = g.choose(_obs([[0.3] * 4] * 16))
  assert d.k == 0 and d.k_B.sum() == 0
  # Easy and hard sequences mixed below the ridge: the spare rows go to the easy ones only.
  mixed = _obs([[0.95] * 4] * 2 + [[0.05] * 4] * 2)
  d = g.choose(mixed)
  assert d.k > 0 and all(d.k_B[:2] > 0) and not any(d.k_B[2:])
  # The choice beats every uniform alternative (same k for all).
  rate = g.rate(mixed, d.k_B, d.k)
  for k in BUCKETS:
    assert rate > g.rate(mixed, np.full(4, k, np.int32), k)


def test_tracker_counts_first_failure_only():
  t = pol.AcceptanceTracker(2, 4, decay=0.5, prior=0.5)
  t.update(np.array([True, True]), np.array([4, 4]), np.array([2, 4]))
  # Slot 0: positions 1, 2 accepted (→ 0.75), 3 failed (→ 0.25), 4 unobserved (0.5).
  assert t.alpha[0].tolist() == [0.75, 0.75, 0.25, 0.5]
  assert t.alpha[1].tolist() == [0.75] * 4
  t.update(np.array([True, False]), np.array([0, 4]), np.array([0, 0]))   # nothing offered: no change
  assert t.alpha[0].tolist() == [0.75, 0.75, 0.25, 0.5]
  t.reset(0)
  assert np.all(t.alpha[0] == t.prior)


def test_poisson_trace():
  tr = trace_lib.poisson(["a", "b"], 2.0, 200, seed=1)
  t = np.array([r["arrival"] for r in tr])
  assert t[0] == 0 and np.all(np.diff(t) >= 0)
  assert 0.35 < np.mean(np.diff(t)) < 0.65                    # mean gap 1/rate
  assert [r["prompt"] for r in tr[:3]] == ["a", "b", "a"]
  assert all(r["arrival"] == 0 for r in trace_lib.poisson(["a"], 0, 5))


# ``tiny``, a loaded tiny GGUF model: tests/conftest.py.
PROMPTS = ["hello world " * (i % 4 + 1) + str(i) for i in range(7)]


@pytest.fixture(scope="module")
def plain(tiny):
  return [api.generate(tiny, [p], max_new_tokens=12)[0][0].token_ids for p in PROMPTS]


def _eagle_dir(m, d):
  """An (untrained) EAGLE drafter exported for the tiny model: the same files `specjax train` writes."""
  from specjax.checkpoints import drafter_io
  from specjax.speculative import eagle
  ecfg = eagle.EagleConfig(m.cfg, (), 0)
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(1))
  return str(drafter_io.save_drafter(d / "eagle", ecfg, tr, target_name=m.source, tokenizer=m.tokenizer))


def _eagle3_dir(m, d):
  """An (untrained) EAGLE-3 head for the tiny model in the speculators layout, as `specjax train` exports one."""
  from specjax.checkpoints import speculators_io
  from specjax.speculative import eagle
  ecfg = eagle.EagleConfig(m.cfg, (0, 1), 32, layout="eagle3")
  p = eagle.init_eagle3(ecfg, jax.random.PRNGKey(2), head_ids=np.arange(32) * 5 % m.cfg.vocab_size)
  return str(speculators_io.save_speculators(d / "eagle3", ecfg, {**p, "embed": m.params["embed"]}))


@pytest.mark.parametrize("drafter,policy", [("ngram", "adaptive"), ("ngram", "goodput"),
                                            ("layerskip", "goodput"), ("none", "fixed"), ("model", "adaptive"),
                                            ("eagle", "fixed"), ("eagle3", "fixed"), ("suffix", "adaptive")])
def test_arrivals_while_others_decode_give_plain_greedy_tokens(tiny, plain, drafter, policy, tmp_path):
  """Continuous batching with every kind of drafter: stateless (n-gram), the target's own layers, a separate
  draft model with its own KV cache (the target itself here: every draft accepted) and EAGLE (a cache and
  the target's features per slot), each admitted into a slot while other slots decode."""
  step_s, draft_s = _toy_costs(ridge_rows=6)
  kw = {"draft_layers": "1"} if drafter == "layerskip" else {}
  if drafter == "model":
    kw = {"draft": tiny}
  elif drafter == "eagle":
    kw = {"draft": _eagle_dir(tiny, tmp_path)}
  elif drafter == "eagle3":                     # a published-architecture head, read by the same kind
    drafter, kw = "eagle", {"draft": _eagle3_dir(tiny, tmp_path)}
  if policy == "goodput":
    eng = bt.ContinuousBatcher(tiny, slots=3, max_len=128, drafter=drafter, buckets=BUCKETS,
                               policy=pol.GoodputOptimal(BUCKETS, step_s, draft_s), **kw)
  else:
    eng = factory.make_batcher(tiny, drafter=drafter, policy=policy, k=4, buckets=BUCKETS, slots=3, max_len=128,
                               **kw)
  # 7 requests over 3 slots, two submitted before each step: later ones arrive while earlier ones decode
  reqs, (compiles, names), most = serve_overlapping(tiny, eng, PROMPTS)
  assert compiles == 0, ("serving compiled after warm-up", names)
  for r, want in zip(reqs, plain):
    assert r.tokens == want, (r.rid, r.tokens, want)
    assert r.finish_reason in ("stop", "length")
  assert most == 3                                    # requests really overlapped, every slot in use
  if drafter != "none":
    assert np.mean([h.k for h in eng.history]) > 0


def test_trace_replay_report(tiny, plain):
  eng = factory.make_batcher(tiny, drafter="ngram", policy="adaptive", buckets=BUCKETS, slots=2, max_len=128)
  eng.warmup(32)
  encoded = [tiny.tokenizer.encode_chat(p) for p in PROMPTS]
  tr = trace_lib.poisson(PROMPTS, 50.0, 7, seed=0, max_tokens=12)
  reqs = [bt.Request(encoded[i], t["max_tokens"], rid=i, arrival=t["arrival"]) for i, t in enumerate(tr)]
  rep = eng.run(reqs, time_limit=120)
  assert rep["served"] == 7 and rep["tokens"] == sum(len(p) for p in plain)
  assert [r.tokens for r in reqs] == plain
  assert rep["tokens_per_s"] > 0 and rep["ttft_s"]["p50"] >= 0 and rep["itl_s"]["p99"] >= rep["itl_s"]["p50"]
  assert rep["steps"] == len(rep["k_over_time"]) > 0


def test_refusals_cancellation_and_full_queue(tiny):
  eng = factory.make_batcher(tiny, drafter="ngram", policy="fixed", k=4, slots=2, max_len=64, max_queue=3)
  with pytest.raises(bt.AdmissionError, match="does not fit the 64-slot KV buffers"):
    eng.submit(bt.Request(list(range(3, 60)), 8))
  with pytest.raises(bt.AdmissionError, match="max_tokens must be >= 1"):
    eng.submit(bt.Request([5, 6], 0))
  reqs = [bt.Request([5, 6, 7], 40, rid=i) for i in range(3)]
  for r in reqs:
    eng.submit(r)
  with pytest.raises(bt.QueueFull, match="limit 3"):
    eng.submit(bt.Request([5, 6, 7], 4))
  eng.step()                                          # two admitted, one waits
  assert eng.num_running == 2 and len(eng.queue) == 1
  eng.cancel(reqs[0])
  eng.step()                                          # the cancelled slot is freed and the third admitted
  assert reqs[0].finish_reason == "cancelled"
  while not all(r.done for r in reqs):
    eng.step()
  assert all(r.finish_reason in ("stop", "length") and r.tokens for r in reqs[1:])
  assert eng.num_running == 0
  # The engine keeps serving after all of that.
  r = bt.Request([5, 6, 7], 5)
  eng.submit(r)
  while not r.done:
    eng.step()
  assert len(r.tokens) >= 1


def test_serve_sim_command_replays_a_trace(tmp_path):
  """`specjax serve-sim --trace FILE --json` on a tiny model: every request served with the tokens asked
  for, its report's percentiles ordered, the k-over-time plot written, and the requests whose trace line
  pins their own speculation reported apart."""
  import json as json_lib
  from tests.helpers import specjax_here
  path = write_gguf(tmp_path / "tiny.gguf", CFG, random_hf_params(CFG, seed=3))
  trace = tmp_path / "trace.jsonl"
  pins = ({"speculation": "off"}, {"speculation": "k=2"}, {})
  trace.write_text("".join(json_lib.dumps({"arrival": 0.05 * i, "prompt": f"hello {'world ' * i}",
                                           "max_tokens": 6, **pins[i % 3]}) + "\n" for i in range(6)))
  proc = specjax_here("serve-sim", "--model", path, "--trace", trace, "--slots", "2", "--policy", "adaptive",
                      "--buckets", "0,2", "--plot", tmp_path / "k.png", "--json")
  assert proc.returncode == 0, proc.stderr
  rep = json_lib.loads(proc.stdout)
  assert rep["requests"] == rep["served"] == 6 and rep["refused"] == 0
  assert rep["slots"] == 2 and rep["policy"] == "adaptive" and rep["buckets"] == [0, 2]
  assert rep["tokens_per_s"] > 0
  assert {g: v["requests"] for g, v in rep["by_speculation"].items()} == {"off": 2, "k=2": 2}
  q = rep["ttft_s"]
  assert 0 < q["p50"] <= q["p90"] <= q["p99"]
  assert (tmp_path / "k.png").stat().st_size > 1000
  # a trace line naming a bucket the run does not compile: one line, before anything compiles
  trace.write_text(json_lib.dumps({"arrival": 0.0, "prompt": "hello", "speculation": "k=4"}) + "\n")
  proc = specjax_here("serve-sim", "--model", path, "--trace", trace, "--slots", "2", "--policy", "adaptive",
                      "--buckets", "0,2")
  assert proc.returncode == 2 and "compiling" not in proc.stderr, proc.stderr
  assert "'speculation' = 'k=4'" in proc.stderr.strip().splitlines()[-1] and "off, k=2" in proc.stderr


def test_goodput_prices_every_row_on_a_path_that_computes_them():
  """On the native CPU path only live rows are computed; elsewhere (XLA, Pallas, bf16, a mesh) a step of
  bucket k computes slots × (k + 1) rows whoever is live.  One live sequence among 16 slots at α = 0.6:
  where only live rows cost, k = 4 (5 rows) is below the ridge and pays; where all 80 rows are computed it
  is past the ridge, and the policy does not speculate."""
  from specjax.kernels import dispatch
  step_s, draft_s = _toy_costs(ridge_rows=8)
  obs = _obs([[0.6] * 4] * 16, live=[True] + [False] * 15)
  native = pol.GoodputOptimal(BUCKETS, step_s, draft_s)
  every_row = pol.GoodputOptimal(BUCKETS, step_s, draft_s, computed_slots=16)
  assert native.choose(obs).k == 4
  d = every_row.choose(obs)
  assert d.k == 0 and not d.k_B.any()
  assert every_row.rate(obs, np.full(16, 4, np.int32), 4) < every_row.rate(obs, np.zeros(16, np.int32), 0)
  # the rule for which paths skip: only the native matmul in fp32 on one device
  native_backends = dispatch.Backends(attention="native", native_matmul=frozenset({"ffn"}))
  assert dispatch.skips_dead_rows(native_backends, "float32")
  assert not dispatch.skips_dead_rows(native_backends, "bfloat16")
  assert not dispatch.skips_dead_rows(dispatch.Backends(attention="xla"), "float32")
  assert not dispatch.skips_dead_rows(dispatch.Backends(attention="pallas"), "float32")


def test_the_cost_model_prices_computed_rows_on_paths_that_do_not_skip_them():
  from specjax.models import config
  from specjax.measure import costmodel
  spec, cfg = costmodel.DEVICES["h200"], config.PRESETS["smollm2-135m"]
  rows, ctx = [5, 0, 0, 0, 1, 1, 1, 1], [300] * 8
  skipping = costmodel.ragged_step_time(spec, cfg, rows, ctx, "bfloat16")
  computing = costmodel.ragged_step_time(spec, cfg, rows, ctx, "bfloat16", skips_dead_rows=False)
  assert computing == pytest.approx(costmodel.ragged_step_time(spec, cfg, [5] * 8, ctx, "bfloat16"))
  assert computing > skipping
