"""Token trees: tree data, KV compaction, greedy exactness for every shape and drafter, lossless tree sampling
(tested statistically, with broken rules caught), and shape-static dynamic trees."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.models import kv_cache, decoder as model, sampling
from specjax.speculative import Engine, ModelDrafter, NgramDrafter, NoDrafter, init_jit, layer_subset
from specjax.speculative import step_jit
from specjax.speculative.trees import device as tree_lib
from specjax.speculative.trees import specs as tree_shapes
from specjax.speculative.drafters import DynamicShape
from tests.helpers.compile_counter import count_compiles
from tests.helpers.trees import BUCKETS, CFG, DRAFT_CFG, LENS, MAX_NEW, PROMPTS, SHAPES, _run

# ``target``, the tiny target these tests decode: tests/speculative/conftest.py.


def _random_parents(r, N1):
  return np.array([-1] + [int(r.integers(0, i)) for i in range(1, N1)], np.int32)


def test_build_matches_a_direct_walk():
  r = np.random.default_rng(0)
  B, N1 = 4, 13
  parents = np.stack([_random_parents(r, N1) for _ in range(B)])
  valid = r.random((B, N1)) < 0.8
  t = tree_lib.build(jnp.zeros((B, N1), jnp.int32), jnp.asarray(parents), jnp.asarray(valid))
  for b in range(B):
    for i in range(N1):
      chain, j = [], i
      while j >= 0:
        chain.append(j)
        j = parents[b, j]
      assert int(t.depth_BxN1[b, i]) == len(chain) - 1
      assert set(np.flatnonzero(np.asarray(t.anc_BxN1xN1[b, i]))) == set(chain)
      assert bool(t.valid_BxN1[b, i]) == (i == 0 or all(valid[b, c] for c in chain if c))
  leaf = jnp.asarray([N1 - 1] * B, jnp.int32)
  path = np.asarray(tree_lib.path_nodes(t, leaf, N1 - 1))
  for b in range(B):
    d = int(t.depth_BxN1[b, N1 - 1])
    assert path[b, d] == N1 - 1 and path[b, 0] == 0 and np.all(path[b, d + 1:] == -1)
    assert all(parents[b, path[b, i + 1]] == path[b, i] for i in range(d))


def test_compact_moves_the_path_next_to_the_prefix():
  L, B, S, K, E = 2, 2, 12, 1, 2
  k = jnp.arange(L * B * S * K * E, dtype=jnp.float32).reshape(L, B, S, K, E)
  cache = kv_cache.KVCache(k=k, v=-k, lengths=jnp.asarray([3, 5], jnp.int32))
  src = jnp.asarray([[0, 2, 5, -1], [0, 1, 3, 4]], jnp.int32)   # node slots along each accepted path
  out = kv_cache.compact(cache, cache.lengths, src)
  want = np.asarray(k).copy()
  for b, base in enumerate([3, 5]):
    for d, s in enumerate(np.asarray(src)[b]):
      if s >= 0:
        want[:, b, base + d] = np.asarray(k)[:, b, base + s]
  np.testing.assert_array_equal(out.k, want)
  np.testing.assert_array_equal(out.v, -want)


# ----------------------------------------------------------------------------------------------------------
# Greedy: every shape and drafter commits exactly plain greedy decoding's tokens.


@pytest.fixture(scope="module")
def plain(target):
  return _run(target, NoDrafter(), (), tree_shapes.chain(0), PROMPTS, LENS, MAX_NEW)[0]


@pytest.mark.parametrize("drafter_name", ["ngram", "model", "self"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_greedy_tree_decoding_equals_plain_greedy(target, plain, shape_name, drafter_name):
  drafter, dparams = {
      "ngram": (NgramDrafter(3), ()),
      "model": (ModelDrafter(DRAFT_CFG, buckets=BUCKETS),
                model.unstack_layers(model.init_params(DRAFT_CFG, jax.random.PRNGKey(1)))),
      "self": (ModelDrafter(CFG, buckets=BUCKETS), target),      # every draft right: the bonus path
  }[drafter_name]
  out, st = _run(target, drafter, dparams, SHAPES[shape_name], PROMPTS, LENS, MAX_NEW)
  assert out == plain, (shape_name, drafter_name)
  s = st.stats
  assert int(s.accepted_B.sum()) <= int(s.drafted_B.sum())
  if drafter_name == "self":      # the drafter is the target: the rank-0 path is always accepted
    D = SHAPES[shape_name].max_depth
    assert int(s.accepted_B.sum()) > 0 and int(s.committed_B.sum()) >= int(s.verify_steps_B.sum()) * 2
    assert np.asarray(s.pos_accepted_D)[0] == np.asarray(s.pos_reached_D)[0] > 0, D


def test_layerskip_tree_and_eos(target, plain):
  shape = SHAPES["sequoia"]
  drafter = ModelDrafter(CFG.replace(num_layers=1), buckets=BUCKETS)
  out, _ = _run(target, drafter, layer_subset(target, (1,)), shape, PROMPTS, LENS, MAX_NEW)
  assert out == plain
  eos = (plain[1][5],)
  base_eos, _ = _run(target, NoDrafter(), (), tree_shapes.chain(0), PROMPTS, LENS, MAX_NEW, eos=eos)
  out, _ = _run(target, NgramDrafter(3), (), SHAPES["dynamic"], PROMPTS, LENS, MAX_NEW, eos=eos)
  assert out == base_eos


def test_ngram_trie_merges_continuations():
  """Two earlier occurrences of '1 2' continue differently: a static tree holds both, ranked by recency."""
  seq = jnp.asarray([[1, 2, 7, 8, 0, 1, 2, 5, 6, 0, 1, 2, 0, 0, 0, 0]], jnp.int32)
  L = jnp.asarray([11])
  shape = tree_shapes.branching([2, 1])
  _, d = NgramDrafter(2, min_ngram=2).propose((), (), seq, L, seq[:, 11], shape, None, sampling.SamplingParams())
  # Most recent full continuation first (5 6), then the other (7 8).
  assert np.asarray(d.tokens_BxN1)[0].tolist() == [2, 5, 7, 6, 8]
  assert np.asarray(d.valid_BxN1)[0].all()
  _, d = NgramDrafter(2, min_ngram=2).propose((), (), seq, L, seq[:, 11], DynamicShape(3, 2, 2), None,
                                              sampling.SamplingParams())
  t = tree_lib.build(d.tokens_BxN1, d.parents_BxN1, d.valid_BxN1)
  assert np.asarray(t.tokens_BxN1)[0].tolist() == [2, 5, 7, 6] and np.asarray(d.parents_BxN1)[0].tolist() == [
      -1, 0, 0, 1]


# ----------------------------------------------------------------------------------------------------------
# Lossless tree sampling: the exact joint distribution of the first two tokens, against 40,000 samples.

V = 6
N_SAMPLES = 40_000


def _tables(seed):
  r = np.random.default_rng(seed)
  soft = lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)
  p0, p1, p2 = soft(r.normal(size=V)), soft(r.normal(size=(V, V))), soft(r.normal(size=(V, V, V)))
  q0, q1 = soft(r.normal(size=V) * 1.5), soft(r.normal(size=(V, V)) * 1.5)
  return p0, p1, p2, q0, q1


def _draw(key, q_BxV, C, replacement):
  if replacement:
    return jax.random.categorical(key, jnp.log(q_BxV)[:, None, :], shape=(q_BxV.shape[0], C)).astype(jnp.int32)
  g = jax.random.gumbel(key, q_BxV.shape)
  return jax.lax.top_k(jnp.log(q_BxV) + g, C)[1].astype(jnp.int32)


def _tree_samples(mode, rule_kwargs, seed=0):
  """Draft branch:3,2 (root: 3 children from q0; each child x: 2 children from q1[x]), accept, and return
  the first two committed tokens (the second drawn from p1 when only one was committed)."""
  p0, p1, p2, q0, q1 = (jnp.asarray(t, jnp.float32) for t in _tables(seed))
  shape = tree_shapes.branching([3, 2])
  B, N1 = N_SAMPLES, shape.num_nodes + 1
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), 5)
  q0_B = jnp.broadcast_to(q0, (B, V))
  if mode == "deterministic":                   # top choices of q: point masses
    c1 = jnp.broadcast_to(jnp.argsort(-q0)[:3], (B, 3)).astype(jnp.int32)
  else:
    c1 = _draw(keys[0], q0_B, 3, mode == "with_replacement")
  if mode == "deterministic":
    c2 = jnp.argsort(-q1[c1], axis=-1)[:, :, :2].astype(jnp.int32)
  else:
    c2 = _draw(keys[1], q1[c1].reshape(B * 3, V), 2, mode == "with_replacement").reshape(B, 3, 2)
  parents = np.asarray(shape.parents)
  tokens = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), c1, c2.reshape(B, 6)], axis=1)
  x1 = tokens[:, parents[4:]]                   # depth-2 nodes' parent tokens
  logp = jnp.concatenate([jnp.log(p0)[None, None].repeat(B, 0), jnp.log(p1[c1]),
                          jnp.log(p2[x1, tokens[:, 4:]])], axis=1)
  q = None if mode == "deterministic" else jnp.concatenate(
      [q0_B[:, None], q1[c1], jnp.full((B, 6, V), 1.0 / V)], axis=1)
  t = tree_lib.build(tokens, jnp.broadcast_to(jnp.asarray(parents), (B, N1)), jnp.ones((B, N1), bool))
  acc = jax.jit(lambda t, lp, q, k: tree_lib.accept_sampling(t, lp, q, k, sampling.SamplingParams(1.0),
                                                             **rule_kwargs))(t, logp, q, keys[2])
  n = np.asarray(t.depth_BxN1)[np.arange(B), np.asarray(acc.leaf_B)]
  path = np.asarray(tree_lib.path_nodes(t, acc.leaf_B, 2))
  toks = np.asarray(tokens)
  nxt = np.asarray(acc.next_token_B)
  first = np.where(n >= 1, toks[np.arange(B), np.maximum(path[:, 1], 0)], nxt)
  extra = np.asarray(jax.random.categorical(keys[3], jnp.log(p1[jnp.asarray(first)])))
  second = np.where(n >= 2, toks[np.arange(B), np.maximum(path[:, 2], 0)], np.where(n == 1, nxt, extra))
  joint = np.asarray(p0, np.float64)[:, None] * np.asarray(p1, np.float64)
  return first, second, joint, n


def _pvalue(first, second, joint):
  observed = np.bincount(first * V + second, minlength=V * V).astype(float)
  expected = joint.reshape(-1) / joint.sum() * len(first)
  return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("mode,wr", [("without_replacement", True), ("with_replacement", False),
                                     ("deterministic", False)])
def test_tree_rejection_sampling_is_lossless(mode, wr):
  first, second, joint, n = _tree_samples(mode, {"without_replacement": wr})
  assert _pvalue(first, second, joint) > 1e-3
  assert (n >= 1).mean() > 0.2 and (n == 2).mean() > 0.03      # the tree is really used


@pytest.mark.parametrize("mode,kwargs", [
    ("without_replacement", {"without_replacement": True, "residual_update": False}),   # no residual update
    ("with_replacement", {"without_replacement": True}),     # drawn with replacement, renormalised as without
])
def test_broken_tree_rules_are_caught(mode, kwargs):
  first, second, joint, _ = _tree_samples(mode, kwargs)
  assert _pvalue(first, second, joint) < 1e-6


# ----------------------------------------------------------------------------------------------------------
# Shape-static: a dynamic tree that changes every iteration compiles nothing after warm-up.


def test_dynamic_trees_compile_nothing_after_warmup(target):
  dparams = model.unstack_layers(model.init_params(DRAFT_CFG, jax.random.PRNGKey(1)))
  shape = DynamicShape(6, top_k=2, max_depth=3)
  eng = Engine(cfg=CFG, drafter=ModelDrafter(DRAFT_CFG, buckets=BUCKETS), k_max=6, sp=sampling.SamplingParams(),
               buckets=BUCKETS, tree=shape)
  B = PROMPTS.shape[0]
  st = init_jit(eng, target, dparams, kv_cache.init_cache(CFG, B, 64), jnp.asarray(PROMPTS), jnp.asarray(LENS),
                jnp.full((B,), 30, jnp.int32), jax.random.PRNGKey(0))
  propose = jax.jit(lambda st: eng.drafter.propose(dparams, st.draft, st.seq_BxS, st.cache.lengths, st.last_B,
                                                    shape, st.key, eng.sp)[1].parents_BxN1)
  propose(st)
  st = step_jit(eng, target, dparams, st, jnp.full((B,), 6, jnp.int32))
  shapes_seen = set()
  with count_compiles() as compiles:
    for i in range(6):
      shapes_seen.add(tuple(np.asarray(propose(st)).ravel().tolist()))
      st = step_jit(eng, target, dparams, st, jnp.full((B,), 6 - i % 3, jnp.int32))
    jax.block_until_ready(st)
    assert compiles() == 0
  assert len(shapes_seen) > 1          # the tree's shape really changed between iterations
