"""The native attention kernel against its reference: masks, head sizes, batch, gradients, dispatch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import cpu_attention as ca, dispatch

pytestmark = pytest.mark.skipif(not ca.native.available(), reason="native CPU kernels not built here")


def _inputs(seed, L, B, S, K, G, E, T, tree=True):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(B, T, K * G, E)), jnp.float32)
  k = jnp.asarray(r.normal(size=(L, B, S, K, E)) * 2, jnp.float32)
  v = jnp.asarray(r.normal(size=(L, B, S, K, E)), jnp.float32)
  lengths = jnp.asarray(r.integers(0, S - T + 1, size=B), jnp.int32)
  mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
  if tree:   # a random ancestor-like mask: drop some earlier new slots, keep the diagonal
    mask &= (r.random((B, T, T)) < 0.6) | np.eye(T, dtype=bool)[None]
  return q, k, v, lengths, jnp.asarray(mask)


@pytest.mark.parametrize("E", [8, 16, 64, 128])      # 8: the portable path; multiples of 16: AVX-512
@pytest.mark.parametrize("T", [1, 3, 9])
def test_matches_reference(E, T):
  L, B, S, K, G = 3, 2, 48, 2, 3
  q, k, v, lengths, mask = _inputs(E * 10 + T, L, B, S, K, G, E, T)
  for layer in range(L):
    got = jax.jit(ca.attend_cache_native)(q, k, v, layer, lengths, mask)
    want = ca.attend_cache_reference(q, k, v, layer, lengths, mask)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_long_context_threads_and_full_buffer():
  # Enough work to split over the thread pool; one sequence fills the buffer to its last slot.
  L, B, S, K, G, E, T = 2, 3, 700, 3, 3, 64, 6
  q, k, v, _, mask = _inputs(1, L, B, S, K, G, E, T, tree=False)
  lengths = jnp.asarray([S - T, 5, 300], jnp.int32)
  got = jax.jit(ca.attend_cache_native)(q, k, v, 1, lengths, mask)
  np.testing.assert_allclose(got, ca.attend_cache_reference(q, k, v, 1, lengths, mask), rtol=2e-5, atol=2e-5)


def test_gradient_goes_through_reference():
  q, k, v, lengths, mask = _inputs(2, 2, 1, 32, 1, 2, 16, 2)
  loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v, 1, lengths, mask) ** 2))
  g_native = jax.grad(loss(ca.attend_cache_native), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(loss(ca.attend_cache_reference), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_native, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_dispatch():
  rows = dispatch.ATTENTION_NATIVE_MAX_ROWS
  here = dispatch.resolve()
  assert here.attention == "native"
  assert dispatch.native_attention_applies(here, rows, jnp.float32, jnp.float32)
  assert not dispatch.native_attention_applies(here, rows + 1, jnp.float32, jnp.float32)     # prefill: XLA
  assert not dispatch.native_attention_applies(here, 4, jnp.bfloat16, jnp.float32)
  assert dispatch.attention(here, rows + 1, jnp.float32, jnp.float32) == "xla"
  assert dispatch.attention(dispatch.Backends(attention="pallas"), rows, jnp.float32, jnp.float32) == "pallas"
  assert dispatch.attention(dispatch.Backends(attention="xla"), 1, jnp.float32, jnp.float32) == "xla"
  q, k, v, lengths, mask = _inputs(3, 1, 1, 32, 1, 2, 16, 2)
  text = jax.jit(lambda *a: ca.attend_cache(*a, 0, lengths, mask)).lower(q, k, v).as_text()
  assert ca.TARGET in text


def test_concurrent_calls_do_not_deadlock():
  # Independent kernel calls in one program may run at once on XLA's pool; each must finish even when no
  # pool thread is free to help (an earlier version waited for its helpers and hung here).
  L, B, S, K, G, E, T = 8, 1, 512, 3, 3, 64, 6
  q, k, v, _, mask = _inputs(4, L, B, S, K, G, E, T, tree=False)
  lengths = jnp.asarray([S - T], jnp.int32)
  total = jax.jit(lambda q, k, v: sum(ca.attend_cache_native(q, k, v, l, lengths, mask) for l in range(L)))
  want = sum(ca.attend_cache_reference(q, k, v, l, lengths, mask) for l in range(L))
  np.testing.assert_allclose(total(q, k, v), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("live", [0, 1, 4, 6])
def test_live_rows_only(live):
  """New rows t >= live are padding: zero; the others are what the full computation gives them."""
  L, B, S, K, G, E, T = 2, 2, 64, 2, 3, 64, 6
  q, k, v, lengths, mask = _inputs(7, L, B, S, K, G, E, T)
  f = jax.jit(ca.attend_cache_native)
  got = np.asarray(f(q, k, v, 1, lengths, mask, jnp.int32(live)))
  full = np.asarray(f(q, k, v, 1, lengths, mask))
  keep = (np.arange(T) < live)[None, :, None, None]
  np.testing.assert_array_equal(got, np.where(keep, full, 0.0))
  ref = ca.attend_cache_reference(q, k, v, 1, lengths, mask, jnp.int32(live))
  np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("E", [8, 64])
def test_region_wider_than_the_new_rows(E):
  """A drafter extending a tree: T frontier rows see their ancestors among U > T region slots (no causal rule),
  including region slots written by earlier calls; a row that sees nothing gives zeros."""
  L, B, S, K, G, T, U = 2, 3, 40, 2, 2, 3, 9
  r = np.random.default_rng(E)
  q = jnp.asarray(r.normal(size=(B, T, K * G, E)), jnp.float32)
  k = jnp.asarray(r.normal(size=(L, B, S, K, E)), jnp.float32)
  v = jnp.asarray(r.normal(size=(L, B, S, K, E)), jnp.float32)
  lengths = jnp.asarray([0, 7, S - U], jnp.int32)
  mask = r.random((B, T, U)) < 0.5
  mask[0, 1] = False                         # lengths 0 and nothing visible: zeros, no NaN
  mask[1, 2] = False
  mask[1, 2, U - 1] = True                   # only the last region slot
  for layer in range(L):
    got = jax.jit(ca.attend_cache_native)(q, k, v, layer, lengths, jnp.asarray(mask))
    want = ca.attend_cache_reference(q, k, v, layer, lengths, jnp.asarray(mask))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[0, 1] == 0)


def test_live_rows_per_sequence():
  """One live count per sequence: a finished sequence (0) is all zeros; the others are exactly the rows the
  full computation gives them."""
  L, B, S, K, G, E, T = 2, 3, 64, 2, 3, 64, 6
  q, k, v, _, mask = _inputs(8, L, B, S, K, G, E, T)
  lengths = jnp.asarray([20, 31, 9], jnp.int32)
  live = jnp.asarray([0, 4, 6], jnp.int32)
  f = jax.jit(ca.attend_cache_native)
  got = np.asarray(f(q, k, v, 1, lengths, mask, live))
  full = np.asarray(f(q, k, v, 1, lengths, mask))
  keep = (np.arange(T)[None, :] < np.asarray(live)[:, None])[:, :, None, None]
  np.testing.assert_array_equal(got, np.where(keep, full, 0.0))
  ref = ca.attend_cache_reference(q, k, v, 1, lengths, mask, live)
  np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("E", [8, 64])
def test_sliding_window_start(E):
  """A windowed layer's first visible slot per query (lo = position - W + 1): equal to the reference, long
  contexts spanning several 256-slot chunks (chunks wholly before the window are skipped), a window start
  inside a chunk, and a global row (lo = 0) beside windowed ones."""
  L, B, S, K, G, T = 2, 3, 900, 2, 2, 4
  q, k, v, _, mask = _inputs(E + 7, L, B, S, K, G, E, T)
  lengths = jnp.asarray([850, 40, 600], jnp.int32)
  pos_BxT = lengths[:, None] + jnp.arange(T)[None, :]
  for W in (1, 7, 300, 2000):
    lo = pos_BxT - (W - 1)
    lo = lo.at[1, 0].set(0)
    got = jax.jit(ca.attend_cache_native)(q, k, v, 1, lengths, mask, None, lo)
    want = ca.attend_cache_reference(q, k, v, 1, lengths, mask, None, lo)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  # The window really narrows what is seen: W = 7 differs from the global result.
  global_out = ca.attend_cache_reference(q, k, v, 1, lengths, mask)
  assert not np.allclose(want if W == 7 else ca.attend_cache_reference(q, k, v, 1, lengths, mask, None,
                                                                      pos_BxT - 6), global_out)
