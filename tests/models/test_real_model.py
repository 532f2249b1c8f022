"""The default real model (SmolLM2-135M-Instruct, downloaded once into the cache): sane perplexity, fluent
greedy replies, and the CLI's JSON contract.  Marked ``real_model``; deselect with ``-m 'not real_model'``."""
import json
import re
import subprocess
import sys

import pytest

import specjax
from tests.helpers.compile_counter import count_compiles

pytestmark = pytest.mark.real_model

PARAGRAPH = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe built "
    "wooden machines that riders pushed along with their feet. Pedals attached to the front wheel came "
    "later, and by the end of the century the safety bicycle, with two wheels of equal size and a chain "
    "driving the rear wheel, had become the design that most people still ride today.")

COMMON_WORDS = {"the", "a", "is", "of", "and", "to", "in", "it", "that", "you", "are", "for", "on", "with",
                "as", "can", "be", "this", "an", "your", "or"}


@pytest.fixture(scope="module")
def smollm():
  return specjax.load("smollm2-135m")


def test_config_matches_preset(smollm):
  from specjax.models.config import SMOLLM2_135M
  for field in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                "rope_theta", "tie_embeddings"):
    assert getattr(smollm.cfg, field) == getattr(SMOLLM2_135M, field), field


def test_perplexity_of_plain_english_is_sane(smollm):
  res = specjax.score(smollm, PARAGRAPH)
  assert len(res.logprobs) == len(res.token_ids) - 1
  # A 135M model on ordinary English: roughly 5-40 (measured ~15).  Random weights give ~50000.
  assert 3.0 < res.perplexity < 40.0, res.perplexity


def _looks_like_english(text: str) -> bool:
  words = re.findall(r"[A-Za-z']+", text.lower())
  ascii_share = sum(c.isascii() for c in text) / max(1, len(text))
  return len(words) >= 5 and ascii_share > 0.95 and sum(w in COMMON_WORDS for w in words) >= 2


def test_greedy_chat_replies_are_fluent_and_batch_invariant(smollm):
  prompts = ["What is the capital of France?",
             "Explain in two sentences why the sky is blue.",
             "Give me three tips for staying focused while studying."]
  outs, stats = specjax.generate(smollm, prompts, max_new_tokens=40, batch_size=3)
  assert "Paris" in outs[0].text
  for o in outs:
    assert _looks_like_english(o.text), o.text
  alone, _ = specjax.generate(smollm, prompts[1:2], max_new_tokens=40, batch_size=1)
  assert alone[0].token_ids == outs[1].token_ids
  # A second call with the same shapes but more tokens compiles nothing new.
  with count_compiles() as n:
    specjax.generate(smollm, prompts[2:3], max_new_tokens=60, batch_size=1)
  assert n() == 0


def test_cli_score_json_contract():
  proc = subprocess.run([sys.executable, "-m", "specjax.cli", "score", "--model", "smollm2-135m", "--text",
                         "Hello there! How are you today?", "--json"], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr
  obj = json.loads(proc.stdout)            # exactly one JSON object on stdout
  assert set(obj) >= {"tokens", "logprobs", "perplexity"}
  assert len(obj["logprobs"]) == len(obj["tokens"]) - 1


def test_speculative_greedy_equals_plain_greedy_on_real_model(smollm):
  prompts = ["Summarize: The city council voted on Tuesday to extend the bus line to the airport. The "
             "extension will open next year and add four stops.", "List three fruits."]
  base, _ = specjax.generate(smollm, prompts, max_new_tokens=24)
  for drafter, k, layers in [("ngram", 4, None), ("layerskip", 2, "0,1,2,3,26,27,28,29")]:
    outs, stats = specjax.generate(smollm, prompts, max_new_tokens=24, drafter=drafter, k=k,
                                   draft_layers=layers)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base], drafter
    assert stats["drafted_tokens"] > 0


def test_integer_activations_keep_chains_trees_and_batches_token_exact_on_real_model():
  """int4 weights on integer dot products (``--activations int8``, kernels/cpu_qdot.py): n-gram chains at batch 1
  and 2 and a dynamic tree at batch 2 give plain greedy's tokens at batch 1 (the rounding of x turns any
  last-bit difference upstream of a matmul into a visible one, so every op before it gives a row the same bits
  whatever the rows beside it: decoder.row_sum, the attention kernel's CompactVisible), and the perplexity of
  a 40-token text stays within 3% of the same weights on fp32 activations with the text fed as verifications
  feed it (5 tokens at a time; over 16 real texts the difference is 0.2%: docs/BENCHMARKS.md, "Integer
  activations")."""
  from specjax.kernels import cpu_qdot
  m = specjax.load("smollm2-135m", weights="int4", activations="int8")
  if cpu_qdot.path() is None:
    pytest.skip("native CPU kernels not built here")
  prompts = ["Summarize: The city council voted on Tuesday to extend the bus line to the airport. The "
             "extension will open next year and add four stops.", "def fibonacci(n):"]
  base, _ = specjax.generate(m, prompts, max_new_tokens=24, batch_size=1)
  for kw in (dict(k=4, batch_size=1), dict(k=4, batch_size=2), dict(tree="dynamic:8:2", batch_size=2)):
    outs, stats = specjax.generate(m, prompts, max_new_tokens=24, drafter="ngram", **kw)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base], kw
    assert stats["drafted_tokens"] > 0
  fp32_acts = specjax.load("smollm2-135m", weights="int4", activations="fp32")
  text = prompts[0] + " The council also approved a new budget for parks and libraries."
  ratio = specjax.score(m, text, block=5).perplexity / specjax.score(fp32_acts, text, block=5).perplexity
  assert abs(ratio - 1) < 0.03, ratio


def test_greedy_tree_decoding_equals_plain_greedy_on_real_model(smollm):
  """10 prompts: a dynamic n-gram tree gives the tokens of plain greedy.  Every tree shape with every drafter
  (static trees, Sequoia, layer-skip and model drafters) is checked on tiny models (tests/speculative/test_trees.py,
  tests/cli/test_tree_cli.py, tests/speculative/test_lossless_trees.py); here a run compiles the 30-layer loop
  (~30 s), so one tree: the kind built per step from the data, whose shape varies most between sequences and
  steps."""
  from specjax.prompts import load_prompts
  prompts = load_prompts()[:10]
  kw = dict(max_new_tokens=16, batch_size=10)
  base = [o.token_ids for o in specjax.generate(smollm, prompts, **kw)[0]]
  outs, stats = specjax.generate(smollm, prompts, drafter="ngram", tree="dynamic:8:2", **kw)
  assert [o.token_ids for o in outs] == base
  assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0


def test_bf16_real_model_perplexity(smollm):
  """bf16 end to end (weights, KV buffers, activations; logits in fp32): perplexity on the council paragraph
  within 2% of fp32.  (bf16 speculative = bf16 plain greedy: tests/parallel/test_sharding.py, on a tiny model.)"""
  text = ("The city council voted on Tuesday to extend the bus line to the airport. The extension will open "
          "next year and add four stops.")
  bf16 = specjax.load("smollm2-135m", dtype="bfloat16")
  ratio = specjax.score(bf16, text).perplexity / specjax.score(smollm, text).perplexity
  assert abs(ratio - 1) < 0.02, ratio
