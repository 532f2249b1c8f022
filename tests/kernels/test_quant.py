"""Quantized weights (quant.py, kernels/cpu_qmatmul.*): storage, the native kernel against its reference on every
instruction-set path, the model on each weight type, greedy exactness and lossless sampling at int4, bad input."""
import json

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from specjax.models import config, decoder as model, quant, sampling
from specjax.errors import SpecjaxError
from specjax.kernels import cpu_qmatmul, dispatch, native
from specjax.speculative import ModelDrafter, NgramDrafter, NoDrafter
from tests.helpers import wrong_weights
from tests.helpers.quant import BUCKETS, CFG, DRAFT_CFG, _logits, _rel, _run, _weight

KINDS = ("bf16", "int8", "int4")
SHAPES = [(1, 70, 96), (2, 9, 17), (3, 37, 64), (5, 45, 101), (7, 64, 192), (16, 21, 32), (40, 130, 256),
          (9, 11, 576)]
PATHS = [p for p in native.ISAS if native.available() and native.ISAS.index(p) <= native.ISAS.index(
    native.detected_isa())]


# ----------------------------------------------------------------------------------------------------------
# Storage


def test_storage_formats_and_bytes():
  r = np.random.default_rng(1)
  w = r.standard_normal((6, 64)).astype(np.float32)
  b, i8, i4 = (quant.quantize(k, w) for k in KINDS)
  assert b.data.dtype == jnp.bfloat16 and b.scale is None and b.nbytes == 6 * 64 * 2
  assert i8.data.dtype == jnp.int8 and i8.scale.shape == (6, 1) and i8.nbytes == 6 * 64 + 6 * 4   # groups of 64
  assert i4.data.shape == (6, 32) and i4.scale.shape == i4.offset.shape == (6, 2)                # groups of 32
  assert i4.nbytes == 6 * 32 + 2 * 12 * 4 and all(q.shape == (6, 64) for q in (b, i8, i4))
  # int4 layout: byte j of a block holds column j (low nibble) and column j + 16 (high nibble)
  q = np.asarray(quant.unpack_int4(i4.data))
  packed = np.asarray(i4.data)
  assert np.array_equal(packed[:, :16] & 15, q[:, :16]) and np.array_equal(packed[:, :16] >> 4, q[:, 16:32])
  assert q.min() == 0 and q.max() == 15           # asymmetric: each group's min and max are levels
  # round trip within half a step
  for qw, step in ((i8, np.repeat(np.asarray(i8.scale), 64, axis=1)), (i4, np.repeat(np.asarray(i4.scale), 32, axis=1))):
    assert np.all(np.abs(np.asarray(qw.dequantize()) - w) <= step * 0.5 + 1e-6)
  assert quant.bits_per_weight("int4") == 6.0 and quant.param_bytes({"a": i4, "b": jnp.zeros(3)}) == i4.nbytes + 12


def test_q4_1_style_groups_are_represented_exactly():
  """A matrix already on a 4-bit asymmetric grid per 32 columns (what a Q4_1 GGUF dequantizes to: SmolLM2's)
  comes back exactly; a symmetric grid could not hold it."""
  r = np.random.default_rng(7)
  lo = r.uniform(-1, 0, (5, 4, 1))
  step = r.uniform(0.01, 0.1, (5, 4, 1))
  grid = (lo + step * r.integers(0, 16, (5, 4, 32))).astype(np.float32)
  grid[..., 0], grid[..., 1] = lo[..., 0], (lo + 15 * step)[..., 0]          # the extremes are levels
  w = grid.reshape(5, 128)
  np.testing.assert_allclose(np.asarray(quant.quantize("int4", w).dequantize()), w, rtol=0, atol=1e-6)


def test_groups_and_bad_groups():
  w = np.random.default_rng(2).standard_normal((4, 128)).astype(np.float32)
  for kind, group in (("int4", 64), ("int8", 32)):
    q = quant.quantize(kind, w, group)
    assert q.scale.shape == (4, 128 // group) and q.group == group
    assert _rel(q.dequantize(), w) < (0.2 if kind == "int4" else 0.01)
  with pytest.raises(SpecjaxError, match="multiple of the group"):
    quant.quantize("int4", w[:, :48], 32)
  with pytest.raises(SpecjaxError, match="use 32 or 64"):
    quant.quantize("int8", w, 16)
  with pytest.raises(SpecjaxError, match="unknown weight type 'int3'"):
    quant.quantize("int3", w)


# ----------------------------------------------------------------------------------------------------------
# The kernel against its reference (``restore_isa``: tests/kernels/conftest.py)


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")
@pytest.mark.parametrize("path", PATHS or ["portable"])
def test_kernel_equals_reference(path, restore_isa):
  """≤ 1e-5 relative (fp32 accumulation) over odd shapes, 1…40 rows, both int4 groups, on this path."""
  assert native.set_isa(path) == path
  kernel = jax.jit(cpu_qmatmul.qmatmul_t_native)
  r = np.random.default_rng(3)
  for kind in KINDS:
    for M, N, D in SHAPES:
      for group in ((32, 64) if kind != "bf16" and D % 64 == 0 else (32,)):
        if kind != "bf16" and D % 32:
          continue
        w = _weight(kind, N, D, group, seed=M)
        x = jnp.asarray(r.standard_normal((M, D)), jnp.float32)
        ref = cpu_qmatmul.qmatmul_t_reference(x, w)
        out = kernel(x, w)
        assert _rel(out, ref) <= 1e-5, (path, kind, M, N, D, group, _rel(out, ref))
        if kind != "bf16" and M == 7:   # the check has power: a wrong group's scale or offset, or nibble half
          for bad in wrong_weights(w):
            assert _rel(out, cpu_qmatmul.qmatmul_t_reference(x, bad)) > 1e-2


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")
@pytest.mark.parametrize("path", PATHS or ["portable"])
def test_kernel_live_rows_and_row_bits(path, restore_isa):
  """Dead rows come out zero; a row's bits do not depend on how many rows are computed beside it."""
  assert native.set_isa(path) == path
  r = np.random.default_rng(4)
  for kind in KINDS:
    w = _weight(kind, 38, 128, seed=9)
    x = jnp.asarray(r.standard_normal((12, 128)), jnp.float32)
    live = jnp.asarray([2, 0, 4], jnp.int32)           # 3 groups of 4 rows
    out = np.asarray(cpu_qmatmul.qmatmul_t_native(x, w, live, 4))
    ref = np.asarray(cpu_qmatmul.qmatmul_t_reference(x, w, live, 4))
    assert _rel(out, ref) <= 1e-5 and not out[2:8].any() and out[8:12].any()
    one = np.asarray(cpu_qmatmul.qmatmul_t_native(x[:1], w))
    many = np.asarray(cpu_qmatmul.qmatmul_t_native(x[:9], w))
    np.testing.assert_array_equal(one[0], many[0], err_msg=f"{path} {kind}")


def test_gradient_flows_to_the_activations_only():
  w = _weight("int4", 16, 64)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 64)), jnp.float32)
  g_ref = jax.grad(lambda x: jnp.sum(cpu_qmatmul.qmatmul_t_reference(x, w) ** 2))(x)
  for acts, tol in (("fp32", 1e-5), ("int8", 0.05)):   # integer activations: straight through x's rounding
    backends = dispatch.resolve(activations=acts)
    g = jax.grad(lambda x: jnp.sum(cpu_qmatmul.qmatmul_t(x, w, backends=backends) ** 2))(x)  # noqa: B023
    assert _rel(g, g_ref) < tol, acts


# ----------------------------------------------------------------------------------------------------------
# The model on each weight type

@pytest.fixture(scope="module")
def fp32_params():
  return model.init_params(CFG, jax.random.PRNGKey(0))


def test_policy_and_forward_near_fp32(fp32_params, monkeypatch):
  monkeypatch.setenv("SPECJAX_ACTIVATIONS", "fp32")   # the weights' error alone (test_qdot.py: integer activations)
  base = _logits(fp32_params)
  for kind, tol in (("bf16", 0.02), ("int8", 0.03), ("int4", 0.25)):
    q = quant.quantize_params(fp32_params, kind)
    assert q["layers"]["w_qkv"].kind == kind and q["layers"]["attn_norm"].dtype == jnp.float32
    assert q["embed"].kind == ("int8" if kind == "int4" else kind)       # the embedding/head policy
    assert quant.weights_kind(q) == kind and quant.activation_dtype(q) == jnp.float32
    assert model.param_bytes(q) < model.param_bytes(fp32_params) / (1.9 if kind == "bf16" else 3.5)
    err = _rel(_logits(q), base)
    assert err < tol, (kind, err)
    # the native kernels and the XLA path (dequantize fused into the dot) agree
    xla = dispatch.Backends()
    assert _rel(_logits(q, xla), _logits(q)) < 1e-5, kind
  with pytest.raises(ValueError, match="quantized"):
    model.cast_params(quant.quantize_params(fp32_params, "int8"), jnp.bfloat16)



@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")
def test_prefill_blocks_take_xla_and_decode_takes_the_kernel():
  """A quantized matmul of more than QUANT_NATIVE_MAX_TOKENS new tokens a sequence (a prefill block) is widened
  once into XLA's dot; a decode step or a verification (fewer tokens, any batch) keeps the native kernel."""
  backends = dispatch.Backends(native_quant=True)
  w = _weight("int4", 24, 64)
  r = np.random.default_rng(5)
  limit = dispatch.QUANT_NATIVE_MAX_TOKENS
  for B, T, native_expected in ((1, 1, True), (4, 5, True), (1, limit, True), (1, limit + 1, False),
                                (2, 128, False)):
    x = jnp.asarray(r.standard_normal((B, T, 64)), jnp.float32)
    f = jax.jit(lambda x: model.linear(x, w, backends=backends))   # noqa: B023
    text = f.lower(x).as_text()
    assert ("specjax_qmatmul_int4" in text) == native_expected, (B, T)
    ref = cpu_qmatmul.qmatmul_t_reference(x.reshape(B * T, 64), w).reshape(B, T, 24)
    assert _rel(f(x), ref) <= 1e-5, (B, T)

@pytest.mark.parametrize("kind", ["int8", "int4"])   # (bf16 takes the same route: its kernel is tested above)
def test_greedy_speculative_equals_plain_greedy(fp32_params, kind):
  target = model.unstack_layers(quant.quantize_params(fp32_params, kind))
  draft = model.unstack_layers(quant.quantize_params(model.init_params(DRAFT_CFG, jax.random.PRNGKey(1)), kind))
  prompts = np.array([[5, 6, 7, 8, 5, 6, 0, 0], [9, 10, 11, 12, 13, 14, 9, 10]], np.int32)
  lens, max_new = np.array([6, 8]), np.array([16, 11], np.int32)
  base = _run(target, NoDrafter(), (), 0, prompts, lens, max_new)
  for drafter, dparams, ks in ((ModelDrafter(DRAFT_CFG, buckets=BUCKETS), draft, (1, 4)), (NgramDrafter(2), (), (3,))):
    for K in ks:
      assert _run(target, drafter, dparams, K, prompts, lens, max_new) == base, (kind, type(drafter), K)


def test_int4_sampling_is_lossless():
  """The chi-square test of test_speculative at int4 (a model whose matrices all take int4), and its power."""
  from tests.helpers import lossless as ts
  cfg = ts.MICRO.replace(name="micro32", d_model=32, head_dim=16, ffn_dim=64)
  sp = sampling.SamplingParams(temperature=1.0)
  target = quant.quantize_params(ts._micro_params(0, cfg), "int4")
  draft = quant.quantize_params(ts._micro_params(7, cfg), "int4")
  assert target["layers"]["wo"].kind == "int4"
  joint = ts._exact_joint(target, sp, cfg)
  p_ok = ts._chi2_pvalue(ts._spec_samples(target, draft, sp, cfg=cfg), joint)
  p_broken = ts._chi2_pvalue(ts._spec_samples(target, draft, sp, acceptance=ts.AcceptAlways(), cfg=cfg), joint)
  assert p_ok > 1e-3, p_ok
  assert p_broken < 1e-6, p_broken


# ----------------------------------------------------------------------------------------------------------
# Meshes and bad input


def test_scales_are_sharded_with_their_weights(fp32_params):
  from specjax.parallel import sharding

  class FakeMesh:
    shape = {"data": 1, "model": 2}
  for kind in ("int8", "int4"):
    specs = sharding.param_specs(quant.quantize_params(fp32_params, kind), FakeMesh())
    qkv, wo = specs["layers"]["w_qkv"], specs["layers"]["wo"]
    assert qkv.data == jax.sharding.PartitionSpec(None, "model", None)     # column-parallel rows
    assert wo.data == jax.sharding.PartitionSpec(None, None, "model")      # row-parallel inputs
    # group scales [rows, groups]: the matrix's own rule (here wo has one group: left whole)
    assert qkv.scale == jax.sharding.PartitionSpec(None, "model", None)
    assert wo.scale == jax.sharding.PartitionSpec(None, None, None)
    wide = sharding._quantized_specs("wo", quant.quantize(kind, np.zeros((2, 8, 256), np.float32)), FakeMesh())
    assert wide.scale == jax.sharding.PartitionSpec(None, None, "model")
    if kind == "int4":
      assert wide.offset == wide.scale


def test_matrices_whose_groups_do_not_fit_fall_back(capsys):
  cfg = config.TINY.replace(name="odd", d_model=96, head_dim=24, ffn_dim=80)   # 96: int4 fits, int8 does not
  p = quant.quantize_params(model.init_params(cfg, jax.random.PRNGKey(0)), "int4")
  assert p["layers"]["w_qkv"].kind == "int4" and p["layers"]["w_down"].kind == "bf16"   # F = 80: no group fits
  assert p["embed"].kind == "int8" and p["embed"].group == 32      # the head's int8, in groups of 32 (64 > 96 % 64)
  assert "kept in bf16" in capsys.readouterr().err or ("w_down", "int4") in quant._WARNED


def test_bad_weight_types_are_one_line_errors():
  from specjax.runtime import loaded
  with pytest.raises(SpecjaxError, match="unknown weight type 'int3'"):
    loaded.load("smollm2-135m", weights="int3")
  with pytest.raises(SpecjaxError, match="fp32 weights with bfloat16 activations"):
    loaded.load("smollm2-135m", dtype="bfloat16", weights="fp32")
  with pytest.raises(SpecjaxError, match="float32 activations"):
    loaded.load("smollm2-135m", dtype="bfloat16", weights="int8")
  with pytest.raises(SpecjaxError, match="already quantized"):
    quant.quantize_params(quant.quantize_params(model.init_params(CFG, jax.random.PRNGKey(0)), "int8"), "int4")


def test_weights_experiment_at_tiny_size(tmp_path):
  """configs/weights.gin's experiment end to end on a tiny GGUF: one row per type, greedy speculative outputs
  identical to the same type's plain ones, perplexity near fp32, the verify-cost plot."""
  from experiments import weights as wx
  from tests.helpers import varied_tiny_gguf
  path = varied_tiny_gguf(tmp_path / "tiny.gguf")
  prompts = tmp_path / "p.txt"
  prompts.write_text("a b c a b c a\nthe cat the cat\n")
  from specjax.measure import costmodel
  device = tmp_path / "device.json"        # a made-up machine: the prediction's plumbing, not its numbers
  device.write_text(json.dumps(costmodel.DeviceSpec(
      "made-up", {"float32": 50e9}, 20e9, 8e9, floor_s=1e-4, overlap=0.0,
      weight_rates={k: {"rows": [1, 32], "s_per_weight": [3e-11, 2e-10]} for k in ("int8", "int4")}).to_dict()))
  res = wx.weights(model=path, kinds=("fp32", "int8", "int4"), prompts=str(prompts), per_category=None,
                   limit=2, max_new_tokens=8, max_len=256, rows=(1, 4), verify_repeats=1,
                   drafters=(("ngram", 3),), text="the cat sat on the mat. a b c a b c", device=str(device),
                   draft=path, pairs=(("int8", "int4"),), log=lambda *_: None)
  rows = {r["weights"]: r for r in res["rows"]}
  assert list(rows) == ["fp32", "int8", "int4"] and rows["fp32"]["speedup_vs_fp32"] == 1.0
  assert rows["int4"]["weight_bytes"] < rows["int8"]["weight_bytes"] < rows["fp32"]["weight_bytes"] / 3
  assert all(r["identical_ngram k3"] == "2/2" and r["identical_model k4"] == "2/2" and r["verify_ms_T4"] > 0
             for r in rows.values())
  # A draft at another type than its target (its own executables: the draft's pytree differs)
  assert rows["int8"]["identical_model k4 draft int4"] == "2/2" and rows["int8"]["predicted_speedup_model k4 draft int4"] > 0
  assert abs(rows["int8"]["perplexity_vs_fp32"]) < 0.05
  assert all(0 < r["predicted_verify_ms_T1"] < r["predicted_verify_ms_T4"] and r["predicted_speedup_ngram k3"] > 0
             for r in rows.values())
  # The ceiling is 4 t(1) / t(4) of the unrounded times; the row's times are rounded to 1 µs, so the check
  # allows exactly that rounding (a tiny model's times are tens of µs: a fixed tolerance flaked under load).
  h = 5e-4
  for r in rows.values():
    t1, t4 = r["verify_ms_T1"], r["verify_ms_T4"]
    assert r["oracle_ceiling_rows"] == 4
    assert 4 * (t1 - h) / (t4 + h) - 1e-3 <= r["oracle_ceiling"] <= 4 * (t1 + h) / max(t4 - h, 1e-9) + 1e-3
  wx.plot(res, tmp_path)
  assert (tmp_path / "verify_cost_by_weights.png").is_file()


def test_speculation_ceiling_is_the_best_oracle_chain():
  """An always-right, free drafter with a chain of T - 1 commits T tokens per T-row verification."""
  from experiments.weights import speculation_ceiling
  # the 1.5B at int8 on an Intel model 167 (BENCHMARKS, "Quantized weights"): under 2.5x at every width
  speed, T = speculation_ceiling({1: 67.9, 2: 78.2, 4: 112.3, 8: 219.9, 16: 438.5})
  assert T == 16 and abs(speed - 16 * 67.9 / 438.5) < 1e-9 and speed < 2.5
  assert speculation_ceiling({1: 10.0, 2: 10.0, 4: 10.0}) == (4.0, 4)       # rows free: the widest wins
  assert speculation_ceiling({1: 10.0, 4: 50.0}) == (0.8, 4)                # rows dear: under 1, it loses
  assert speculation_ceiling({4: 50.0}) is None and speculation_ceiling({1: 10.0}) is None
