"""EAGLE-1/2 drafters in their published layout: equal to the ``eagle`` package's ``cnets.Model`` (recorded by
scripts/record_eagle1_reference.py) at depth 1 and when feeding itself (depth 2), greedy-exact in the engine,
refusals in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import api
from specjax.checkpoints import drafter_io
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.errors import SpecjaxError
from specjax.models import decoder as M
from specjax.models.kv_cache import init_cache
from specjax.speculative import eagle
from tests.helpers.families import write_family

DATA = Path(__file__).parents[1] / "data" / "eagle1"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  return write_family(tmp_path_factory.mktemp("eagle1"), "llama")


def test_logits_equal_the_eagle_package(llama):
  d, ref = llama
  cfg, params, tok = load_hf_dir(d)
  ecfg, dp, _ = drafter_io.load_drafter(DATA, cfg, params, tok)
  assert ecfg.layout == "eagle1" and "fc_bias" in dp and not ecfg.layer_cfg.input_norm
  ids = jnp.asarray([ref["token_ids"]])
  T = ids.shape[1]
  feats = M.forward(params, cfg, ids, jnp.arange(T)[None], init_cache(cfg, 1, T), feature_layers=()).features
  lcfg = ecfg.layer_cfg
  for case in json.loads((DATA / "reference.json").read_text())["cases"]:
    n = case["prefix"]
    # token x_t at slot and position t with the feature g_{t-1} (g_{-1} = 0: x_0 is seen by itself only)
    toks, pos = ids[:, :n], jnp.arange(n)[None]
    x = eagle.input_proj(dp, toks, eagle.previous_features(feats)[:, :n])
    out = M.forward(dp, lcfg, toks, pos, init_cache(lcfg, 1, n + 4), inputs_embeds_BxTxD=x)
    np.testing.assert_allclose(out.logits[0, -1], case["depth1_logits"], atol=1e-4, rtol=0)
    token = int(jnp.argmax(out.logits[0, -1]))
    assert token == case["depth1_top1"]
    x2 = eagle.input_proj(dp, jnp.asarray([[token]]), out.hidden[:, -1:])   # the drafter feeds itself
    out2 = M.forward(dp, lcfg, jnp.asarray([[token]]), jnp.asarray([[n]]), out.cache, inputs_embeds_BxTxD=x2)
    np.testing.assert_allclose(out2.logits[0, -1], case["depth2_logits"], atol=1e-4, rtol=0)
    assert int(jnp.argmax(out2.logits[0, -1])) == case["depth2_top1"]


def test_greedy_eagle1_equals_plain_greedy(llama):
  d, ref = llama
  m = api.load(str(d))
  prompts = [m.tokenizer.decode(ref["token_ids"][:n], skip_special_tokens=False) for n in (20, 45)]
  kw = dict(max_new_tokens=16, chat=False, ignore_eos=True, batch_size=2)
  plain = [g.token_ids for g in api.generate(m, prompts, **kw)[0]]
  for settings in (dict(k=3), dict(tree="branch:2,2"), dict(tree="dynamic:6:2:3")):
    got = api.generate(m, prompts, drafter="eagle", draft=str(DATA), **kw, **settings)[0]
    assert [g.token_ids for g in got] == plain, settings


def test_bad_eagle1_directories_are_refused(llama, tmp_path):
  d, _ = llama
  cfg, params, tok = load_hf_dir(d)
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  shutil.copy(DATA / "config.json", pickled / "config.json")
  (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02")
  with pytest.raises(SpecjaxError, match="pickled torch file.*save_file"):
    drafter_io.load_drafter(pickled, cfg, params, tok)
  other = tmp_path / "other"
  shutil.copytree(DATA, other)
  c = json.loads((other / "config.json").read_text())
  (other / "config.json").write_text(json.dumps({**c, "hidden_size": 128}))
  with pytest.raises(SpecjaxError, match="hidden_size=128"):
    drafter_io.load_drafter(other, cfg, params, tok)
  (other / "config.json").write_text(json.dumps(c))
  (other / "model.safetensors").write_bytes(b"truncated")
  with pytest.raises(SpecjaxError, match="model.safetensors is damaged"):
    drafter_io.load_drafter(other, cfg, params, tok)
