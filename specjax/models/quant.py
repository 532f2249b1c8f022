"""Weight-only quantization: weights kept compact (bf16, int8, int4) and dequantized inside the matmul.

Decode is bandwidth-bound, so the bytes per weight are the speed.  A quantized matrix is a ``QWeight``: the
compact data, its scales and (static) its kind.  The activations stay in the compute dtype (fp32 on the CPU,
bf16 on accelerators); only the weights shrink.

  kind  data                         scale, offset (per group)        bits/weight   dequantized value
  bf16  bfloat16 [N, D]              none                             16            the bf16 value
  int8  int8 [N, D]                  scale fp32 [N, D/G]              8 + 32/G      q * scale[n, d // G]
  int4  uint8 [N, D/2] (two a byte)  scale, offset fp32 [N, D/G]      4 + 64/G      nibble * scale + offset

Groups run along the input (G = 64 for int8, 32 for int4 by default; 32 or 64 either way).  int8 is
symmetric, ``amax(group) / 127``; int4 is asymmetric, the group's [min, max] in 16 steps (offset = min).
Measured on SmolLM2-135M (perplexity on ``experiments/weights.TEXT`` against fp32; docs/benchmarks-log.md):
int8 per output row +1.6%, per group of 64 −0.4%; int4 symmetric per group of 32 +9% to +24% (with or
without a searched clipping scale), asymmetric −0.5%: SmolLM2's GGUF is itself Q4_1 (4-bit asymmetric groups
of 32), which asymmetric int4 represents exactly and symmetric cannot.  int4 packs each block of 32 columns
into 16 bytes: byte j holds column j in its low nibble and column j + 16 in its high one (GGUF's Q4_1 layout,
onto which Q4_0, Q4_1 and Q4_K blocks map exactly: a GGUF model loaded at int4 takes those layer matrices
over from their blocks, bit for bit the file's values (``checkpoints/gguf_blocks.py``); everything else is
requantized from its fp32 values, which is exact only where a group uses its lowest and highest level: for
the 1.5B's Q4_K tensors 78.8% of the groups, ``scripts/probes/int4_takeover_check.py``).  Where a group does not
divide a matrix's input size, groups of 32 are used, and where 32 does not either, the matrix stays bf16
(said once on stderr).

Which tensors take the chosen kind (``quantize_params``): the layer matrices (w_qkv, wo, w_gate_up, w_down)
always; the embedding and the LM head too, except at int4, where they stay int8: the head is a large share
of a small model's bytes (a tied SmolLM2 head is 21% of its weights) and the tensor whose rounding lands on
the logits directly, and an int8 head costs ~1.06 bytes per weight where the rest of the model costs 0.75.  Norms
and biases stay fp32 (a few KB).

Stacked layer tensors keep their leading layer axis L on every field ([L, N, D] data, [L, N, D/G] scales).
A GGUF model is quantized once per type and kept in the converted-weight cache (``checkpoints/quantized_cache.py``).
The format itself (``QWeight``, quantizing and dequantizing a matrix) is ``specjax/kernels/qformat.py``: the
kernels' data type, in the kernel layer; it is re-exported here.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError
from specjax.kernels.qformat import (BLOCK, GROUP, GROUPS, KINDS, QUANTIZED, QWeight, dequantize, tiles_apply,
                                     is_quantized, pack_int4, quantize, unpack_int4)

__all__ = ["BLOCK", "GROUP", "GROUPS", "KINDS", "QUANTIZED", "QWeight", "dequantize", "is_quantized", "pack_int4",
           "tiles_apply", "in_tiles",
           "quantize", "unpack_int4", "MATRICES", "weight_kind", "quantize_matrix", "quantize_params",
           "holds_quantized", "weights_kind", "compute_dtype", "activation_dtype", "embed_rows", "param_bytes",
           "bits_per_weight"]

MATRICES = ("w_qkv", "wo", "w_gate_up", "w_down")
_WARNED: set = set()


def _is_leaf(x) -> bool:
  return isinstance(x, QWeight)


# ----------------------------------------------------------------------------------------------------------
# Whole models


def weight_kind(name: str, kind: str, D: int) -> tuple[str, int | None]:
  """(kind, group) tensor ``name`` (with input size D) takes when a model is quantized to ``kind``: the
  embedding and head int8 under int4; a group that does not divide D replaced by 32, else the matrix kept in
  bf16 (said once on stderr)."""
  if kind in ("fp32", "bf16"):
    return kind, None
  if name in ("embed", "lm_head") and kind == "int4":
    kind = "int8"
  for group in dict.fromkeys((GROUPS[kind], 32)):
    if D % group == 0:
      return kind, group
  if (name, kind) not in _WARNED:
    _WARNED.add((name, kind))
    sys.stderr.write(f"[specjax] {kind}: '{name}' has an input size ({D}) that is not a multiple of 32; "
                     "kept in bf16\n")
  return "bf16", None


def quantize_matrix(name: str, w, kind: str) -> QWeight:
  """The float matrix ``w`` (tensor ``name``) quantized as a model quantized to ``kind`` holds it
  (``weight_kind``: its kind and group)."""
  k, group = weight_kind(name, kind, w.shape[-1])
  return quantize(k, w, group)


def quantize_params(params: dict, kind: str) -> dict:
  """A model's parameters with its matrices quantized to ``kind`` by the policy in the module docstring.
  Norms, biases and any tensor not a matrix stay as they are.  'fp32' returns the parameters unchanged."""
  if kind not in KINDS:
    raise SpecjaxError(f"unknown weight type '{kind}': use one of {', '.join(KINDS)}")
  if kind == "fp32":
    return params

  def one(name, w):
    if isinstance(w, QWeight):
      raise SpecjaxError(f"'{name}' is already quantized ({w.kind}): load the model in fp32 to requantize")
    return quantize_matrix(name, w, kind)

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


def in_tiles(params: dict, tied: bool = False) -> dict:
  """``params`` with every int8/int4 matrix that can be in 16-row tiles (``QWeight.in_tiles``): the layout of the
  integer-dot kernel (``kernels/cpu_qdot_tiles.cc``), made on the host once, at load, when a model runs with
  integer activations.  The same values: every other reader (the reference, a prefill block, an embedding
  lookup) reads it through the layout.  The embedding stays in rows unless it is also the head (``tied``):
  it is only looked up."""
  tile = lambda w: w.in_tiles() if isinstance(w, QWeight) else w   # noqa: E731
  return {k: v if k == "embed" and not tied else jax.tree_util.tree_map(tile, v, is_leaf=_is_leaf)
          for k, v in params.items()}


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


def bits_per_weight(kind: str) -> float:
  """Bits read per weight of a layer matrix of kind ``kind`` (scales and offsets included)."""
  return {"fp32": 32.0, "bf16": 16.0, "int8": 8.0 + 32.0 / GROUPS["int8"],
          "int4": 4.0 + 64.0 / GROUPS["int4"]}[kind]
