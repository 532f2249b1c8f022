"""DFlash drafters in their published layout (z-lab / SpecForge): equal to SpecForge's ``DFlashDraftModel``
(recorded by scripts/record_dflash_references.py) at every depth of the block, from the prompt's context and
after accepted tokens; greedy-exact through the API (chains, static and dynamic trees) and lossless under
sampling; refusals in one line before any weight is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.checkpoints import dflash_io, drafter_io
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.errors import SpecjaxError
from specjax.models import decoder as M
from specjax.models.kv_cache import init_cache
from specjax.speculative import dflash
from test_families import write_family

DATA = Path(__file__).parent / "data" / "dflash" / "zlab"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  d, _ = write_family(tmp_path_factory.mktemp("dflash"), "qwen3")
  return d


def test_block_logits_equal_the_reference_implementation(qwen3):
  """Each recorded block (anchor s: context 0..s-1, block [x_s, mask x 3]) within 1e-4 of SpecForge's logits at
  depths 1..3 with the same top-1: the context written at prefill, or partly by prefill and partly as a step's
  accepted path (the commit's pending features)."""
  ref = json.loads((DATA / "reference.json").read_text())
  cfg, params, tok = load_hf_dir(qwen3)
  dcfg, dp, config = drafter_io.load_drafter(DATA, cfg, params, tok)
  assert config["layout"] == "dflash-zlab" and dcfg.feature_layers == (1, 0)
  assert (dcfg.block_size, dcfg.mask_token_id, dcfg.layer.num_layers, dcfg.layer.head_dim) == (4, 269, 2, 16)
  ids = jnp.asarray([ref["token_ids"]])
  T = ids.shape[1]
  feats = M.forward(params, cfg, ids, jnp.arange(T)[None], init_cache(cfg, 1, T),
                    feature_layers=dcfg.feature_layers).features
  drafter = dflash.DFlashDrafter(dcfg.layer, dcfg=dcfg, max_depth=dcfg.max_depth)
  block, init = jax.jit(drafter.block), jax.jit(drafter.init, static_argnums=3)
  for case in ref["cases"]:
    s = case["anchor"]
    at_prefill = init(dp, ids[:, :s], jnp.asarray([s]), T, feats[:, :s])
    accepted = drafter.commit(init(dp, ids, jnp.asarray([s - 3]), T, feats),     # a padded prompt of s - 3
                              jnp.asarray([s - 3]), None, jnp.asarray([s]), feats[:, s - 3:s + 1])
    for state in (at_prefill, accepted):
      logits, cache = block(dp, state, jnp.asarray([s]), ids[:, s])
      np.testing.assert_allclose(logits[0], case["logits"], atol=1e-4, rtol=0, err_msg=str(s))
      assert np.asarray(logits[0]).argmax(-1).tolist() == case["top1"]
      assert int(cache.lengths[0]) == s


def test_steps_equal_a_drafter_built_from_scratch(qwen3):
  """Over several steps of a batch of two, each accepting 0..3 tokens (its pending context a padded path), the
  block drafted from the carried state equals the block of a drafter prefilled with the whole prefix."""
  ref = json.loads((DATA / "reference.json").read_text())
  cfg, params, tok = load_hf_dir(qwen3)
  dcfg, dp, _ = drafter_io.load_drafter(DATA, cfg, params, tok)
  ids = jnp.asarray([ref["token_ids"]] * 2)
  T = ids.shape[1]
  feats = M.forward(params, cfg, ids, jnp.broadcast_to(jnp.arange(T), (2, T)), init_cache(cfg, 2, T),
                    feature_layers=dcfg.feature_layers).features
  drafter = dflash.DFlashDrafter(dcfg.layer, dcfg=dcfg, max_depth=dcfg.max_depth)
  block, init = jax.jit(drafter.block), jax.jit(drafter.init, static_argnums=3)
  lengths = jnp.asarray([10, 17])
  state = init(dp, ids, lengths, T, feats)                 # padded prompts: what lies past a length is not seen
  for accepted in ([2, 0], [0, 3], [1, 1], [3, 2]):
    last = jnp.take_along_axis(ids, lengths[:, None], axis=1)[:, 0]
    logits, cache = block(dp, state, lengths, last)
    for b in range(2):
      fresh = init(dp, ids[b:b + 1], lengths[b:b + 1], T, feats[b:b + 1])
      np.testing.assert_allclose(logits[b], block(dp, fresh, lengths[b:b + 1], last[b:b + 1])[0][0], atol=1e-5)
    state = state.replace(cache=cache)                     # what propose leaves
    path = jnp.stack([feats[b, int(lengths[b]):int(lengths[b]) + 4] for b in range(2)])
    new_lengths = lengths + jnp.asarray(accepted) + 1
    state = drafter.commit(state, lengths, None, new_lengths, path)
    lengths = new_lengths


def _constant_drafter(tmp_path, mask_token_id: int) -> Path:
  """The fixture with its attention and MLP outputs zeroed and another mask token: every block row stays its
  input embedding, so the tied head drafts the mask token at every depth (accepted where the target repeats it)."""
  def zero_outputs(t):
    return {k: v * 0 if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in t.items()}
  return _edited(tmp_path, "constant", lambda c: _dflash_config(c, mask_token_id=mask_token_id), zero_outputs)


def test_greedy_dflash_equals_plain_greedy(qwen3, tmp_path):
  """Chains (the whole block and a shorter one), a static and a dynamic tree: plain greedy tokens with one
  draft forward a step — with the recorded drafter, and with one whose drafts the target accepts (76 is what
  the first prompt's greedy reply repeats)."""
  m = api.load(str(qwen3))
  ids = json.loads((DATA / "reference.json").read_text())["token_ids"]
  prompts = [m.tokenizer.decode(ids[:n], skip_special_tokens=False) for n in (20, 45)]
  kw = dict(max_new_tokens=24, chat=False, ignore_eos=True, batch_size=2)
  plain = [g.token_ids for g in api.generate(m, prompts, **kw)[0]]
  assert plain[0].count(76) > 10
  for draft in (DATA, _constant_drafter(tmp_path, 76)):
    for settings in (dict(k=3), dict(k=2), dict(tree="branch:2,2"), dict(tree="dynamic:6:2:3")):
      got, stats = api.generate(m, prompts, drafter="dflash", draft=str(draft), **kw, **settings)
      assert [g.token_ids for g in got] == plain, (draft.name, settings)
      assert stats["draft_forwards"] == stats["iterations"], settings
      assert (stats["accepted_tokens"] > 8) == (draft != DATA), (draft.name, settings, stats["accepted_tokens"])


def _micro_drafter(target, block_size=3, sharpen=3.0):
  from test_speculative import MICRO
  layer = MICRO.replace(name="micro-dflash", num_layers=2, qk_norm=True, head_dim=4, num_heads=2, ffn_dim=24)
  dcfg = dflash.DFlashConfig(MICRO, layer, (1, 0), block_size, mask_token_id=11)
  head = {**dflash.init_params(dcfg, jax.random.PRNGKey(5)), **dflash.frozen_from_target(dcfg, target)}
  head["final_norm"] = head["final_norm"] * sharpen
  return dflash.DFlashDrafter(layer, dcfg=dcfg, max_depth=block_size - 1), head


def test_sampling_with_a_dflash_drafter_is_lossless():
  """The χ² harnesses of test_speculative (a chain of 2: the whole block of 3) and test_lossless_trees (a 2 x 2
  tree): a DFlash drafter's samples have plain sampling's joint distribution; the accept-everything rule and
  acceptance without the residual update are caught."""
  from test_lossless_trees import _tree_samples
  from test_speculative import AcceptAlways, _chi2_pvalue, _exact_joint, _micro_params, _spec_samples
  from specjax.models.sampling import SamplingParams
  from specjax.speculative.acceptance import SpeculativeSampling
  from specjax.speculative.trees import specs as tree_shapes
  sp = SamplingParams(temperature=1.0)
  target = _micro_params(0)
  drafter, head = _micro_drafter(target)
  joint = _exact_joint(target, sp)
  assert _chi2_pvalue(_spec_samples(target, head, sp, drafter=drafter), joint) > 1e-3
  assert _chi2_pvalue(_spec_samples(target, head, sp, drafter=drafter, acceptance=AcceptAlways()), joint) < 1e-6
  tree = tree_shapes.branching([2, 2])
  assert _chi2_pvalue(_tree_samples(target, head, sp, tree, drafter=drafter), joint) > 1e-3
  no_residual = _tree_samples(target, head, sp, tree, drafter=drafter,
                              acceptance=SpeculativeSampling(residual_update=False))
  assert _chi2_pvalue(no_residual, joint) < 1e-6


def _edited(tmp_path, name, edit=None, weights=None, garbage=False):
  d = tmp_path / name
  shutil.copytree(DATA, d)
  if edit is not None:
    (d / "config.json").write_text(json.dumps(edit(json.loads((d / "config.json").read_text()))))
  if weights is not None:
    from safetensors.numpy import load_file, save_file
    save_file(weights(load_file(str(d / "model.safetensors"))), str(d / "model.safetensors"))
  if garbage:            # a config refusal must come before the weights file is opened
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
  return d


def _dflash_config(c, **kw):
  return {**c, "dflash_config": {**c["dflash_config"], **kw}}


CONFIG_CASES = [
    (lambda c: {**c, "hidden_size": 128}, r"hidden_size=128, the target .* has 64: a drafter for another target"),
    (lambda c: {**c, "vocab_size": 300}, r"vocab_size=300, the target .* has 270"),
    (lambda c: {**c, "num_target_layers": 36}, r"num_target_layers=36, the target .* has 3"),
    (lambda c: {**c, "block_size": 1}, r"block_size=1 \(a block of the root and at least one mask token"),
    (lambda c: {k: v for k, v in c.items() if k != "block_size"}, r"block_size=None"),
    (lambda c: _dflash_config(c, mask_token_id=270), r"mask_token_id=270, the target .* has tokens 0..269"),
    (lambda c: _dflash_config(c, target_layer_ids=[1, 2]),
     r"target_layer_ids \[1, 2\] do not fit the target .* \(3 layers; ids 0..1\)"),
    (lambda c: {**c, "layer_types": ["sliding_attention", "full_attention"]}, r"sliding_attention draft layers"),
]


def test_bad_config_is_refused_in_one_line_before_the_weights(qwen3, tmp_path):
  cfg, params, tok = load_hf_dir(qwen3)
  for i, (edit, msg) in enumerate(CONFIG_CASES):
    with pytest.raises(SpecjaxError, match=msg) as e:
      drafter_io.load_drafter(_edited(tmp_path, f"c{i}", edit, garbage=True), cfg, params, tok)
    assert "\n" not in str(e.value) and "dflash" in str(e.value).lower()


def test_bad_weights_are_refused_in_one_line(qwen3, tmp_path, monkeypatch):
  cfg, params, tok = load_hf_dir(qwen3)
  cases = [(lambda t: {k: v for k, v in t.items() if k != "layers.1.self_attn.k_norm.weight"},
            r"lacks 'layers.1.self_attn.k_norm.weight': not a DFlash drafter"),
           (lambda t: {**t, "fc.weight": t["fc.weight"][:, :64]},
            r"'fc.weight' has shape \(64, 64\), config.json and the target say \(64, 128\)")]
  edited = [_edited(tmp_path, f"w{i}", weights=w) for i, (w, _) in enumerate(cases)]
  def unread(f):                       # the header alone decides: no tensor is read for these refusals
    raise AssertionError(f"{f} was read")
  with monkeypatch.context() as mp:
    mp.setattr(dflash_io, "_read", unread)
    for d, (_, msg) in zip(edited, cases):
      with pytest.raises(SpecjaxError, match=msg):
        drafter_io.load_drafter(d, cfg, params, tok)
  broken = _edited(tmp_path, "truncated")
  (broken / "model.safetensors").write_bytes((DATA / "model.safetensors").read_bytes()[:5000])
  with pytest.raises(SpecjaxError, match=r"truncated/model.safetensors is damaged"):
    drafter_io.load_drafter(broken, cfg, params, tok)
  pickled = _edited(tmp_path, "pickled")
  (pickled / "model.safetensors").unlink()
  (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02")
  with pytest.raises(SpecjaxError, match="pickled torch file.*save_file"):
    drafter_io.load_drafter(pickled, cfg, params, tok)


def test_the_api_refuses_a_mismatched_request_in_one_line(qwen3):
  m = api.load(str(qwen3))
  kw = dict(max_new_tokens=4, chat=False)
  with pytest.raises(SpecjaxError, match=r"drafts blocks of 4 \(depth 3\); --k/--tree asks for depth 4"):
    api.generate(m, ["hello"], drafter="dflash", draft=str(DATA), k=4, **kw)
  with pytest.raises(SpecjaxError, match="holds a DFlash drafter: use --drafter dflash"):
    api.generate(m, ["hello"], drafter="eagle", draft=str(DATA), k=2, **kw)
  eagle3 = Path(__file__).parent / "data" / "eagle3" / "specforge"
  llama, _ = write_family(qwen3.parent, "llama")
  with pytest.raises(SpecjaxError, match="holds an EAGLE head: use --drafter eagle"):
    api.generate(api.load(str(llama)), ["hello"], drafter="dflash", draft=str(eagle3), k=2, **kw)
  assert dflash_io.default_layer_ids(36, 5) == [1, 9, 17, 25, 33] and dflash_io.default_layer_ids(3, 1) == [1]


def test_the_draft_is_checked_before_any_model_loads():
  """``api.check_draft`` (the CLI's check before loading): the depth asked against the block, a DFlash directory
  for another kind and another directory for dflash refused in one line; the other published layouts pass."""
  data = Path(__file__).parent / "data"
  with pytest.raises(SpecjaxError, match=r"drafts blocks of 4 \(depth 3\); --k/--tree asks for depth 4: use --k 3"):
    api.check_draft(api.decode_spec(drafter="dflash", k=4), str(DATA))
  with pytest.raises(SpecjaxError, match=r"asks for depth 4"):
    api.check_draft(api.decode_spec(drafter="dflash", tree="dynamic:8:2:4"), str(DATA))
  api.check_draft(api.decode_spec(drafter="dflash", tree="branch:2,2,1"), str(DATA))
  with pytest.raises(SpecjaxError, match="a DFlash drafter's directory, which --drafter dflash reads"):
    api.check_draft(api.decode_spec(drafter="eagle", k=2), str(DATA))
  with pytest.raises(SpecjaxError, match="not a DFlash drafter's directory"):
    api.check_draft(api.decode_spec(drafter="dflash", k=2), str(data / "eagle3" / "specforge"))
  with pytest.raises(SpecjaxError, match="drafter directory not found"):
    api.check_draft(api.decode_spec(drafter="dflash", k=2), str(data / "nowhere"))
  api.check_draft(api.decode_spec(drafter="eagle", k=2), str(data / "eagle3" / "specforge"))
  api.check_draft(api.decode_spec(drafter="medusa", k=2), str(data / "medusa" / "k3r1"))
