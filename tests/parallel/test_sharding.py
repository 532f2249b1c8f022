"""Decoding over a device mesh (specjax/parallel/sharding.py) on 8 host CPU devices, in a process of its own (the device
count is fixed when jax starts): every mesh gives the single device's tokens, greedy and sampled, chain and
tree; the compiled sharded step has its all-reduces and gathers no weight matrix."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specjax.parallel import sharding
from specjax.errors import SpecjaxError

_EIGHT = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"   # 8 host devices


@pytest.fixture(scope="module")
def child():
  env = {**os.environ, "XLA_FLAGS": _EIGHT, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "helpers" / "sharded_decoding_child.py")],
                        capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout)


def test_every_mesh_decodes_the_single_device_tokens(child):
  assert child["devices"] == 8
  results = child["results"]
  assert set(results) == {"plain/greedy", "ngram-chain/greedy", "model-tree/greedy", "model-chain/sampled",
                          "pallas-tree/greedy", "int4-plain/greedy"}
  q4 = results["int4-plain/greedy"]              # quantized weights on a mesh: the single device's tokens
  assert q4["2x4"] == q4["single"] and len({t for seq in q4["single"] for t in seq}) > 10
  plain = results["plain/greedy"]["single"]
  assert len({t for seq in plain for t in seq}) > 10                       # replies that move
  # speculative greedy decoding on a mesh is plain greedy decoding on one device
  for setting in ("ngram-chain/greedy", "model-tree/greedy", "pallas-tree/greedy"):
    assert set(results[setting]) and "single" not in results[setting], setting
    for mesh, tokens in results[setting].items():
      assert tokens == plain, (setting, mesh)
  # sampled speculative decoding on a mesh draws the single device's tokens from the same key
  sampled = results["model-chain/sampled"]
  assert sampled["single"] != plain                                        # sampling really samples
  assert sampled["1x8"] == sampled["single"]
  meshes_run = {m for setting, row in results.items() if setting not in ("pallas-tree/greedy", "int4-plain/greedy")
                for m in row} - {"single"}
  assert meshes_run == {"1x8", "2x4", "8x1"}                               # each mesh shape decodes once


def test_a_training_step_gives_the_single_device_loss_on_a_data_and_model_mesh(child):
  losses = child["train_losses"]
  single = losses["single"]
  assert len(single) == 2 and single[1] < single[0]          # the step trains
  assert set(losses) == {"single", "2x4"}                    # 2x4: data- and model-parallel at once
  np.testing.assert_allclose(losses["2x4"], single, rtol=1e-5, atol=1e-5)


def test_sharded_step_all_reduces_and_gathers_no_weight(child):
  ops = child["collectives_2x4"]
  assert ops["all-reduce"] > 0, ops               # row-parallel matmuls sum their partial products
  weights = set(child["weight_shapes"])
  assert not weights & set(child["all_gather_shapes_2x4"]), child["all_gather_shapes_2x4"]


def test_pallas_tree_kernel_runs_per_shard(child):
  """SPECJAX_ATTENTION=pallas (interpret mode on the CPU): under a 2x4 mesh the kernel runs in shard_map on
  each device's sequences and KV heads, gives plain greedy decoding's tokens on one device, and no KV buffer (the only
  rank-5 arrays) is gathered."""
  row = child["results"]["pallas-tree/greedy"]
  assert row["2x4"] == child["results"]["plain/greedy"]["single"]
  assert child["pallas_2x4_shard_map"]
  rank5 = [s for s in child["all_gather_shapes_pallas_2x4"] if s.count(",") == 4]
  assert not rank5, rank5
  assert not set(child["weight_shapes"]) & set(child["all_gather_shapes_pallas_2x4"])


def test_mesh_spec_errors_are_clear():
  with pytest.raises(SpecjaxError, match="DATAxMODEL"):
    sharding.parse_mesh("2by4")
  with pytest.raises(SpecjaxError, match="needs 8 devices"):
    sharding.make_mesh("2x4")                      # this process has one device
  assert sharding.parse_mesh("2x4") == (2, 4)


def test_rules_name_every_parameter_and_drop_axes_that_do_not_divide():
  import jax
  from specjax.models import config, decoder as model
  mesh = sharding.make_mesh("1x1")
  params = model.init_params(config.TINY, jax.random.PRNGKey(0))
  rows = sharding.describe(mesh, params)           # raises if a parameter has no rule
  assert {r["param"].split("'")[-2] for r in rows} <= set(sharding.RULES)
  fake = type("M", (), {"shape": {"data": 2, "model": 8}})()
  assert sharding._fit(("model", None), (12, 32), fake) == sharding.P(None, None)   # 12 heads on 8: whole
  assert sharding._fit(("model", None), (16, 32), fake) == sharding.P("model", None)


def test_generate_and_bench_cli_on_a_mesh(tmp_path):
  """`specjax generate --mesh 2x4` end to end (a tiny GGUF, greedy n-gram speculation, batch 4) gives the
  single device's tokens; `specjax bench --mesh 2x4` runs both methods sharded."""
  from tests.helpers import _single_device_tokens, varied_tiny_gguf
  path = varied_tiny_gguf(tmp_path / "tiny.gguf")
  prompts = tmp_path / "p.txt"
  prompts.write_text("a b c a b c a\nhello hello hello\nthe cat the cat\nx\n")
  env = {**os.environ, "XLA_FLAGS": _EIGHT, "JAX_PLATFORMS": "cpu",
         "SPECJAX_CACHE": str(tmp_path / "cache")}
  args = [sys.executable, "-m", "specjax.cli", "generate", "--model", path, "--prompts", str(prompts),
          "--batch-size", "4", "--max-new-tokens", "12", "--drafter", "ngram", "--k", "3", "--json", "--mesh", "2x4"]
  proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  want = _single_device_tokens(path, prompts)
  assert [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]] == want
  assert len({tuple(w) for w in want}) == 4 and len({t for w in want for t in w}) > 4   # replies that differ
  bench = subprocess.run([sys.executable, "-m", "specjax.cli", "bench", "--model", path, "--prompts", str(prompts),
                          "--batch-size", "4", "--max-new-tokens", "8", "--drafter", "ngram", "--k", "3",
                          "--mesh", "2x4", "--json"], capture_output=True, text=True, env=env, timeout=600)
  assert bench.returncode == 0, bench.stderr[-2000:]
  res = json.loads(bench.stdout)
  assert res["mesh"] == "2x4" and res["speedup_median"] > 0 and res["ar_tokens_per_s"] > 0
  from tests.helpers import specjax_here, varied_tiny_gguf          # the mesh is checked before anything compiles
  bad = specjax_here(*args[3:-1], "3x3")
  assert bad.returncode == 2 and "needs 9 devices" in bad.stderr, bad.stderr


def test_serving_on_a_mesh_gives_plain_greedy_tokens():
  """The continuous-batching engine with its slots over "data" and KV heads over "model" (4x2)."""
  env = {**os.environ, "XLA_FLAGS": _EIGHT, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "helpers" / "sharded_serving_child.py")],
                        capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out["served"] == out["plain"]
  assert len({tuple(p) for p in out["plain"]}) > 2 and len({t for p in out["plain"] for t in p}) > 4
  assert set(out["ks"]) == {3}                       # every step speculated
  assert out["cache_sharding"].startswith("P(None, 'data', None, 'model'")


def test_bf16_speculative_greedy_equals_bf16_plain_greedy(tmp_path):
  """--dtype bfloat16: weights, KV buffers and activations in bf16 (logits and softmax statistics in fp32);
  the engine's exactness holds in that dtype too."""
  import jax.numpy as jnp
  from specjax import api
  from tests.helpers import CFG, random_hf_params, write_gguf
  path = str(write_gguf(tmp_path / "tiny.gguf", CFG, random_hf_params(CFG, seed=3)))
  m = api.load(path, dtype="bfloat16")
  assert m.dtype == jnp.bfloat16
  prompts = ["a b c a b c a", "hello hello hello", "the cat the cat"]
  base, _ = api.generate(m, prompts, max_new_tokens=16, batch_size=3)
  assert sum(len(o.token_ids) for o in base) > 0
  for drafter, kw in (("ngram", {"k": 3}), ("layerskip", {"k": 2, "draft_layers": 1})):
    outs, stats = api.generate(m, prompts, max_new_tokens=16, batch_size=3, drafter=drafter, **kw)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base], drafter
  f32 = api.load(path)                             # dtype "auto": float32 on the CPU, bfloat16 on accelerators
  assert f32.dtype == jnp.float32
  assert (api.default_dtype("cpu"), api.default_dtype("gpu"), api.default_dtype("tpu")) == (
      "float32", "bfloat16", "bfloat16")
  text = "a b c a b c a b c hello the cat"
  assert abs(api.score(m, text).perplexity / api.score(f32, text).perplexity - 1) < 0.05
