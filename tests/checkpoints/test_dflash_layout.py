"""DFlash drafters in their published layouts (z-lab / SpecForge, and ``speculators``): equal to each project's
``DFlashDraftModel`` (recorded by scripts/record_dflash_references.py) at every depth of the block, from the
prompt's context and after accepted tokens; greedy-exact through the API (chains, static and dynamic trees) and
lossless under sampling, over the target's vocabulary and a reduced one; in the continuous batcher; refusals in
one line before any weight is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.checkpoints import dflash_io, drafter_io, weights_file
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.errors import SpecjaxError
from specjax.models import decoder as M
from specjax.models.kv_cache import init_cache
from specjax.speculative import dflash
from tests.helpers.families import write_family

ROOT = Path(__file__).parents[1] / "data" / "dflash"
DATA = ROOT / "zlab"
TARGET = {"zlab": "qwen3", "speculators": "gemma3"}
# What each recording says of itself: taps, block size, mask token, draft layers, head dim, draft vocabulary.
SHAPE = {"zlab": ((1, 0), 4, 269, 2, 16, 270), "speculators": ((3, 1), 5, 3, 1, 24, 150)}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  d, _ = write_family(tmp_path_factory.mktemp("dflash"), "qwen3")
  return d


@pytest.fixture(scope="module", params=sorted(TARGET))
def pair(request, tmp_path_factory):
  layout = request.param
  d, _ = write_family(tmp_path_factory.mktemp("dflash"), TARGET[layout])
  return layout, d


def _loaded(layout, d):
  ref = json.loads((ROOT / layout / "reference.json").read_text())
  cfg, params, tok = load_hf_dir(d)
  dcfg, dp, config = drafter_io.load_drafter(ROOT / layout, cfg, params, tok)
  ids = jnp.asarray([ref["token_ids"]])
  T = ids.shape[1]
  feats = M.forward(params, cfg, ids, jnp.arange(T)[None], init_cache(cfg, 1, T),
                    feature_layers=dcfg.feature_layers).features
  return ref, dcfg, dp, config, ids, feats


def test_block_logits_equal_the_reference_implementation(pair):
  """Each recorded block (anchor s: context 0..s-1, block [x_s, mask, ...]) within 1e-4 of the project's logits at
  every depth (over its draft vocabulary) with the same top-1 target token: the context written at prefill, or
  partly by prefill and partly as a step's accepted path (the commit's pending features)."""
  layout, d = pair
  ref, dcfg, dp, config, ids, feats = _loaded(layout, d)
  assert config["layout"] == f"dflash-{layout}"
  assert (dcfg.feature_layers, dcfg.block_size, dcfg.mask_token_id, dcfg.layer.num_layers, dcfg.layer.head_dim,
          dcfg.layer.vocab_size) == SHAPE[layout]
  T = ids.shape[1]
  rows = np.asarray(dp["head_ids"]) if dcfg.reduced else np.arange(dcfg.target.vocab_size)
  drafter = dflash.DFlashDrafter(dcfg.layer, dcfg=dcfg, max_depth=dcfg.max_depth)
  block, init = jax.jit(drafter.block), jax.jit(drafter.init, static_argnums=3)
  for case in ref["cases"]:
    s = case["anchor"]
    at_prefill = init(dp, ids[:, :s], jnp.asarray([s]), T, feats[:, :s])
    accepted = drafter.commit(init(dp, ids, jnp.asarray([s - 3]), T, feats),     # a padded prompt of s - 3
                              jnp.asarray([s - 3]), None, jnp.asarray([s]), feats[:, s - 3:s + 1])
    for state in (at_prefill, accepted):
      logits, cache = block(dp, state, jnp.asarray([s]), ids[:, s])
      np.testing.assert_allclose(logits[0][:, rows], case["logits"], atol=1e-4, rtol=0, err_msg=f"{layout} {s}")
      assert np.asarray(logits[0]).argmax(-1).tolist() == case["top1_target"]
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
  """The z-lab fixture with its attention and MLP outputs zeroed and another mask token: every block row stays its
  input embedding, so the tied head drafts the mask token at every depth (accepted where the target repeats it)."""
  def zero_outputs(t):
    return {k: v * 0 if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in t.items()}
  return _edited(tmp_path, "zlab", "constant", lambda c: _dflash_config(c, mask_token_id=mask_token_id),
                 zero_outputs)


def test_greedy_dflash_equals_plain_greedy(pair, tmp_path):
  """Chains (the whole block and a shorter one), a static and a dynamic tree: plain greedy tokens with one draft
  forward a step — with each recorded drafter, and (z-lab, Qwen3) with one whose drafts the target accepts (76
  is what the first prompt's greedy reply repeats)."""
  layout, d = pair
  m = api.load(str(d))
  ids = json.loads((ROOT / layout / "reference.json").read_text())["token_ids"]
  prompts = [m.tokenizer.decode(ids[:n], skip_special_tokens=False) for n in (20, 45)]
  kw = dict(max_new_tokens=24, chat=False, ignore_eos=True, batch_size=2)
  plain = [g.token_ids for g in api.generate(m, prompts, **kw)[0]]
  drafts = [ROOT / layout]
  if layout == "zlab":
    assert plain[0].count(76) > 10
    drafts.append(_constant_drafter(tmp_path, 76))
  for draft in drafts:
    for settings in (dict(k=3), dict(k=2), dict(tree="branch:2,2"), dict(tree="dynamic:6:2:3")):
      got, stats = api.generate(m, prompts, drafter="dflash", draft=str(draft), **kw, **settings)
      assert [g.token_ids for g in got] == plain, (draft.name, settings)
      assert stats["draft_forwards"] == stats["iterations"], settings
      if draft.name == "constant":
        assert stats["accepted_tokens"] > 8, (settings, stats["accepted_tokens"])


def _micro_drafter(target, reduced: bool, block_size=3, sharpen=3.0):
  """A random two-layer DFlash drafter for the micro target (block 3: depth 2), over the target's vocabulary
  (its head) or 7 of its 12 tokens (its own head)."""
  from tests.helpers.lossless import MICRO
  vocab = 7 if reduced else MICRO.vocab_size
  layer = MICRO.replace(name="micro-dflash", num_layers=2, qk_norm=True, head_dim=4, num_heads=2, ffn_dim=24,
                        vocab_size=vocab, tie_embeddings=not reduced)
  dcfg = dflash.DFlashConfig(MICRO, layer, (1, 0), block_size, mask_token_id=11)
  head = {**dflash.init_params(dcfg, jax.random.PRNGKey(5)), **dflash.frozen_from_target(dcfg, target)}
  head["final_norm"] = head["final_norm"] * sharpen
  if reduced:
    head["lm_head"] = jax.random.normal(jax.random.PRNGKey(6), (vocab, MICRO.d_model)) * 0.5
    head["head_ids"] = jnp.asarray([0, 2, 3, 5, 7, 8, 11], jnp.int32)
  return dflash.DFlashDrafter(layer, dcfg=dcfg, max_depth=block_size - 1), head


@pytest.mark.parametrize("reduced", [False, True], ids=["target-vocabulary", "draft-vocabulary"])
def test_sampling_with_a_dflash_drafter_is_lossless(reduced):
  """The χ² harnesses of test_speculative (a chain of 2: the whole block of 3) and test_lossless_trees (a 2 x 2
  tree): a DFlash drafter's samples have plain sampling's joint distribution, over the target's vocabulary and
  over a draft vocabulary of 7 tokens (q is 0 on the other 5); the accept-everything rule and acceptance without
  the residual update are caught."""
  from tests.helpers.lossless import (AcceptAlways, _chi2_pvalue, _exact_joint, _micro_params, _spec_samples,
                                      _tree_samples)
  from specjax.models.sampling import SamplingParams
  from specjax.speculative.acceptance import SpeculativeSampling
  from specjax.speculative.trees import specs as tree_shapes
  sp = SamplingParams(temperature=1.0)
  target = _micro_params(0)
  drafter, head = _micro_drafter(target, reduced)
  joint = _exact_joint(target, sp)
  tree = tree_shapes.branching([2, 2])
  assert _chi2_pvalue(_spec_samples(target, head, sp, drafter=drafter), joint) > 1e-3
  assert _chi2_pvalue(_tree_samples(target, head, sp, tree, drafter=drafter), joint) > 1e-3
  if reduced:
    return
  assert _chi2_pvalue(_spec_samples(target, head, sp, drafter=drafter, acceptance=AcceptAlways()), joint) < 1e-6
  no_residual = _tree_samples(target, head, sp, tree, drafter=drafter,
                              acceptance=SpeculativeSampling(residual_update=False))
  assert _chi2_pvalue(no_residual, joint) < 1e-6


def _edited(tmp_path, layout, name, edit=None, weights=None, garbage=False):
  d = tmp_path / name
  shutil.copytree(ROOT / layout, d)
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


def _layer_config(c, **kw):
  return {**c, "transformer_layer_config": {**c["transformer_layer_config"], **kw}}


_NOT_TARGET = ": a drafter for another target"
CONFIG_CASES = {
    "zlab": [
        (lambda c: {**c, "hidden_size": 128}, r"hidden_size=128, the target .* has 64" + _NOT_TARGET),
        (lambda c: {**c, "vocab_size": 300}, r"vocab_size=300, the target .* has 270"),
        (lambda c: {**c, "num_target_layers": 36}, r"num_target_layers=36, the target .* has 3"),
        (lambda c: {**c, "block_size": 1}, r"block_size=1 \(a block of the root and at least one mask token"),
        (lambda c: {k: v for k, v in c.items() if k != "block_size"}, r"block_size=None"),
        (lambda c: _dflash_config(c, mask_token_id=270), r"mask_token_id=270, the target .* has tokens 0..269"),
        (lambda c: _dflash_config(c, target_layer_ids=[1, 2]),
         r"target_layer_ids \[1, 2\] do not fit the target .* \(3 layers; ids 0..1\)" + _NOT_TARGET),
        (lambda c: {**c, "layer_types": ["sliding_attention", "full_attention"]}, r"sliding_attention draft layers"),
    ],
    "speculators": [
        (lambda c: _layer_config(c, hidden_size=128), r"hidden_size=128, the target .* has 64" + _NOT_TARGET),
        (lambda c: _layer_config(c, vocab_size=300), r"vocab_size=300, the target .* has 270"),
        (lambda c: {**c, "target_hidden_size": 32}, r"target_hidden_size=32, the target .* has 64"),
        (lambda c: {**c, "draft_vocab_size": 300}, r"draft_vocab_size=300, the target .* has 270 tokens"),
        (lambda c: {**c, "block_size": 1}, r"block_size=1 \(a block of the root"),
        (lambda c: {**c, "mask_token_id": None}, r"mask_token_id=None, the target .* has tokens 0..269"),
        (lambda c: {**c, "aux_hidden_state_layer_ids": [0, 2]},
         r"aux_hidden_state_layer_ids \[0, 2\] do not fit the target .* \(7 layers; hidden-state indices 1..6\)"),
        (lambda c: {**c, "aux_hidden_state_layer_ids": [7]}, r"aux_hidden_state_layer_ids \[7\] do not fit"),
        (lambda c: {**c, "sample_from_anchor": True}, r"sample_from_anchor drafts from the anchor row too"),
        (lambda c: {**c, "speculators_model_type": "dflash2"}, r"speculators_model_type 'dflash2'; supported: dflash"),
    ],
}


def test_bad_config_is_refused_in_one_line_before_the_weights(pair, tmp_path):
  """Every mismatch with the target, and every setting specjax does not read, in one line naming both sides —
  with a weights file that is not one, so the refusal came from config.json alone."""
  layout, d = pair
  cfg, params, tok = load_hf_dir(d)
  for i, (edit, msg) in enumerate(CONFIG_CASES[layout]):
    with pytest.raises(SpecjaxError, match=msg) as e:
      drafter_io.load_drafter(_edited(tmp_path, layout, f"c{i}", edit, garbage=True), cfg, params, tok)
    assert "\n" not in str(e.value) and "dflash" in str(e.value).lower()


WEIGHT_CASES = {
    "zlab": [(lambda t: {k: v for k, v in t.items() if k != "layers.1.self_attn.k_norm.weight"},
              r"lacks 'layers.1.self_attn.k_norm.weight': not a DFlash drafter"),
             (lambda t: {**t, "fc.weight": t["fc.weight"][:, :64]},
              r"'fc.weight' has shape \(64, 64\), config.json and the target say \(64, 128\)")],
    "speculators": [(lambda t: {k: v for k, v in t.items() if k != "d2t"},
                     r"lacks 'd2t': a reduced draft vocabulary needs its d2t map"),
                    (lambda t: {**t, "lm_head.weight": t["lm_head.weight"][:100]},
                     r"'lm_head.weight' has shape \(100, 64\), config.json and the target say \(150, 64\)")],
}


def test_bad_weights_are_refused_in_one_line(pair, tmp_path, monkeypatch):
  """Missing tensors and wrong shapes from the file's header alone (no tensor read), a d2t map out of the
  target's vocabulary, a truncated file (named), a pickled one (with the conversion)."""
  layout, d = pair
  cfg, params, tok = load_hf_dir(d)
  edited = [_edited(tmp_path, layout, f"w{i}", weights=w) for i, (w, _) in enumerate(WEIGHT_CASES[layout])]
  def unread(f):
    raise AssertionError(f"{f} was read")
  with monkeypatch.context() as mp:
    mp.setattr(weights_file, "read", unread)
    for e, (_, msg) in zip(edited, WEIGHT_CASES[layout]):
      with pytest.raises(SpecjaxError, match=msg):
        drafter_io.load_drafter(e, cfg, params, tok)
  if layout == "speculators":
    far = _edited(tmp_path, layout, "far", weights=lambda t: {**t, "d2t": t["d2t"] + 200})
    with pytest.raises(SpecjaxError, match="d2t map sends draft tokens outside the target's 270 tokens"):
      drafter_io.load_drafter(far, cfg, params, tok)
  broken = _edited(tmp_path, layout, "truncated")
  (broken / "model.safetensors").write_bytes((ROOT / layout / "model.safetensors").read_bytes()[:5000])
  with pytest.raises(SpecjaxError, match=r"truncated/model.safetensors is damaged"):
    drafter_io.load_drafter(broken, cfg, params, tok)
  pickled = _edited(tmp_path, layout, "pickled")
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
  eagle3 = Path(__file__).parents[1] / "data" / "eagle3" / "specforge"
  llama, _ = write_family(qwen3.parent, "llama")
  with pytest.raises(SpecjaxError, match="holds an EAGLE head: use --drafter eagle"):
    api.generate(api.load(str(llama)), ["hello"], drafter="dflash", draft=str(eagle3), k=2, **kw)
  assert dflash_io.default_layer_ids(36, 5) == [1, 9, 17, 25, 33] and dflash_io.default_layer_ids(3, 1) == [1]


def test_the_draft_is_checked_before_any_model_loads():
  """``api.check_draft`` (the CLI's check before loading): the depth asked against the block, a DFlash directory
  for another kind and another directory for dflash refused in one line; the other published layouts pass."""
  data = Path(__file__).parents[1] / "data"
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


def test_the_continuous_batcher_drafts_with_dflash(qwen3, tmp_path):
  """Requests admitted into slots while others decode (per-row mode: each slot's context cache written from its
  own B = 1 prefill), with the drafter whose drafts the target accepts: plain greedy tokens, drafts accepted."""
  from specjax.serving import batcher as bt, factory
  m = api.load(str(qwen3))
  ids = json.loads((DATA / "reference.json").read_text())["token_ids"]
  prompts = [ids[:n] for n in (20, 33, 45, 12)]
  texts = [m.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
  plain = [g.token_ids for g in api.generate(m, texts, max_new_tokens=12, chat=False, ignore_eos=True)[0]]
  eng = factory.make_batcher(m, drafter="dflash", policy="fixed", k=3, buckets=(0, 3), slots=2, max_len=128,
                             draft=str(_constant_drafter(tmp_path, 76)))
  eng.warmup(64)
  reqs = [bt.Request(list(p), 12, rid=i) for i, p in enumerate(prompts)]
  pending = list(reqs)
  while pending or not all(r.done for r in reqs):
    if pending:
      eng.submit(pending.pop(0))
    eng.step()
  assert [r.tokens for r in reqs] == plain
  assert sum(r.drafts_accepted for r in reqs) > 5
