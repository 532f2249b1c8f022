"""The Pallas tree-attention kernel (CPU interpret mode) against its XLA reference, and the dispatch rule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels.pallas import ATTENTION_ENV, attention_path, tree_attention_reference
from specjax.kernels.pallas import tree_attention


def tree_mask(rng, T):
  """[T, T] ancestor mask of a random tree: parent[i] < i (-1: hangs off the prefix); node i sees itself
  and its ancestors."""
  parent = [int(rng.integers(-1, i)) for i in range(T)]
  mask = np.zeros((T, T), bool)
  for i in range(T):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parent[j]
  return mask


def make_inputs(seed, *, B, T, K, G, E, S, L=2, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, K * G, E)).astype(np.float32)
  k = rng.standard_normal((L, B, S, K, E)).astype(np.float32)
  v = rng.standard_normal((L, B, S, K, E)).astype(np.float32)
  mask = np.stack([tree_mask(rng, T) for _ in range(B)])
  return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(mask)


def run_kernel(q, k, v, layer, lengths, mask, **kw):
  fn = jax.jit(lambda *a: tree_attention(*a, **kw))
  return fn(q, k, v, jnp.int32(layer), jnp.asarray(lengths, jnp.int32), mask)


def assert_close(out, ref, rtol):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


# (B, T, K, G, E, S, block_kv, lengths, variant): T*G and S not multiples of the block, block_kv not
# dividing S, lengths from 0 up to past S - U (the tree tile clamps), G = 1, 2, 4.
CASES = [
    (3, 5, 2, 1, 16, 40, 16, [0, 17, 35], "triton"),
    (2, 7, 1, 2, 32, 48, 32, [41, 3], "triton"),
    (2, 3, 2, 4, 16, 37, 64, [0, 35], "triton"),
    (3, 6, 1, 4, 16, 40, 24, [0, 34, 13], "mosaic_tpu"),
    (2, 5, 2, 2, 16, 41, 16, [37, 20], "mosaic_tpu"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}K{c[2]}G{c[3]}S{c[5]}bkv{c[6]}-{c[8]}")
def test_kernel_matches_reference_fp32(case):
  B, T, K, G, E, S, block_kv, lengths, variant = case
  q, k, v, mask = make_inputs(sum(case[:7]), B=B, T=T, K=K, G=G, E=E, S=S)
  ref = tree_attention_reference(q, k, v, 1, jnp.asarray(lengths), mask)
  out = run_kernel(q, k, v, 1, lengths, mask, block_kv=block_kv, variant=variant)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("variant", ["triton", "mosaic_tpu"])
def test_kernel_matches_reference_bf16(variant):
  q, k, v, mask = make_inputs(7, B=2, T=5, K=2, G=2, E=32, S=40, dtype=jnp.bfloat16)
  lengths = [0, 33]
  ref = tree_attention_reference(q, k, v, 0, jnp.asarray(lengths), mask)
  out = run_kernel(q, k, v, 0, lengths, mask, block_kv=16, variant=variant)
  assert out.dtype == jnp.bfloat16
  assert_close(out, ref, 1e-2)


def test_random_mask_with_fewer_queries_than_tree_slots():
  """The mask says it all: no causal rule, T != U."""
  q, k, v, _ = make_inputs(11, B=2, T=3, K=1, G=2, E=16, S=32)
  mask = jnp.asarray(np.random.default_rng(11).random((2, 3, 6)) < 0.5)
  lengths = [9, 26]
  ref = tree_attention_reference(q, k, v, 1, jnp.asarray(lengths), mask)
  assert_close(run_kernel(q, k, v, 1, lengths, mask, block_kv=16), ref, 1e-5)


def test_fully_masked_row_is_zero():
  q, k, v, mask = make_inputs(3, B=2, T=4, K=1, G=2, E=16, S=32)
  mask = mask.at[0, 2].set(False)  # lengths[0] == 0: row (0, 2) sees nothing
  lengths = [0, 5]
  out = np.asarray(run_kernel(q, k, v, 0, lengths, mask, block_kv=16))
  ref = tree_attention_reference(q, k, v, 0, jnp.asarray(lengths), mask)
  assert np.isfinite(out).all() and np.isfinite(np.asarray(ref)).all()
  assert (out[0, 2] == 0).all() and (np.asarray(ref)[0, 2] == 0).all()
  assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("variant", ["triton", "mosaic_tpu"])
def test_slots_past_the_tree_are_never_live(variant):
  """NaN in every slot >= lengths[b] + U (k and v, all layers) must not reach the output."""
  B, T, S = 3, 5, 64
  q, k, v, mask = make_inputs(5, B=B, T=T, K=2, G=2, E=16, S=S)
  lengths = np.array([0, 9, 30])
  dead_1xBxSx1x1 = (np.arange(S)[None, :] >= (lengths + T)[:, None])[None, :, :, None, None]
  k_bad, v_bad = jnp.where(dead_1xBxSx1x1, jnp.nan, k), jnp.where(dead_1xBxSx1x1, jnp.nan, v)
  ref = tree_attention_reference(q, k, v, 1, jnp.asarray(lengths), mask)
  out = run_kernel(q, k_bad, v_bad, 1, lengths, mask, block_kv=16, variant=variant)
  assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("platform,variant,target", [("cuda", "triton", "xla.gpu.triton"),
                                                     ("tpu", "mosaic_tpu", "tpu_custom_call")])
def test_lowers_for_accelerators(platform, variant, target):
  """JAX-side lowering (Triton IR / Mosaic MLIR) from the CPU; the device compilers are not run here."""
  B, T, K, G, E, S, L, U = 2, 5, 2, 2, 64, 40, 2, 5
  args = (jax.ShapeDtypeStruct((B, T, K * G, E), jnp.bfloat16),
          jax.ShapeDtypeStruct((L, B, S, K, E), jnp.bfloat16),
          jax.ShapeDtypeStruct((L, B, S, K, E), jnp.bfloat16),
          jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
          jax.ShapeDtypeStruct((B, T, U), jnp.bool_))
  fn = jax.jit(lambda *a: tree_attention(*a, block_kv=16, interpret=False, variant=variant))
  text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
  calls = [line for line in text.splitlines() if target in line]
  assert len(calls) == 1, calls                      # the whole attention is one kernel
  call = calls[0]
  # Its operands as the docstring of tree_attention says: layer, lengths, the packed query tile [B, K, R', E]
  # (T*G = 10 rows padded to 16), the mask [B, R', U'] (tree tile: 16 slots on Triton, 8 on Mosaic), each
  # row's first visible slot [B, R', 1] (a sliding window's start), the KV buffers read in place (not copied or
  # padded), and one output tile per (b, kv head).
  mask_tile = "tensor<2x16x16xi32>" if variant == "triton" else "tensor<2x16x8xi32>"
  operands = ("tensor<1xi32>, tensor<2xi32>, tensor<2x2x16x64xbf16>, " + mask_tile +
              ", tensor<2x16x1xi32>, tensor<2x2x40x2x64xbf16>, tensor<2x2x40x2x64xbf16>) -> tensor<2x2x16x64xbf16>")
  assert operands in call, call[-300:]
  if variant == "triton":                            # one program per (sequence, kv head)
    import re
    assert re.findall(r"grid_[xyz] = (\d+)", call) == ["2", "2", "1"]


def test_attention_path(monkeypatch):
  monkeypatch.delenv(ATTENTION_ENV, raising=False)
  assert attention_path("cpu") == "native"
  assert attention_path("gpu") == attention_path("cuda") == attention_path("tpu") == "pallas"
  assert attention_path("metal") == "xla"
  assert attention_path() == "native"  # the tests run on the CPU backend
  for forced in ("native", "pallas", "xla"):
    monkeypatch.setenv(ATTENTION_ENV, forced)
    assert attention_path("cpu") == attention_path("tpu") == forced
  monkeypatch.setenv(ATTENTION_ENV, "cuda")
  with pytest.raises(ValueError, match="native, pallas, xla"):
    attention_path("cpu")


@pytest.mark.parametrize("variant", ["triton", "mosaic_tpu"])
def test_sliding_window_and_softcap(variant):
  """A windowed layer (each query's first visible slot lo = position - W + 1, prefix blocks before every
  row's start skipped) and Gemma 2's score cap, against the reference."""
  B, T, K, G, E, S = 3, 4, 2, 2, 16, 96
  q, k, v, mask = make_inputs(11, B=B, T=T, K=K, G=G, E=E, S=S)
  lengths = jnp.asarray([80, 5, 50], jnp.int32)
  pos = lengths[:, None] + jnp.arange(T)[None, :]
  for W, cap in ((6, None), (40, 30.0), (1000, 5.0)):
    lo = pos - (W - 1)
    fn = jax.jit(lambda *a: tree_attention(*a, softcap=cap, block_kv=16, variant=variant))
    out = fn(q, k, v, jnp.int32(1), lengths, mask, lo)
    ref = tree_attention_reference(q, k, v, 1, lengths, mask, lo, cap)
    assert_close(out, ref, 1e-5)
  assert not np.allclose(ref, tree_attention_reference(q, k, v, 1, lengths, mask))
