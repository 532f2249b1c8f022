"""Medusa-1 heads in their published layout: equal to the ``medusa`` package's heads (recorded by
scripts/record_medusa_reference.py), greedy-exact and lossless in the engine, refusals in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.checkpoints import medusa_io
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.errors import CheckpointError, SpecjaxError
from specjax.models import decoder as M
from specjax.models.kv_cache import init_cache
from specjax.speculative import medusa
from tests.helpers.families import write_family

DATA = Path(__file__).parents[1] / "data" / "medusa"
VARIANTS = sorted(p.name for p in DATA.iterdir() if (p / "reference.json").is_file())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  d, ref = write_family(tmp_path_factory.mktemp("medusa"), "llama")
  return d, ref


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_the_medusa_package(llama, variant):
  """The heads read from the file the ``medusa`` package's modules saved, on the target's final hidden
  states: every head (depth 1 and deeper) within 1e-4 of the package's logits, the same top-1 everywhere."""
  d, ref = llama
  cfg, params, _ = load_hf_dir(d)
  mcfg, mparams = medusa_io.load_medusa(DATA / variant, cfg)
  want = json.loads((DATA / variant / "reference.json").read_text())
  ids = ref["token_ids"]
  T = len(ids)
  out = M.forward(params, cfg, jnp.asarray([ids]), jnp.arange(T)[None], init_cache(cfg, 1, T), feature_layers=())
  logits_TxKxV = np.asarray(medusa.medusa_logits(mparams, out.features[0]))
  assert logits_TxKxV.shape[1] == mcfg.num_heads >= 2
  np.testing.assert_allclose(logits_TxKxV[want["positions"]].transpose(1, 0, 2), want["logits"], atol=1e-4, rtol=0)
  assert logits_TxKxV.argmax(-1).T.tolist() == want["top1"]


def test_greedy_medusa_equals_plain_greedy(llama):
  """Chains, a static tree and a dynamic tree through ``api.generate``: plain greedy tokens."""
  d, ref = llama
  m = api.load(str(d))
  prompts = [m.tokenizer.decode(ref["token_ids"][:n], skip_special_tokens=False) for n in (20, 45)]
  kw = dict(max_new_tokens=20, chat=False, ignore_eos=True, batch_size=2)
  plain = [g.token_ids for g in api.generate(m, prompts, **kw)[0]]
  for settings in (dict(k=3), dict(tree="branch:2,2,1"), dict(tree="dynamic:6:2:3")):
    got, stats = api.generate(m, prompts, drafter="medusa", draft=str(DATA / "k3r1"), **kw, **settings)
    assert [g.token_ids for g in got] == plain, settings
    assert stats["draft_forwards"] == stats["iterations"]          # one evaluation of the heads a step


def test_commit_keeps_the_new_roots_hidden_state():
  """After a accepted nodes the next root was produced by the target's hidden state at path position a."""
  mcfg = medusa.MedusaConfig(target=M.ModelConfig(name="t", vocab_size=8, num_layers=1, d_model=4, num_heads=1,
                                                  num_kv_heads=1, head_dim=4, ffn_dim=8), num_heads=3)
  d = medusa.MedusaDrafter(mcfg.target, mcfg=mcfg)
  state = medusa.MedusaState(feat_BxF=jnp.full((3, 4), -1.0))
  path_feats = jnp.arange(3 * 4 * 4, dtype=jnp.float32).reshape(3, 4, 4)   # [B, D1, F]
  lengths = jnp.asarray([10, 10, 10])
  new = d.commit(state, lengths, None, jnp.asarray([11, 13, 10]), path_feats)
  np.testing.assert_array_equal(new.feat_BxF[0], path_feats[0, 0])          # nothing accepted: the root's own
  np.testing.assert_array_equal(new.feat_BxF[1], path_feats[1, 2])          # two accepted
  np.testing.assert_array_equal(new.feat_BxF[2], state.feat_BxF[2])         # a finished sequence keeps its own


def test_sampling_with_medusa_heads_is_lossless():
  """The χ² harnesses of test_speculative (a chain) and test_lossless_trees (a static tree of 2 x 2 nodes):
  Medusa heads' samples have plain sampling's joint distribution; an accept-everything rule, and (the tree)
  acceptance without the residual update, are caught."""
  from tests.helpers.lossless import (MICRO, AcceptAlways, _chi2_pvalue, _exact_joint, _micro_params, _spec_samples,
                                      _tree_samples)
  from specjax.models.sampling import SamplingParams
  from specjax.speculative.acceptance import SpeculativeSampling
  from specjax.speculative.trees import specs as tree_shapes
  sp = SamplingParams(temperature=1.0)
  target = _micro_params(0)
  mcfg = medusa.MedusaConfig(target=MICRO, num_heads=2, num_layers=1)
  heads = medusa.init_params(mcfg, jax.random.PRNGKey(5))
  heads = {**heads, "head": heads["head"] * 2.0}
  joint = _exact_joint(target, sp)
  drafter = medusa.MedusaDrafter(MICRO, mcfg=mcfg)
  assert _chi2_pvalue(_spec_samples(target, heads, sp, drafter=drafter), joint) > 1e-3
  broken = _spec_samples(target, heads, sp, drafter=drafter, acceptance=AcceptAlways())
  assert _chi2_pvalue(broken, joint) < 1e-6
  tree = tree_shapes.branching([2, 2])
  assert _chi2_pvalue(_tree_samples(target, heads, sp, tree, drafter=drafter), joint) > 1e-3
  no_residual = _tree_samples(target, heads, sp, tree, drafter=drafter,
                              acceptance=SpeculativeSampling(residual_update=False))
  assert _chi2_pvalue(no_residual, joint) < 1e-6


def test_bad_medusa_directories_are_refused_in_one_line(llama, tmp_path):
  d, _ = llama
  cfg, _, _ = load_hf_dir(d)
  pt = tmp_path / "pt"
  pt.mkdir()
  shutil.copy(DATA / "k3r1" / "config.json", pt / "config.json")
  (pt / "medusa_lm_head.pt").write_bytes(b"\x80\x02")
  with pytest.raises(CheckpointError, match="pickled torch file.*save_file"):
    medusa_io.load_medusa(pt, cfg)
  more = tmp_path / "more"
  shutil.copytree(DATA / "k3r1", more)
  (more / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
  with pytest.raises(CheckpointError, match="missing tensor '3.0.linear.weight'"):
    medusa_io.load_medusa(more, cfg)
  with pytest.raises(CheckpointError, match="hidden_size=32"):
    (more / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "hidden_size": 32}))
    medusa_io.load_medusa(more, cfg)
  m = api.load(str(d))
  with pytest.raises(SpecjaxError, match="3 Medusa heads draft 3 deep"):
    api.generate(m, ["hello"], drafter="medusa", draft=str(DATA / "k3r1"), k=4, max_new_tokens=4, chat=False)


def test_export_round_trips(tmp_path, llama):
  d, _ = llama
  cfg, _, _ = load_hf_dir(d)
  mcfg, params = medusa_io.load_medusa(DATA / "k2r2", cfg)
  out = medusa_io.save_medusa(tmp_path / "again", mcfg, params)
  mcfg2, params2 = medusa_io.load_medusa(out, cfg)
  assert mcfg2 == mcfg and all(np.array_equal(params[k], params2[k]) for k in params)


def test_medusa_heads_train_on_a_feature_store_and_draft_exactly(tmp_path):
  """``medusa_train``: heads started at the target's own head learn the tiny target's later tokens (the loss
  falls, 1 − TVD at depth 1 rises), are written in the published layout, load back and draft greedy-exactly."""
  from tests.helpers import eagle as te
  from specjax.checkpoints import medusa_io
  from specjax.models import decoder as model
  from specjax.speculative import NoDrafter
  from specjax.speculative.trees import specs as tree_shapes
  from specjax.training import eagle_train, medusa_train, recipes
  target = model.init_params(te.CFG, jax.random.PRNGKey(0))
  store = eagle_train.FeatureData(te.make_store(tmp_path, target, n=12))
  mcfg = medusa.MedusaConfig(te.CFG, 2, 1)
  head = target["embed"] if te.CFG.tie_embeddings else target["lm_head"]
  frozen = {"lm_head": head}
  p0 = medusa_train.init_params(mcfg, head)
  before = medusa_train.held_out_acceptance(mcfg, p0, frozen, store, range(12), seq_len=64)
  res = recipes._fit(lambda tr, fz, b: medusa_train.loss_fn(tr, fz, mcfg, b), p0, frozen, store, store.final,
                     run_dir=tmp_path / "run", resume=False, fingerprint={"drafter": "medusa"}, settings={},
                     steps=30, batch_size=2, seq_len=64, learning_rate=3e-3, warmup_steps=2, log_every=5,
                     progress=False)
  losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert losses[-1] < losses[0]
  params = jax.device_get(res["params"])
  after = medusa_train.held_out_acceptance(mcfg, params, frozen, store, range(12), seq_len=64)
  assert after["tvd_acceptance_by_position"][0] > before["tvd_acceptance_by_position"][0]
  d = medusa_io.save_medusa(tmp_path / "heads", mcfg, params)
  mcfg2, loaded = medusa_io.load_medusa(d, te.CFG)
  plain, _ = te._run(target, NoDrafter(), (), tree_shapes.chain(0))
  got, _ = te._run(target, medusa.MedusaDrafter(te.CFG, mcfg=mcfg2, buckets=te.BUCKETS), loaded,
                   tree_shapes.branching([2, 2]))
  assert got == plain
