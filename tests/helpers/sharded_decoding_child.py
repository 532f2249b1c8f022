"""Run by tests/parallel/test_sharding.py in a process of its own with 8 host CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8): decoding on meshes against one device; prints JSON."""
import json
import os
import re
import sys

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run with 8 host devices"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from specjax.models import config, kv_cache, decoder as model, quant, sampling
from specjax.parallel import sharding  # noqa: E402
from specjax.kernels import dispatch  # noqa: E402
from specjax.speculative import Engine, ModelDrafter, NgramDrafter, NoDrafter, generate
from specjax.speculative.trees import specs as tree_shapes  # noqa: E402

# Every sharded dimension divisible by 8: 8 heads = 8 KV heads of 4, FFN 64, vocabulary 128, batch 8.
CFG = config.TINY.replace(name="tiny-tp", num_layers=2, d_model=32, num_heads=8, num_kv_heads=8, head_dim=4,
                          ffn_dim=64, vocab_size=128)
DRAFT_CFG = CFG.replace(name="tiny-tp-draft", num_layers=1)
BUCKETS = (16, 32, 64)
B, S = 8, 64
rng = np.random.default_rng(0)
LENS = rng.integers(1, 12, B).astype(np.int32)
PROMPTS = np.zeros((B, 12), np.int32)
for b in range(B):   # repeated patterns, so that n-gram lookup finds drafts
  pat = rng.integers(3, CFG.vocab_size, 3)
  PROMPTS[b, :LENS[b]] = np.resize(pat, LENS[b])
MAX_NEW = rng.integers(6, 14, B).astype(np.int32)


def run(params, dparams, drafter, shape, sp, mesh, hlo=None):
  """Tokens of each sequence; with ``hlo`` (a dict), also the compiled program's text under hlo["text"]."""
  N = shape.num_nodes
  # What ``on_mesh`` does to a loaded model: the backends, with the mesh, resolved once into the config.
  cfg = CFG.replace(backends=dispatch.resolve(mesh))
  if isinstance(drafter, ModelDrafter):
    drafter = ModelDrafter(DRAFT_CFG.replace(backends=cfg.backends), buckets=BUCKETS)
  eng = Engine(cfg=cfg, drafter=drafter, k_max=N, sp=sp, eos_ids=(), buckets=BUCKETS, tree=shape)
  cache = kv_cache.init_cache(cfg, B, S)
  args = [jnp.asarray(PROMPTS), jnp.asarray(LENS), jnp.asarray(MAX_NEW), jnp.full((B,), N, jnp.int32)]
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
    dparams = sharding.shard_params(dparams, mesh) if dparams != () else ()
    cache = sharding.shard_cache(cache, mesh)
    args = [sharding.shard_batch(a, mesh) for a in args]
  if hlo is None:
    st = generate(params, dparams, cache, *args, jax.random.PRNGKey(7), engine=eng)
  else:   # compile once: read the program, then run that same executable
    compiled = generate.lower(params, dparams, cache, *args, jax.random.PRNGKey(7), engine=eng).compile()
    hlo["text"] = compiled.as_text()
    st = compiled(params, dparams, cache, *args, jax.random.PRNGKey(7))
  seq = np.asarray(st.seq_BxS)
  return [seq[i, LENS[i]:LENS[i] + int(st.num_new_B[i])].tolist() for i in range(B)]


def collectives(text):
  """Collective ops in a compiled program's text, and every all-gather's result shape."""
  ops = {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in ("all-reduce", "all-gather", "all-to-all",
                                                                          "collective-permute")}
  gathers = re.findall(r"=\s*\(?([a-z0-9]+\[[0-9,]*\])[^=\n]*?\ball-gather(?:-start)?\(", text)
  return ops, gathers


def train_losses(mesh, steps: int = 2):
  """Losses of `steps` AdamW steps of the draft-model trainer's loss (cross-entropy) on a fixed batch: on one
  device, or data- and model-parallel over `mesh` (batch over "data", parameters by sharding.RULES)."""
  import optax
  from specjax.training import draft_model
  params = model.init_params(CFG, jax.random.PRNGKey(3))
  r = np.random.default_rng(5)
  T = 16
  batch = {"tokens": jnp.asarray(r.integers(3, CFG.vocab_size, (B, T)), jnp.int32),
           "seg": jnp.ones((B, T), jnp.int32), "pos": jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1)),
           "loss_mask": jnp.asarray(r.random((B, T)) < 0.8),
           "final": jnp.asarray(r.standard_normal((B, T, CFG.d_model)), jnp.float32)}
  head = jnp.asarray(r.standard_normal((CFG.vocab_size, CFG.d_model)) * 0.1, jnp.float32)
  tx = optax.adamw(1e-2)
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
    batch = {k: sharding.shard_batch(v, mesh) for k, v in batch.items()}

  @jax.jit
  def step(params, opt, batch):
    (loss, _), g = jax.value_and_grad(
        lambda p: draft_model.loss_fn(p, {}, CFG, "ce", batch, head), has_aux=True)(params)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, loss

  opt = tx.init(params)
  out = []
  with sharding.use(mesh):
    for _ in range(steps):
      params, opt, loss = step(params, opt, batch)
      out.append(float(loss))
  return out


def main():
  params = model.unstack_layers(model.init_params(CFG, jax.random.PRNGKey(0)))
  dparams = model.unstack_layers(model.init_params(DRAFT_CFG, jax.random.PRNGKey(1)))
  greedy, sampled = sampling.SamplingParams(), sampling.SamplingParams(temperature=0.8, top_k=20)
  model_drafter = ModelDrafter(DRAFT_CFG, buckets=BUCKETS)
  # (drafter, its params, tree, sampling, meshes to run on, whether to run it on the single device too).  Every
  # compile costs seconds here, so each mesh serves one setting, and a greedy setting is checked against plain
  # greedy decoding on one device rather than against its own single-device run (that speculative greedy is
  # plain greedy on one device is tested on every drafter and tree in tests/speculative/test_speculative.py,
  # test_trees.py).
  settings = {
      "plain/greedy": (NoDrafter(), (), tree_shapes.chain(0), greedy, (), True),
      "ngram-chain/greedy": (NgramDrafter(3), (), tree_shapes.chain(3), greedy, ("2x4",), False),
      "model-tree/greedy": (model_drafter, dparams, tree_shapes.branching([2, 2]), greedy, ("8x1",), False),
      "model-chain/sampled": (model_drafter, dparams, tree_shapes.chain(3), sampled, ("1x8",), True),
  }
  meshes = {name: sharding.make_mesh(name) for name in ("1x8", "2x4", "8x1")}
  out = {"devices": len(jax.devices()), "results": {}}
  hlo = {}
  for label, (drafter, dp, shape, sp, on, single) in settings.items():
    row = {"single": run(params, dp, drafter, shape, sp, None)} if single else {}
    for mname in on:
      want = hlo if (label, mname) == ("ngram-chain/greedy", "2x4") else None
      row[mname] = run(params, dp, drafter, shape, sp, meshes[mname], want)
    out["results"][label] = row
  out["collectives_2x4"], out["all_gather_shapes_2x4"] = collectives(hlo["text"])
  # int4 weights (data, group scales and offsets sharded by the matrices' rules; XLA's dequantize-and-dot on
  # the mesh, the native kernel on one device): the same greedy tokens
  q4 = quant.quantize_params(params, "int4")
  # fp32 activations on both: a mesh multiplies by fp32 activations on the CPU (dispatch.resolve), where one
  # device would take integer ones by default on a CPU with VNNI
  os.environ["SPECJAX_ACTIVATIONS"] = "fp32"
  out["results"]["int4-plain/greedy"] = {
      "single": run(q4, (), NoDrafter(), tree_shapes.chain(0), greedy, None),
      "2x4": run(q4, (), NoDrafter(), tree_shapes.chain(0), greedy, meshes["2x4"])}
  # The Pallas tree kernel (interpret mode here) per shard under shard_map: same tokens, no gathered KV.
  os.environ["SPECJAX_ATTENTION"] = "pallas"
  # resolved again by run(): the path rides in the config, so the executables differ
  pallas_hlo = {}
  out["results"]["pallas-tree/greedy"] = {   # against plain greedy decoding on one device
      "2x4": run(params, dparams, model_drafter, tree_shapes.branching([2, 2]), greedy, meshes["2x4"], pallas_hlo)}
  del os.environ["SPECJAX_ATTENTION"]
  out["pallas_2x4_shard_map"] = "shmap_body" in pallas_hlo["text"] or "shard_map" in pallas_hlo["text"]
  out["collectives_pallas_2x4"], out["all_gather_shapes_pallas_2x4"] = collectives(pallas_hlo["text"])
  # 2x4 shards both the batch (data) and the parameters (model): the one mesh that exercises both at once.
  out["train_losses"] = {"single": train_losses(None), "2x4": train_losses(meshes["2x4"])}
  weights = sorted({f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree_util.tree_leaves(params)})
  out["weight_shapes"] = weights
  out["cache_shape"] = f"f32[{CFG.num_layers},{B},{S},{CFG.num_kv_heads},{CFG.head_dim}]"
  out["partitions_2x4"] = sharding.describe(meshes["2x4"], params)[:8]
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
