"""Token trees on the command line: --tree / --acceptance on generate and bench, acceptance-vector, and the
tree_shapes experiment, on a tiny random model."""
import json

import pytest

from specjax.speculative.trees.specs import load_acceptance_vector
from tests.helpers import CFG, random_hf_params, write_gguf
from tests.helpers import assert_clean_error, specjax, specjax_here

MISSING_MODEL = "/no/such/model.gguf"      # tree errors must come before the model is even looked for


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  """Layer weights scaled up so greedy replies vary (an unscaled random model repeats one token)."""
  hf = random_hf_params(CFG, seed=3)
  hf["layers"] = [{k: v * 2.0 if k.endswith("proj") else v for k, v in layer.items()} for layer in hf["layers"]]
  return str(write_gguf(tmp_path_factory.mktemp("tree_cli") / "tiny.gguf", CFG, hf))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
  path = tmp_path_factory.mktemp("tree_prompts") / "p.jsonl"
  path.write_text('{"question_id": 1, "category": "qa", "turns": ["the world the world the world"]}\n'
                  '{"question_id": 2, "category": "qa", "turns": ["hello world, hello world"]}\n')
  return str(path)


def generate(model, prompts, *extra):
  proc = specjax("generate", "--model", model, "--prompts", prompts, "--max-new-tokens", "16", "--max-len", "128",
                 "--json", *extra)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout)


def token_ids(obj):
  return [o["token_ids"] for o in obj["outputs"]]


@pytest.fixture(scope="module")
def plain(tiny_model, prompts):
  return generate(tiny_model, prompts)


def test_tree_errors_are_one_line_and_come_before_loading(tmp_path):
  not_a_tree = tmp_path / "gap.json"
  not_a_tree.write_text("[[0], [2]]")
  acc = tmp_path / "acc.json"
  acc.write_text('{"acceptance_vector": [0.5, 0.2]}')
  base = ("generate", "--model", MISSING_MODEL, "--prompt", "hi")
  cases = [(("--drafter", "ngram", "--tree", "star:3"), ("unknown tree shape", "star:3", "branch:")),
           (("--drafter", "ngram", "--tree", "chain:100", "--max-len", "64"), ("100 draft nodes", "--max-len")),
           (("--drafter", "ngram", "--tree", f"paths:{not_a_tree}"), ("gap.json", "sibling")),
           (("--drafter", "ngram", "--tree", "sequoia:8:0"), ("depth limit", "positive")),
           (("--tree", "branch:2"), ("--tree", "--drafter ngram")),
           (("--drafter", "none", "--tree", "branch:2"), ("--tree", "--drafter")),
           (("--drafter", "ngram", "--tree", "sequoia:4"), ("acceptance vector", "--acceptance")),
           (("--drafter", "ngram", "--tree", "sequoia:4", "--acceptance", str(tmp_path / "nope.json")),
            ("nope.json",)),
           (("--drafter", "ngram", "--tree", "dynamic:4", "--acceptance", str(acc)), ("dynamic", "--acceptance"))]
  for extra, needles in cases:
    assert_clean_error(specjax_here(*base, *extra), *needles)
  assert_clean_error(specjax_here("bench", "--model", MISSING_MODEL, "--drafter", "ngram", "--tree", "chain:0"),
                     "positive integer")
  assert_clean_error(specjax_here("acceptance-vector", "--model", MISSING_MODEL, "--drafter", "none"),
                     "--drafter ngram")
  assert_clean_error(specjax_here("acceptance-vector", "--model", MISSING_MODEL, "--ranks", "0"), "--ranks")
  assert_clean_error(specjax_here("acceptance-vector", "--model", MISSING_MODEL, "--depths", "0"), "--depths")


def test_generate_tree_gives_plain_greedy_tokens(tiny_model, prompts, plain):
  obj = generate(tiny_model, prompts, "--drafter", "ngram", "--tree", "branch:2,1", "--k", "7")
  assert token_ids(obj) == token_ids(plain)
  st = obj["stats"]
  assert st["tree"] == "branch:2,1" and st["nodes"] == 4 and st["k"] == 4       # N from the tree, not --k
  assert len(st["acceptance_by_depth"]) == 2 and st["acceptance_by_position"] == st["acceptance_by_depth"]
  assert len(st["node_accepted"]) == 5 and 1.0 <= st["mean_accepted_length"] <= 3.0
  assert "predicted_mean_accepted_length" not in st
  chain = generate(tiny_model, prompts, "--drafter", "ngram", "--k", "3")["stats"]
  assert chain["tree"] == "chain:3" and chain["nodes"] == 3


def test_acceptance_vector_file_feeds_a_sequoia_tree(tiny_model, prompts, plain, tmp_path):
  out = tmp_path / "acc.json"
  proc = specjax("acceptance-vector", "--model", tiny_model, "--drafter", "ngram", "--prompts", prompts,
                 "--ranks", "3", "--depths", "2", "--max-new-tokens", "16", "--max-len", "128", "--out", str(out),
                 "--json")
  assert proc.returncode == 0, proc.stderr
  obj = json.loads(proc.stdout)
  assert json.loads(out.read_text()) == obj
  for key in ("model", "drafter", "ranks", "iterations", "prompts", "machine", "iterations_by_depth"):
    assert key in obj, key
  acc = load_acceptance_vector(out)              # the depth table, preferred over the depth-1 vector
  assert len(acc) == obj["depths"] == 2 and list(acc[0]) == obj["acceptance_vector"]
  assert all(len(row) == obj["ranks"] == 3 and sum(row) <= 1 for row in acc)
  assert obj["iterations"] == obj["iterations_by_depth"][0] > 0 and obj["prompts"] == 2
  seq = generate(tiny_model, prompts, "--drafter", "ngram", "--tree", "sequoia:4", "--acceptance", str(out))
  assert token_ids(seq) == token_ids(plain)
  st = seq["stats"]
  assert st["tree"] == "sequoia:4" and st["nodes"] == 4
  assert st["predicted_mean_accepted_length"] >= 1.0


def test_bench_tree_json(tiny_model, prompts):
  proc = specjax("bench", "--model", tiny_model, "--prompts", prompts, "--max-new-tokens", "8", "--max-len", "128",
                 "--drafter", "ngram", "--tree", "dynamic:3:2", "--json")
  assert proc.returncode == 0, proc.stderr
  obj = json.loads(proc.stdout)
  assert obj["tree"] == "dynamic:3:2" and obj["nodes"] == 3
  assert len(obj["verify_ms_by_rows"]) == 4 and obj["verify_ms_full"] == obj["verify_ms_by_rows"]["4"]
  for key in ("mean_accepted_length", "acceptance_by_depth", "acceptance_by_position", "verify_ms", "draft_ms",
              "speedup", "predicted_speedup"):
    assert key in obj, key


def test_tree_shapes_experiment(tiny_model, prompts, tmp_path):
  out = tmp_path / "run"
  bind = ["--gin-binding", f"tree_shapes.model = '{tiny_model}'", "--gin-binding", f"tree_shapes.prompts = '{prompts}'",
          "--gin-binding", "tree_shapes.categories = None", "--gin-binding", "tree_shapes.budgets = [4]",
          "--gin-binding", "tree_shapes.ranks = 3", "--gin-binding", "tree_shapes.max_new_tokens = 8",
          "--gin-binding", "tree_shapes.max_len = 128"]
  proc = specjax("run", "configs/tree_shapes.gin", *bind, "--out", str(out), "--json")
  assert proc.returncode == 0, proc.stderr
  obj = json.loads(proc.stdout)
  rows = obj["rows"]
  shapes = ("chain", "branch", "sequoia", "sequoia_flat", "dynamic")
  assert [(r["shape"], r["nodes"]) for r in rows] == [(s, 4) for s in shapes]   # one budget: 5 compiles
  for r in rows:
    assert r["verify_ms_full"] > 0 and r["speedup"] > 0 and r["mean_accepted_length"] >= 1.0
    assert (r["predicted_mean_accepted_length"] is None) == (r["shape"] == "dynamic")
  choice = obj["summary"]["sequoia_choice"]
  assert choice["n_star"] == 4 and choice["best_measured_nodes"] == 4
  for f in ("config.gin", "results.json", "results.csv", "tau_vs_nodes.png", "speedup_vs_nodes.png"):
    assert (out / f).is_file(), f
  table = load_acceptance_vector(out / "acceptance_vector.json")   # configs/tree_shapes.gin: 4 depths
  assert len(table) == 4 and all(len(row) == 3 for row in table)
