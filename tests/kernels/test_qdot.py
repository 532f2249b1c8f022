"""The integer-dot kernel for int8/int4 weights (kernels/cpu_qdot.*): each instruction-set path against the XLA
reference (the same integers), odd shapes and 1-64 rows, a row's bits whatever else is computed, the error
against fp32 activations, the dispatch, and greedy speculative decoding token-exact on integer activations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.kernels import cpu_qdot, cpu_qmatmul, dispatch, native
from specjax.models import decoder as model, quant
from specjax.speculative import ModelDrafter, NgramDrafter, NoDrafter
from tests.helpers import wrong_weights
from tests.helpers.quant import BUCKETS, CFG, DRAFT_CFG, _logits, _rel, _run, _weight

PATHS = [p for p in native.ISAS if native.available() and native.ISAS.index(p) <= native.ISAS.index(
    native.detected_isa())]
SHAPES = [(1, 70, 96), (2, 9, 32), (3, 37, 64), (5, 45, 576), (8, 33, 192), (13, 21, 160), (40, 130, 256),
          (64, 17, 96)]
needs_native = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")


@needs_native
@pytest.mark.parametrize("path", PATHS or ["portable"])
def test_each_path_equals_the_integer_reference(path, restore_isa):
  """≤ 1e-5 relative to ``qdot_t_reference`` (same integers; only the float combination's order differs), for
  both weight kinds, both groups and both x scale blocks; a wrong scale, offset or nibble order is caught."""
  assert native.set_isa(path) == path
  kernel = jax.jit(cpu_qdot.qdot_t_native, static_argnames=("group", "xblock"))
  r = np.random.default_rng(3)
  for kind in cpu_qdot.KINDS:
    for M, N, D in SHAPES:
      for group in ((32, 64) if D % 64 == 0 else (32,)):
        w = _weight(kind, N, D, group, seed=M)
        x = jnp.asarray(r.standard_normal((M, D)) * np.exp(r.uniform(-2, 2, (1, D))), jnp.float32)
        for xblock in (32, 64, 256):
          out = kernel(x, w, xblock=xblock)
          ref = cpu_qdot.qdot_t_reference(x, w, xblock=xblock)
          assert _rel(out, ref) <= 1e-5, (path, kind, M, N, D, group, xblock, _rel(out, ref))
        if M == 8:   # the check has power
          for bad in wrong_weights(w):
            assert _rel(out, cpu_qdot.qdot_t_reference(x, bad, xblock=256)) > 1e-2


@needs_native
@pytest.mark.parametrize("path", PATHS or ["portable"])
def test_a_row_has_the_same_bits_however_many_rows(path, restore_isa):
  """Plain decoding (1 row) and a verification (up to 64) give a row the same bits; dead rows are zero."""
  assert native.set_isa(path) == path
  r = np.random.default_rng(4)
  for kind in cpu_qdot.KINDS:
    w = _weight(kind, 38, 192, seed=9)
    x = jnp.asarray(r.standard_normal((64, 192)), jnp.float32)
    for xblock in (32, 64):
      one = np.asarray(cpu_qdot.qdot_t_native(x[:1], w, xblock=xblock))[0]
      for M in (2, 3, 5, 8, 17, 64):
        many = np.asarray(cpu_qdot.qdot_t_native(x[:M], w, xblock=xblock))
        np.testing.assert_array_equal(many[0], one, err_msg=f"{path} {kind} {xblock} M={M}")
      live = jnp.asarray([2, 0, 4], jnp.int32)           # 3 groups of 4 rows
      out = np.asarray(cpu_qdot.qdot_t_native(x[:12], w, live, 4, xblock))
      ref = np.asarray(cpu_qdot.qdot_t_reference(x[:12], w, live, 4, xblock))
      assert _rel(out, ref) <= 1e-5 and not out[2:8].any() and out[8:12].any()
      np.testing.assert_array_equal(out[0], one)


TILED_SHAPES = [(1, 16, 96), (2, 48, 32), (3, 32, 64), (5, 16, 576), (8, 64, 192), (9, 16, 160), (40, 32, 256),
                (64, 16, 96)]


@needs_native
@pytest.mark.parametrize("path", PATHS or ["portable"])
def test_tiled_weights_give_the_portable_row_bits(path, restore_isa):
  """Weights in 16-row tiles (the layout a model with integer activations loads, cpu_qdot_tiles.cc): on every
  path, bit for bit the portable path in rows, for 1-64 rows, both kinds, groups and x scale blocks, odd block
  counts, live rows; so also the same bits whatever the row count.  The layout itself: a permutation that
  dequantizes, gathers embedding rows and goes back to rows unchanged."""
  kernel = jax.jit(cpu_qdot.qdot_t_native, static_argnames=("group", "xblock"))
  r = np.random.default_rng(7)
  for kind in cpu_qdot.KINDS:
    for M, N, D in TILED_SHAPES:
      group = 64 if D % 64 == 0 and M % 2 else 32
      w = _weight(kind, N, D, group, seed=M)
      tiles = w.in_tiles()
      assert tiles.tiled and tiles.shape == w.shape and not np.array_equal(tiles.data, w.data)
      np.testing.assert_array_equal(tiles.in_rows().data, w.data)
      np.testing.assert_array_equal(tiles.dequantize(), w.dequantize())
      ids = jnp.asarray([[0, N - 1], [N // 2, 5]])
      np.testing.assert_array_equal(tiles.take_rows(ids), w.take_rows(ids))
      x = jnp.asarray(r.standard_normal((M, D)) * np.exp(r.uniform(-2, 2, (1, D))), jnp.float32)
      for xblock in (32, 64, 256):
        native.set_isa("portable")
        rows = np.asarray(kernel(x, w, xblock=xblock))
        assert native.set_isa(path) == path
        out = np.asarray(kernel(x, tiles, xblock=xblock))
        np.testing.assert_array_equal(out, rows, err_msg=f"{path} {kind} M={M} N={N} D={D} G={group} xb={xblock}")
        assert _rel(out, cpu_qdot.qdot_t_reference(x, tiles, xblock=xblock)) <= 1e-5
  w = _weight("int8", 32, 96).in_tiles()
  x = jnp.asarray(r.standard_normal((12, 96)), jnp.float32)
  live = jnp.asarray([2, 0, 4], jnp.int32)           # 3 groups of 4 rows
  out = np.asarray(cpu_qdot.qdot_t_native(x, w, live, 4))
  assert not out[2:8].any() and out[8:12].any()
  np.testing.assert_array_equal(out[0], np.asarray(cpu_qdot.qdot_t_native(x[:1], w))[0])


def test_reference_is_an_integer_dot_near_fp32_activations():
  """The XLA path an accelerator runs: an int8 x int8 dot accumulated in int32; against fp32 activations the
  error is the activation rounding, larger where a few columns are large (as in real activations) and larger
  again under one scale per 256 columns than per 32 (the real models' perplexity: docs/BENCHMARKS.md)."""
  r = np.random.default_rng(5)
  w = _weight("int4", 64, 256, seed=2)
  x = r.standard_normal((6, 256))
  x[:, [7, 100]] *= 30
  x = jnp.asarray(x, jnp.float32)
  text = jax.jit(cpu_qdot.qdot_t_reference).lower(x, w).as_text()
  assert "xi32>" in text and "xi8>" in text
  fp32 = cpu_qmatmul.qmatmul_t_reference(x, w)
  e32, e256 = (_rel(cpu_qdot.qdot_t_reference(x, w, xblock=b), fp32) for b in (32, 256))
  assert 1e-4 < e32 < 0.1 and 1.5 * e32 < e256 < 0.3, (e32, e256)
  q, sx = cpu_qdot.quantize_activations(jnp.zeros((2, 64)).at[1, 3].set(-2.0))
  assert not np.asarray(q[0]).any() and not np.asarray(sx[0]).any() and int(q[1, 3]) == -127


@needs_native
def test_the_default_activations_follow_the_integer_dot_path(monkeypatch, restore_isa):
  """``auto``: int8 where the integer-dot kernel runs on AVX-512 VNNI (measured faster there), else fp32; the
  environment and an explicit choice win; a bad name fails before anything is built."""
  monkeypatch.delenv("SPECJAX_ACTIVATIONS", raising=False)
  want = "int8" if native.qdot_path() == "avx512-vnni" else "fp32"
  assert dispatch.default_activations() == want and dispatch.resolve().activations == want
  native.set_isa("avx2")
  assert native.qdot_path() == "avx2" and dispatch.resolve().activations == "fp32"
  monkeypatch.setenv("SPECJAX_ACTIVATIONS", "int8-64")
  assert dispatch.resolve().activations == "int8-64" and dispatch.resolve(activations="fp32").activations == "fp32"
  with pytest.raises(SpecjaxError, match="unknown activations 'int16'"):
    dispatch.check_activations("int16")


@needs_native
def test_dispatch_takes_the_integer_kernel_for_decode_rows(monkeypatch):
  w = _weight("int8", 24, 64)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 3, 64)), jnp.float32)
  for acts, target in (("fp32", "specjax_qmatmul_int8"), ("int8", "specjax_qdot_int8"),
                       ("int8-64", "specjax_qdot_int8")):
    backends = dispatch.Backends(native_quant=True, activations=acts)
    assert target in jax.jit(lambda x: model.linear(x, w, backends=backends)).lower(x).as_text()  # noqa: B023
  prefill = jnp.zeros((1, dispatch.QUANT_NATIVE_MAX_TOKENS + 1, 64))
  text = jax.jit(lambda x: model.linear(x, w, backends=dispatch.Backends(native_quant=True, activations="int8"))
                 ).lower(prefill).as_text()
  assert "specjax_q" not in text                  # a prefill block: XLA with fp32 activations
  monkeypatch.setenv("SPECJAX_ACTIVATIONS", "int8-256")
  assert dispatch.resolve().activations == "int8-256"
  assert dispatch.resolve(activations="fp32").activations == "fp32"
  from specjax.cli import flags
  assert flags.ACTIVATIONS == tuple(cpu_qdot.ACTIVATIONS)           # --activations' choices
  monkeypatch.setenv("SPECJAX_ACTIVATIONS", "int4")
  with pytest.raises(SpecjaxError, match="unknown activations 'int4': use one of auto, fp32, int8, int8-64, int8-256"):
    dispatch.resolve()


@needs_native
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_greedy_speculative_equals_plain_on_integer_activations(kind):
  backends = dispatch.Backends(native_quant=True, activations="int8")
  fp32 = model.init_params(CFG, jax.random.PRNGKey(0))
  target = model.unstack_layers(quant.in_tiles(quant.quantize_params(fp32, kind), CFG.tie_embeddings))   # as loaded
  assert all(w.tiled for w in target["layers"][0].values() if quant.is_quantized(w))
  draft = model.unstack_layers(quant.quantize_params(model.init_params(DRAFT_CFG, jax.random.PRNGKey(1)), kind))
  prompts = np.array([[5, 6, 7, 8, 5, 6, 0, 0], [9, 10, 11, 12, 13, 14, 9, 10]], np.int32)
  lens, max_new = np.array([6, 8]), np.array([16, 11], np.int32)
  cfg = CFG.replace(backends=backends)
  base = _run(target, NoDrafter(), (), 0, prompts, lens, max_new, cfg=cfg)
  dcfg = DRAFT_CFG.replace(backends=backends)
  for drafter, dparams, K in ((ModelDrafter(dcfg, buckets=BUCKETS), draft, 4), (NgramDrafter(2), (), 3)):
    assert _run(target, drafter, dparams, K, prompts, lens, max_new, cfg=cfg) == base, (kind, type(drafter), K)
  q = quant.quantize_params(fp32, kind)          # the integer path ran: near fp32 activations, not equal
  assert 0 < _rel(_logits(q, backends), _logits(q, dispatch.Backends(native_quant=True))) < 0.05
