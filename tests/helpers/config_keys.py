"""Every config in configs/ at tiny size, and the shape of what it writes (the key paths of results.json, or of
summary.json for a training config).

The redesign promised that the configs give the same JSON keys as before it; tests/eval/test_config_keys.py runs
each config here and compares with tests/data/config_keys.json, which this module records:

    python -m tests.helpers.config_keys --code DIR --out tests/data/config_keys.json

``--code DIR`` runs the configs with the specjax found in DIR (a worktree of another commit: the CLI in a
subprocess with PYTHONPATH=DIR), so the reference can come from the code before a change.  The tiny inputs (a
random 2-layer GGUF, a prompt file, a HumanEval-style task file) are made by this checkout's test helpers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "config_keys.json"

# Per config: bindings that shrink it (placeholders: {model} {prompts} {tasks} {head} {data}).  The config's own
# settings stay where they are cheap; sizes, prompt sets and grids shrink; a published device spec stands in
# for this machine's calibration (which would measure for minutes).
TINY: dict[str, list[str]] = {
    "quickstart": ["quickstart.model = '{model}'", "quickstart.prompts = '{prompts}'",
                   "quickstart.max_new_tokens = 4", "quickstart.max_len = 128", "quickstart.k = 2"],
    "multi_device": ["quickstart.model = '{model}'", "quickstart.prompts = '{prompts}'", "quickstart.mesh = '1x2'",
                     "quickstart.max_new_tokens = 4", "quickstart.max_len = 128", "quickstart.k = 2",
                     "quickstart.drafters = ['ngram']"],
    "acceptance_vs_k": ["acceptance_vs_k.model = '{model}'", "acceptance_vs_k.prompts = '{prompts}'",
                        "acceptance_vs_k.ks = [1, 2]", "acceptance_vs_k.max_new_tokens = 4",
                        "acceptance_vs_k.max_len = 128"],
    "batch_sweep": ["batch_sweep.model = '{model}'", "batch_sweep.prompts = '{prompts}'",
                    "batch_sweep.categories = None", "batch_sweep.k = 2", "batch_sweep.buckets = [0, 2]",
                    "batch_sweep.slots = 2", "batch_sweep.batches = [1]", "batch_sweep.rates = [50.0]",
                    "batch_sweep.requests = 3", "batch_sweep.max_new_tokens = 4", "batch_sweep.max_batch = 1",
                    "batch_sweep.crossover_requests = 2", "batch_sweep.device = 'h200'"],
    "serve_trees": ["batch_sweep.model = '{model}'", "batch_sweep.draft = '{model}'",
                    "batch_sweep.prompts = '{tasks}'", "batch_sweep.weights = 'auto'", "batch_sweep.k = 2",
                    "batch_sweep.buckets = [0, 2]", "batch_sweep.trees = ['branch:2,1']", "batch_sweep.slots = 2",
                    "batch_sweep.rates = [50.0]", "batch_sweep.requests = 3", "batch_sweep.max_new_tokens = 4",
                    "batch_sweep.device = 'h200'"],
    "coder_pair": ["coder_pair.model = '{model}'", "coder_pair.draft = '{model}'", "coder_pair.prompts = '{tasks}'",
                   "coder_pair.limit = 1", "coder_pair.max_new_tokens = 4", "coder_pair.max_len = 256",
                   "coder_pair.ks = [2]", "coder_pair.sequoia_budgets = [3]", "coder_pair.dynamic_budgets = []",
                   "coder_pair.acceptance_ranks = 2", "coder_pair.acceptance_depths = 1",
                   "coder_pair.ngram_ks = [3]", "coder_pair.ngram_trees = []", "coder_pair.layerskip_ks = []",
                   "coder_pair.draft_layers = 1", "coder_pair.hybrid_ks = [3]", "coder_pair.hybrid_match = 1",
                   "coder_pair.device = 'h200'"],
    "cross_vocab": ["cross_vocab.model = '{model}'",
                    "cross_vocab.prompt_sets = [{{'name': 'tasks', 'prompts': '{tasks}', 'limit': 1}}]",
                    "cross_vocab.drafts = [{{'label': 'same tokenizer', 'draft': '{model}'}}]",
                    "cross_vocab.k = 2", "cross_vocab.ngram_k = 3", "cross_vocab.max_new_tokens = 4",
                    "cross_vocab.max_len = 256"],
    "sampled_speed": ["sampled_speed.model = '{model}'",
                      "sampled_speed.prompt_sets = [{{'name': 'tasks', 'prompts': '{tasks}', 'limit': 1}}]",
                      "sampled_speed.methods = [{{'label': 'n-gram', 'drafter': 'ngram', 'k': 2}}, "
                      "{{'label': 'draft', 'drafter': 'model', 'k': 2, 'draft': '{model}'}}]",
                      "sampled_speed.weights = 'auto'", "sampled_speed.max_new_tokens = 4",
                      "sampled_speed.max_len = 256"],
    "drafter_table": ["drafter_table.model = '{model}'", "drafter_table.prompts = '{prompts}'",
                      "drafter_table.categories = ['qa']", "drafter_table.per_category = 1",
                      "drafter_table.max_new_tokens = 4", "drafter_table.max_len = 128",
                      "drafter_table.drafters = [{{'label': 'n-gram', 'drafter': 'ngram', 'k': 3}}, "
                      "{{'label': 'layer-skip', 'drafter': 'layerskip', 'k': 2, 'draft_layers': '1'}}]"],
    "layerskip_search": ["layerskip_search.model = '{model}'", "layerskip_search.prompts = '{prompts}'",
                         "layerskip_search.k = 2", "layerskip_search.max_new_tokens = 4",
                         "layerskip_search.max_len = 128", "layerskip_search.candidates = [[0], [1]]"],
    "roofline": ["roofline.model = '{model}'", "roofline.batches = [1, 2]", "roofline.rows = [1, 4]",
                 "roofline.context = 16", "roofline.repeats = 1", "roofline.device = 'h200'"],
    "tree_shapes": ["tree_shapes.model = '{model}'", "tree_shapes.prompts = '{prompts}'",
                    "tree_shapes.categories = None", "tree_shapes.budgets = [3]", "tree_shapes.ranks = 2",
                    "tree_shapes.acceptance_depths = 2", "tree_shapes.max_new_tokens = 4",
                    "tree_shapes.max_len = 128"],
    "weights": ["weights.model = '{model}'", "weights.prompts = '{prompts}'", "weights.kinds = ['fp32', 'int8']",
                "weights.per_category = None", "weights.limit = 1", "weights.max_new_tokens = 4",
                "weights.max_len = 128", "weights.rows = [1, 4]", "weights.verify_repeats = 1",
                "weights.drafters = [('ngram', 3)]", "weights.device = 'h200'",
                "weights.text = 'the cat sat on the mat. a b c a b c'"],
    "suffix_trace": ["suffix_trace.model = '{model}'", "suffix_trace.prompts = '{prompts}'", "suffix_trace.tasks = 1",
                     "suffix_trace.repeats = 2", "suffix_trace.max_new_tokens = 6", "suffix_trace.max_len = 128",
                     "suffix_trace.k = 3", "suffix_trace.ngram_k = 3", "suffix_trace.slots = 2",
                     "suffix_trace.index_tokens = 64"],
    "online_adapt": ["online_adapt.model = '{model}'", "online_adapt.prompts = '{prompts}'",
                     "online_adapt.draft = '{head}'", "online_adapt.first = ['qa']", "online_adapt.then = ['qa']",
                     "online_adapt.then_generated = 0",
                     "online_adapt.requests = 6", "online_adapt.rate = 0.0", "online_adapt.max_new_tokens = 6",
                     "online_adapt.max_len = 128", "online_adapt.k = 3", "online_adapt.seq_len = 32",
                     "online_adapt.buffer_tokens = 128", "online_adapt.every = 1",
                     "online_adapt.matmul_dtype = 'float32'", "online_adapt.window_s = 0.5"],
    "distill_losses": ["distill_losses.model = '{model}'", "distill_losses.data_dir = '{data}'",
                       "distill_losses.num_prompts = 6", "distill_losses.max_new_tokens = 6",
                       "distill_losses.losses = ['ce', 'tvd']", "distill_losses.reduced_vocab = 0",
                       "distill_losses.eval_positions = 2", "distill_losses.steps = 2",
                       "distill_losses.batch_size = 2", "distill_losses.seq_len = 32",
                       "distill_losses.warmup_steps = 1", "distill_losses.checkpoint_every = 2"],
    "draft_smollm2": ["train_draft_model.model = '{model}'", "train_draft_model.data_dir = '{data}'",
                      "train_draft_model.num_prompts = 6", "train_draft_model.max_new_tokens = 6",
                      "train_draft_model.layers = [0]", "train_draft_model.steps = 2",
                      "train_draft_model.batch_size = 2", "train_draft_model.seq_len = 32",
                      "train_draft_model.warmup_steps = 1", "train_draft_model.checkpoint_every = 2"],
    "eagle_smollm2": ["train_eagle.model = '{model}'", "train_eagle.data_dir = '{data}'",
                      "train_eagle.num_prompts = 6", "train_eagle.max_new_tokens = 6", "train_eagle.steps = 2",
                      "train_eagle.batch_size = 2", "train_eagle.seq_len = 32", "train_eagle.warmup_steps = 1",
                      "train_eagle.checkpoint_every = 2", "train_eagle.eval_positions = 2"],
    "eagle_qwen_coder": ["train_eagle.model = '{model}'", "train_eagle.data_dir = '{data}'",
                         "train_eagle.num_prompts = 2", "train_eagle.chat_prompts = 1", "train_eagle.code_prompts = 3",
                         "train_eagle.self_prompts = 0", "train_eagle.reduced_vocab = 64",
                         "train_eagle.max_new_tokens = 6", "train_eagle.steps = 2", "train_eagle.batch_size = 2",
                         "train_eagle.seq_len = 64", "train_eagle.warmup_steps = 1", "train_eagle.gen_batch_size = 2",
                         "train_eagle.checkpoint_every = 2", "train_eagle.eval_positions = 2"],
    "medusa_smollm2": ["train_medusa.model = '{model}'", "train_medusa.data_dir = '{data}'",
                       "train_medusa.num_prompts = 6", "train_medusa.max_new_tokens = 6", "train_medusa.steps = 2",
                       "train_medusa.num_heads = 2", "train_medusa.batch_size = 2", "train_medusa.seq_len = 32",
                       "train_medusa.warmup_steps = 1", "train_medusa.checkpoint_every = 2",
                       "train_medusa.gen_batch_size = 2"],
}
TRAINING = ("distill_losses", "draft_smollm2", "eagle_smollm2", "eagle_qwen_coder", "medusa_smollm2")
MESHED = ("multi_device",)          # runs in its own process with two host devices


def key_paths(obj, prefix: str = "") -> set[str]:
  """'/a/b' for every dict key, '[]' for list elements (the union over elements).  The machine description and
  dicts keyed by data (numbers, labels with spaces) are summarised as their path only: their keys follow the
  machine or the settings, not the code's schema."""
  out: set[str] = set()
  if isinstance(obj, dict):
    if prefix.endswith("/machine") or (obj and all(_is_data_key(k) for k in obj)):
      return out
    for k, v in obj.items():
      out.add(f"{prefix}/{k}")
      out |= key_paths(v, f"{prefix}/{k}")
  elif isinstance(obj, list):
    for v in obj:
      out |= key_paths(v, prefix + "[]")
  return out


def _is_data_key(k: str) -> bool:
  return k.replace(".", "", 1).lstrip("-").isdigit() or " " in k


def make_inputs(root: Path) -> dict[str, str]:
  """The tiny model and prompt files the bindings name."""
  from tests.helpers import varied_tiny_gguf
  root.mkdir(parents=True, exist_ok=True)
  model = varied_tiny_gguf(root / "tiny.gguf")
  prompts = root / "prompts.jsonl"
  prompts.write_text('{"question_id": 1, "category": "qa", "turns": ["the world the world the world"]}\n'
                     '{"question_id": 2, "category": "qa", "turns": ["hello world, hello world"]}\n')
  tasks = root / "tasks.jsonl"
  tasks.write_text(json.dumps({"task_id": "Tiny/0", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
                               "entry_point": "add", "canonical_solution": "    return a + b\n",
                               "test": "def check(f):\n    assert f(1, 2) == 3\n"}) + "\n")
  return {"model": str(model), "prompts": str(prompts), "tasks": str(tasks), "head": _tiny_head(model, root)}


def _tiny_head(model: str, root: Path) -> str:
  """An (untrained) fused feature drafter exported for the tiny model, as `specjax train` writes one."""
  import jax
  from specjax import api
  from specjax.checkpoints import drafter_io
  from specjax.speculative import eagle
  m = api.load(model)
  ecfg = eagle.EagleConfig(m.cfg, (0, 1), 0)
  return str(drafter_io.save_drafter(root / "head", ecfg, eagle.init_trainable(ecfg, jax.random.PRNGKey(1)),
                                     target_name=m.source, tokenizer=m.tokenizer))


def bindings(name: str, inputs: dict[str, str], work: Path) -> list[str]:
  return [b.format(**inputs, data=str(work / f"{name}-data")) for b in TINY[name]]


def result_file(name: str, out: Path) -> Path:
  return out / ("summary.json" if name in TRAINING else "results.json")


def run_in_process(name: str, inputs: dict[str, str], work: Path) -> dict:
  """The config through the runner, as ``specjax run``/``specjax train`` would, in this process."""
  from specjax.cli import runner
  out = work / f"{name}-out"
  binds = bindings(name, inputs, work)
  config = str(ROOT / "configs" / f"{name}.gin")
  if name in TRAINING:
    runner.train_from_files([config], binds, str(out), resume=False)
  else:
    runner.run_from_files([config], binds, str(out), log=lambda *_: None)
  return json.loads(result_file(name, out).read_text())


def run_in_subprocess(name: str, inputs: dict[str, str], work: Path, code: Path = ROOT) -> dict:
  """The config through the CLI of the specjax in ``code``, in a fresh process."""
  out = work / f"{name}-out"
  cmd = [sys.executable, "-m", "specjax.cli", "train" if name in TRAINING else "run",
         str(code / "configs" / f"{name}.gin"), "--json"]
  cmd += ["--run-dir" if name in TRAINING else "--out", str(out)]
  for b in bindings(name, inputs, work):
    cmd += ["--gin-binding", b]
  env = dict(os.environ, PYTHONPATH=str(code), JAX_PLATFORMS="cpu")
  if name in MESHED:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
  proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=900)
  if proc.returncode != 0:
    raise RuntimeError(f"{name}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
  return json.loads(result_file(name, out).read_text())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--code", default=str(ROOT), help="the checkout whose specjax runs the configs")
  ap.add_argument("--out", default=str(FIXTURE))
  ap.add_argument("--only", action="append", default=None, help="record only these configs (merged into --out)")
  ap.add_argument("--add", action="store_true",
                  help="keep the recorded keys and record the new ones as additions (a key gone is an error)")
  args = ap.parse_args(argv)
  code = Path(args.code).resolve()
  commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  path = Path(args.out)
  table = json.loads(path.read_text()) if path.is_file() else {}
  names = args.only or [c.stem for c in sorted((ROOT / "configs").glob("*.gin"))]
  with tempfile.TemporaryDirectory() as tmp:
    work = Path(tmp)
    inputs = make_inputs(work / "inputs")
    for name in names:
      if not (code / "configs" / f"{name}.gin").is_file():
        print(f"[config_keys] {name}: not in {code} ({commit}); recording from {ROOT}")
        src = ROOT
      else:
        src = code
      t0 = time.perf_counter()
      keys = sorted(key_paths(run_in_subprocess(name, inputs, work, src)))
      src_commit = commit if src == code else subprocess.run(
          ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
      if args.add and name in table:
        entry = table[name]
        gone = sorted(set(entry["keys"]) - set(keys))
        if gone:
          raise SystemExit(f"[config_keys] {name}: keys gone since {entry['recorded_at']}: {gone}")
        added = entry.setdefault("added", {})
        for k in sorted(set(keys) - set(entry["keys"]) - set(added)):
          added[k] = src_commit
        print(f"[config_keys] {name}: {len(added)} key paths added since {entry['recorded_at']}")
      else:
        table[name] = {"recorded_at": src_commit, "keys": keys}
      print(f"[config_keys] {name}: {len(keys)} key paths at {src_commit} "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
