"""Suffix decoding: the frequency trie of the longest suffix match, the bounded index, greedy exactness for
every tree shape (with an empty index, a learned one and the batch's other rows), lossless sampling (tested
statistically, a broken rule caught), and the index learning across requests in generate, bench and the
server."""
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import sampling
from specjax.speculative import NoDrafter, SpeculativeSampling
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import DynamicShape
from specjax.speculative.suffix import SuffixDrafter, absorb, corpus_fill, empty_index
from specjax.serving import batcher as bt
from tests.helpers.trees import LENS, MAX_NEW, PROMPTS, SHAPES, _run

# The fixtures ``tiny`` (a loaded tiny GGUF model) and ``target`` (the token-tree tests' tiny target):
# tests/conftest.py and tests/speculative/conftest.py.


@pytest.fixture(scope="module")
def plain_one(tiny):
  from specjax import api
  return api.generate(tiny, ["hello world hello world 3"], max_new_tokens=24, ignore_eos=True)[0][0].token_ids

SP = sampling.SamplingParams()


def _draft(corpus_seqs, seq, shape, drafter=SuffixDrafter(spec_factor=8.0), C=64):
  """One proposal for one sequence ``seq`` (its last token the root) over an index of ``corpus_seqs``."""
  dp = absorb(empty_index(C), corpus_seqs)
  L = len(seq) - 1
  seq_1xS = jnp.asarray([seq + [0] * (16 - len(seq))], jnp.int32)
  return drafter.propose(dp, (), seq_1xS, jnp.asarray([L]), seq_1xS[:, L], shape, None, SP)[1]


def test_the_most_frequent_continuation_of_the_longest_match_comes_first():
  # "1 2 3" is followed by 4 5 twice and by 9 once; "3" alone (a shorter match) by 7 three times.
  corpus = [[1, 2, 3, 4, 5], [8, 1, 2, 3, 9, 9], [1, 2, 3, 4, 5], [3, 7], [3, 7], [3, 7]]
  d = _draft(corpus, [6, 1, 2, 3], tree_shapes.chain(2))
  assert np.asarray(d.tokens_BxN1)[0].tolist() == [3, 4, 5] and np.asarray(d.valid_BxN1)[0].all()
  d = _draft(corpus, [6, 1, 2, 3], tree_shapes.branching([2, 1]))   # rank 1 at the root: the 9
  assert np.asarray(d.tokens_BxN1)[0].tolist() == [3, 4, 9, 5, 9]
  d = _draft(corpus, [6, 1, 2, 3], DynamicShape(3, 2, 2))
  # counts 2 (4), 2 (4 5), 1 (9): the shallower of the equal counts first, parents before children
  assert np.asarray(d.tokens_BxN1)[0].tolist() == [3, 4, 5, 9]
  assert np.asarray(d.parents_BxN1)[0].tolist() == [-1, 0, 1, 0]


def test_rare_continuations_and_short_matches_propose_little():
  corpus = [[1, 2, 3, 4]] * 9 + [[1, 2, 3, 5]]
  d = _draft(corpus, [1, 2, 3], DynamicShape(4, 2, 2), drafter=SuffixDrafter(min_prob=0.2, spec_factor=8.0))
  # 5 follows 1 time in 10 (< 0.2): not drafted; 4 is, and nothing after it (no tokens follow)
  assert np.asarray(d.tokens_BxN1)[0, :2].tolist() == [3, 4] and np.asarray(d.valid_BxN1)[0].tolist() == [
      True, True, False, False, False]
  # the last token alone matches (a 1-token match): spec_factor 1 allows one node
  d = _draft([[7, 4, 5, 6]], [9, 7], tree_shapes.chain(3), drafter=SuffixDrafter(spec_factor=1.0))
  assert np.asarray(d.valid_BxN1)[0].tolist() == [True, True, False, False]
  d = _draft([[7, 4, 5, 6]], [9, 8], tree_shapes.chain(3))       # no match: no drafts
  assert not np.asarray(d.valid_BxN1)[0, 1:].any()


def test_the_index_is_bounded_and_keeps_the_newest():
  dp = empty_index(16)
  for i in range(10):
    dp = absorb(dp, [[i] * 5])
    assert dp["corpus_C"].shape == (16,) and corpus_fill(dp) <= 16
  c = np.asarray(dp["corpus_C"]).tolist()
  assert c[-5:] == [9] * 5 and c[-6] == -1 and 0 not in c       # the oldest evicted
  with pytest.raises(ValueError, match="token slot"):
    empty_index(0)


@pytest.mark.parametrize("shape_name,index", [(s, "learned") for s in SHAPES] + [("chain", "empty"),
                                                                                ("dynamic", "empty")])
def test_greedy_suffix_decoding_equals_plain_greedy(target, shape_name, index):
  plain, _ = _run(target, NoDrafter(), (), tree_shapes.chain(0), PROMPTS, LENS, MAX_NEW)
  dp = empty_index(256)
  if index == "learned":        # earlier requests: these very prompts and their replies (and noise)
    dp = absorb(dp, [PROMPTS[b, :LENS[b]].tolist() + plain[b] for b in range(3)] + [[5, 6, 7, 1, 2, 3]])
  out, st = _run(target, SuffixDrafter(spec_factor=2.0), dp, SHAPES[shape_name], PROMPTS, LENS, MAX_NEW)
  assert out == plain, (shape_name, index)
  s = st.stats
  assert int(s.accepted_B.sum()) <= int(s.drafted_B.sum())
  if index == "learned":      # the replies are in the index: most drafts are right, > 2 tokens a step
    assert int(s.verify_steps_B.sum()) < sum(map(len, plain)) / 2, (int(s.verify_steps_B.sum()), plain)


def test_rows_of_one_batch_draft_from_each_other(target):
  """Row 1's prompt already holds the first 8 tokens of row 0's reply: with the batch's other rows in the
  haystack (cross_rows) row 0 drafts from it and accepts more; greedy, the tokens are plain decoding's."""
  plain0, _ = _run(target, NoDrafter(), (), tree_shapes.chain(0), PROMPTS[:1], LENS[:1], MAX_NEW[:1])
  ahead = PROMPTS[0, :10].tolist() + plain0[0][:8]
  prompts = np.array([PROMPTS[0, :10].tolist() + [0] * 8, ahead], np.int32)
  lens, max_new = np.array([10, 18]), np.array([18, 10], np.int32)
  plain, _ = _run(target, NoDrafter(), (), tree_shapes.chain(0), prompts, lens, max_new)
  out_x, st_x = _run(target, SuffixDrafter(), empty_index(64), tree_shapes.chain(3), prompts, lens, max_new)
  out_1, st_1 = _run(target, SuffixDrafter(cross_rows=False), empty_index(64), tree_shapes.chain(3), prompts,
                     lens, max_new)
  assert out_x == plain == out_1
  assert int(st_x.stats.accepted_B[0]) >= int(st_1.stats.accepted_B[0]) + 4, (st_x.stats.accepted_B,
                                                                              st_1.stats.accepted_B)


def test_generate_and_the_server_index_earlier_requests(tiny, plain_one):
  """The same prompt twice: the second reply is drafted from the first (far fewer steps), token for token
  plain decoding's; in the server the index grows by each finished request and stays within its size."""
  from specjax import api
  from specjax.serving import factory
  prompt = "hello world hello world 3"
  gens, _ = api.generate(tiny, [prompt, prompt], max_new_tokens=24, drafter="suffix", k=4, ignore_eos=True)
  assert [g.token_ids for g in gens] == [plain_one] * 2
  steps = [len(g.iteration_starts) for g in gens]
  assert steps[1] * 2 <= steps[0] and steps[1] <= 24 / 3, steps
  b = factory.make_batcher(tiny, drafter="suffix", policy="fixed", k=4, slots=2, max_len=128)
  b.warmup(16)
  ids = tiny.tokenizer.encode_chat(prompt)
  per_request = []
  for _ in range(2):
    r = bt.Request(list(ids), 24)
    h0 = len(b.history)
    b.run([r])
    assert r.tokens[:len(plain_one)] == plain_one[:len(r.tokens)]
    per_request.append(len(b.history) - h0)
  assert per_request[1] * 2 <= per_request[0], per_request
  st = b.index_stats()
  assert 0 < st["tokens"] <= st["capacity"] and st["tokens"] >= 2 * len(ids)


def test_bench_index_sees_earlier_batches_of_the_same_repeat_only():
  """bench.time_methods: a learning drafter's params for batch p hold batches 0..p-1 of the same repeat."""
  from specjax.eval import bench
  from specjax.speculative import registry
  eng = type("E", (), {"drafter": SuffixDrafter()})()
  method = bench.Method("suffix", eng, empty_index(64), 3, {})
  batches = [(np.array([[10 + p, 11 + p]]), np.array([2]), 1) for p in range(3)]
  seen = []

  def run(meth, batch):
    seen.append(corpus_fill(meth.draft_params))
    return bench.Run(1.0, 2, None, [2.0], [[20, 21]])
  bench.time_methods(None, [method], batches, 2, 64, repeats=2, run=run, log=lambda *_: None)
  per = 1 + 2 + 2                     # a separator, the prompt, the reply (the first's separator is not counted)
  assert seen == [0, per - 1, 2 * per - 1] * 2, seen
  assert registry.absorb(NoDrafter(), (), [[1, 2]]) == ()


# ----------------------------------------------------------------------------------------------------------
# Lossless sampling: the joint distribution of the first three tokens against plain sampling's (micro model).

from tests.helpers.lossless import (MICRO, SETTINGS, _chi2_pvalue, _exact_joint, _micro_params,  # noqa: E402
                                    _tree_samples)


def _micro_index():
  """Earlier 'requests' over the micro vocabulary: the prompt 1 2 3, then random tokens, so that after any
  first token there are several continuations with different counts (several siblings per node)."""
  r = np.random.default_rng(3)
  seqs = [[1, 2, 3] + r.integers(0, MICRO.vocab_size, 5).tolist() for _ in range(60)]
  return absorb(empty_index(1024), seqs)


@pytest.mark.parametrize("shape", [tree_shapes.branching([3, 2]), DynamicShape(8, top_k=3, max_depth=2)],
                         ids=["branch3x2", "dynamic8"])
def test_sampled_suffix_trees_are_lossless(shape):
  target, sp = _micro_params(6), SETTINGS[0]
  joint = _exact_joint(target, sp)
  drafter = SuffixDrafter(cross_rows=False, min_prob=0.0, spec_factor=8.0)
  dp = _micro_index()
  samples = _tree_samples(target, dp, sp, shape, drafter=drafter)
  p_right = _chi2_pvalue(samples, joint)
  p_broken = _chi2_pvalue(_tree_samples(target, dp, sp, shape, drafter=drafter,
                                        acceptance=SpeculativeSampling(residual_update=False)), joint)
  print(f"suffix {shape}: p = {p_right:.3g} (the rule), {p_broken:.3g} (no residual)")
  assert p_right > 1e-3, p_right
  assert p_broken < 1e-6, p_broken


def test_repeated_and_shifted_traces_round_trip(tmp_path, capsys):
  """`specjax trace`: a repeated trace asks every task once per round, reworded; a shifted one moves from one
  category to another halfway; both load back for serve-sim/loadgen --trace with their labels."""
  from specjax.cli import main
  from specjax.serving import trace as trace_lib
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(f'{{"question_id": {i}, "category": "{c}", "turns": ["task {i} {c}"]}}\n'
                             for i, c in enumerate(["qa", "qa", "qa", "math", "math"])))
  out = tmp_path / "rep.jsonl"
  assert main(["trace", "repeated", "--prompts", str(prompts), "--tasks", "3", "--repeats", "2", "--rate", "2",
               "--out", str(out)]) == 0
  items = trace_lib.load(str(out))
  assert [i["round"] for i in items] == [0, 0, 0, 1, 1, 1]
  assert sorted(i["task"] for i in items[:3]) == [0, 1, 2] == sorted(i["task"] for i in items[3:])
  texts = [f"task {i} qa" for i in range(3)]
  assert all(i["prompt"] == trace_lib.REWORDINGS[i["round"]].format(p=texts[i["task"]]) for i in items)
  assert all(b["arrival"] >= a["arrival"] for a, b in zip(items, items[1:]))
  out2 = tmp_path / "shift.jsonl"
  assert main(["trace", "shifted", "--prompts", str(prompts), "--first", "qa", "--then", "math", "--requests", "6",
               "--out", str(out2)]) == 0
  items = trace_lib.load(str(out2))
  assert [i["phase"] for i in items] == [0, 0, 0, 1, 1, 1]
  assert all(("math" in i["prompt"]) == bool(i["phase"]) for i in items)
  assert main(["trace", "repeated", "--prompts", str(prompts), "--tasks", "9", "--out", str(out)]) == 2
  assert "lower --tasks" in capsys.readouterr().err


def test_the_server_index_stays_within_its_size_over_a_long_trace(tiny):
  """Twelve requests through a 160-slot index: it evicts the oldest, never grows, and ends with the newest."""
  from specjax.serving import factory
  b = factory.make_batcher(tiny, drafter="suffix", policy="fixed", k=4, slots=2, max_len=128)
  b.draft_params = empty_index(160)
  b.warmup(16)
  reqs = [bt.Request(tiny.tokenizer.encode_chat(f"hello world {i}"), 12, rid=i) for i in range(12)]
  fills = []
  for r in reqs:
    b.run([r])
    fills.append(b.index_stats()["tokens"])
  assert max(fills) <= 160 and fills[-1] == 160, fills
  corpus = np.asarray(b.draft_params["corpus_C"]).tolist()
  last = list(reqs[-1].prompt_ids) + reqs[-1].tokens
  assert corpus[-len(last):] == last


def test_index_tokens_sizes_the_index_in_generate_bench_and_the_server(tiny):
  """``index_tokens`` (``--index-tokens``) reaches the suffix index wherever one is built, and is refused for a
  drafter that keeps none."""
  from specjax import api
  from specjax.eval import bench
  from specjax.errors import SpecjaxError
  from specjax.runtime.builder import DecodeSpec, build
  from specjax.serving import factory
  d = build(tiny, DecodeSpec(drafter="suffix", k=4, index_tokens=96), eos_ids=(), max_len=128)
  assert d.draft_params["corpus_C"].shape == (96,)
  meth = bench.speculative_method(tiny, (), 128, drafter="suffix", k=4, index_tokens=80)
  assert meth.draft_params["corpus_C"].shape == (80,)
  b = factory.make_batcher(tiny, drafter="suffix", policy="fixed", k=4, slots=2, max_len=128, index_tokens=112)
  assert b.index_stats()["capacity"] == 112
  gens, _ = api.generate(tiny, ["hello world hello world 3"] * 2, max_new_tokens=8, drafter="suffix", k=4,
                         index_tokens=48)
  assert len(gens) == 2
  with pytest.raises(SpecjaxError, match="--index-tokens sizes the index of --drafter suffix"):
    build(tiny, DecodeSpec(drafter="ngram", k=4, index_tokens=64), eos_ids=(), max_len=128)
  with pytest.raises(SpecjaxError, match=">= 1 token slot"):
    build(tiny, DecodeSpec(drafter="suffix", k=4, index_tokens=0), eos_ids=(), max_len=128)
