"""Every instruction-set path of the native kernels the running CPU supports, forced one by one, equals its
reference; a library meeting a CPU without the instructions it could use falls back to the portable path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import cpu_attention as ca
from specjax.kernels import cpu_matmul, native

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here")


def _supported():
  best = native.detected_isa()
  return list(native.ISAS[:native.ISAS.index(best) + 1])


@pytest.fixture
def restore_isa():
  yield
  native.pretend_cpu_without_features(False)
  native.set_isa(native.detected_isa())


def _check_matmul():
  for M, N, D in [(1, 64, 32), (3, 197, 576), (5, 37, 100), (7, 5, 17), (16, 1536, 64), (2, 3, 8)]:
    rng = np.random.default_rng(M * 100 + N + D)
    x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    got = np.asarray(jax.jit(cpu_matmul.matmul_t_native)(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(D))


def _check_attention():
  for E in (8, 16, 24, 64, 128):
    for T in (1, 5):
      r = np.random.default_rng(E + T)
      L, B, S, K, G = 2, 2, 61, 2, 3
      q = jnp.asarray(r.normal(size=(B, T, K * G, E)), jnp.float32)
      k = jnp.asarray(r.normal(size=(L, B, S, K, E)) * 2, jnp.float32)
      v = jnp.asarray(r.normal(size=(L, B, S, K, E)), jnp.float32)
      lengths = jnp.asarray([S - T, 13], jnp.int32)
      mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
      mask &= (r.random((B, T, T)) < 0.6) | np.eye(T, dtype=bool)[None]
      got = jax.jit(ca.attend_cache_native)(q, k, v, 1, lengths, jnp.asarray(mask))
      want = ca.attend_cache_reference(q, k, v, 1, lengths, jnp.asarray(mask))
      np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("path", native.ISAS)
def test_each_supported_path_equals_reference(path, restore_isa):
  if path not in _supported():
    pytest.skip(f"this CPU has no {path}")
  assert native.set_isa(path) == path
  assert native.isa() == path
  _check_matmul()
  _check_attention()


def test_asking_for_more_than_the_cpu_has_gives_the_best_it_has(restore_isa):
  assert native.set_isa("avx512") == native.detected_isa()


def test_cpu_without_the_instructions_falls_back_to_portable(restore_isa):
  """The feature check made to fail, as on a CPU older than the build machine: the kernels must run the
  portable path (not fault) and still equal their references."""
  assert native.pretend_cpu_without_features(True) == "portable"
  assert native.isa() == "portable"
  assert native.set_isa("avx512") == "portable"     # cannot be forced back above what the "CPU" has
  _check_matmul()
  _check_attention()
  native.pretend_cpu_without_features(False)
  assert native.isa() == native.detected_isa()


def test_library_is_built_without_march_native():
  assert not any(f.startswith("-march") for f in native._FLAGS)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_a_row_has_the_same_bits_however_many_rows_are_computed(isa, restore_isa):
  """Greedy speculative decoding equals plain decoding token for token only if a verification row (M = k+1)
  gets the very bits a one-row decode step gets: each path (which may use a different loop for few rows)
  must compute a row the same way whatever M is, tail columns included."""
  if isa not in _supported():
    pytest.skip("the CPU lacks this ISA")
  native.set_isa(isa)
  rng = np.random.default_rng(11)
  D = 101                                            # not a multiple of 8 or 16: the tail loops run too
  x = jnp.asarray(rng.standard_normal((9, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((70, D)), jnp.float32)
  f = jax.jit(cpu_matmul.matmul_t_native)
  full = np.asarray(f(x, w))
  for M in (1, 2, 3, 4, 7):
    np.testing.assert_array_equal(np.asarray(f(x[:M], w)), full[:M], err_msg=f"{isa}, M = {M}")
