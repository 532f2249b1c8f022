"""The cost model: hand-counted FLOPs and bytes, τ and predicted speedup, the KV bill and its refusals, buffer
sizing, calibration reuse, and the `specjax cost` / `calibrate` commands."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.models import buffers, config, kv_cache, decoder as model
from specjax.measure import costmodel, memory
from specjax.measure import calibrate
from specjax.errors import SpecjaxError

CFG = config.ModelConfig(name="hand", vocab_size=100, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2,
                         head_dim=8, ffn_dim=64)


def test_one_layer_flops_and_bytes_equal_a_hand_count():
  # Weights of one layer: q 32×32, k and v 32×16 each, o 32×32, gate and up 32×64 each, down 64×32.
  weights = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 32 * 64 + 64 * 32        # = 9216
  assert costmodel.layer_weight_count(CFG) == weights == 9216
  B, T, C = 2, 3, 5
  # Matmuls: 2 FLOPs per weight per token row, 6 rows.
  matmul = 2 * 6 * 9216                                                    # = 110592
  # Attention per sequence and head: row t sees C + t + 1 slots → 6 + 7 + 8 = 21 scores; each score costs
  # E multiply-adds for q·k and E for p·v: 4·E FLOPs; 2 sequences × 4 heads.
  attention = 2 * 4 * 21 * 4 * 8                                           # = 5376
  per_layer = lambda field: (getattr(costmodel.step_cost(CFG, B, T, C), field)
                             - getattr(costmodel.step_cost(CFG.replace(num_layers=2), B, T, C), field))
  c = type("Layer", (), {f: per_layer(f) for f in ("flops", "weight_bytes", "kv_read_bytes", "kv_write_bytes")})
  assert c.flops == matmul + attention == 115968
  # Bytes: the weights and the two 32-wide norms once; K/V of C + T slots read, T slots written (2 kv heads
  # × 8 dims × k and v × 4 bytes = 128 bytes a slot per sequence).
  assert c.weight_bytes == (9216 + 64) * 4 == 37120
  assert c.kv_read_bytes == 2 * (5 + 3) * 128 == 2048
  assert c.kv_write_bytes == 2 * 3 * 128 == 768
  # The whole step adds L layers, the tied head (100 × 32) over all 6 rows and its fp32 logits.
  s = costmodel.step_cost(CFG, B, T, C)
  assert s.flops == 3 * 115968 + 2 * 6 * 32 * 100
  assert s.weight_bytes == 3 * 37120 + 100 * 32 * 4 + 32 * 4
  assert s.other_bytes == 6 * 32 * 4 + 6 * 100 * 4


def test_flop_count_agrees_with_xla_on_the_xla_path(monkeypatch):
  """XLA's own count of the compiled forward (matmuls dominate at this width) agrees within 10%."""
  monkeypatch.setenv("SPECJAX_NATIVE", "0")
  cfg = config.TINY.replace(num_layers=2, d_model=256, num_heads=4, num_kv_heads=2, head_dim=64, ffn_dim=768,
                            vocab_size=512)
  params = model.unstack_layers(model.init_params(cfg, jax.random.PRNGKey(0)))   # unrolled: XLA counts a
  B, T, C = 2, 8, 24                                                                # scan's body only once
  cache = kv_cache.init_cache(cfg, B, 64).with_lengths(jnp.full((B,), C, jnp.int32))
  toks = jnp.zeros((B, T), jnp.int32)
  pos = jnp.broadcast_to(C + jnp.arange(T), (B, T)).astype(jnp.int32)
  from specjax.kernels import cpu_matmul, native
  monkeypatch.setattr(native, "available", lambda: False)
  monkeypatch.setattr(cpu_matmul, "available", lambda: False)
  f = jax.jit(lambda p, c: model.forward(p, cfg, toks, pos, c, kv_window=32).logits)
  analysis = f.lower(params, cache).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  xla_flops = analysis["flops"]
  ours = costmodel.step_cost(cfg, B, T, C).flops
  assert abs(xla_flops / ours - 1) < 0.10, (xla_flops, ours)


def test_expected_accepted_and_speedup():
  assert costmodel.expected_accepted([1.0], 4) == 5.0
  assert costmodel.expected_accepted([0.5], 2) == pytest.approx(1.75)
  assert costmodel.expected_accepted([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
  assert costmodel.expected_accepted([0.9], 0) == 1.0
  spec = costmodel.DeviceSpec("toy", {"float32": 100e9}, 20e9, 16e9)
  cfg = config.SMOLLM2_135M
  # Memory-bound at batch 1: k + 1 rows cost about one row, so speedup ≈ τ.
  s1 = costmodel.predicted_speedup(spec, cfg, [0.7], 4, B=1)
  assert 1.5 < s1 <= costmodel.expected_accepted([0.7], 4)
  # Compute-bound at a large batch: five rows cost five times one; speculation loses.
  s64 = costmodel.predicted_speedup(spec, cfg, [0.7], 4, B=64)
  assert s64 < 1.0
  cross = costmodel.crossover_batch(spec, cfg, [0.7], 4, [1, 2, 4, 8, 16, 32, 64])
  assert cross is not None and costmodel.predicted_speedup(spec, cfg, [0.7], 4, B=cross) < 1.0
  smaller = [b for b in [1, 2, 4, 8, 16, 32, 64] if b < cross]
  assert all(costmodel.predicted_speedup(spec, cfg, [0.7], 4, B=b) >= 1.0 for b in smaller)
  # The bound flips where the arithmetic intensity passes the ridge.
  lo, hi = costmodel.breakdown(spec, cfg, 1, 1, 128), costmodel.breakdown(spec, cfg, 64, 16, 128)
  assert lo["bound"] == "memory" and lo["intensity"] < spec.ridge("float32")
  assert hi["bound"] == "compute" and hi["intensity"] > spec.ridge("float32")


def test_published_devices_and_errors():
  h200 = costmodel.device_spec("h200")
  assert h200.mem_bandwidth == 4.8e12 and h200.peak("bfloat16") == 989e12
  assert costmodel.step_time(h200, config.SMOLLM2_135M, 1, 1, 128, "bfloat16") < costmodel.step_time(
      costmodel.device_spec("a100-sxm-80gb"), config.SMOLLM2_135M, 1, 1, 128, "bfloat16")
  with pytest.raises(SpecjaxError, match="unknown device 'nope'"):
    costmodel.device_spec("nope")
  with pytest.raises(SpecjaxError, match="no peak FLOP/s for float32"):
    costmodel.device_spec("tpu-v5e").peak("float32")


def test_kv_bill_max_batch_and_refusal():
  cfg = config.SMOLLM2_135M
  per_token = 30 * 2 * 3 * 64 * 4                      # layers × (k, v) × kv heads × head dim × fp32
  assert memory.kv_bytes_per_token(cfg) == per_token == 46080
  plain = memory.kv_bill(cfg, 1024, nodes=0)
  specb = memory.kv_bill(cfg, 1024, nodes=4, draft_cfg=config.TINY)
  assert plain.target_kv_per_seq == per_token * 1024 + 4           # + the int32 length
  assert specb.target_kv_per_seq == per_token * 1024 + 4           # the headroom is inside the buffer
  assert specb.draft_kv_per_seq == memory.kv_bytes_per_token(config.TINY) * 1024 + 4
  bf16 = memory.kv_bill(cfg, 1024, nodes=4, draft_cfg=config.TINY, dtype="bfloat16")
  assert bf16.target_kv_per_seq == per_token // 2 * 1024 + 4       # the target's KV in its dtype ...
  assert bf16.draft_kv_per_seq == specb.draft_kv_per_seq           # ... the draft's cache fp32 whatever it is
  assert specb.weights == (cfg.param_count() + config.TINY.param_count()) * 4
  budget = 4 * 2**30
  bp, bs = memory.max_batch(budget, plain), memory.max_batch(budget, specb)
  assert bp >= bs > 0
  assert plain.total(bp) <= budget < plain.total(bp + 1)
  memory.check_budget(budget, plain, bp)
  with pytest.raises(SpecjaxError, match=f"at most batch {bp} fits"):
    memory.check_budget(budget, plain, bp + 1)


def test_buffer_length_buckets():
  assert buffers.buffer_length(20, 64) == 256
  assert buffers.buffer_length(200, 50, nodes=4) == 256        # 200 + 50 + 6 = 256
  assert buffers.buffer_length(200, 51, nodes=4) == 512
  assert buffers.buffer_length(900, 128, nodes=31) == 2048


def test_calibration_is_saved_and_reused(tmp_path, monkeypatch):
  monkeypatch.setattr(calibrate, "probe_stream", lambda nbytes, repeats: 12.5e9)
  monkeypatch.setattr(calibrate, "probe_matmul", lambda repeats: 100e9)
  monkeypatch.setattr(calibrate, "probe_overlap", lambda bw, fl, nbytes, repeats: 0.25)
  monkeypatch.setattr(calibrate, "measure_read_bandwidth", lambda nbytes, repeats: {"best": 20.0})
  out = tmp_path / "cal.json"
  rec = calibrate.calibrate(path=str(out), log=lambda m: None, quick=True)
  spec = costmodel.load_spec(out)
  assert spec.mem_bandwidth == 12.5e9 and spec.peak("float32") == 100e9
  assert 0 <= spec.floor_s < 0.05 and 0 <= spec.floor_per_layer_s < 0.01
  assert rec["probes"]["raw_read_gb_per_s"]["best"] == 20.0
  monkeypatch.setattr(calibrate, "probe_matmul", lambda repeats: pytest.fail("reused calibration re-measured"))
  logs = []
  assert calibrate.calibrate(path=str(out), log=logs.append)["spec"] == rec["spec"]
  assert any("reusing" in m for m in logs)
  out.write_text("{not json")
  with pytest.raises(SpecjaxError, match="calibrate"):
    costmodel.load_spec(out)


def test_cost_command(capsys):
  from specjax import cli
  assert cli.main(["cost", "--device", "h200", "--dtype", "bfloat16", "--k", "4", "--acceptance", "0.8",
                   "--batch-size", "1", "256", "4096", "--context", "16", "--max-len", "4096", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert [r["batch"] for r in out["rows"]] == [1, 256, 4096]
  assert out["rows"][0]["predicted_speedup"] > 1 > out["rows"][-1]["predicted_speedup"]
  assert out["crossover_batch"] in (256, 4096)
  assert out["max_batch_plain"] >= out["max_batch_speculative"] > 0
  assert cli.main(["cost", "--device", "nope"]) == 2
  assert "unknown device 'nope'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  from tests.helpers import CFG as TINY_CFG, random_hf_params, write_gguf
  path = write_gguf(tmp_path_factory.mktemp("cost") / "tiny.gguf", TINY_CFG, random_hf_params(TINY_CFG, seed=3))
  return api.load(str(path))


def test_generate_sizes_buffers_to_the_request_and_refuses_what_does_not_fit(tiny):
  _, st = api.generate(tiny, ["hello there"], max_new_tokens=5)
  assert st["max_len"] == 256                               # short prompt + 5 tokens: the smallest bucket
  _, st = api.generate(tiny, ["hello there"], max_new_tokens=300, drafter="ngram", k=4, ignore_eos=True)
  assert st["max_len"] == 512 and st["new_tokens"] == 300   # prompt + 300 + headroom > 256
  _, st = api.generate(tiny, ["hello there"], max_new_tokens=5, max_len=128)
  assert st["max_len"] == 128                               # an explicit size is kept
  with pytest.raises(SpecjaxError, match=r"batch 64 needs .* at most batch \d+ fits"):
    api.generate(tiny, ["hello"] * 64, max_new_tokens=5, batch_size=64, max_len=1 << 16,
                 memory_budget=64 * 2**20)


def test_ragged_step_time_matches_the_uniform_one_and_skips_idle_slots():
  spec = costmodel.DeviceSpec("toy", {"float32": 100e9}, 20e9, 16e9, floor_s=1e-4, floor_per_layer_s=1e-5)
  cfg = config.SMOLLM2_135M
  for B, T, C in [(1, 1, 100), (4, 5, 300), (32, 16, 128)]:
    assert costmodel.ragged_step_time(spec, cfg, [T] * B, [C] * B) == pytest.approx(
        costmodel.step_time(spec, cfg, B, T, C), rel=1e-9)
  # Idle slots (0 rows) add nothing.
  assert costmodel.ragged_step_time(spec, cfg, [5, 0, 0, 5], [300, 900, 900, 300]) == pytest.approx(
      costmodel.step_time(spec, cfg, 2, 5, 300), rel=1e-9)


def test_rows_step_time_tracks_the_ragged_one():
  spec = costmodel.DeviceSpec("toy", {"float32": 100e9}, 20e9, 16e9, floor_s=1e-4, overlap=0.5)
  cfg = config.SMOLLM2_135M
  ctx = [300, 320, 280, 310]
  for rows in ([1, 1, 1, 1], [5, 5, 5, 5], [9, 1, 1, 3]):
    want = costmodel.ragged_step_time(spec, cfg, rows, ctx)
    got = costmodel.rows_step_time(spec, cfg, [sum(rows)], ctx)[0]
    assert got == pytest.approx(want, rel=0.02)


LLAMA_8B_LIKE = config.SMOLLM2_135M.replace(name="llama-8b-like", num_layers=32, d_model=4096, num_heads=32,
                                            num_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=128256,
                                            tie_embeddings=False)


def test_communication_on_a_mesh_is_a_hand_count():
  """Per layer two ring all-reduces of the device's rows × D over the model axis, plus the logits' gather."""
  cfg, spec = config.TINY, costmodel.DEVICES["h200"]
  mesh = costmodel.MeshShape(2, 4)                 # B = 4 over data 2: 2 sequences per device
  nbytes, count = costmodel.comm_per_step(cfg, 4, 3, mesh, 2)
  rows, ring = 2 * 3, 3 / 4
  want = cfg.num_layers * 2 * (2 * ring * rows * cfg.d_model * 2) + ring * rows * cfg.vocab_size * 4
  assert nbytes == pytest.approx(want) and count == 2 * cfg.num_layers + 1
  assert costmodel.comm_time(spec, cfg, 4, 3, mesh, "bfloat16") == pytest.approx(
      count * spec.link_latency_s + want / spec.interconnect_bandwidth)
  # data parallelism alone: no collective in a forward, and each device prices its share of the batch
  assert costmodel.comm_per_step(cfg, 8, 3, costmodel.MeshShape(8, 1)) == (0.0, 0)
  assert costmodel.step_time(spec, cfg, 8, 3, 64, "bfloat16", mesh="8x1") == pytest.approx(
      costmodel.step_time(spec, cfg, 1, 3, 64, "bfloat16"))
  # the model axis splits compute and the weights and KV read, not the token rows
  one = costmodel.breakdown(spec, LLAMA_8B_LIKE, 16, 5, 512, "bfloat16")
  four = costmodel.breakdown(spec, LLAMA_8B_LIKE, 16, 5, 512, "bfloat16", mesh="1x4")
  assert four["compute_s"] == pytest.approx(one["compute_s"] / 4)
  assert four["memory_s"] < one["memory_s"] / 3.9 and four["comm_s"] > 0 == one["comm_s"]
  assert four["predicted_s"] == pytest.approx(max(four["compute_s"], four["memory_s"]) + four["comm_s"]
                                              + four["floor_s"])


def test_the_crossover_moves_with_the_mesh():
  spec, cfg = costmodel.DEVICES["h200"], LLAMA_8B_LIKE
  batches = [2 ** i for i in range(12)]
  cross = {m: costmodel.crossover_batch(spec, cfg, [0.7], 4, batches, 512, "bfloat16", mesh=m)
           for m in ("1x1", "2x4", "8x1")}
  assert cross["1x1"] is not None
  # splitting sequences over data devices leaves each a smaller batch: speculation pays up to a larger one
  assert cross["8x1"] is None or cross["8x1"] >= 4 * cross["1x1"]
  assert cross["2x4"] > cross["1x1"]
  # tensor parallelism's all-reduce bytes grow with the rows verified: at a large batch speculation pays less
  tp = {m: costmodel.predicted_speedup(spec, config.SMOLLM2_135M, [0.7], 4, 512, 512, "bfloat16", mesh=m)
        for m in ("1x1", "1x8")}
  assert tp["1x8"] < tp["1x1"]
  calibrated = costmodel.DeviceSpec("cpu", {"float32": 1e11}, 2e10, 1e10)     # no interconnect measured
  with pytest.raises(SpecjaxError, match="no interconnect bandwidth"):
    costmodel.step_time(calibrated, cfg, 1, 1, 16, mesh="1x2")


def test_cost_command_on_a_mesh(capsys):
  from specjax import cli
  assert cli.main(["cost", "--device", "h200", "--dtype", "bfloat16", "--batch-size", "1", "64", "--mesh", "2x4",
                   "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["mesh"] == "2x4" and all(r["verify_comm_ms"] > r["plain_comm_ms"] > 0 for r in out["rows"])
  single_gib = costmodel.DEVICES["h200"].memory_bytes
  assert out["memory_budget_bytes"] == pytest.approx(8 * single_gib)


# ----------------------------------------------------------------------------------------------------------
# Weight types


def test_weight_bytes_by_type_equal_a_hand_count():
  # CFG: one layer's matrices q,k,v 32×32 + 2 × 16×32 ([out, in] = [64, 32]), o [32, 32], gate/up [128, 32],
  # down [32, 64]; norms 2 × 32.  int8: a byte a weight + an fp32 scale per 64 inputs — but every input but
  # down's (64) is 32 wide, so those take groups of 32; int4: half a byte + scale and offset per 32.
  mats = {"w_qkv": (64, 32), "wo": (32, 32), "w_gate_up": (128, 32), "w_down": (32, 64)}
  assert costmodel.layer_matrices(CFG) == mats
  int8 = sum(n * d + 4 * n * d / (64 if d % 64 == 0 else 32) for n, d in mats.values())
  int4 = sum(n * d / 2 + 8 * n * d / 32 for n, d in mats.values())
  layer8, vocab8 = costmodel.weight_bytes(CFG, "int8")
  layer4, vocab4 = costmodel.weight_bytes(CFG, "int4")
  assert layer8 == int8 + 64 * 4 and layer4 == int4 + 64 * 4
  # The tied head: int8 under both (int4's policy keeps the embedding/head at int8); + the final norm.
  assert vocab8 == vocab4 == 100 * 32 + 4 * 100 * 32 / 32 + 32 * 4
  layer32, vocab32 = costmodel.weight_bytes(CFG, "fp32")
  assert layer32 == costmodel.layer_param_count(CFG) * 4 and costmodel.weight_bytes(CFG, "bf16")[0] == 9216 * 2 + 256
  assert costmodel.step_cost(CFG, 1, 1, 8, weights="int4").weight_bytes == 3 * layer4 + vocab4
  with pytest.raises(SpecjaxError, match="unknown weight type 'int3'"):
    costmodel.weight_bytes(CFG, "int3")
  from specjax.models import quant
  from specjax.cli import flags
  assert flags.WEIGHT_KINDS == quant.KINDS


def test_fewer_bytes_per_weight_is_faster_until_unpacking_costs_more():
  spec = costmodel.DeviceSpec("bw-bound", {"float32": 1e15}, 10e9, 8e9)     # compute free: bytes set the pace
  t = {k: costmodel.step_time(spec, CFG, 1, 1, 16, weights=k) for k in ("fp32", "bf16", "int8", "int4")}
  assert t["fp32"] > t["bf16"] > t["int8"] > t["int4"]
  # A kernel measured at 1e-9 s per weight at one row and 2e-9 at 9 (calibrate's table): interpolated
  # between them, extended along the last two past them.
  table = {"rows": [1, 9], "s_per_weight": [1e-9, 2e-9]}
  slow = dataclasses.replace(spec, weight_rates={"int4": table, "int8": table})
  assert slow.matrix_seconds("int4", 10, 5, "float32") == pytest.approx(10 * 1.5e-9)
  assert slow.matrix_seconds("int4", 10, 17, "float32") == pytest.approx(10 * 3e-9)
  np.testing.assert_allclose(slow.matrix_seconds("int4", 10, np.array([1, 5]), "float32"), [1e-8, 1.5e-8])
  assert slow.matrix_seconds("fp32", 10, 5, "float32") == 2 * 10 * 5 / 1e15        # not measured: the peak
  W = 3 * costmodel.layer_weight_count(CFG)
  c = costmodel.step_cost(CFG, 1, 5, 16, weights="int4")
  head = 100 * 32 * 1.5e-9                 # the head at int8's rate, 5 rows
  assert costmodel.compute_seconds(slow, c, "float32", "int4") == pytest.approx(
      W * 1.5e-9 + head + (c.flops - 2 * 5 * (W + 3200)) / 1e15)
  assert costmodel.step_time(slow, CFG, 1, 1, 16, weights="int4") > t["fp32"]
  # The scheduler's forms agree with step_time at equal rows and contexts.
  assert costmodel.ragged_step_time(slow, CFG, [5, 5], [16, 16], weights="int4") == pytest.approx(
      costmodel.step_time(slow, CFG, 2, 5, 16, weights="int4"))
  assert float(costmodel.rows_step_time(slow, CFG, 10, [16, 16], weights="int4")) == pytest.approx(
      costmodel.ragged_step_time(slow, CFG, [5, 5], [16, 16], weights="int4"), rel=0.02)


def test_cost_command_by_weight_type(capsys):
  from specjax import cli
  assert cli.main(["cost", "--device", "h200", "--dtype", "bfloat16", "--weights", "bf16,int8,int4",
                   "--model", "qwen2.5-coder-1.5b", "--acceptance", "0.8", "--batch-size", "1", "64", "1024",
                   "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  by = {r["weights"]: r for r in out["by_weights"]}
  assert list(by) == ["bf16", "int8", "int4"] and out["weights"] == "bf16"
  assert by["bf16"]["weight_gb"] > by["int8"]["weight_gb"] > by["int4"]["weight_gb"]
  for r in by.values():
    ms = [r["verify_ms"][str(T)] for T in (1, 2, 4, 8, 16, 32)]
    assert ms == sorted(ms) and r["speedup_b1"] > 1
  # Fewer bytes per weight move the ridge point: speculation stops paying at a batch no larger.
  cross = [by[k]["crossover_batch"] or 10**9 for k in ("bf16", "int8", "int4")]
  assert cross == sorted(cross, reverse=True)


def test_calibrate_fits_the_quantized_matmuls():
  from specjax.measure import calibrate
  rates = calibrate.probe_weights(kinds=("int8", "int4"), rows=(1, 4, 16), N=256, D=256, repeats=1)
  for r in rates.values():
    assert r["rows"] == [1, 4, 16] and all(t > 0 for t in r["s_per_weight"]) and set(r["ms"]) == {1, 4, 16}
  spec = costmodel.DeviceSpec("probed", {"float32": 1e11}, 1e10, 1e9, weight_rates={
      k: {"rows": r["rows"], "s_per_weight": r["s_per_weight"]} for k, r in rates.items()})
  assert costmodel.DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
