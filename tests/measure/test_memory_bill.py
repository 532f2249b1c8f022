"""The memory bill equals the bytes a decode allocates, for every drafter in every dtype.

Each decode is built as ``generate`` builds it; the state its ``init`` returns (target cache, the drafter's
state, the token buffers) is traced with ``jax.eval_shape`` — the arrays' exact shapes and dtypes, without
compiling — and its bytes are compared with ``runtime.checks.memory_bill``'s account, item by item."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.models.kv_cache import init_cache
from specjax.runtime import checks
from specjax.runtime.builder import DecodeSpec, build
from specjax.speculative import engine as spec
from tests.helpers import CFG, eagle_dir, random_hf_params, write_gguf

B, S, K = 3, 64, 3


def nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("bill")
  target = write_gguf(d / "target.gguf", CFG, random_hf_params(CFG, seed=3))
  small = CFG.replace(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, ffn_dim=32)
  draft = write_gguf(d / "draft.gguf", small, random_hf_params(small, seed=4))
  return d, str(target), str(draft)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("drafter", ["none", "ngram", "layerskip", "model", "hybrid", "eagle", "eagle-parallel"])
def test_the_bill_is_the_bytes_allocated(files, drafter, dtype):
  d, target, draft_path = files
  m = api.load(target, dtype=dtype)
  draft = {"model": api.load(draft_path, dtype=dtype), "hybrid": api.load(draft_path, dtype=dtype),
           "eagle": None}.get(drafter)
  if drafter.startswith("eagle"):
    draft = eagle_dir(m, d, parallel=K if drafter == "eagle-parallel" else 0)
  ds = DecodeSpec(drafter=drafter, k=K, draft_layers="1" if drafter == "layerskip" else None)
  dec = build(m, ds, eos_ids=(), max_len=S, draft=draft, batch_size=B)
  bill = checks.memory_bill(m, S, dec.k_max, dec.draft.cfg if dec.draft is not None else None,
                            drafter=dec.engine.drafter)
  prompt = np.ones((B, 8), np.int32)
  state = jax.eval_shape(lambda *a: spec.init(dec.engine, m.prefill_params, dec.draft_params, *a),
                         init_cache(m.cfg, B, S, m.dtype), prompt, np.full((B,), 8, np.int32),
                         np.full((B,), 16, np.int32), jax.random.PRNGKey(0))
  assert state.cache.k.dtype == jnp.dtype(dtype)
  assert nbytes(state.cache) == B * bill.target_kv_per_seq
  assert nbytes(state.draft) == B * bill.draft_kv_per_seq
  assert (bill.draft_kv_per_seq > 0) == (drafter in ("layerskip", "model", "hybrid", "eagle", "eagle-parallel"))
  assert nbytes((state.seq_BxS, state.starts_BxS)) == B * bill.tokens_per_seq
  if drafter == "model":       # the bill from configs alone (`specjax cost`, the early checks) is the same
    from specjax.measure import memory
    assert memory.kv_bill(m.cfg, S, K, dec.draft.cfg, dtype) == bill
  rest = nbytes(state) - nbytes((state.cache, state.draft, state.seq_BxS, state.starts_BxS))
  assert rest <= 0.02 * B * bill.per_seq, (rest, bill)       # per-sequence scalars and counters


def test_the_budget_refuses_exactly_past_the_bill(files):
  _, target, _ = files
  m = api.load(target)
  dec = build(m, DecodeSpec(drafter="layerskip", k=K, draft_layers="1"), eos_ids=(), max_len=S, batch_size=1)
  bill = checks.memory_bill(m, S, dec.k_max, drafter=dec.engine.drafter)
  budget = bill.total(5)
  build(m, DecodeSpec(drafter="layerskip", k=K, draft_layers="1"), eos_ids=(), max_len=S, batch_size=5,
        memory_budget=budget)
  from specjax.errors import SpecjaxError
  with pytest.raises(SpecjaxError, match="at most batch 5 fits"):
    build(m, DecodeSpec(drafter="layerskip", k=K, draft_layers="1"), eos_ids=(), max_len=S, batch_size=6,
          memory_budget=budget)
