"""Online adaptation (``training/online.py`` in the continuous batcher): the replay buffer stays bounded and
packs what the offline recipe trains on; the engine records the target's features beside a feature drafter
without changing its drafts; serving with adaptation on gives exactly plain greedy tokens while the head's
weights change between steps, compiles nothing after warm-up, and a restarted batcher starts from the last
adapted checkpoint (the periodic one after a kill, the final one after a stop); the adaptation steps learn (the loss falls, acceptance rises) on repeated traffic."""
import jax
import numpy as np
import pytest

from specjax import api
from specjax import speculative as spec
from specjax.errors import SpecjaxError
from specjax.serving import batcher as bt, factory
from specjax.speculative import eagle, registry
from specjax.training import online
from tests.helpers.compile_counter import count_compiles
from tests.helpers import CFG, random_hf_params, write_gguf
from tests.helpers import assert_clean_error, specjax_here

SMALL = online.AdaptConfig(learning_rate=3e-3, batch_size=2, seq_len=48, buffer_tokens=160, min_tokens=16,
                           checkpoint_every=4, unroll=2, replay=8.0)


def test_replay_buffer_is_bounded_and_packs_reply_positions():
  buf = online.ReplayBuffer(capacity=100, seq_len=40, feat_dim=6, final_dim=3, seed=0)
  rng = np.random.default_rng(0)
  for i in range(12):
    T = int(rng.integers(10, 60))
    feats = np.full((T, 6), i, np.float16)
    buf.add(np.arange(T) + 1000 * i, feats, feats[:, :3], prompt_len=5)
    assert buf.tokens_held <= 100 and buf.nbytes <= buf.capacity_bytes
  assert buf.evicted > 0 and len(buf) + buf.evicted == buf.windows_added > buf.added == 12
  b = buf.batch(3)
  assert b["tokens"].shape == (3, 40) and b["feats"].shape == (3, 40, 6) and b["final"].shape == (3, 40, 3)
  for row in range(3):
    for s in set(b["seg"][row].tolist()) - {0}:
      at = np.flatnonzero(b["seg"][row] == s)
      toks, pos, mask = b["tokens"][row, at], b["pos"][row, at], b["loss_mask"][row, at]
      seq = toks[0] // 1000
      # absolute positions (windows of a long sequence), features of the same sequence
      assert np.all(toks == pos + 1000 * seq) and np.all(b["feats"][row, at] == seq)
      # positions that predict a reply token: from the last prompt token to the one before the window's last
      assert not mask[-1] and not np.any(mask[pos < 4])
      assert np.all(mask[1:-1][pos[1:-1] >= 4])
  # every position of a sequence from the last prompt token on is predicted exactly once, across its windows
  one = online.ReplayBuffer(capacity=1000, seq_len=16, feat_dim=2, final_dim=2)
  T = 70
  one.add(np.arange(T), np.zeros((T, 2)), np.zeros((T, 2)), prompt_len=30)
  predicted = []
  for w in one._seqs:
    n = len(w["tokens"])
    predicted += (w["start"] + np.arange(w["first"], n - 1)).tolist()
  assert sorted(predicted) == list(range(29, T - 1))
  assert all(len(w["tokens"]) <= 16 for w in one._seqs)
  with pytest.raises(SpecjaxError, match="empty"):
    online.ReplayBuffer(10, 8, 2, 2).batch(1)


def test_settings_are_checked():
  with pytest.raises(SpecjaxError, match="hold at least one training row"):
    online.AdaptConfig(buffer_tokens=64, seq_len=128)
  with pytest.raises(SpecjaxError, match="adapt-every"):
    online.AdaptConfig(every=-1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = write_gguf(tmp_path_factory.mktemp("adapt") / "tiny.gguf", CFG, random_hf_params(CFG, seed=3))
  return api.load(str(path))


def _head_dir(m, d, layers=(0, 1), parallel=0):
  from specjax.checkpoints import drafter_io
  ecfg = eagle.EagleConfig(m.cfg, layers, 0, parallel)
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(1))
  return str(drafter_io.save_drafter(d / f"head{parallel or ''}", ecfg, tr, target_name=m.source,
                                     tokenizer=m.tokenizer))


PROMPTS = ["hello world " * (i % 3 + 1) + str(i) for i in range(6)]


@pytest.mark.parametrize("layers", [(0, 1), ()])
def test_recording_beside_a_feature_drafter_keeps_its_drafts(tiny, tmp_path, layers):
  """The forward returns the recorded taps (the drafter's layers, then the last layer's output) and the
  drafter reads its part of them: the same tokens and the same accepted drafts as without recording, and
  the recorded features are a teacher-forced forward's."""
  head = _head_dir(tiny, tmp_path, layers)
  prompts = PROMPTS[:3]
  base, st0 = api.generate(tiny, prompts, drafter="eagle", draft=head, k=3, max_new_tokens=10, batch_size=3)
  rec = spec.Record(taps=layers, top_k=0, final=True)
  got, st1 = api.generate(tiny, prompts, drafter="eagle", draft=head, k=3, max_new_tokens=10, batch_size=3,
                          record=rec)
  assert [g.token_ids for g in got] == [g.token_ids for g in base]
  assert st1["accepted_tokens"] == st0["accepted_tokens"] and st1["drafted_tokens"] == st0["drafted_tokens"]
  plain, _ = api.generate(tiny, prompts, max_new_tokens=10, batch_size=3, record=rec)
  for g, p in zip(got, plain):
    n = g.prompt_tokens + len(g.token_ids) - 1           # the last token's features come with the next step
    np.testing.assert_allclose(g.recorded["features"][:n].astype(np.float32),
                               p.recorded["features"][:n].astype(np.float32), atol=2e-2, rtol=2e-2)


def _plain(m, n=14):
  return [api.generate(m, [p], max_new_tokens=n)[0][0].token_ids for p in PROMPTS]


def test_served_adaptation_is_exact_compiles_nothing_and_restarts_from_its_checkpoint(tiny, tmp_path):
  head = _head_dir(tiny, tmp_path)
  plain = _plain(tiny)
  ckpt = tmp_path / "adapted"
  make = lambda cfg: factory.make_batcher(            # noqa: E731
      tiny, drafter="eagle", draft=head, policy="fixed", k=3, slots=2, max_len=96,
      adapter_factory=lambda d, p: online.OnlineAdapter.for_engine(d, p, cfg, checkpoint_dir=ckpt))
  eng = make(SMALL.__class__(**{**SMALL.__dict__, "every": 2}))      # also adapt while busy: every 2 steps
  eng.warmup(32)
  first = jax.tree_util.tree_map(np.asarray, eng.draft_params["fc"])
  encoded = [tiny.tokenizer.encode_chat(p) for p in PROMPTS]
  names: list = []
  with count_compiles(names) as compiles:
    for rounds in range(2):                      # the prompts twice: the second round meets an adapted head
      reqs = [bt.Request(e, 14, rid=i) for i, e in enumerate(encoded)]
      for r in reqs:
        eng.submit(r)
      while not all(r.done for r in reqs):
        eng.step()
      while eng.adapt() and eng.adapter.steps < 6 * (rounds + 1):   # idle: adapt
        pass
      assert [r.tokens for r in reqs] == plain       # the target's tokens, whatever the head's weights
  assert compiles() == 0, ("adapting compiled after warm-up", names)
  ad = eng.adapter
  assert ad.steps >= 12 and ad.buffer.tokens_held <= SMALL.buffer_tokens and ad.buffer.evicted > 0
  assert not np.allclose(np.asarray(eng.draft_params["fc"]), first)        # the weights the engine runs moved
  assert sum(h.rows - h.live for h in eng.history) > 0        # drafts offered
  # Killed without closing (no final save): a new batcher starts from the last periodic checkpoint.
  saved = sorted(int(d.name) for d in ckpt.iterdir() if d.name.isdigit())
  assert saved and saved[-1] % SMALL.checkpoint_every == 0 and saved[-1] <= ad.steps
  killed = make(SMALL)
  assert killed.adapter.steps == saved[-1]
  # Closed (the server stopped): the final state is saved, and a restart starts from it.
  ad.close()
  steps, fc = ad.steps, np.asarray(eng.draft_params["fc"])
  again = make(SMALL)
  assert again.adapter.steps == steps
  np.testing.assert_allclose(np.asarray(again.draft_params["fc"]), fc, rtol=1e-6, atol=1e-6)


def test_adaptation_steps_learn_repeated_traffic(tiny, tmp_path):
  """On a buffer of served replies, adaptation steps lower the loss and raise the head's agreement with the
  target (its held-in 1 - TVD at the first draft position)."""
  head = _head_dir(tiny, tmp_path)
  drafter, params = api.build_drafter(tiny, api.decode_spec(drafter="eagle", k=3), max_len=256, draft=head)[:2]
  ad = online.OnlineAdapter.for_engine(drafter, params, SMALL)
  rec = ad.record
  gens, _ = api.generate(tiny, PROMPTS, max_new_tokens=20, batch_size=3, record=rec)
  for g in gens:
    ad.observe(list(tiny.tokenizer.encode_chat(g.prompt)) + g.token_ids, g.recorded["features"], g.prompt_tokens)
  assert ad.ready
  ad.buffer.rng = np.random.default_rng(0)
  first = [ad.step() for _ in range(3)]
  for _ in range(40):
    last = ad.step()
  assert last["loss"] < 0.3 * np.mean([m["loss"] for m in first])
  assert last["accept_s1"] > np.mean([m["accept_s1"] for m in first]) + 0.05


def test_a_parallel_head_adapts_while_served_exactly(tiny, tmp_path):
  """--adapt with a parallel head (all K positions in one forward, trained with unroll K): the served tokens
  are plain greedy's, its weights (placeholders included) move, and nothing compiles after warm-up."""
  head = _head_dir(tiny, tmp_path, parallel=3)
  eng = factory.make_batcher(tiny, drafter="eagle-parallel", draft=head, policy="fixed", k=3, slots=2,
                             max_len=96, adapter_factory=lambda d, p: online.OnlineAdapter.for_engine(d, p, SMALL))
  assert eng.adapter.lcfg.unroll == 3
  eng.warmup(32)
  before = {k: np.asarray(eng.draft_params[k]) for k in ("fc", "placeholders")}
  reqs = [bt.Request(tiny.tokenizer.encode_chat(p), 14, rid=i) for i, p in enumerate(PROMPTS)]
  with count_compiles() as compiles:
    for r in reqs:
      eng.submit(r)
    while not all(r.done for r in reqs):
      eng.step()
    while eng.adapt() and eng.adapter.steps < 4:
      pass
  assert compiles() == 0
  assert [r.tokens for r in reqs] == _plain(tiny)
  assert eng.adapter.steps == 4
  for k, v in before.items():
    assert not np.allclose(np.asarray(eng.draft_params[k]), v), k


def test_accumulated_steps_update_the_head_once_every_n(tiny, tmp_path):
  """``accumulate`` = 3: the served weights stay as they were for two micro-steps and change at the third (one
  update from the three averaged gradients)."""
  import dataclasses
  head = _head_dir(tiny, tmp_path)
  drafter, params = api.build_drafter(tiny, api.decode_spec(drafter="eagle", k=3), max_len=256, draft=head)[:2]
  ad = online.OnlineAdapter.for_engine(drafter, params, dataclasses.replace(SMALL, accumulate=3))
  gens, _ = api.generate(tiny, PROMPTS[:3], max_new_tokens=20, batch_size=3, record=ad.record)
  for g in gens:
    ad.observe(list(tiny.tokenizer.encode_chat(g.prompt)) + g.token_ids, g.recorded["features"], g.prompt_tokens)
  fc = [np.asarray(ad.draft_params()["fc"])]
  for _ in range(6):
    ad.step()
    fc.append(np.asarray(ad.draft_params()["fc"]))
  changed = [not np.array_equal(a, b) for a, b in zip(fc, fc[1:])]
  assert changed == [False, False, True, False, False, True]
  with pytest.raises(SpecjaxError, match="accumulate"):
    online.AdaptConfig(accumulate=0)


def test_adapt_needs_a_head_and_dir_needs_adapt(tmp_path):
  p = specjax_here("serve-sim", "--model", str(tmp_path / "nope.gguf"), "--drafter", "ngram", "--adapt")
  assert_clean_error(p, "--adapt", "--drafter eagle")
  p = specjax_here("serve-sim", "--model", str(tmp_path / "nope.gguf"), "--drafter", "ngram", "--adapt-dir",
                   str(tmp_path / "a"))
  assert_clean_error(p, "--adapt-dir needs --adapt")
  with pytest.raises(SpecjaxError, match="has none"):
    online.OnlineAdapter.for_engine(registry.build(registry.get("ngram"), CFG, None, k=2, depth=None,
                                                   buckets=None)[0], {}, SMALL)

