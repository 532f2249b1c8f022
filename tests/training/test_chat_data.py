"""More training data for drafters: chat-style and passage requests (deterministic, distinct, sized to fit),
feature stores merged end to end, and training continued from an exported drafter."""
import json

import jax
import numpy as np
import pytest

from specjax.checkpoints import drafter_io
from specjax.errors import SpecjaxError
from specjax.training import chat_prompts, data as data_lib, eagle_train, recipes
from tests.helpers.eagle import CFG, _Tok, make_store


def test_chat_requests_are_deterministic_distinct_and_varied():
  a, b = chat_prompts.chat_requests(1500, seed=3), chat_prompts.chat_requests(1500, seed=3)
  assert a == b and a != chat_prompts.chat_requests(1500, seed=4)
  texts = [r["prompt"] for r in a]
  assert len(set(texts)) == len(texts) and len({r["id"] for r in a}) == len(a)
  kinds = {r["category"] for r in a}
  assert kinds == {"chat-writing", "chat-persona", "chat-multipart", "chat-code", "chat-math"}
  assert np.mean([len(t) for t in texts]) > 100       # longer than the one-line synthesized questions
  assert chat_prompts.chat_requests(0) == []


def test_clip_passage_cuts_at_a_sentence_end():
  text = "First sentence here. Second one is longer than that! Third? " * 5
  cut = chat_prompts.clip_passage(text, 70)
  assert len(cut) <= 70 and cut.endswith(("!", ".", "?")) and text.startswith(cut)
  assert chat_prompts.clip_passage("short text.", 70) == "short text."
  nostop = "word " * 40
  cut = chat_prompts.clip_passage(nostop, 50)
  assert len(cut) <= 50 and cut.endswith("word")


def test_passage_requests_fit_and_name_their_task():
  passages = [f"Paragraph {i} talks about gardens. " * 30 for i in range(20)] + ["too short"]
  a = chat_prompts.passage_requests(passages, 200, seed=1, max_chars=600)
  assert a == chat_prompts.passage_requests(passages, 200, seed=1, max_chars=600)
  assert len({r["prompt"] for r in a}) == 200
  tags = {r["category"] for r in a}
  assert {"passage-summarize", "passage-translate", "passage-qa"} <= tags
  for r in a:
    assert "too short" not in r["prompt"]
    extra = 160 if r["category"] != "passage-translate" else 60    # the instruction around the passage
    assert len(r["prompt"]) <= (600 if r["category"] != "passage-translate" else 200) + extra
  with pytest.raises(ValueError, match="at least 200 characters"):
    chat_prompts.passage_requests(["tiny"], 3)


def test_merged_store_is_the_sources_end_to_end(tmp_path, target_tiny):
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  a = make_store(tmp_path / "a", target_tiny, n=5, seed=0)
  b = make_store(tmp_path / "b", target_tiny, n=4, seed=1)
  from specjax import cli
  assert cli.main(["merge-data", str(tmp_path / "merged"), str(a), str(b), "--json"]) == 0
  out = tmp_path / "merged"
  sa, sb, sm = (eagle_train.FeatureData(d) for d in (a, b, out))
  assert sm.num_sequences == 9 and sm.meta["tokens"] == sa.meta["tokens"] + sb.meta["tokens"]
  for name in ("tokens", "final", "fused", "topk_ids", "prompt_lens"):
    np.testing.assert_array_equal(getattr(sm, name), np.concatenate([getattr(sa, name), getattr(sb, name)]))
  for s in range(9):
    src, i = (sa, s) if s < 5 else (sb, s - 5)
    np.testing.assert_array_equal(sm.tokens[sm.offsets[s]:sm.offsets[s + 1]],
                                  src.tokens[src.offsets[i]:src.offsets[i + 1]])
  ids = [json.loads(l)["id"] for l in (out / "responses.jsonl").read_text().splitlines()]
  assert len(ids) == 9 and len(set(ids)) == 9
  with pytest.raises(SpecjaxError, match="already holds a feature store"):
    data_lib.merge_stores([a, b], out)
  meta = json.loads((b / "features" / "meta.json").read_text())
  (b / "features" / "meta.json").write_text(json.dumps({**meta, "fused_layers": [1, 2]}))
  with pytest.raises(SpecjaxError, match="fused_layers"):
    data_lib.merge_stores([a, b], tmp_path / "other")
  assert not (tmp_path / "other" / "features").exists()


@pytest.fixture(scope="module")
def target_tiny():
  from specjax.models import decoder as model
  return model.init_params(CFG, jax.random.PRNGKey(0))


def test_training_continues_from_an_exported_drafter(tmp_path, target_tiny, monkeypatch):
  """``init``: the run starts from the given weights and keeps the given reduced vocabulary (with a learning
  rate of 1e-9 the weights come back as they went in; a fresh run's do not)."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  d = make_store(tmp_path, target_tiny, n=8)
  tok = _Tok(CFG.vocab_size)
  kw = dict(steps=2, batch_size=2, seq_len=64, warmup_steps=1, log_every=1, progress=False, reduced_vocab=16)
  first = recipes.train_eagle_on(target_tiny, CFG, data_dir=d, run_dir=tmp_path / "first", learning_rate=3e-2,
                                 **kw)
  ecfg = first["ecfg"]
  head_ids = (np.arange(16) * 3 + 1).astype(np.int32)            # not the store's most frequent tokens
  saved = drafter_io.save_drafter(tmp_path / "exported", ecfg, jax.device_get(first["params"]),
                                  target_name="tiny", tokenizer=tok, head_ids=head_ids)
  _, loaded, _ = drafter_io.load_drafter(saved, CFG, target_tiny, tok)
  trainable = {k: v for k, v in loaded.items() if k not in ("embed", "lm_head", "head_ids")}
  again = recipes.train_eagle_on(target_tiny, CFG, data_dir=d, run_dir=tmp_path / "again", learning_rate=1e-9,
                                 init=(trainable, np.asarray(loaded["head_ids"])), **kw)
  np.testing.assert_array_equal(np.asarray(again["head_ids"]), head_ids)
  for x, y in zip(jax.tree.leaves(trainable), jax.tree.leaves(again["params"])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
  fresh = recipes.train_eagle_on(target_tiny, CFG, data_dir=d, run_dir=tmp_path / "fresh", learning_rate=1e-9,
                                 **kw)
  leaves = lambda p: jax.tree.leaves(p)
  assert any(np.abs(np.asarray(x) - np.asarray(y)).max() > 1e-3
             for x, y in zip(leaves(fresh["params"]), leaves(again["params"])))


def test_questions_the_target_wrote_become_prompts():
  from specjax.training import synth_prompts
  replies = ['"How do solar panels turn sunlight into electricity?"\n\nThis question asks...',
             "\n\nQuestion: What should I pack for a first camping trip?",
             "**Request:** Please plan a one-week running schedule for a beginner.",
             "ok", "x" * 500,
             "How do solar panels turn sunlight into electricity?"]
  assert synth_prompts.questions_from_replies(replies) == [
      "How do solar panels turn sunlight into electricity?", "What should I pack for a first camping trip?",
      "Please plan a one-week running schedule for a beginner."]
  # Forms a small target writes: a quotation after a colon, a label further down, a question after a colon,
  # the message on the line after a colon; the assistant's voice is not a user's request.
  replies = ['A journalist might ask: "What is the minimum wage in your country?"',
             'A farmer might ask, "What is the best way to get a passport?',
             "What a good idea! Here is one:\n\nQuestion: How do I plan a four-day trip to Lisbon?\n\nThis...",
             "What is the answer to this question: How do bees make honey from nectar?",
             "Here's a message:\nPlease write a short poem about autumn leaves for my class.",
             "I'm here to help with any culinary project. What's the request?",
             "I'm ready to assist. What's your request?"]
  assert synth_prompts.questions_from_replies(replies) == [
      "What is the minimum wage in your country?", "What is the best way to get a passport?",
      "How do I plan a four-day trip to Lisbon?",
      "How do bees make honey from nectar?", "Please write a short poem about autumn leaves for my class."]
  seeds = synth_prompts.self_written_seed_prompts(40, seed=1)
  assert len({s["prompt"] for s in seeds}) == 40 and all("Reply with" in s["prompt"] for s in seeds)
