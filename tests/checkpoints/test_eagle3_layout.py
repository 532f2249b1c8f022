"""EAGLE-3 drafters in their published layouts (SpecForge / the EAGLE release, and ``speculators``): equal to
the projects' own models (recorded by scripts/record_eagle3_references.py) at depth 1 and feeding themselves
(depths 2 and 3), greedy-exact and lossless in the engine over a reduced draft vocabulary, refusals in one
line before any weight is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.checkpoints import drafter_io, eagle3_io
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.errors import SpecjaxError
from specjax.models import decoder as M
from specjax.models.kv_cache import init_cache
from specjax.speculative import eagle
from tests.helpers.families import write_family

DATA = Path(__file__).parents[1] / "data" / "eagle3"
# specforge and speculators: written by those packages; exported: written by specjax's exporter and read by
# speculators (tests/helpers/eagle3_export_fixture.py).
TARGET = {"specforge": "llama", "speculators": "gemma3", "exported": "gemma3"}


@pytest.fixture(scope="module", params=sorted(TARGET))
def pair(request, tmp_path_factory):
  layout = request.param
  d, _ = write_family(tmp_path_factory.mktemp("eagle3"), TARGET[layout])
  return layout, d


def _step(dp, ecfg, tokens, pos, g, cache):
  """One forward of the drafter's layer: (draft-vocabulary logits of the last row, the feature it feeds on)."""
  lcfg = ecfg.layer_cfg
  x, prefix = eagle.layer_inputs(dp, ecfg, tokens, g)
  out = M.forward(dp, lcfg, tokens, pos, cache, inputs_embeds_BxTxD=x, attn_prefix_BxTxD=prefix,
                  feature_layers=(0,) if ecfg.feeds_prenorm else None)
  fed = out.features if ecfg.feeds_prenorm else out.hidden
  return out.logits[0, -1], fed[:, -1:], out.cache


def test_logits_equal_the_reference_implementation(pair):
  layout, d = pair
  ref = json.loads((DATA / layout / "reference.json").read_text())
  cfg, params, tok = load_hf_dir(d)
  ecfg, dp, config = drafter_io.load_drafter(DATA / layout, cfg, params, tok)
  assert ecfg.layout == "eagle3" and ecfg.reduced
  assert config["layout"] == f"eagle3-{'specforge' if layout == 'specforge' else 'speculators'}"
  ids = jnp.asarray([ref["token_ids"]])
  T = ids.shape[1]
  feats = M.forward(params, cfg, ids, jnp.arange(T)[None], init_cache(cfg, 1, T),
                    feature_layers=ecfg.feature_layers).features
  g_all = eagle.target_feature(dp, ecfg, feats)
  head_ids = np.asarray(dp["head_ids"])
  for case in ref["cases"]:
    q = case["t"] + 1                      # the root: token x_q at position q with the target feature g_{q-1}
    # as the engine feeds a prompt: every x_t at slot t with g_{t-1} (g_{-1} = 0); x_0 is seen by itself only
    logits, fed, cache = _step(dp, ecfg, ids[:, :q + 1], jnp.arange(q + 1)[None],
                               eagle.previous_features(g_all)[:, :q + 1], init_cache(ecfg.layer_cfg, 1, T + 4))
    for depth in range(ref["steps"]):
      if depth:                            # the text's next token, fed with the drafter's own feature
        logits, fed, cache = _step(dp, ecfg, ids[:, q + depth:q + depth + 1], jnp.asarray([[q + depth]]), fed,
                                   cache)
      np.testing.assert_allclose(logits, case["logits"][depth], atol=1e-4, rtol=0, err_msg=f"{layout} {q} {depth}")
      assert int(head_ids[int(jnp.argmax(logits))]) == case["top1_target"][depth]


def test_training_forward_equals_the_reference_implementation(pair):
  """specjax's training-time-test forward (``eagle_train.train_forward``, unroll 3) gives each step the
  reference's logits: row t + 1 + i at step i is the depth-i node anchored at t + 1."""
  from specjax.training import eagle_train
  layout, d = pair
  ref = json.loads((DATA / layout / "reference.json").read_text())
  cfg, params, tok = load_hf_dir(d)
  ecfg, dp, _ = drafter_io.load_drafter(DATA / layout, cfg, params, tok)
  ids = jnp.asarray([ref["token_ids"]])
  T = ids.shape[1]
  feats = M.forward(params, cfg, ids, jnp.arange(T)[None], init_cache(cfg, 1, T),
                    feature_layers=ecfg.feature_layers).features
  batch = {"tokens": ids, "pos": jnp.arange(T)[None], "seg": jnp.ones((1, T), jnp.int32), "feats": feats}
  logits_S, _ = eagle_train.train_forward(dp, ecfg, batch, unroll=ref["steps"])
  for case in ref["cases"]:
    for i in range(ref["steps"]):
      np.testing.assert_allclose(logits_S[i, 0, case["t"] + 1 + i], case["logits"][i], atol=1e-4, rtol=0,
                                 err_msg=f"{layout} t={case['t']} step {i}")


def test_greedy_eagle3_equals_plain_greedy(pair):
  """Chains, a static and a dynamic tree, over each layout's reduced draft vocabulary."""
  from specjax import api
  layout, d = pair
  if layout == "exported":
    pytest.skip("the speculators layout's engine path: the speculators case covers it")
  m = api.load(str(d))
  ids = json.loads((DATA / layout / "reference.json").read_text())["token_ids"]
  prompts = [m.tokenizer.decode(ids[:n], skip_special_tokens=False) for n in (20, 45)]
  kw = dict(max_new_tokens=16, chat=False, ignore_eos=True, batch_size=2)
  plain = [g.token_ids for g in api.generate(m, prompts, **kw)[0]]
  for settings in (dict(k=3), dict(tree="branch:2,2"), dict(tree="dynamic:6:2:3")):
    got, stats = api.generate(m, prompts, drafter="eagle", draft=str(DATA / layout), **kw, **settings)
    assert [g.token_ids for g in got] == plain, (layout, settings)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_sampling_over_a_reduced_draft_vocabulary_is_lossless(norm_before_residual):
  """The χ² harnesses of test_speculative (a chain) and test_lossless_trees (a 2 x 2 tree): an EAGLE-3 head
  whose draft vocabulary holds 7 of the 12 tokens (q is 0 on the other 5) samples plain sampling's joint
  distribution; the accept-everything rule and acceptance without the residual update are caught."""
  import jax
  from tests.helpers.lossless import (MICRO, AcceptAlways, _chi2_pvalue, _exact_joint, _micro_params, _spec_samples,
                                      _tree_samples)
  from specjax.models.sampling import SamplingParams
  from specjax.speculative.acceptance import SpeculativeSampling
  from specjax.speculative.trees import specs as tree_shapes
  sp = SamplingParams(temperature=1.0)
  target = _micro_params(0)
  ecfg = eagle.EagleConfig(MICRO, (0, 1, 0), 7, layout="eagle3", norm_before_residual=norm_before_residual)
  head = eagle.init_eagle3(ecfg, jax.random.PRNGKey(3), head_ids=[0, 2, 3, 5, 7, 8, 11])
  head = {**head, "lm_head": head["lm_head"] * 3.0, "embed": target["embed"]}
  drafter = eagle.EagleDrafter(ecfg.layer_cfg, ecfg=ecfg, max_depth=2)
  joint = _exact_joint(target, sp)
  assert _chi2_pvalue(_spec_samples(target, head, sp, drafter=drafter), joint) > 1e-3
  if norm_before_residual:
    return
  assert _chi2_pvalue(_spec_samples(target, head, sp, drafter=drafter, acceptance=AcceptAlways()), joint) < 1e-6
  tree = tree_shapes.branching([2, 2])
  assert _chi2_pvalue(_tree_samples(target, head, sp, tree, drafter=drafter), joint) > 1e-3
  no_residual = _tree_samples(target, head, sp, tree, drafter=drafter,
                              acceptance=SpeculativeSampling(residual_update=False))
  assert _chi2_pvalue(no_residual, joint) < 1e-6


def _edited(tmp_path, layout, name, edit=None, weights=None):
  d = tmp_path / name
  shutil.copytree(DATA / layout, d)
  if edit is not None:
    (d / "config.json").write_text(json.dumps(edit(json.loads((d / "config.json").read_text()))))
  if weights is not None:
    from safetensors.numpy import load_file, save_file
    save_file(weights(load_file(str(d / "model.safetensors"))), str(d / "model.safetensors"))
  return d


def test_bad_eagle3_directories_are_refused_in_one_line(pair, tmp_path):
  layout, d = pair
  cfg, params, tok = load_hf_dir(d)
  spec = layout != "specforge"
  layer = (lambda c, **kw: {**c, "transformer_layer_config": {**c["transformer_layer_config"], **kw}}) if spec \
      else (lambda c, **kw: {**c, **kw})
  ids_key = "eagle_aux_hidden_state_layer_ids"
  cases = [
      (lambda c: layer(c, hidden_size=128), None, "hidden_size=128, the target .* has 64"),
      (lambda c: layer(c, vocab_size=300), None, "vocab_size=300, the target .* has 270"),
      (lambda c: layer(c, num_hidden_layers=2), None, "2 layers; specjax reads one-layer"),
      (lambda c: {**c, ids_key: [1, 2, 9]} if spec else {**c, "eagle_config": {ids_key: [0, 1, 3]}}, None,
       "capture layers .* do not fit the target"),
      (None, lambda t: {k: v for k, v in t.items() if k != "d2t"}, "lacks 'd2t': a reduced draft vocabulary"),
      (None, lambda t: {**t, "fc.weight": t["fc.weight"][:, :128]}, "'fc.weight' has shape"),
  ]
  for i, (edit, weights, msg) in enumerate(cases):
    with pytest.raises(SpecjaxError, match=msg):
      drafter_io.load_drafter(_edited(tmp_path, layout, f"c{i}", edit, weights), cfg, params, tok)
  broken = _edited(tmp_path, layout, "truncated")
  (broken / "model.safetensors").write_bytes((DATA / layout / "model.safetensors").read_bytes()[:5000])
  with pytest.raises(SpecjaxError, match="model.safetensors is damaged"):
    drafter_io.load_drafter(broken, cfg, params, tok)
  pickled = _edited(tmp_path, layout, "pickled")
  (pickled / "model.safetensors").unlink()
  (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02")
  with pytest.raises(SpecjaxError, match="pickled torch file.*save_file"):
    drafter_io.load_drafter(pickled, cfg, params, tok)
  taps = {"specforge": (1, 0, 1), "speculators": (1, 2, 3), "exported": (0, 2, 4)}[layout]
  assert eagle3_io.describe(DATA / layout, cfg).taps == taps


def test_export_writes_what_speculators_read_and_round_trips(tmp_path):
  """The exporter still writes the fixture speculators read (the same tensors and config), and every layout
  exports and loads back with the same parameters."""
  from safetensors.numpy import load_file
  from tests.helpers.eagle3_export_fixture import write
  from specjax.checkpoints import speculators_io
  d, _ = write_family(tmp_path, "gemma3")
  out = write(tmp_path / "again", d)
  old, new = load_file(str(DATA / "exported" / "model.safetensors")), load_file(str(out / "model.safetensors"))
  assert sorted(old) == sorted(new) and all(np.array_equal(old[k], new[k]) for k in old)
  assert json.loads((out / "config.json").read_text()) == json.loads((DATA / "exported" / "config.json").read_text())
  for layout in ("speculators", "exported"):
    cfg, params, tok = load_hf_dir(d)
    ecfg, dp, _ = drafter_io.load_drafter(DATA / layout, cfg, params, tok)
    back = speculators_io.save_speculators(tmp_path / f"{layout}-back", ecfg, dp)
    ecfg2, dp2, _ = drafter_io.load_drafter(back, cfg, params, tok)
    assert ecfg2 == ecfg
    flat, flat2 = jax.tree_util.tree_leaves_with_path(dp), dict(jax.tree_util.tree_leaves_with_path(dp2))
    assert all(np.array_equal(v, flat2[k]) for k, v in flat), layout
  own = eagle.EagleConfig(cfg, (0, 2), 0)
  with pytest.raises(SpecjaxError, match="only an EAGLE-3 head has a speculators equivalent"):
    speculators_io.save_speculators(tmp_path / "own", own, {})


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_engine_drafting_equals_the_eagle3_training_forward(norm_before_residual):
  """The engine's root, depths 1 and 2 and its root after a commit give the training forward's logits at
  unroll steps 1-3 for the EAGLE-3 architecture (so training optimises what the engine runs)."""
  from tests.helpers import eagle as te
  from specjax.models import decoder as model
  target = model.init_params(te.CFG, jax.random.PRNGKey(0))
  te._engine_equals_training(te.CFG, target, eagle.EagleConfig(te.CFG, (0, 1), 16, layout="eagle3",
                                                                norm_before_residual=norm_before_residual))


def test_eagle3_training_exports_to_speculators_and_drafts_exactly(tmp_path):
  """``train_eagle_on(architecture="eagle3")`` on the tiny store: the loss falls, the head exports in the
  speculators layout, loads back through ``load_drafter`` and drafts greedy-exactly in the engine."""
  from tests.helpers import eagle as te
  from specjax.checkpoints import speculators_io
  from specjax.models import decoder as model
  from specjax.speculative import NoDrafter
  from specjax.speculative.trees import specs as tree_shapes
  from specjax.training import recipes
  target = model.init_params(te.CFG, jax.random.PRNGKey(0))
  data = te.make_store(tmp_path, target, n=12)
  with pytest.raises(SpecjaxError, match="reads fused features"):
    recipes.train_eagle_on(target, te.CFG, data_dir=data, run_dir=tmp_path / "bad", architecture="eagle3")
  out = recipes.train_eagle_on(target, te.CFG, data_dir=data, run_dir=tmp_path / "run", steps=10, batch_size=2,
                               seq_len=64, learning_rate=3e-3, warmup_steps=2, log_every=1, unroll=2,
                               progress=False, features="fused", fused_layers=(0, 2), reduced_vocab=24,
                               architecture="eagle3")
  losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert losses[-1] < losses[0]
  ecfg = out["ecfg"]
  params = {**jax.device_get(out["params"]), **out["frozen"]}
  d = speculators_io.save_speculators(tmp_path / "drafter", ecfg, params)
  ecfg2, dp, config = drafter_io.load_drafter(d, te.CFG, target, None)
  assert ecfg2.feature_layers == (0, 2) and ecfg2.head_size == 24 and config["eagle_aux_hidden_state_layer_ids"] == [1, 3]
  plain, _ = te._run(target, NoDrafter(), (), tree_shapes.chain(0))
  for shape in (tree_shapes.chain(3), tree_shapes.branching([2, 2])):
    got, _ = te._run(target, eagle.EagleDrafter(ecfg2.layer_cfg, ecfg=ecfg2, max_depth=3, buckets=te.BUCKETS),
                     dp, shape)
    assert got == plain
