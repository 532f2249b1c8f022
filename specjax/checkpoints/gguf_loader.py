"""Load a GGUF file (llama.cpp's format) into a ModelConfig, specjax parameters and a Tokenizer.

The metadata becomes a ModelConfig in ``gguf_config`` (per architecture: llama, qwen2, qwen3, gemma2, gemma3)
and the vocabulary a Tokenizer in ``gguf_vocab``; this module reads the tensors and places them.  Tensors are
dequantized to float32 with ``gguf.dequantize`` (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, ...
whatever the installed ``gguf`` package handles).  After dequantization a GGUF matrix is a numpy array
[out, in], the Hugging Face orientation.

llama.cpp's converter reorders the rows of the q and k projections of ``llama`` models, per head, from the
rotate-half RoPE layout to the interleaved one; ``unpermute_qk_llamacpp`` restores the Hugging Face layout
that ``specjax.models.decoder`` uses.  Other architectures (qwen2, qwen3, gemma2, gemma3) are stored
unpermuted.

Gemma (``gemma2``, ``gemma3``): llama.cpp's converter stores every RMSNorm weight as ``1 + w``, the multiplier
itself, which is what specjax keeps (Hugging Face's Gemma RMSNorm multiplies by ``1 + w`` at run time), so
they are read as they are (checked against transformers: tests/checkpoints/test_gemma3_gguf.py,
tests/checkpoints/test_gguf_families.py).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

# SUPPORTED_ARCHS and rope_scaling_from_freq_factors are re-exported: they lived here before gguf_config.
from specjax.checkpoints.gguf_config import (SUPPORTED_ARCHS, config_from_metadata,  # noqa: F401
                                             rope_scaling_from_freq_factors)
from specjax.checkpoints.tokenizer import Tokenizer
from specjax.errors import CheckpointError
from specjax.models.config import ModelConfig
from specjax.models.decoder import Params

GGUF_MAGIC = b"GGUF"

# Architectures whose q/k rows llama.cpp permutes when converting (its LlamaModel; Qwen and Gemma keep
# Hugging Face's rows).
PERMUTED_ARCHS = frozenset({"llama"})


# ----------------------------------------------------------------------------------------------------------
# llama.cpp's q/k row permutation


def permute_qk_llamacpp(w_NxI: np.ndarray, n_heads: int) -> np.ndarray:
  """Hugging Face (rotate-half) rows -> llama.cpp (interleaved) rows, as llama.cpp's converter does.

  ``w`` is a q or k projection [n_heads * E, in] (or its bias [n_heads * E]); ``n_heads`` is the number of
  query heads for q and of kv heads for k.  Within each head, rows (r, E/2 + r) become rows (2r, 2r + 1).
  """
  w = np.asarray(w_NxI)
  half = w.shape[0] // n_heads // 2
  return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk_llamacpp(w_NxI: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of ``permute_qk_llamacpp``: llama.cpp interleaved rows -> Hugging Face rotate-half rows."""
  w = np.asarray(w_NxI)
  half = w.shape[0] // n_heads // 2
  return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------------------------------
# Reading the file


def _describe(e: Exception) -> str:
  """An exception as one short line (library messages can span lines)."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:200]}"


def _open_reader(path: Path):
  """A ``gguf.GGUFReader`` for ``path``; any failure becomes a one-line CheckpointError."""
  import gguf  # imported lazily: the library is only needed for GGUF files

  if not path.is_file():
    raise CheckpointError(f"{path}: no such file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError/IndexError/KeyError/... on damaged files
    raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({_describe(e)})") from e


def _field_value(field) -> Any:
  """A reader field as a plain Python value (str, int, float, bool or list)."""
  import gguf

  value = field.contents()
  if isinstance(value, np.generic):
    value = value.item()
  if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32:
    value = float(str(np.float32(value)))   # 1e-05, not 9.999999747378752e-06
  return value


def read_metadata(reader) -> dict[str, Any]:
  """All key/value metadata of a GGUF reader as plain Python values."""
  return {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _dequantize(path: Path, tensor, rows: slice | None = None) -> np.ndarray:
  """A reader tensor (or a block of its rows) as float32 numpy in numpy orientation ([out, in] for
  matrices)."""
  import gguf

  shape = tuple(int(d) for d in reversed(list(tensor.shape)))
  data = tensor.data
  if rows is not None:    # the reader's data is [rows, ...] (quantized: [rows, bytes per row])
    data = data.reshape(shape[0], -1)[rows]
    shape = (data.shape[0], *shape[1:])
  try:
    if data.dtype.kind == "f":
      out = np.asarray(data, dtype=np.float32)
    else:
      out = gguf.dequantize(data, tensor.tensor_type)
    return np.array(out, dtype=np.float32).reshape(shape)
  except NotImplementedError as e:
    raise CheckpointError(f"{path}: tensor '{tensor.name}' uses quantization {tensor.tensor_type.name}, "
                          f"which the installed gguf package cannot dequantize ({e})") from e
  except Exception as e:
    raise CheckpointError(f"{path}: tensor '{tensor.name}' is damaged ({_describe(e)})") from e


# ----------------------------------------------------------------------------------------------------------
# Parameters: where each GGUF tensor goes in specjax's (stacked) parameter leaves
#
# Every leaf is [L, rows, cols] (per-layer matrices, [out, in]), [L, rows] (norms, biases) or [rows, cols]
# (embedding, head) / [rows] (final norm).  A fused leaf is its parts one after the other along rows
# (w_qkv = q; k; v, w_gate_up = gate; up), so every GGUF tensor fills one contiguous range of its leaf's bytes:
# a conversion can write tensor by tensor, in bounded memory, straight into the converted file.


@dataclasses.dataclass(frozen=True)
class Placement:
  """GGUF tensor ``src`` fills rows [row0, row0 + rows) of layer ``layer`` (None: an unstacked leaf)."""
  src: str
  leaf: str
  layer: int | None
  row0: int
  rows: int


def leaf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The canonical parameter leaves of ``cfg`` by dotted name ("embed", "layers.w_qkv", ...) and shape
  (the layout of ``specjax.models.decoder.params_from_hf_layout``)."""
  D, H, K, E, F, V, L = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim,
                         cfg.vocab_size, cfg.num_layers)
  shapes = {"embed": (V, D), "final_norm": (D,), "layers.attn_norm": (L, D),
            "layers.w_qkv": (L, (H + 2 * K) * E, D), "layers.wo": (L, D, H * E), "layers.mlp_norm": (L, D),
            "layers.w_gate_up": (L, 2 * F, D), "layers.w_down": (L, D, F)}
  if cfg.qkv_bias:
    shapes["layers.b_qkv"] = (L, (H + 2 * K) * E)
  if cfg.qk_norm:
    shapes.update({"layers.q_norm": (L, E), "layers.k_norm": (L, E)})
  if cfg.sandwich_norms:
    shapes.update({"layers.post_attn_norm": (L, D), "layers.post_mlp_norm": (L, D)})
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (V, D)
  return shapes


def placements(cfg: ModelConfig) -> list[Placement]:
  """Every GGUF tensor of a ``cfg`` model and where it goes; together they cover every leaf exactly once."""
  H, K, E, F, V, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size, cfg.d_model
  per_layer = [("attn_q.weight", "w_qkv", 0, H * E), ("attn_k.weight", "w_qkv", H * E, K * E),
               ("attn_v.weight", "w_qkv", (H + K) * E, K * E), ("attn_output.weight", "wo", 0, D),
               ("ffn_gate.weight", "w_gate_up", 0, F), ("ffn_up.weight", "w_gate_up", F, F),
               ("ffn_down.weight", "w_down", 0, D), ("attn_norm.weight", "attn_norm", 0, D),
               ("ffn_norm.weight", "mlp_norm", 0, D)]
  if cfg.qkv_bias:
    per_layer += [("attn_q.bias", "b_qkv", 0, H * E), ("attn_k.bias", "b_qkv", H * E, K * E),
                  ("attn_v.bias", "b_qkv", (H + K) * E, K * E)]
  if cfg.qk_norm:
    per_layer += [("attn_q_norm.weight", "q_norm", 0, E), ("attn_k_norm.weight", "k_norm", 0, E)]
  if cfg.sandwich_norms:   # with them, ffn_norm is the norm before the MLP (Gemma's pre_feedforward_layernorm)
    per_layer += [("post_attention_norm.weight", "post_attn_norm", 0, D),
                  ("post_ffw_norm.weight", "post_mlp_norm", 0, D)]
  out = [Placement("token_embd.weight", "embed", None, 0, V)]
  for i in range(cfg.num_layers):
    out += [Placement(f"blk.{i}.{src}", f"layers.{leaf}", i, r0, n) for src, leaf, r0, n in per_layer]
  out.append(Placement("output_norm.weight", "final_norm", None, 0, D))
  if not cfg.tie_embeddings:
    out.append(Placement("output.weight", "lm_head", None, 0, V))
  return out


def _qk_heads(cfg: ModelConfig, src: str) -> int | None:
  """Heads whose rows llama.cpp permuted in tensor ``src`` (None: not permuted)."""
  if src.endswith(("attn_q.weight", "attn_q.bias")):
    return cfg.num_heads
  if src.endswith(("attn_k.weight", "attn_k.bias")):
    return cfg.num_kv_heads
  return None


@dataclasses.dataclass
class GGUFSource:
  """An opened GGUF checkpoint: its config, tokenizer and tensors, read piece by piece (``pieces``)."""
  path: Path
  cfg: ModelConfig
  tokenizer: Tokenizer
  arch: str
  tensors: dict

  def leaf_shapes(self) -> dict[str, tuple[int, ...]]:
    return leaf_shapes(self.cfg)

  def pieces(self, dtype, max_bytes: int = 1 << 28):
    """Yield (leaf name, element offset in the leaf, flat array in ``dtype``) for every tensor, in file
    order; tensors larger than ``max_bytes`` as float32 (the embedding, the head) come in row blocks, so
    no more than about ``max_bytes`` of dequantized data exists at once."""
    shapes = self.leaf_shapes()
    np_dtype = np.dtype(dtype)
    for pl in placements(self.cfg):
      if pl.src not in self.tensors:
        raise CheckpointError(f"{self.path}: GGUF file is missing tensor '{pl.src}'")
      tensor = self.tensors[pl.src]
      shape = shapes[pl.leaf]
      inner = shape[2:] if pl.layer is not None else shape[1:]     # the columns of one row ((): a vector)
      got = tuple(int(d) for d in reversed(list(tensor.shape)))
      if got != (pl.rows, *inner):
        raise CheckpointError(f"{self.path}: tensor '{pl.src}' has shape {got}, expected "
                              f"{(pl.rows, *inner)} for this model's config")
      row_elems = int(np.prod(inner, dtype=np.int64))
      base = (pl.layer * shape[1] if pl.layer is not None else 0) + pl.row0
      heads = _qk_heads(self.cfg, pl.src) if self.arch in PERMUTED_ARCHS else None
      block = pl.rows if heads is not None else max(1, max_bytes // max(1, 4 * row_elems))
      for r in range(0, pl.rows, block):
        rows = _dequantize(self.path, tensor, slice(r, min(pl.rows, r + block)))
        if heads is not None:
          rows = unpermute_qk_llamacpp(rows, heads)
        yield pl.leaf, (base + r) * row_elems, rows.astype(np_dtype, copy=False).reshape(-1)


def open_gguf(path: str | os.PathLike) -> GGUFSource:
  """Read a GGUF file's metadata and tensor table (the tensor data stays in the file's memory map).

  Raises:
    CheckpointError: the file is missing, not GGUF, damaged, or describes an unsupported model.
  """
  path = Path(path)
  reader = _open_reader(path)
  try:
    meta = read_metadata(reader)
  except Exception as e:
    raise CheckpointError(f"{path}: corrupt GGUF metadata ({_describe(e)})") from e
  tensors = {t.name: t for t in reader.tensors}
  try:
    tokenizer = Tokenizer.from_gguf_fields(meta)
  except CheckpointError as e:
    raise CheckpointError(f"{path}: {e}") from None
  rope_freqs = tensors.get("rope_freqs.weight")
  cfg = config_from_metadata(meta, tensors, path, tokenizer,
                             None if rope_freqs is None else _dequantize(path, rope_freqs))
  return GGUFSource(path=path, cfg=cfg, tokenizer=tokenizer, arch=meta["general.architecture"], tensors=tensors)


def load_gguf(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params, Tokenizer]:
  """Load a GGUF checkpoint into memory (``converted.convert_streaming`` writes the same leaves to a file).

  Returns:
    (config, params in ``dtype``, tokenizer).  ``config.eos_token_ids`` are the tokenizer's stop ids (the
    declared EOS plus the chat template's end-of-turn token).
  Raises:
    CheckpointError: the file is missing, not GGUF, damaged, or describes an unsupported model.
  """
  src = open_gguf(path)
  leaves = {name: np.empty(shape, np.dtype(dtype)) for name, shape in src.leaf_shapes().items()}
  for name, offset, flat in src.pieces(dtype):
    leaves[name].reshape(-1)[offset:offset + flat.size] = flat
  params: dict = {}
  for name, value in leaves.items():
    node = params
    *parents, leaf = name.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = jnp.asarray(value)
  return src.cfg, params, src.tokenizer
