"""The compact weight formats the quantized kernels read (``QWeight``), and quantizing a matrix into one.

The formats, the group sizes and why they were chosen: ``specjax/models/quant.py`` (the model-level policy lives
there; this module is the kernels' data type, so it sits in the kernel layer).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError

KINDS = ("fp32", "bf16", "int8", "int4")
QUANTIZED = ("bf16", "int8", "int4")
GROUPS = {"int8": 64, "int4": 32}     # default scale group along the input (32 or 64 for either)
GROUP = 32                   # the int4 default (kept as a name for callers)
BLOCK = 32                   # int4 packing block (16 bytes per 32 columns)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
  """A quantized matrix [..., N, D] (``specjax/models/quant.py``'s docstring gives each kind's fields)."""
  data: jax.Array
  scale: jax.Array | None
  kind: str = dataclasses.field(metadata=dict(static=True))
  group: int = dataclasses.field(default=GROUP, metadata=dict(static=True))
  offset: jax.Array | None = None     # int4: the group minimum
  tiled: bool = dataclasses.field(default=False, metadata=dict(static=True))
  """Whether the fields are in 16-row tiles (``tile_rows``), the integer-dot kernel's layout, instead of rows."""

  @property
  def shape(self) -> tuple[int, ...]:
    s = tuple(self.data.shape)
    return s[:-1] + (s[-1] * 2,) if self.kind == "int4" else s

  @property
  def nbytes(self) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in (self.data, self.scale, self.offset) if x is not None))

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return self.in_rows().dequantize(dtype) if self.tiled else dequantize(self.kind, self.data, self.scale,
                                                                          self.group, dtype, self.offset)

  def in_rows(self) -> "QWeight":
    """The weight in the row layout (itself if it is in it)."""
    return self._fields_through(untile_rows, tiled=False) if self.tiled else self

  def in_tiles(self) -> "QWeight":
    """The weight in 16-row tiles (``tile_rows``; on the host), or itself where that layout does not apply."""
    if self.tiled or not tiles_apply(self):
      return self
    return self._fields_through(lambda x, unit: jnp.asarray(tile_rows(np.asarray(x), unit)), tiled=True)

  def _fields_through(self, f, tiled: bool) -> "QWeight":
    """The weight with each field x replaced by f(x, unit): unit 4 (bytes) for the data, 1 for scale and offset."""
    opt = lambda x: None if x is None else f(x, 1)   # noqa: E731
    return QWeight(f(self.data, 4), opt(self.scale), self.kind, self.group, opt(self.offset), tiled=tiled)

  def take_rows(self, ids, dtype=jnp.float32) -> jax.Array:
    """Rows ``ids`` of a [N, D] weight, dequantized (an embedding lookup): [..., D]."""
    return self.select_rows(ids).dequantize(dtype)

  def select_rows(self, ids) -> "QWeight":
    """The weight restricted to rows ``ids``, still quantized (a reduced-vocabulary head), in rows."""
    if self.tiled:   # row r is lane r % 16 of tile r // 16: gathered where it lies, nothing else is moved
      ids = jnp.asarray(ids)
      return self._fields_through(lambda x, unit: take_tiled_rows(x, ids, unit), tiled=False)
    take = lambda x: None if x is None else jnp.take(x, ids, axis=0)   # noqa: E731
    return QWeight(take(self.data), take(self.scale), self.kind, self.group, take(self.offset))


def is_quantized(w) -> bool:
  return isinstance(w, QWeight)


# ----------------------------------------------------------------------------------------------------------
# 16-row tiles: the integer-dot kernel's layout (``cpu_qdot_tiles.cc`` says why).  A field [N, C] (the packed
# bytes, or the scales) is cut into units of ``unit`` consecutive elements (4 bytes, or 1 scale), and each tile
# of 16 rows stores unit q of its 16 rows side by side: [N/16, 16, C/unit, unit] -> [N/16, C/unit, 16, unit].
# A permutation: the shape, the bytes and every quantized value are those of the row layout.

TILE = 16


def tiles_apply(w: QWeight) -> bool:
  """Whether ``w`` can be tiled: int8 or int4, N a multiple of 16 and D of 32."""
  return w.kind in ("int8", "int4") and w.shape[-2] % TILE == 0 and w.shape[-1] % BLOCK == 0


def tile_rows(x, unit: int):
  """A field [..., N, C] in rows -> in tiles (numpy or jax, whichever ``x`` is)."""
  *lead, N, C = x.shape
  if isinstance(x, np.ndarray) and unit == 4 and x.dtype.itemsize == 1:   # 4-byte units as one uint32: 2.5x faster
    x = np.ascontiguousarray(x)
    return tile_rows(x.view(np.uint32), 1).view(x.dtype)
  t = x.reshape(*lead, N // TILE, TILE, C // unit, unit).swapaxes(-3, -2).reshape(*lead, N, C)
  return np.ascontiguousarray(t) if isinstance(t, np.ndarray) else t


def untile_rows(x, unit: int):
  """The inverse of ``tile_rows``."""
  *lead, N, C = x.shape
  return x.reshape(*lead, N // TILE, C // unit, TILE, unit).swapaxes(-3, -2).reshape(*lead, N, C)


def take_tiled_rows(x, ids, unit: int):
  """Rows ``ids`` [...] of a tiled field [N, C], in rows: [..., C]."""
  N, C = x.shape
  t = jnp.asarray(x).reshape(N // TILE, C // unit, TILE, unit)
  return t[ids // TILE, :, ids % TILE, :].reshape(*ids.shape, C)


# ----------------------------------------------------------------------------------------------------------
# Quantize / dequantize (numpy on the host for loading; jnp for the reference and the XLA path)


def quantize(kind: str, w, group: int | None = None) -> QWeight:
  """Quantize a float matrix [..., N, D] (numpy or jax) to ``kind`` ('bf16', 'int8' or 'int4'), on the host;
  ``group``: the scale group along the input (default ``GROUPS[kind]``)."""
  if kind not in QUANTIZED:
    raise SpecjaxError(f"unknown weight type '{kind}': use one of {', '.join(KINDS)}")
  w = np.asarray(w, np.float32)
  if kind == "bf16":
    return QWeight(jnp.asarray(w.astype(jnp.bfloat16)), None, "bf16")
  group = group or GROUPS[kind]
  if group not in (32, 64):
    raise SpecjaxError(f"{kind} group size {group}: use 32 or 64")
  D = w.shape[-1]
  if D % group:
    raise SpecjaxError(f"{kind} needs the input size ({D}) to be a multiple of the group ({group})")
  g = w.reshape(*w.shape[:-1], D // group, group)
  if kind == "int8":
    amax = np.max(np.abs(g), axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / scale[..., None]), -127, 127).astype(np.int8)
    return QWeight(jnp.asarray(q.reshape(w.shape)), jnp.asarray(scale), "int8", group)
  lo, hi = np.min(g, axis=-1), np.max(g, axis=-1)
  scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
  q = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
  return QWeight(jnp.asarray(pack_int4(q.reshape(w.shape))), jnp.asarray(scale), "int4", group,
                 jnp.asarray(lo.astype(np.float32)))


def pack_int4(q):
  """uint8 nibble values [..., D] (0..15) -> packed uint8 [..., D/2]: per block of 32 columns, byte j holds
  column j (low nibble) and column j + 16 (high nibble)."""
  q = np.asarray(q, np.uint8)
  D = q.shape[-1]
  blocks = q.reshape(*q.shape[:-1], D // BLOCK, 2, BLOCK // 2)
  return (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).astype(np.uint8).reshape(*q.shape[:-1], D // 2)


def unpack_int4(packed):
  """Packed uint8 [..., D/2] -> the nibble values as uint8 [..., D] (jnp)."""
  p = jnp.asarray(packed)
  blocks = p.reshape(*p.shape[:-1], -1, BLOCK // 2)
  return jnp.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def dequantize(kind: str, data, scale, group: int = GROUP, dtype=jnp.float32, offset=None) -> jax.Array:
  """The float matrix a quantized one stands for (the references dequantize, then multiply)."""
  if kind == "bf16":
    return jnp.asarray(data).astype(dtype)
  q = (unpack_int4(data) if kind == "int4" else jnp.asarray(data)).astype(jnp.float32)
  if kind not in ("int8", "int4"):
    raise ValueError(f"not a quantized kind: {kind!r}")
  D = q.shape[-1]
  w = q.reshape(*q.shape[:-1], D // group, group) * scale[..., None]
  if kind == "int4":
    w = w + offset[..., None]
  return w.reshape(q.shape).astype(dtype)
