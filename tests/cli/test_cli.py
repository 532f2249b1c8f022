"""The CLI contract: one JSON object on stdout with --json; bad input is one line on stderr, exit != 0."""
import json
import os
from pathlib import Path

import pytest

from tests.helpers import CFG, assert_clean_error, random_hf_params, specjax, specjax_here, write_gguf

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_model_name(tmp_path):
  assert_clean_error(specjax("tokenize", "--model", "no-such-model", "--text", "hi", cache=tmp_path),
                     "no-such-model", "smollm2-135m")


def test_missing_model_file(tmp_path):
  assert_clean_error(specjax("tokenize", "--model", str(tmp_path / "missing.gguf"), "--text", "hi"),
                     "missing.gguf")


def test_corrupt_gguf(tmp_path, tiny_model):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(Path(tiny_model).read_bytes()[:3000])
  assert_clean_error(specjax_here("tokenize", "--model", str(bad), "--text", "hi"), "bad.gguf")
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(os.urandom(4096))
  assert_clean_error(specjax_here("tokenize", "--model", str(junk), "--text", "hi"), "junk.gguf")


def test_prompt_longer_than_cache(tiny_model):
  proc = specjax("generate", "--model", tiny_model, "--prompt", "hello world " * 40, "--max-len", "64",
                 "--max-new-tokens", "8")
  assert_clean_error(proc, "does not fit the KV cache", "--max-len")


def test_invalid_gin_binding():
  proc = specjax("run", "configs/quickstart.gin", "--gin-binding", "quickstart.no_such_arg = 3")
  assert_clean_error(proc, "no_such_arg")
  proc = specjax("run", "configs/quickstart.gin", "--gin-binding", "nosuch.thing = 1")
  assert_clean_error(proc, "nosuch")
  assert_clean_error(specjax("run", "configs/missing.gin"), "missing.gin")


def test_missing_prompt_file(tiny_model):
  assert_clean_error(specjax("generate", "--model", tiny_model, "--prompts", "nope.jsonl"), "nope.jsonl")


def test_generate_tokenize_json(tiny_model, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"question_id": 7, "category": "qa", "turns": ["hello world", "ignored"]}\n'
                     '{"question_id": 8, "category": "qa", "turns": ["the world"]}\n')
  proc = specjax("generate", "--model", tiny_model, "--prompts", str(prompts), "--max-new-tokens", "5",
                 "--batch-size", "2", "--json")
  assert proc.returncode == 0, proc.stderr
  obj = json.loads(proc.stdout)
  assert [o["question_id"] for o in obj["outputs"]] == [7, 8]
  assert all(1 <= len(o["token_ids"]) <= 5 for o in obj["outputs"])
  assert obj["stats"]["new_tokens"] == sum(len(o["token_ids"]) for o in obj["outputs"])
  proc = specjax("tokenize", "--model", tiny_model, "--text", "hello world", "--json")
  assert proc.returncode == 0, proc.stderr
  assert json.loads(proc.stdout)["ids"]


def test_models_lists_default(tmp_path):
  proc = specjax("models", "--json", cache=tmp_path)
  assert proc.returncode == 0, proc.stderr
  models = json.loads(proc.stdout)["models"]
  assert any(m["name"] == "smollm2-135m" and m["cached"] is False for m in models)


def test_unknown_drafter_and_k_too_large(tiny_model):
  assert_clean_error(specjax_here("generate", "--model", tiny_model, "--prompt", "hi", "--drafter", "magic"),
                     "unknown drafter", "ngram")
  assert_clean_error(specjax_here("generate", "--model", tiny_model, "--prompt", "hi", "--drafter", "ngram",
                                  "--k", "70", "--max-len", "64"), "--k 70", "--max-len")
  assert_clean_error(specjax_here("generate", "--model", tiny_model, "--prompt", "hi", "--drafter", "model"),
                     "--draft")
  assert_clean_error(specjax_here("generate", "--model", tiny_model, "--prompt", "hi", "--drafter", "ngram",
                                  "--ngram-caps", "one,3"), "--ngram-caps", "1,3")
  assert_clean_error(specjax_here("generate", "--model", tiny_model, "--prompt", "hi", "--drafter", "ngram",
                                  "--ngram-caps", "-1"), "--ngram-caps", ">= 0")


def _gguf_with_vocabulary(path, tokens, types, merges, seed: int) -> str:
  """A tiny checkpoint whose vocabulary is ``tokens`` (helpers' vocabulary swapped in while it is written)."""
  from tests import helpers as tc            # write_gguf reads the vocabulary from there
  cfg = CFG.replace(name=path.stem, vocab_size=len(tokens))
  saved = (tc.TOKENS, tc.TOKEN_TYPES, tc.MERGES)
  tc.TOKENS, tc.TOKEN_TYPES, tc.MERGES = tokens, types, merges
  try:
    return str(write_gguf(path, cfg, random_hf_params(cfg, seed=seed)))
  finally:
    tc.TOKENS, tc.TOKEN_TYPES, tc.MERGES = saved


def test_a_draft_of_another_tokenizer_drafts_across_tokenizers(tiny_model, tmp_path):
  """Another vocabulary (5 more tokens) drafts through the map, said in one line: greedy output unchanged.  A
  drafter that reads the target's tokens (hybrid) refuses it in one line naming the one that does not."""
  from tests import helpers as tc
  other = _gguf_with_vocabulary(tmp_path / "other.gguf", tc.TOKENS + [f"<extra{i}>" for i in range(5)],
                                tc.TOKEN_TYPES + [1] * 5, tc.MERGES, seed=4)
  run = lambda *a: specjax("generate", "--model", tiny_model, "--prompt", "hello world", "--max-new-tokens", "8",
                           "--json", *a)
  plain, across = run(), run("--drafter", "model", "--draft", other, "--k", "3")
  assert plain.returncode == 0 and across.returncode == 0, across.stderr
  assert "drafting across tokenizers: 270 tokens map" in across.stderr, across.stderr
  tokens = lambda proc: [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]]
  assert tokens(across) == tokens(plain)
  assert_clean_error(run("--drafter", "hybrid", "--draft", other), "tokenizer", "--drafter model")


def test_a_draft_sharing_almost_no_tokens_is_refused(tiny_model, tmp_path):
  from tests import helpers as tc
  # two byte strings in common with the target's vocabulary ("z", "q"): 0.7% of it
  tokens = ["<s>", "<bos>", "<eos>", "z", "q", "zq"] + [f"zq{i}" for i in range(len(tc.TOKENS) - 6)]
  other = _gguf_with_vocabulary(tmp_path / "disjoint.gguf", tokens, [3] * 3 + [1] * (len(tokens) - 3),
                                [("z", "q")], seed=5)
  proc = specjax("generate", "--model", tiny_model, "--prompt", "hello", "--drafter", "model", "--draft", other,
                 "--max-new-tokens", "4")
  assert_clean_error(proc, "share 2 tokens", "disjoint.gguf", "tiny.gguf", "different tokenizers")


def test_bench_json_reports_speculative_metrics(tiny_model, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(f'{{"question_id": {i}, "category": "qa", "turns": ["the world the world {i}"]}}\n'
                             for i in range(3)))
  proc = specjax("bench", "--model", tiny_model, "--prompts", str(prompts), "--batch-size", "2",
                 "--max-new-tokens", "6", "--max-len", "128", "--drafter", "ngram", "--k", "2", "--repeats", "2",
                 "--json")
  assert proc.returncode == 0, proc.stderr
  obj = json.loads(proc.stdout)
  for key in ("ar_tokens_per_s", "spec_tokens_per_s", "speedup", "mean_accepted_length", "acceptance_rate",
              "acceptance_by_position", "draft_ms", "verify_ms", "predicted_speedup", "efficiency",
              "roofline_fraction", "load_s", "compile_s", "prefill_s", "decode_s"):
    assert key in obj, key
  # Paired statistics over prompts x repeats, and the bandwidth probed on both sides of the decode runs.
  assert obj["repeats"] == 2 and obj["paired"] is True
  lo, hi = obj["speedup_ci95"]
  q25, q75 = obj["speedup_iqr"]
  assert lo <= obj["speedup_median"] <= hi and q25 <= obj["speedup_median"] <= q75
  for key in ("ar_tokens_per_s_spread", "spec_tokens_per_s_spread"):
    a, b, c = obj[key]
    assert 0 < a <= b <= c
  assert len(obj["speedup_by_prompt"]) == 2           # 3 prompts in batches of 2
  assert obj["read_bandwidth_gbs_before"] > 0 and obj["read_bandwidth_gbs_after"] > 0
  assert obj["read_bandwidth_gbs"] == max(obj["read_bandwidth_gbs_before"], obj["read_bandwidth_gbs_after"])
  machine = obj["machine"]                           # every benchmark names its machine
  for key in ("cpu", "cpu_flags", "cores", "kernel_path", "jax", "backend"):
    assert key in machine, key
  assert machine["cores"] >= 1 and machine["cpu"]
  assert obj["batch_size"] == 2 and obj["prompts"] == 3 and obj["k"] == 2
  assert obj["speedup"] > 0 and obj["ar_tokens_per_s"] > 0 and obj["verify_ms"] > 0
  assert 1.0 <= obj["mean_accepted_length"] <= 3.0 and len(obj["acceptance_by_position"]) == 2


def test_draft_weights_reach_a_trained_head_as_its_weight_type():
  """``--draft-weights`` is a draft model's type when it loads, and a trained head's ``head_weights``."""
  from argparse import Namespace
  from specjax.cli import common
  assert common.head_kwargs(Namespace(drafter="eagle-hybrid", draft_weights="int8")) == {"head_weights": "int8"}
  assert common.head_kwargs(Namespace(drafter="eagle", draft_weights="auto")) == {}
  assert common.head_kwargs(Namespace(drafter="model", draft_weights="int8")) == {}
  args = Namespace(drafter="eagle", k=3, ngram=3, draft_layers=None, ngram_caps="1,3", tree=None, acceptance=None,
                   draft_weights="int4")
  assert common.drafter_kwargs(args)["head_weights"] == "int4"


def test_models_describes_a_drafter_directory_and_checks_it_against_a_target(tmp_path):
  """``models --draft DIR``: the layout, the kind that reads it, what it expects; with ``--model`` the target's
  config alone is read and a mismatch is one line naming both sides."""
  data = ROOT / "tests" / "data"
  proc = specjax("models", "--draft", str(data / "eagle3" / "speculators"), "--json", cache=tmp_path)
  assert proc.returncode == 0, proc.stderr
  info = json.loads(proc.stdout)
  assert info["layout"] == "eagle3 (speculators)" and info["drafter"] == "eagle" and info["draft_vocab_size"] == 120
  target = tmp_path / "t"
  target.mkdir()
  (target / "config.json").write_text((data / "hf_families" / "gemma3" / "config.json").read_text())
  proc = specjax("models", "--draft", str(data / "eagle3" / "speculators"), "--model", str(target), "--json",
                 cache=tmp_path)
  assert proc.returncode == 0 and json.loads(proc.stdout)["fits"] == str(target), proc.stderr
  (target / "config.json").write_text((data / "hf_families" / "llama" / "config.json").read_text())
  proc = specjax("models", "--draft", str(data / "eagle3" / "speculators"), "--model", str(target), cache=tmp_path)
  assert_clean_error(proc, "capture layers", "3 layers")
  proc = specjax("models", "--draft", str(tmp_path), cache=tmp_path)
  assert_clean_error(proc, "no readable config.json")
