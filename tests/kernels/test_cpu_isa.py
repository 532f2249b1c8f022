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
  for E, S in [(8, 61), (16, 61), (24, 61), (64, 61), (128, 61), (16, 600), (64, 600)]:
    for T in (1, 5):      # S = 600: contexts over one, two and three 256-slot chunks (combined in a second pass)
      r = np.random.default_rng(E + T + S)
      L, B, K, G = 2, 2, 2, 3
      q = jnp.asarray(r.normal(size=(B, T, K * G, E)), jnp.float32)
      k = jnp.asarray(r.normal(size=(L, B, S, K, E)) * 2, jnp.float32)
      v = jnp.asarray(r.normal(size=(L, B, S, K, E)), jnp.float32)
      lengths = jnp.asarray([S - T, 13 if S < 256 else 300], jnp.int32)
      mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
      mask &= (r.random((B, T, T)) < 0.6) | np.eye(T, dtype=bool)[None]
      got = jax.jit(ca.attend_cache_native)(q, k, v, 1, lengths, jnp.asarray(mask))
      want = ca.attend_cache_reference(q, k, v, 1, lengths, jnp.asarray(mask))
      np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)


def _check_tree_row_bits():
  """A tree row (it sees some region slots, not its siblings') has the bits of the same row laid out as a
  chain, its visible slots contiguous (kernels/cpu_attention.cc CompactVisible): with integer activations a
  last-bit difference here became a different token between a tree's verification and plain decoding."""
  parent = [-1, 0, 0, 1, 2]      # the tree: 0 the root, 1 and 2 its children, 3 under 1, 4 under 2
  T = len(parent)
  tree = np.zeros((T, T), bool)
  for t in range(T):
    a = t
    while a >= 0:
      tree[t, a], a = True, parent[a]
  order = np.asarray([0, 2, 4, 1, 3])   # the branch 0-2-4 first: rows 0..2 of this layout see 0..2 only
  for E, ctx in [(8, 37), (16, 254), (24, 300), (64, 253), (128, 37), (64, 255)]:   # 253-255: across a chunk
    r = np.random.default_rng(E + ctx)
    L, B, S, K, G = 1, 1, 320, 2, 3
    q = r.normal(size=(B, T, K * G, E)).astype(np.float32)
    k = (r.normal(size=(L, B, S, K, E)) * 2).astype(np.float32)
    v = r.normal(size=(L, B, S, K, E)).astype(np.float32)
    lengths = jnp.asarray([ctx], jnp.int32)
    as_tree = np.asarray(jax.jit(ca.attend_cache_native)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0, lengths,
                                                          jnp.asarray(tree[None])))
    k2, v2 = k.copy(), v.copy()
    k2[:, :, ctx:ctx + T], v2[:, :, ctx:ctx + T] = k[:, :, ctx + order], v[:, :, ctx + order]
    as_chain = np.asarray(jax.jit(ca.attend_cache_native)(jnp.asarray(q[:, order]), jnp.asarray(k2), jnp.asarray(v2),
                                                           0, lengths, jnp.asarray(tree[order][:, order][None])))
    np.testing.assert_array_equal(as_tree[:, order[:3]], as_chain[:, :3], err_msg=f"E={E} ctx={ctx}")


@pytest.mark.parametrize("path", native.ISAS)
def test_each_supported_path_equals_reference(path, restore_isa):
  if path not in _supported():
    pytest.skip(f"this CPU has no {path}")
  assert native.set_isa(path) == path
  assert native.isa() == path
  _check_matmul()
  _check_attention()
  _check_tree_row_bits()


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


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_an_attention_row_has_the_same_bits_whatever_else_is_computed(isa, restore_isa):
  """The attention half of greedy exactness: a query row's output must not depend on how many new rows are
  verified beside it, nor on the other sequences of the batch (a decode step, a verification step and a
  batched step must give a row the same bits), at contexts over several slot chunks too."""
  if isa not in _supported():
    pytest.skip("the CPU lacks this ISA")
  native.set_isa(isa)
  r = np.random.default_rng(5)
  L, B, S, K, G, E, T = 1, 2, 700, 3, 3, 64, 5
  q = jnp.asarray(r.normal(size=(B, T, K * G, E)), jnp.float32)
  k = jnp.asarray(r.normal(size=(L, B, S, K, E)), jnp.float32)
  v = jnp.asarray(r.normal(size=(L, B, S, K, E)), jnp.float32)
  lengths = jnp.asarray([600, 40], jnp.int32)
  causal = jnp.asarray(np.tril(np.ones((T, T), bool))[None].repeat(B, 0))
  f = jax.jit(ca.attend_cache_native)
  full = np.asarray(f(q, k, v, 0, lengths, causal))
  for t in range(T):        # row t alone, as the one new row of its step: it sees the same slots
    one = np.asarray(f(q[:1, t:t + 1], k[:, :1], v[:, :1], 0, lengths[:1] + t, causal[:1, :1, :1]))
    np.testing.assert_array_equal(one[0, 0], full[0, t], err_msg=f"{isa}, row {t} alone")
  alone = np.asarray(f(q[1:], k[:, 1:], v[:, 1:], 0, lengths[1:], causal[1:]))
  np.testing.assert_array_equal(alone[0], full[1], err_msg=f"{isa}, sequence 1 without the batch")


def test_specjax_cpu_isa_forces_a_path_at_load():
  """The environment variable (docs/guides/cpu-kernels.md) in a fresh process: the kernels load on the forced
  path; a name that is no path is refused with the names that are."""
  import os
  import subprocess
  import sys
  code = "from specjax.kernels import native; print(native.available(), native.isa())"
  env = dict(os.environ, SPECJAX_CPU_ISA="portable", SPECJAX_NATIVE="1")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["True", "portable"]
  env["SPECJAX_CPU_ISA"] = "sse9"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "unknown kernel path 'sse9'" in out.stderr and "avx2" in out.stderr


def test_an_installed_package_ships_every_kernel_source():
  """A non-editable install builds the kernels from the files packaged with it: every source and header the
  build reads must match the package data (the headers once did not)."""
  import fnmatch
  import tomllib
  from pathlib import Path
  root = Path(native.__file__).resolve().parents[2]
  patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specjax"]
  for src in native._SOURCES + native._HEADERS:
    rel = src.relative_to(root / "specjax").as_posix()
    assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} is not in specjax's package data"
