"""Quantized weights in the converted-weight cache (specjax/checkpoints/quantized_cache.py): quantized once,
memory-mapped after that, equal to quantizing in memory, aligned, and rebuilt when damaged."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax.models import quant
from specjax.checkpoints import converted, load_model, quantized_cache
from tests.helpers import CFG, random_hf_params, write_gguf


@pytest.fixture
def gguf_file(tmp_path):
  return write_gguf(tmp_path / "tiny.gguf", CFG, random_hf_params(CFG, seed=11))


def _quantized_entry(cache: Path, kind: str) -> Path:
  entries = [p for p in (cache / "converted").glob(f"*-{kind}-q*") if p.is_dir()]
  assert len(entries) == 1, entries
  return entries[0]


def _leaves(params):
  return jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, quant.QWeight))


def _assert_same(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert isinstance(x, quant.QWeight) == isinstance(y, quant.QWeight)
    if isinstance(x, quant.QWeight):
      assert (x.kind, x.group) == (y.kind, y.group)
      for f in ("data", "scale", "offset"):
        u, v = getattr(x, f), getattr(y, f)
        assert (u is None) == (v is None)
        if u is not None:
          assert np.asarray(u).dtype == np.asarray(v).dtype
          np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_quantized_once_then_read_back_equal(tmp_path, gguf_file, monkeypatch, capfd, kind):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  fp32 = load_model(gguf_file)
  in_memory = quant.quantize_params(jax.tree_util.tree_map(np.asarray, fp32.params), kind)
  capfd.readouterr()
  first = load_model(gguf_file, quantize_to=kind)
  assert f"quantizing tiny.gguf to {kind}" in capfd.readouterr().err
  second = load_model(gguf_file, quantize_to=kind)
  assert capfd.readouterr().err == ""                    # mapped from the cache: nothing to report
  assert quant.weights_kind(second.params) == kind
  _assert_same(in_memory, first.params)
  _assert_same(in_memory, second.params)
  # Every tensor whose size is a multiple of 64 bytes starts 64-byte aligned (so the CPU aliases it).
  params_file = _quantized_entry(tmp_path / "cache", kind) / converted.PARAMS_FILE
  n, _ = converted._header_length(params_file)
  header = json.loads(params_file.read_bytes()[8:8 + n])
  sizes = {name: info["data_offsets"] for name, info in header.items()}
  aligned = [(a, b) for a, b in sizes.values() if (b - a) % 64 == 0]
  assert aligned and all((8 + n + a) % 64 == 0 for a, _ in aligned)


def test_damaged_quantized_entry_is_reported_and_rebuilt(tmp_path, gguf_file, monkeypatch, capfd):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  good = jax.tree_util.tree_map(np.array, load_model(gguf_file, quantize_to="int4").params)
  capfd.readouterr()
  params_file = _quantized_entry(tmp_path / "cache", "int4") / converted.PARAMS_FILE
  data = bytearray(params_file.read_bytes())
  data[-5] ^= 0xFF
  params_file.write_bytes(bytes(data))
  again = load_model(gguf_file, quantize_to="int4")
  lines = [line for line in capfd.readouterr().err.splitlines() if "unusable" in line]
  assert len(lines) == 1 and "quantizing tiny.gguf again" in lines[0], lines
  _assert_same(good, again.params)
  load_model(gguf_file, quantize_to="int4")
  assert capfd.readouterr().err == ""


def test_an_entry_from_another_quantization_version_is_not_used(tmp_path, gguf_file, monkeypatch, capfd):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  load_model(gguf_file, quantize_to="int8")
  entry = _quantized_entry(tmp_path / "cache", "int8")
  meta = json.loads((entry / converted.MODEL_FILE).read_text())
  meta["manifest"]["quant_version"] = quantized_cache.QUANT_VERSION + 1
  (entry / converted.MODEL_FILE).write_text(json.dumps(meta))
  capfd.readouterr()
  load_model(gguf_file, quantize_to="int8")
  assert "quantization version" in capfd.readouterr().err


def test_with_the_cache_off_the_weights_are_quantized_in_memory(tmp_path, gguf_file, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("SPECJAX_WEIGHT_CACHE", "0")
  m = load_model(gguf_file, quantize_to="int4")
  assert quant.weights_kind(m.params) == "int4"
  converted_dir = tmp_path / "cache" / "converted"
  assert not converted_dir.exists() or not list(converted_dir.glob("*-int4-*"))
