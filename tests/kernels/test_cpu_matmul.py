"""The native CPU matmul kernel against its reference (shapes with tails, many row counts, gradients)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="native CPU kernel not built here")


@pytest.mark.parametrize("M", [1, 2, 3, 5, 6, 7, 12, 16])
@pytest.mark.parametrize("N,D", [(64, 32), (197, 576), (1536, 100), (5, 17), (3, 8)])
def test_native_equals_reference(M, N, D):
  rng = np.random.default_rng(M * 1000 + N + D)
  x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  got = jax.jit(cpu_matmul.matmul_t_native)(x, w)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(D))


def test_dispatch_uses_reference_for_many_rows_and_bf16():
  x = jnp.ones((cpu_matmul.MAX_ROWS + 1, 8))
  w = jnp.ones((4, 8))
  text = jax.jit(cpu_matmul.matmul_t).lower(x, w).as_text()
  assert cpu_matmul.TARGET not in text
  assert cpu_matmul.TARGET in jax.jit(cpu_matmul.matmul_t).lower(x[:2], w).as_text()
  assert cpu_matmul.TARGET not in jax.jit(cpu_matmul.matmul_t).lower(
      x[:2].astype(jnp.bfloat16), w.astype(jnp.bfloat16)).as_text()


def test_gradient_matches_reference():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 20)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((7, 20)), jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  g_native = jax.grad(loss(cpu_matmul.matmul_t_native), argnums=(0, 1))(x, w)
  g_ref = jax.grad(loss(cpu_matmul.matmul_t_reference), argnums=(0, 1))(x, w)
  for a, b in zip(g_native, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("group,live", [(6, 1), (6, 4), (6, 6), (6, 0), (1, 1), (3, 2)])
def test_live_rows_only(group, live):
  """Rows r with r % group >= live are padding: zero, whatever x holds there; the live rows are exactly
  what the full product gives them."""
  rng = np.random.default_rng(group * 10 + live)
  B = 2
  x = jnp.asarray(rng.standard_normal((B * group, 96)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((200, 96)), jnp.float32)
  f = jax.jit(cpu_matmul.matmul_t_native, static_argnums=(3,))
  got = np.asarray(f(x, w, jnp.int32(live), group))
  full = np.asarray(jax.jit(cpu_matmul.matmul_t_native)(x, w))
  keep = (np.arange(B * group) % group < live)[:, None]
  np.testing.assert_array_equal(got, np.where(keep, full, 0.0))
  ref = cpu_matmul.matmul_t_reference(x, w, jnp.int32(live), group)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_live_rows_per_group(isa):
  """One live count per group (per sequence): a finished sequence (0) costs nothing and comes out zero,
  the others keep their first live rows exactly; on every ISA path the CPU has."""
  from specjax.kernels import native
  if native.ISAS.index(isa) > native.ISAS.index(native.detected_isa()):
    pytest.skip("the CPU lacks this ISA")
  group, live = 5, np.array([0, 3, 5, 1], np.int32)
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((4 * group, 72)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((130, 72)), jnp.float32)
  native.set_isa(isa)
  try:
    got = np.asarray(jax.jit(cpu_matmul.matmul_t_native, static_argnums=(3,))(x, w, jnp.asarray(live), group))
  finally:
    native.set_isa(native.detected_isa())
  keep = (np.arange(4 * group) % group < np.repeat(live, group))[:, None]
  full = np.asarray(x) @ np.asarray(w).T
  np.testing.assert_allclose(got, np.where(keep, full, 0.0), rtol=1e-4, atol=1e-4)
  assert np.all(got[~keep[:, 0]] == 0)
  ref = cpu_matmul.matmul_t_reference(x, w, jnp.asarray(live), group)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-3)


def test_a_bf16_row_on_the_xla_path_does_not_depend_on_how_many_rows_come_with_it():
  """Plain decoding at batch 1 multiplies one row, its verification k + 1: in bf16 the XLA reference gives a
  row the same bits whatever the row count (fewer than 4 rows are computed as 4), so greedy speculative
  decoding stays plain greedy decoding on that path.  (Unpadded, XLA:CPU's one-row kernel sums in another
  order: on a Zen 4, 8 of these 16,384 bf16 outputs differ; on an Intel Xeon with AMX, two rows against
  three or more: 7 differ.)"""
  r = np.random.default_rng(0)
  w = jnp.asarray(r.standard_normal((16384, 576)) * 0.05, jnp.bfloat16)
  x = jnp.asarray(r.standard_normal((33, 576)), jnp.bfloat16)
  f = jax.jit(cpu_matmul.matmul_t_reference)
  one = np.asarray(f(x[:1], w), np.float32)
  for M in (2, 3, 5, 9, 33):
    np.testing.assert_array_equal(np.asarray(f(x[:M], w), np.float32)[:1], one)
