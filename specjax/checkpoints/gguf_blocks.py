"""GGUF 4-bit blocks taken over into int4 ``QWeight`` rows exactly, instead of requantized.

specjax's int4 (``quant.py``) is GGUF's Q4_1 layout: per group of 32 inputs a scale and an offset, 16 bytes of
nibbles with byte j holding input j (low nibble) and input j + 16 (high).  The 4-bit GGUF types map onto it
with no rounding at all:

  Q4_0  per 32: d (f16), 16 bytes        w = d * (q - 8)            scale d,       offset -8 d
  Q4_1  per 32: d, m (f16), 16 bytes     w = d * q + m              scale d,       offset m
  Q4_K  per 256: d, dmin (f16), 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32, 128 bytes of nibbles
                                         w = d sc_s * q - dmin m_s   scale d sc_s,  offset -dmin m_s
        (in each 64 inputs, sub-block 2c is the low nibbles of 32 bytes, 2c + 1 the high ones: repacked)

A model's other tensor types (Q5_0, Q6_K, Q8_0, ... : Gemma 3 270M's Q4_K_M file mixes them) are
dequantized and requantized as before (``take_over_int4``).

Every product here is exact in fp32 (an fp16 times a 6-bit and a 4-bit integer), so ``QWeight.dequantize``
equals ``gguf.dequantize`` bit for bit (tests/checkpoints/test_gguf_blocks.py).  Requantizing the dequantized values
instead reproduces a Q4_K group only where it uses its lowest and highest level: 78.8% of the
Qwen2.5-Coder-1.5B's groups (``scripts/probes/int4_takeover_check.py``).
"""
from __future__ import annotations

import numpy as np

from specjax.errors import CheckpointError

TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _f16(raw_B2: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(raw_B2).view(np.float16).astype(np.float32)[..., 0]


def _pack(nibbles_Gx32: np.ndarray) -> np.ndarray:
  """Nibble values [..., 32] in input order -> our 16 bytes (byte j: input j low, input j + 16 high)."""
  return (nibbles_Gx32[..., :16] | (nibbles_Gx32[..., 16:] << 4)).astype(np.uint8)


def int4_rows(raw_NxBytes: np.ndarray, type_name: str, D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A GGUF tensor's raw rows (uint8 [N, bytes per row]) of type Q4_0, Q4_1 or Q4_K with D inputs ->
  (packed uint8 [N, D/2], scale fp32 [N, D/32], offset fp32 [N, D/32]) in ``QWeight``'s int4 format."""
  raw = np.asarray(raw_NxBytes, np.uint8)
  N = raw.shape[0]
  if type_name in ("Q4_0", "Q4_1"):
    head = 2 if type_name == "Q4_0" else 4
    blocks = raw.reshape(N, D // 32, head + 16)
    d = _f16(blocks[..., 0:2])
    if type_name == "Q4_0":
      scale, offset = d, -8.0 * d
    else:
      scale, offset = d, _f16(blocks[..., 2:4])
    return blocks[..., head:].reshape(N, D // 2).copy(), scale, offset.astype(np.float32)
  if type_name != "Q4_K":
    raise CheckpointError(f"{type_name} blocks do not map onto int4 (only {', '.join(TYPES)} do)")
  from gguf.quants import Q4_K   # the 6-bit (sc, m) unpacking, as the gguf package reads it

  blocks = raw.reshape(N * (D // 256), 144)
  d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
  sc, m = Q4_K.get_scale_min(blocks[:, 4:16])                      # [blocks, 8] each
  scale = (d[:, None] * sc.astype(np.float32)).reshape(N, D // 32)
  offset = (-(dmin[:, None] * m.astype(np.float32))).reshape(N, D // 32)
  qs = blocks[:, 16:].reshape(-1, 4, 32)                          # per 64 inputs, 32 bytes
  nib = np.stack([qs & 15, qs >> 4], axis=2)                      # [blocks, 4, 2 (low: sub-block 2c), 32]
  return _pack(nib).reshape(N, D // 2), scale.astype(np.float32), offset.astype(np.float32)


def take_over_int4(qparams: dict, src) -> tuple[dict, int, int]:
  """``qparams`` (a model quantized to int4 by ``quant.quantize_params``) with every layer matrix row block
  whose GGUF tensor is Q4_0, Q4_1 or Q4_K replaced by its blocks taken over exactly; ``src`` is the opened
  GGUF (``gguf_loader.open_gguf``).  Returns (params, tensors taken over, 4-bit-eligible tensors seen)."""
  from specjax.models import quant
  from specjax.checkpoints.gguf_loader import PERMUTED_ARCHS, _qk_heads, placements, unpermute_qk_llamacpp

  layers = dict(qparams["layers"])
  arrays: dict = {}     # leaf -> [data, scale, offset] as writable host copies
  taken = seen = 0
  for pl in placements(src.cfg):
    leaf = pl.leaf.split(".")[-1]
    if pl.layer is None or leaf not in quant.MATRICES:
      continue
    w = layers[leaf]
    if not isinstance(w, quant.QWeight) or w.kind != "int4" or w.group != 32:
      continue
    tensor = src.tensors[pl.src]
    seen += 1
    if tensor.tensor_type.name not in TYPES:
      # Q5_0, Q6_K, Q8_0, F32, ... have no exact int4 form: the tensor keeps what ``quant.quantize_params``
      # made of its dequantized values (the gguf package's), so every type the file holds still loads.
      continue
    D = int(tensor.shape[0])
    data, scale, offset = int4_rows(np.asarray(tensor.data).reshape(pl.rows, -1), tensor.tensor_type.name, D)
    heads = _qk_heads(src.cfg, pl.src) if src.arch in PERMUTED_ARCHS else None
    if heads is not None:
      data, scale, offset = (unpermute_qk_llamacpp(a, heads) for a in (data, scale, offset))
    if leaf not in arrays:
      arrays[leaf] = [np.array(w.data), np.array(w.scale), np.array(w.offset)]
    for dst, part in zip(arrays[leaf], (data, scale, offset)):
      dst[pl.layer, pl.row0:pl.row0 + pl.rows] = part
    taken += 1
  for leaf, (data, scale, offset) in arrays.items():
    layers[leaf] = quant.QWeight(data, scale, "int4", 32, offset)
  return {**qparams, "layers": layers}, taken, seen
