"""Recording the target's features and top-k while decoding (``Engine.record``): what the loop records at
every committed position equals a teacher-forced forward over prompt + reply, for plain decoding, a chain
and a tree drafter — so drafter training data needs no second target pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import kv_cache, decoder as model, sampling
from specjax.speculative import Engine, NoDrafter, generate
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import NgramDrafter
from specjax.speculative.engine import Record
from tests.helpers import engine as ts

CFG = ts.CFG
TAPS = (0, 1)
REC = Record(taps=TAPS, top_k=4, final=True)


def _run(target, drafter, K, tree=None, eos=()):
  B = ts.PROMPTS.shape[0]
  eng = Engine(cfg=CFG, drafter=drafter, k_max=K, sp=sampling.SamplingParams(), eos_ids=eos, buckets=ts.BUCKETS,
               tree=tree, record=REC)
  st = generate(target, (), kv_cache.init_cache(CFG, B, 64), jnp.asarray(ts.PROMPTS), jnp.asarray(ts.LENS),
                jnp.full((B,), 20, jnp.int32), jnp.full((B,), K, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  return st


def _teacher_forced(target, seq_T):
  T = len(seq_T)
  out = model.forward(target, CFG, jnp.asarray([seq_T]), jnp.arange(T)[None], kv_cache.init_cache(CFG, 1, 64),
                      feature_layers=REC.forward_taps(CFG.num_layers))
  taps = np.asarray(out.features[0, :, :-CFG.d_model])
  lp, ids = jax.lax.top_k(jax.nn.log_softmax(out.logits[0]), REC.top_k)
  return np.concatenate([taps, np.asarray(out.hidden[0])], axis=-1), np.asarray(ids), np.asarray(lp)


@pytest.mark.parametrize("how", ["plain", "ngram_chain", "ngram_tree"])
def test_recorded_features_and_topk_equal_a_teacher_forced_pass(how):
  target = model.unstack_layers(model.init_params(CFG, jax.random.PRNGKey(0)))
  drafter, K, tree = {"plain": (NoDrafter(), 0, None),
                      "ngram_chain": (NgramDrafter(3), 3, None),
                      "ngram_tree": (NgramDrafter(3), 4, tree_shapes.branching([2, 1]))}[how]
  st = _run(target, drafter, K if tree is None else tree.num_nodes, tree)
  seq, num_new = np.asarray(st.seq_BxS), np.asarray(st.num_new_B)
  feats = np.asarray(st.record.feats_BxSxF, np.float32)
  ids, lp = np.asarray(st.record.topk_ids_BxSxK), np.asarray(st.record.topk_lp_BxSxK, np.float32)
  if how != "plain":
    assert int(st.stats.accepted_B.sum()) > 0, "the drafter must have had drafts accepted for this test to bite"
  for b, P in enumerate(ts.LENS):
    n = P + int(num_new[b])
    want_f, want_ids, want_lp = _teacher_forced(target, seq[b, :n].tolist())
    # every position but the last token (whose feature no step computed) is recorded
    np.testing.assert_allclose(feats[b, :n - 1], want_f[:n - 1], rtol=2e-2, atol=2e-2)
    assert not np.any(feats[b, :n - 1] == 0).all(axis=-1).any()
    # the top-k after each position from the last prompt token on (what training's loss reads)
    np.testing.assert_array_equal(ids[b, P - 1:n - 1, 0], want_ids[P - 1:n - 1, 0])
    np.testing.assert_array_equal(ids[b, P - 1:n - 1, 0], seq[b, P:n])      # greedy: the first choice came next
    np.testing.assert_allclose(lp[b, P - 1:n - 1], want_lp[P - 1:n - 1], atol=2e-2)


def test_recording_leaves_the_tokens_unchanged():
  target = model.unstack_layers(model.init_params(CFG, jax.random.PRNGKey(0)))
  eng = Engine(cfg=CFG, drafter=NgramDrafter(3), k_max=3, sp=sampling.SamplingParams(), buckets=ts.BUCKETS)
  B = ts.PROMPTS.shape[0]
  plain = generate(target, (), kv_cache.init_cache(CFG, B, 64), jnp.asarray(ts.PROMPTS), jnp.asarray(ts.LENS),
                   jnp.full((B,), 20, jnp.int32), jnp.full((B,), 3, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  rec = _run(target, NgramDrafter(3), 3)
  np.testing.assert_array_equal(np.asarray(plain.seq_BxS), np.asarray(rec.seq_BxS))
  assert plain.record is None


# ----------------------------------------------------------------------------------------------------------
# The data stage: replies recorded into shards, then assembled (no target pass), equal to the teacher-forced
# store; a kill between a shard and its lines loses nothing.


def _tiny_model(tmp_path):
  from specjax import api
  from tests.helpers import CFG as GGUF_CFG, random_hf_params, write_gguf
  hf = random_hf_params(GGUF_CFG, seed=3)
  hf["layers"] = [{k: v * 2.0 if k.endswith("proj") else v for k, v in layer.items()} for layer in hf["layers"]]
  return api.load(str(write_gguf(tmp_path / "tiny.gguf", GGUF_CFG, hf)))


def test_recorded_store_equals_the_teacher_forced_store(tmp_path):
  import json
  from specjax.training import data as data_lib, eagle_train
  m = _tiny_model(tmp_path)
  prompts = [{"id": f"p{i}", "prompt": w} for i, w in enumerate(["hello there", "a b c d e", "zz", "one two",
                                                                "the cat sat", "why"])]
  fused = (0, m.cfg.num_layers - 1)
  rec = Record(taps=fused, top_k=4)
  gen = dict(max_new_tokens=12, batch_size=2, max_len=64)
  a = tmp_path / "recorded"
  data_lib.generate_responses(m, prompts[:4], a, capture=rec, **gen)
  # a kill after a shard was renamed into place but before its lines were appended: the orphan goes
  orphan = a / data_lib.CAPTURED / "000099"
  orphan.mkdir()
  data_lib.generate_responses(m, prompts, a, capture=rec, **gen)
  assert not orphan.exists()
  data_lib.compute_features(m, a, fused_layers=fused, top_k=4)
  assert json.loads((a / "features" / "meta.json").read_text())["recorded"]
  # the same replies, without their shards: the teacher-forced pass
  b = tmp_path / "forced"
  b.mkdir()
  recs = data_lib.read_responses(a / data_lib.RESPONSES)
  assert len(recs) == 6 and len({r["shard"] for r in recs}) == 3
  (b / data_lib.RESPONSES).write_text("".join(
      json.dumps({k: v for k, v in r.items() if k not in ("shard", "row")}) + "\n" for r in recs))
  data_lib.compute_features(m, b, fused_layers=fused, top_k=4)
  sa, sb = eagle_train.FeatureData(a), eagle_train.FeatureData(b)
  np.testing.assert_array_equal(sa.tokens, sb.tokens)
  np.testing.assert_array_equal(sa.offsets, sb.offsets)
  last = np.asarray(sa.offsets[1:]) - 1
  keep = np.ones(len(sa.tokens), bool)
  keep[last] = False
  for name in ("final", "fused"):
    np.testing.assert_allclose(np.asarray(getattr(sa, name), np.float32)[keep],
                               np.asarray(getattr(sb, name), np.float32)[keep], rtol=2e-2, atol=2e-2)
  pred = sa.predicted_positions()
  np.testing.assert_array_equal(np.asarray(sa.topk_ids)[pred, 0], np.asarray(sb.topk_ids)[pred, 0])
  assert np.all(eagle_train.token_counts(sa, m.cfg.vocab_size) == eagle_train.token_counts(sb, m.cfg.vocab_size))


def test_a_token_budget_stops_the_replies_after_the_batch_that_reaches_it(tmp_path):
  from specjax.training import data as data_lib
  m = _tiny_model(tmp_path)
  prompts = [{"id": f"p{i}", "prompt": f"word {i} " * (i + 1)} for i in range(6)]
  d = tmp_path / "budget"
  data_lib.generate_responses(m, prompts, d, max_new_tokens=5, batch_size=2, chunk=2, max_len=64,
                                 token_budget=1)
  assert len(data_lib.read_responses(d / data_lib.RESPONSES)) == 2          # one batch reached it
  data_lib.generate_responses(m, prompts, d, max_new_tokens=5, batch_size=2, chunk=2, max_len=64,
                                 token_budget=1)
  assert len(data_lib.read_responses(d / data_lib.RESPONSES)) == 2          # a resumed run stops at once
  data_lib.generate_responses(m, prompts, d, max_new_tokens=5, batch_size=2, max_len=64)
  assert len(data_lib.read_responses(d / data_lib.RESPONSES)) == 6
