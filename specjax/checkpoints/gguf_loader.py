"""Load a GGUF file (llama.cpp's format) into a ModelConfig, specjax parameters and a Tokenizer.

Tensors are dequantized to float32 with ``gguf.dequantize`` (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the
K-quants, ... whatever the installed ``gguf`` package handles) and then assembled with
``specjax.models.decoder.params_from_hf_layout``.  After dequantization a GGUF matrix is a numpy array [out, in],
the Hugging Face orientation.

llama.cpp's converter reorders the rows of the q and k projections of ``llama`` models, per head, from the
rotate-half RoPE layout to the interleaved one; ``unpermute_qk_llamacpp`` restores the Hugging Face layout
that ``specjax.models.decoder`` uses.  Other architectures (qwen2, gemma3) are stored unpermuted.

Gemma 3 (``gemma3``): RMSNorm weights are stored by llama.cpp's converter as ``1 + w``, the multiplier itself,
which is what specjax keeps (Hugging Face's Gemma3RMSNorm multiplies by ``1 + w`` at run time), so they are
read as they are; its q and k rows are not permuted (both checked against transformers' load of the file:
tests/test_gemma3_gguf.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.checkpoints.tokenizer import Tokenizer
from specjax.models.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError
from specjax.models.decoder import Params
from specjax.models.rope import rope_inv_freq

GGUF_MAGIC = b"GGUF"

# Architectures whose q/k rows llama.cpp permutes when converting.
PERMUTED_ARCHS = frozenset({"llama"})
SUPPORTED_ARCHS = frozenset({"llama", "qwen2", "gemma3"})

# Gemma 3 facts that its GGUF metadata does not carry (the Hugging Face config and llama.cpp agree):
GEMMA3_GLOBAL_EVERY = 6           # layer i attends globally when (i + 1) % 6 == 0, else to a sliding window
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # the windowed layers' RoPE base (the global layers': rope.freq_base)
GEMMA3_27B_LAYERS = 62            # the one size whose query_pre_attn_scalar is D / H, not the head dim



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
# Config


def _get(meta: Mapping[str, Any], key: str, path: Path, default: Any = None, required: bool = False) -> Any:
  if key in meta:
    value = meta[key]
    if isinstance(value, list):   # per-layer arrays (some models): only uniform values are supported
      if len(set(value)) != 1:
        raise CheckpointError(f"{path}: metadata {key} varies per layer ({value[:4]}...), "
                              "which specjax does not support")
      value = value[0]
    return value
  if required:
    raise CheckpointError(f"{path}: GGUF metadata is missing required key '{key}'")
  return default


def _round_sig(x: float, digits: int = 7) -> float:
  return float(f"{float(x):.{digits}g}")


def _llama3_band_edges(f_R: np.ndarray, x_R: np.ndarray, factor: float) -> tuple[float, float] | None:
  """Band edges (x_low, x_high) in 1/wavelength reproducing the factors ``f`` under the Llama-3 rule.

  Frequencies with x < x_low are divided by ``factor``, those with x > x_high are kept, and between them
  the inverse divisor blends linearly in x: s = (x - x_low) / (x_high - x_low).
  """
  middle = (f_R > 1.0 + 1e-6) & (f_R < factor * (1 - 1e-6))
  ones, full = f_R <= 1.0 + 1e-6, f_R >= factor * (1 - 1e-6)
  x_one = float(x_R[ones].min()) if ones.any() else 2.0 * float(x_R.max())   # smallest unscaled x
  x_full = float(x_R[full].max()) if full.any() else 0.0                     # largest fully scaled x
  smooth = (1.0 / f_R[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
  if middle.sum() >= 2:          # a line through the blend: slope 1/(x_high - x_low)
    slope, intercept = np.polyfit(x_R[middle], smooth, 1)
    if slope <= 0:
      return None
    return -intercept / slope, -intercept / slope + 1.0 / slope
  if middle.sum() == 1:          # one blended frequency: any narrow band around it that gives its s
    x_m, s_m = float(x_R[middle][0]), float(smooth[0])
    if not 0.0 < s_m < 1.0:
      return None
    delta = 0.5 * min(x_m - x_full, (x_one - x_m) * s_m / (1.0 - s_m))
    return x_m - delta, x_m + delta * (1.0 - s_m) / s_m
  gap = x_one - x_full           # no blended frequency: any band between the two groups
  return x_full + gap / 3.0, x_full + 2.0 * gap / 3.0


def rope_scaling_from_freq_factors(factors_R: np.ndarray, head_dim: int, rope_theta: float,
                                   original_context: int | None = None) -> RopeScaling | None:
  """Recover Llama-3 RoPE scaling from llama.cpp's precomputed ``rope_freqs.weight``.

  llama.cpp stores one divisor per frequency: 1 for high frequencies, ``factor`` for low ones, and a blend
  between whose inverse is linear in 1/wavelength.  The band edges fix low/high_freq_factor only up to a
  common scale with the original context length (which the frequencies do not depend on), so
  ``original_context`` (GGUF ``rope.scaling.original_context_length``, default 8192) picks that scale.
  Every candidate is checked by recomputing the frequencies.  Returns None when all factors are 1; raises
  CheckpointError when the factors do not follow the Llama-3 rule.
  """
  f = np.asarray(factors_R, dtype=np.float64)
  if f.shape != (head_dim // 2,):
    raise CheckpointError(f"rope_freqs.weight has shape {f.shape}, expected {(head_dim // 2,)}")
  if np.allclose(f, 1.0):
    return None
  factor = float(f.max())
  orig = int(original_context or 8192)
  inv = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  target = (inv / f).astype(np.float32)
  candidates = [RopeScaling(factor=_round_sig(factor), original_max_position_embeddings=orig)]
  edges = _llama3_band_edges(f, inv / (2 * np.pi), factor) if factor > 1.0 else None
  if edges is not None:
    low, high = orig * edges[0], orig * edges[1]
    for rnd in (_round_sig, float):   # prefer 1.0 over 1.0000000130 when both reproduce the factors
      candidates.append(RopeScaling(factor=rnd(factor), low_freq_factor=rnd(low), high_freq_factor=rnd(high),
                                    original_max_position_embeddings=orig))
  for scaling in candidates:
    probe = ModelConfig(name="probe", vocab_size=1, num_layers=1, d_model=head_dim, num_heads=1,
                        num_kv_heads=1, head_dim=head_dim, ffn_dim=1, rope_theta=rope_theta,
                        rope_scaling=scaling)
    if np.allclose(rope_inv_freq(probe), target, rtol=1e-4, atol=0):
      return scaling
  raise CheckpointError("rope_freqs.weight does not follow Llama-3 RoPE scaling; specjax cannot represent "
                        "these per-frequency factors (ModelConfig would need explicit RoPE frequencies)")


def _rope_scaling(meta: Mapping[str, Any], arch: str, path: Path, tensors: Mapping[str, Any],
                  head_dim: int, theta: float) -> RopeScaling | None:
  kind = _get(meta, f"{arch}.rope.scaling.type", path, default="none")
  factor = float(_get(meta, f"{arch}.rope.scaling.factor", path, default=1.0) or 1.0)
  orig = _get(meta, f"{arch}.rope.scaling.original_context_length", path)
  if "rope_freqs.weight" in tensors:
    factors = _dequantize(path, tensors["rope_freqs.weight"])
    try:
      return rope_scaling_from_freq_factors(factors, head_dim, theta, orig)
    except CheckpointError as e:
      raise CheckpointError(f"{path}: {e}") from None
  if kind in ("none", "", None) or factor == 1.0:
    return None
  if kind == "linear":            # positions divided by the factor (Gemma 3 4B and up: its global layers)
    return RopeScaling(kind="linear", factor=factor)
  raise CheckpointError(f"{path}: RoPE scaling type '{kind}' (factor {factor}) is not supported; specjax "
                        "handles linear scaling and Llama-3 scaling given as a rope_freqs.weight tensor")


def _gemma3_windows(meta: Mapping[str, Any], num_layers: int, path: Path) -> tuple[int, ...]:
  """Gemma 3's per-layer attention windows: 0 for a global layer, ``attention.sliding_window`` for the
  others; every 6th layer is global (``GEMMA3_GLOBAL_EVERY``) unless the file lists the pattern per layer
  (``attention.sliding_window_pattern``, True where windowed)."""
  window = int(_get(meta, "gemma3.attention.sliding_window", path, required=True))
  pattern = meta.get("gemma3.attention.sliding_window_pattern")
  if isinstance(pattern, list):
    if len(pattern) != num_layers:
      raise CheckpointError(f"{path}: gemma3.attention.sliding_window_pattern has {len(pattern)} entries for "
                            f"{num_layers} layers")
    return tuple(window if bool(w) else 0 for w in pattern)
  return tuple(0 if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window for i in range(num_layers))


def _family_fields(meta: Mapping[str, Any], arch: str, path: Path, tensors: Mapping[str, Any],
                   num_layers: int, d_model: int, num_heads: int, head_dim: int) -> dict[str, Any]:
  """The ModelConfig fields a family changes (none for llama and qwen2)."""
  fields: dict[str, Any] = {"family": arch if arch == "gemma3" else "llama",
                            "qk_norm": "blk.0.attn_q_norm.weight" in tensors,
                            "sandwich_norms": "blk.0.post_attention_norm.weight" in tensors}
  if arch != "gemma3":
    return fields
  # llama.cpp's rule: the query scale is 1/sqrt(query_pre_attn_scalar), the head dim but for the 27B model.
  scalar = d_model // num_heads if num_layers == GEMMA3_27B_LAYERS else head_dim
  softcaps = {k: _get(meta, f"gemma3.{key}", path) for k, key in
              (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping"))}
  fields.update(activation="gelu_tanh", embed_scale=math.sqrt(d_model), query_scale=scalar ** -0.5,
                layer_windows=_gemma3_windows(meta, num_layers, path),
                local_rope_theta=GEMMA3_LOCAL_ROPE_THETA,
                **{k: None if v is None else float(v) for k, v in softcaps.items()})
  return fields


def config_from_metadata(meta: Mapping[str, Any], tensors: Mapping[str, Any], path: Path,
                         tokenizer: Tokenizer | None = None) -> ModelConfig:
  """A ModelConfig from GGUF metadata and the tensor table (name -> reader tensor)."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise CheckpointError(f"{path}: architecture '{arch}' is not supported (supported: "
                          f"{', '.join(sorted(SUPPORTED_ARCHS))})")
  num_layers = int(_get(meta, f"{arch}.block_count", path, required=True))
  d_model = int(_get(meta, f"{arch}.embedding_length", path, required=True))
  num_heads = int(_get(meta, f"{arch}.attention.head_count", path, required=True))
  num_kv_heads = int(_get(meta, f"{arch}.attention.head_count_kv", path, default=num_heads))
  head_dim = int(_get(meta, f"{arch}.attention.key_length", path, default=d_model // num_heads))
  rope_dim = int(_get(meta, f"{arch}.rope.dimension_count", path, default=head_dim))
  if rope_dim != head_dim:
    raise CheckpointError(f"{path}: partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) "
                          "are not supported")
  theta = float(_get(meta, f"{arch}.rope.freq_base", path, default=10000.0))
  if "token_embd.weight" not in tensors:
    raise CheckpointError(f"{path}: GGUF file has no 'token_embd.weight' tensor")
  vocab_size = int(tensors["token_embd.weight"].shape[-1])   # GGUF dims are [in, out]: [D, V]
  bos = meta.get("tokenizer.ggml.bos_token_id")
  eos = (tokenizer.eos_token_ids if tokenizer is not None else
         tuple(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id",) if k in meta))
  try:
    return ModelConfig(
        name=path.stem, vocab_size=vocab_size, num_layers=num_layers, d_model=d_model,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        ffn_dim=int(_get(meta, f"{arch}.feed_forward_length", path, required=True)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(meta, arch, path, tensors, head_dim, theta),
        norm_eps=float(_get(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, default=1e-5)),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        max_position=int(_get(meta, f"{arch}.context_length", path, default=2048)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        **_family_fields(meta, arch, path, tensors, num_layers, d_model, num_heads, head_dim))
  except ValueError as e:
    raise CheckpointError(f"{path}: inconsistent model metadata ({e})") from e


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
  cfg = config_from_metadata(meta, tensors, path, tokenizer)
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
