"""Weight-only quantization: weights kept compact (bf16, int8, int4) and dequantized inside the matmul.

Decode is bandwidth-bound, so the bytes per weight are the speed.  A quantized matrix is a ``QWeight``: the
compact data, its scales and (static) its kind.  The activations stay in the compute dtype (fp32 on the CPU,
bf16 on accelerators); only the weights shrink.

  kind  data                         scale                       bits/weight   dequantized value
  bf16  bfloat16 [N, D]              none                        16            the bf16 value
  int8  int8 [N, D]                  fp32 [N]   (per output row) 8 + 32/D      q * scale[n]
  int4  uint8 [N, D/2] (two a byte)  fp32 [N, D/G] (per group)   4 + 32/G      (nibble - 8) * scale[n, d // G]

Scales are symmetric: int8 ``amax(row) / 127``, int4 ``amax(group) / 7`` (values clipped to -8..7).  int4
packs each block of 32 columns into 16 bytes: byte j holds column j in its low nibble and column j + 16 in
its high one (GGUF's Q4_0 layout, so Q4_0 blocks map onto it).  The group G is 32 (default) or 64 and must
divide D; a matrix whose D it does not divide is kept in int8 instead (said once on stderr).

Which tensors take the chosen kind (``quantize_params``): the layer matrices (w_qkv, wo, w_gate_up, w_down)
always; the embedding and the LM head too, except at int4, where they stay int8: the head is a large share
of a small model's bytes but also the tensor most sensitive to rounding (a tied SmolLM2 head is 21% of its
weights), and one int8 head costs 1 byte per weight where the rest of the model costs 0.56.  Norms and
biases stay fp32 (a few KB).

Stacked layer tensors keep their leading layer axis L on every field ([L, N, D] data, [L, N] scales).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError

KINDS = ("fp32", "bf16", "int8", "int4")
QUANTIZED = ("bf16", "int8", "int4")
GROUP = 32                   # int4 scale group along the input (32 or 64)
BLOCK = 32                   # int4 packing block (16 bytes per 32 columns)
MATRICES = ("w_qkv", "wo", "w_gate_up", "w_down")
_WARNED: set = set()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
  """A quantized matrix [..., N, D] (see the module docstring for each kind's fields)."""
  data: jax.Array
  scale: jax.Array | None
  kind: str = dataclasses.field(metadata=dict(static=True))
  group: int = dataclasses.field(default=GROUP, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    s = tuple(self.data.shape)
    return s[:-1] + (s[-1] * 2,) if self.kind == "int4" else s

  @property
  def nbytes(self) -> int:
    return int(self.data.size * self.data.dtype.itemsize
               + (0 if self.scale is None else self.scale.size * self.scale.dtype.itemsize))

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return dequantize(self.kind, self.data, self.scale, self.group, dtype)

  def take_rows(self, ids, dtype=jnp.float32) -> jax.Array:
    """Rows ``ids`` of a [N, D] weight, dequantized (an embedding lookup): [..., D]."""
    scale = None if self.scale is None else jnp.take(self.scale, ids, axis=0)
    return dequantize(self.kind, jnp.take(self.data, ids, axis=0), scale, self.group, dtype)

  def select_rows(self, ids) -> "QWeight":
    """The weight restricted to rows ``ids``, still quantized (a reduced-vocabulary head)."""
    scale = None if self.scale is None else jnp.take(self.scale, ids, axis=0)
    return QWeight(jnp.take(self.data, ids, axis=0), scale, self.kind, self.group)


def is_quantized(w: Any) -> bool:
  return isinstance(w, QWeight)


def _is_leaf(x) -> bool:
  return isinstance(x, QWeight)


# ----------------------------------------------------------------------------------------------------------
# Quantize / dequantize (numpy on the host for loading; jnp for the reference and the XLA path)


def quantize(kind: str, w, group: int = GROUP) -> QWeight:
  """Quantize a float matrix [..., N, D] (numpy or jax) to ``kind`` ('bf16', 'int8' or 'int4'), on the host."""
  if kind not in QUANTIZED:
    raise SpecjaxError(f"unknown weight type '{kind}': use one of {', '.join(KINDS)}")
  w = np.asarray(w, np.float32)
  if kind == "bf16":
    return QWeight(jnp.asarray(w.astype(jnp.bfloat16)), None, "bf16")
  if kind == "int8":
    amax = np.max(np.abs(w), axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -127, 127).astype(np.int8)
    return QWeight(jnp.asarray(q), jnp.asarray(scale), "int8")
  if group not in (32, 64):
    raise SpecjaxError(f"int4 group size {group}: use 32 or 64")
  D = w.shape[-1]
  if D % group or D % BLOCK:
    raise SpecjaxError(f"int4 needs the input size ({D}) to be a multiple of the group ({group})")
  g = w.reshape(*w.shape[:-1], D // group, group)
  amax = np.max(np.abs(g), axis=-1)
  scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
  q = (np.clip(np.rint(g / scale[..., None]), -8, 7).astype(np.int16) + 8).astype(np.uint8)
  q = q.reshape(*w.shape[:-1], D // BLOCK, 2, BLOCK // 2)           # [..., blocks, lo/hi half, 16]
  packed = (q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8)    # byte j: col j low, col j + 16 high
  return QWeight(jnp.asarray(packed.reshape(*w.shape[:-1], D // 2)), jnp.asarray(scale), "int4", group)


def unpack_int4(packed):
  """uint8 [..., D/2] -> the nibble values - 8 as int8 [..., D] (jnp)."""
  p = jnp.asarray(packed)
  blocks = p.reshape(*p.shape[:-1], -1, BLOCK // 2)
  lo = (blocks & 15).astype(jnp.int8) - 8
  hi = (blocks >> 4).astype(jnp.int8) - 8
  return jnp.concatenate([lo, hi], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def dequantize(kind: str, data, scale, group: int = GROUP, dtype=jnp.float32) -> jax.Array:
  """The float matrix a quantized one stands for (the references dequantize, then multiply)."""
  if kind == "bf16":
    return jnp.asarray(data).astype(dtype)
  if kind == "int8":
    return (jnp.asarray(data).astype(jnp.float32) * scale[..., None]).astype(dtype)
  if kind == "int4":
    q = unpack_int4(data).astype(jnp.float32)
    D = q.shape[-1]
    w = q.reshape(*q.shape[:-1], D // group, group) * scale[..., None]
    return w.reshape(q.shape).astype(dtype)
  raise ValueError(f"not a quantized kind: {kind!r}")


# ----------------------------------------------------------------------------------------------------------
# Whole models


def weight_kind(name: str, kind: str, D: int, group: int = GROUP) -> str:
  """The kind tensor ``name`` (with input size D) takes when a model is quantized to ``kind``."""
  if kind == "fp32":
    return "fp32"
  if name in ("embed", "lm_head") and kind == "int4":
    return "int8"
  if kind == "int4" and (D % group or D % BLOCK):
    if name not in _WARNED:
      _WARNED.add(name)
      sys.stderr.write(f"[specjax] int4: '{name}' has an input size ({D}) that is not a multiple of {group}; "
                       "kept in int8\n")
    return "int8"
  return kind


def quantize_params(params: dict, kind: str, group: int = GROUP) -> dict:
  """A model's parameters with its matrices quantized to ``kind`` by the policy in the module docstring.
  Norms, biases and any tensor not a matrix stay as they are.  'fp32' returns the parameters unchanged."""
  if kind not in KINDS:
    raise SpecjaxError(f"unknown weight type '{kind}': use one of {', '.join(KINDS)}")
  if kind == "fp32":
    return params

  def one(name, w):
    if isinstance(w, QWeight):
      raise SpecjaxError(f"'{name}' is already quantized ({w.kind}): load the model in fp32 to requantize")
    return quantize(weight_kind(name, kind, w.shape[-1], group), w, group)

  out = dict(params)
  for name in ("embed", "lm_head"):
    if name in params:
      out[name] = one(name, params[name])
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    out["layers"] = [{n: one(n, w) if n in MATRICES else w for n, w in lp.items()} for lp in layers]
  else:
    out["layers"] = {n: one(n, w) if n in MATRICES else w for n, w in layers.items()}
  return out


def holds_quantized(params) -> bool:
  """Whether any tensor of ``params`` is a ``QWeight``."""
  return any(isinstance(x, QWeight) for x in jax.tree_util.tree_leaves(params, is_leaf=_is_leaf))


def weights_kind(params: dict) -> str:
  """The kind of a model's layer matrices ('fp32' when not quantized; 'bf16' also for a bf16 model)."""
  layers = params["layers"]
  w = (layers[0] if isinstance(layers, (list, tuple)) else layers)["w_qkv"]
  if isinstance(w, QWeight):
    return w.kind
  return "bf16" if w.dtype == jnp.bfloat16 else "fp32"


def compute_dtype(backend: str | None = None):
  """The activations' dtype beside quantized weights: fp32 on the CPU (the native kernels' input), bf16 on
  accelerators."""
  return jnp.dtype(jnp.float32 if (backend or jax.default_backend()) == "cpu" else jnp.bfloat16)


def activation_dtype(params: dict):
  """The dtype a model's activations (and its KV cache) run in: the embedding's dtype, or ``compute_dtype``
  for a quantized embedding."""
  e = params["embed"]
  return compute_dtype() if isinstance(e, QWeight) else jnp.dtype(e.dtype)


def embed_rows(embed, ids, dtype) -> jax.Array:
  """``embed[ids]`` in ``dtype``, for a plain or a quantized embedding."""
  if isinstance(embed, QWeight):
    return embed.take_rows(ids, dtype)
  return jnp.take(embed, ids, axis=0).astype(dtype)


def param_bytes(params) -> int:
  """Bytes the parameters occupy (quantized data and scales counted as stored)."""
  return int(sum(x.nbytes if isinstance(x, QWeight) else x.size * x.dtype.itemsize
                 for x in jax.tree_util.tree_leaves(params, is_leaf=_is_leaf)))


def bits_per_weight(kind: str, D: int = 4096, group: int = GROUP) -> float:
  """Bits read per weight for a layer matrix of kind ``kind`` with input size D (scales included)."""
  return {"fp32": 32.0, "bf16": 16.0, "int8": 8.0 + 32.0 / D, "int4": 4.0 + 32.0 / group}[kind]
