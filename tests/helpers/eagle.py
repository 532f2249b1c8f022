"""The EAGLE-style feature drafter's tiny target and its variants, a drafter's parameters drawn near its initial
ones, the engine's drafts against the training forward, a batch decoded with a drafter, and a feature store of
the target's own continuations: shared by the feature drafters' tests (test_eagle.py, test_eagle_parallel.py,
test_eagle_lookup.py, the published layouts' tests) and test_chat_data.py."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from specjax.models import config, kv_cache, decoder as model, sampling
from specjax.speculative import Engine, NoDrafter, generate
from specjax.speculative import eagle
from specjax.training import data as data_lib, eagle_train

CFG = config.TINY.replace(num_layers=3)
BUCKETS = (16, 32, 64)
VARIANTS = {"final": ((), 0), "fused": ((0, 2), 0), "reduced": ((), 16)}


def _drafter_params(ecfg, target, seed=1, noise=0.05):
  head_ids = np.arange(ecfg.head_size) * 3 % ecfg.target.vocab_size if ecfg.reduced else None
  if ecfg.layout == "eagle3":       # the published architecture (its own head; the target's embedding)
    tr = eagle.init_eagle3(ecfg, jax.random.PRNGKey(seed), head_ids)
    ids = tr.pop("head_ids", None)
    leaves, tdef = jax.tree_util.tree_flatten(tr)
    keys = jax.random.split(jax.random.PRNGKey(seed + 100), len(leaves))
    tr = jax.tree_util.tree_unflatten(tdef, [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return tr, {**tr, "embed": target["embed"], **({"head_ids": ids} if ids is not None else {})}
  tr = eagle.init_trainable(ecfg, jax.random.PRNGKey(seed))
  leaves, tdef = jax.tree_util.tree_flatten(tr)
  keys = jax.random.split(jax.random.PRNGKey(seed + 100), len(leaves))
  tr = jax.tree_util.tree_unflatten(tdef, [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  return tr, {**tr, **eagle.frozen_from_target(ecfg, target, head_ids)}


def _engine_equals_training(CFG, target, ecfg):
  _, dp = _drafter_params(ecfg, target)
  seq = np.array([[5, 9, 7, 3, 11, 12, 4, 20, 33, 17, 8]], np.int32)
  T, P = seq.shape[1], 7
  taps = ecfg.feature_layers
  G = model.forward(target, CFG, jnp.asarray(seq), jnp.arange(T)[None], kv_cache.init_cache(CFG, 1, 32),
                    feature_layers=taps).features
  batch = {"tokens": jnp.asarray(seq), "pos": jnp.arange(T)[None], "seg": jnp.ones((1, T), jnp.int32), "feats": G}
  logits_S, _ = eagle_train.train_forward(dp, ecfg, batch, unroll=3)
  full = eagle.to_target_vocab(dp, ecfg, logits_S)
  d = eagle.EagleDrafter(ecfg.layer_cfg, buckets=(32,), ecfg=ecfg, max_depth=3)
  st = d.init(dp, jnp.asarray(seq[:, :P]), jnp.array([P]), 32, G[:, :P])
  S = jnp.zeros((1, 32), jnp.int32).at[:, :T].set(seq)
  lg, f, cache = d._root(dp, st, S, jnp.array([P]), jnp.asarray(seq[:, P]))
  np.testing.assert_allclose(lg[0], full[0, 0, P], atol=2e-5)
  lg1, f1, cache = d._extend(dp, cache, jnp.asarray(seq[:, P + 1:P + 2]), 1, jnp.array([[1]]),
                             jnp.array([[[1, 1, 0]]], bool), f[:, None])
  np.testing.assert_allclose(lg1[0, 0], full[1, 0, P + 1], atol=2e-5)
  lg2, _, cache = d._extend(dp, cache, jnp.asarray(seq[:, P + 2:P + 3]), 2, jnp.array([[2]]),
                            jnp.array([[[1, 1, 1]]], bool), f1)
  np.testing.assert_allclose(lg2[0, 0], full[2, 0, P + 2], atol=2e-5)
  # Accept root + 2 nodes: the next root re-feeds them with the target's features.
  st2 = d.commit(d._with_cache(st, cache), jnp.array([P]), None, jnp.array([P + 2]), G[:, P:P + 3])
  lg3, _, _ = d._root(dp, st2, S, jnp.array([P + 2]), jnp.asarray(seq[:, P + 2]))
  np.testing.assert_allclose(lg3[0], full[0, 0, P + 2], atol=2e-5)
  if ecfg.reduced:   # nothing outside the reduced vocabulary can be drafted
    outside = np.setdiff1d(np.arange(CFG.vocab_size), np.asarray(dp["head_ids"]))
    assert float(jax.nn.softmax(lg)[0, outside].sum()) == 0.0


PROMPTS = np.array([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [9, 10, 11, 12, 13, 14, 9, 10, 0, 0], [3] + [0] * 9], np.int32)
LENS = np.array([10, 8, 1])
MAX_NEW = np.array([18, 13, 15], np.int32)


def _run(target, drafter, dp, shape, sp=sampling.SamplingParams()):
  B, N = 3, shape.num_nodes
  eng = Engine(cfg=CFG, drafter=drafter, k_max=N, sp=sp, buckets=BUCKETS, tree=shape)
  st = generate(target, dp, kv_cache.init_cache(CFG, B, 64), jnp.asarray(PROMPTS), jnp.asarray(LENS),
                jnp.asarray(MAX_NEW), jnp.full((B,), N, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  seq = np.asarray(st.seq_BxS)
  return [seq[i, LENS[i]:LENS[i] + int(st.num_new_B[i])].tolist() for i in range(B)], st


class _Tok:
  def __init__(self, n, prefix="t"):
    self.hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"{prefix}{i}": i for i in range(n)},
                                                               unk_token=f"{prefix}0"))


class _FakeModel:
  def __init__(self, cfg, params):
    self.cfg, self.params, self.prefill_params, self.source = cfg, params, params, "tiny"


def make_store(tmp_path, target, n=24, seed=0):
  """A feature store of the tiny target's own greedy continuations of random prompts."""
  rng = np.random.default_rng(seed)
  d = tmp_path / "data"
  d.mkdir()
  lines = []
  tparams = model.unstack_layers(target)
  for i in range(n):
    p = rng.integers(3, CFG.vocab_size, size=int(rng.integers(4, 12))).tolist()
    eng = Engine(cfg=CFG, drafter=NoDrafter(), k_max=0, sp=sampling.SamplingParams(temperature=1.0))
    st = generate(tparams, (), kv_cache.init_cache(CFG, 1, 64), jnp.asarray([p], jnp.int32),
                  jnp.asarray([len(p)]), jnp.asarray([24]), jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(i),
                  engine=eng)
    resp = np.asarray(st.seq_BxS)[0, len(p):len(p) + int(st.num_new_B[0])].tolist()
    lines.append(json.dumps({"id": i, "prompt": "", "prompt_ids": p, "response_ids": resp}))
  (d / "responses.jsonl").write_text("\n".join(lines) + "\n")
  data_lib.compute_features(_FakeModel(CFG, target), d, fused_layers=(0, 2), top_k=4, batch_size=4)
  return d
