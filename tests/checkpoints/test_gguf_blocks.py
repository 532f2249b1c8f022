"""GGUF 4-bit blocks taken over into int4 exactly (specjax/checkpoints/gguf_blocks.py): each type's blocks
dequantize bit for bit as the gguf package's, and a GGUF model loaded at int4 holds its file's values where
requantizing them would not."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from specjax.models import quant
from specjax.checkpoints import gguf_blocks, load_model
from tests.helpers import CFG, random_hf_params, write_gguf


def _random_blocks(type_name: str, N: int, D: int, seed: int = 0) -> np.ndarray:
  """Random raw rows of ``type_name``: random nibbles and 6-bit scales, finite fp16 block scales."""
  rng = np.random.default_rng(seed)
  qt = getattr(gguf.GGMLQuantizationType, type_name)
  block, size = gguf.GGML_QUANT_SIZES[qt]
  raw = rng.integers(0, 256, (N, D // block, size), dtype=np.uint8)
  halves = 2 if type_name in ("Q4_1", "Q4_K") else 1         # d (and m / dmin) at the block's start
  f16 = rng.uniform(-0.05, 0.05, (N, D // block, halves)).astype(np.float16)
  raw[..., :2 * halves] = f16.view(np.uint8).reshape(N, D // block, 2 * halves)
  return raw.reshape(N, -1)


@pytest.mark.parametrize("type_name", gguf_blocks.TYPES)
def test_blocks_dequantize_bit_for_bit_as_gguf(type_name):
  N, D = 5, 512
  raw = _random_blocks(type_name, N, D)
  data, scale, offset = gguf_blocks.int4_rows(raw, type_name, D)
  ours = np.asarray(quant.QWeight(data, scale, "int4", 32, offset).dequantize())
  theirs = np.asarray(gguf.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)), np.float32)
  np.testing.assert_array_equal(ours, theirs.reshape(N, D))
  # requantizing the same values does not reproduce them all (what taking the blocks over avoids)
  again = np.asarray(quant.quantize("int4", theirs.reshape(N, D)).dequantize())
  assert not np.array_equal(again, ours)


def test_other_types_are_refused():
  with pytest.raises(Exception, match="do not map onto int4"):
    gguf_blocks.int4_rows(np.zeros((1, 34), np.uint8), "Q8_0", 32)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_a_gguf_model_at_int4_holds_its_files_values(tmp_path, monkeypatch, capfd, type_name):
  """Layer matrices stored as 4-bit blocks (q/k rows permuted, as llama.cpp writes llama) come back exactly
  at int4, with the cache on and off; the embedding and head (int8 under int4) are requantized as before.
  (gguf.quantize's Q4_0/Q4_1 groups use their extreme levels, so requantizing them happens to be exact too:
  the log line says the blocks were taken over, and the random blocks above show requantizing is not.)"""
  layer = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
           "ffn_up.weight", "ffn_down.weight"]
  names = tuple(f"blk.{i}.{n}" for i in range(CFG.num_layers) for n in layer)
  path = write_gguf(tmp_path / "q4.gguf", CFG, random_hf_params(CFG, seed=5), quantized=names,
                    quant_type=type_name)
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  fp32 = load_model(path)                       # the file's values, dequantized by the gguf package
  capfd.readouterr()
  for cache in ("1", "0"):
    monkeypatch.setenv("SPECJAX_WEIGHT_CACHE", cache)
    m = load_model(path, quantize_to="int4")
    assert f"{len(names)} of {len(names)} layer tensors of q4.gguf taken over" in capfd.readouterr().err
    for leaf in quant.MATRICES:
      w = m.params["layers"][leaf]
      assert w.kind == "int4"
      np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(fp32.params["layers"][leaf]))
