"""SPECJAX_HUGE_PAGES=1: the weights a CPU decode step reads copied into anonymous memory advised for 2 MB pages
(runtime/huge_pages.py) — the same values, in new buffers, at every weight type."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import config, kv_cache, decoder as model, quant
from specjax.runtime import huge_pages
from specjax.runtime.loaded import default_exec_params


def _leaves(tree):
  return jax.tree_util.tree_leaves(tree)


def test_a_copy_holds_the_same_values_in_its_own_memory():
  for x in (jnp.arange(3 * 1000, dtype=jnp.float32).reshape(3, 1000), jnp.ones((7,), jnp.bfloat16),
            jnp.asarray(np.arange(256, dtype=np.uint8))):
    y = huge_pages.copy_to_huge_pages(x, min_bytes=0)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
  del x
  small = jnp.ones((4,), jnp.float32)
  assert huge_pages.copy_to_huge_pages(small) is small     # under a page: kept as it is
  z = huge_pages.copy_to_huge_pages(np.full((5, 5), 2.5, np.float32), min_bytes=0)
  import gc; gc.collect()                                  # the mapping lives as long as the array
  assert float(jnp.sum(z)) == 62.5


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_exec_params_are_copied_only_when_asked(kind, monkeypatch):
  if jax.default_backend() != "cpu":
    pytest.skip("per-layer exec params are a CPU layout")
  cfg = config.TINY.replace(name="tiny-huge")
  params = quant.quantize_params(model.init_params(cfg, jax.random.PRNGKey(0)), kind)
  monkeypatch.delenv("SPECJAX_HUGE_PAGES", raising=False)
  plain = default_exec_params(params)
  monkeypatch.setenv("SPECJAX_HUGE_PAGES", "1")
  monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)          # the tiny model's weights are all under 2 MB
  huge = default_exec_params(params)
  assert jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(huge)
  for a, b in zip(_leaves(plain), _leaves(huge)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ranges = [(np.asarray(x).ctypes.data, np.asarray(x).nbytes) for x in _leaves(params)]
  inside = lambda x: any(a <= np.asarray(x).ctypes.data < a + n for a, n in ranges)
  assert all(inside(x) for x in _leaves(plain))        # not asked: views of the loaded weights, no copy
  assert not any(inside(x) for x in _leaves(huge))     # asked: every weight in memory of its own
  # and the forward a decode step runs gives the same logits, bit for bit
  toks = jnp.asarray([[1, 5, 9, 13, 2, 7]], jnp.int32)
  pos = jnp.arange(toks.shape[1])[None]
  logits = [model.forward(p, cfg, toks, pos, kv_cache.init_cache(cfg, 1, 32)).logits for p in (plain, huge)]
  np.testing.assert_array_equal(np.asarray(logits[0]), np.asarray(logits[1]))
