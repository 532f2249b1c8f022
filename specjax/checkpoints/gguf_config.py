"""GGUF metadata -> ModelConfig, per architecture: what each of llama.cpp's ``general.architecture`` values
(llama, qwen2, qwen3, gemma2, gemma3) says in its keys, and what llama.cpp itself assumes where the file is
silent (Gemma's global-layer rhythm, local RoPE base and query scale, Gemma 2's soft-cap defaults), so a file
means here what it means to llama.cpp.

Kept apart from ``gguf_loader`` (which reads tensors and places them) because this is the one place that
knows each architecture's keys.  Llama-3 RoPE scaling, which llama.cpp stores only as per-frequency divisors
(``rope_freqs.weight``), is recovered here as ``RopeScaling`` (``rope_scaling_from_freq_factors``).

Per architecture:
  * llama: Llama's layer; Mistral files are llama too, a window on every layer when the file has
    ``llama.attention.sliding_window`` (llama.cpp's own converter writes none, so most Mistral files say
    nothing and run unwindowed, as llama.cpp runs them).
  * qwen2: q/k/v biases (from the tensors).  qwen3: q/k norms (from the tensors), no biases.
  * gemma2: GeGLU, embeddings times sqrt(D), sandwich norms, soft-capped scores and logits
    (``attn_logit_softcapping``, ``final_logit_softcapping``; llama.cpp's 50 and 30 when absent), windowed
    and global layers alternating, the first windowed (``attention.sliding_window``, 4096 when absent).
  * gemma3: gemma2's layer plus q/k norms, no score soft-cap; five windowed layers per global one, the
    windowed ones with RoPE base 10000 unscaled; linear RoPE scaling on the global ones.
  For both Gemmas the query scale is 1/sqrt(head dim), D/H for the 27B models (llama.cpp's rule: the files
  carry no ``query_pre_attn_scalar``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from specjax.checkpoints.tokenizer import Tokenizer
from specjax.errors import CheckpointError
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.rope import rope_inv_freq

SUPPORTED_ARCHS = frozenset({"llama", "qwen2", "qwen3", "gemma2", "gemma3"})
# The ModelConfig family of each architecture (as a Hugging Face directory of the same model reads).
FAMILY_OF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3"}

# Gemma facts that GGUF metadata does not carry (llama.cpp hard-codes the same):
GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}   # layer i attends globally when (i + 1) % n == 0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}   # the size whose query_pre_attn_scalar is D / H, not E
GEMMA_LOCAL_ROPE_THETA = {"gemma3": 10000.0}      # the windowed layers' RoPE base (the global ones': freq_base)
# What llama.cpp takes when a gemma2 file lacks the key (the values of Gemma 2's Hugging Face config).
GEMMA2_DEFAULTS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "attention.sliding_window": 4096}


# ----------------------------------------------------------------------------------------------------------
# Reading keys and RoPE scaling


def _get(meta: Mapping[str, Any], key: str, path: Path, default: Any = None, required: bool = False) -> Any:
  """Metadata ``key`` (a per-layer list only when uniform), else ``default``, or a refusal when ``required``."""
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
  """``x`` to ``digits`` significant digits (float32 metadata read back as the value that was written)."""
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


def _rope_scaling(meta: Mapping[str, Any], arch: str, path: Path, rope_freqs_R: np.ndarray | None,
                  head_dim: int, theta: float) -> RopeScaling | None:
  """The global layers' RoPE scaling: Llama-3's from ``rope_freqs.weight`` (``rope_freqs_R``, dequantized),
  else the metadata's ``rope.scaling.type`` (none or linear)."""
  kind = _get(meta, f"{arch}.rope.scaling.type", path, default="none")
  factor = float(_get(meta, f"{arch}.rope.scaling.factor", path, default=1.0) or 1.0)
  orig = _get(meta, f"{arch}.rope.scaling.original_context_length", path)
  if rope_freqs_R is not None:
    try:
      return rope_scaling_from_freq_factors(rope_freqs_R, head_dim, theta, orig)
    except CheckpointError as e:
      raise CheckpointError(f"{path}: {e}") from None
  if kind in ("none", "", None) or factor == 1.0:
    return None
  if kind == "linear":            # positions divided by the factor (Gemma 3 4B and up: its global layers)
    return RopeScaling(kind="linear", factor=factor)
  raise CheckpointError(f"{path}: RoPE scaling type '{kind}' (factor {factor}) is not supported; specjax "
                        "handles linear scaling and Llama-3 scaling given as a rope_freqs.weight tensor")


# ----------------------------------------------------------------------------------------------------------
# Windows and family fields


def _pattern_windows(pattern: Any, window: int, num_layers: int, key: str, path: Path) -> tuple[int, ...]:
  """``attention.sliding_window_pattern`` as windows: a list (True where windowed) or a period n (the last
  layer of every n global, as llama.cpp reads it)."""
  if isinstance(pattern, list):
    if len(pattern) != num_layers:
      raise CheckpointError(f"{path}: {key} has {len(pattern)} entries for {num_layers} layers")
    return tuple(window if bool(w) else 0 for w in pattern)
  n = int(pattern)
  if n < 1:
    raise CheckpointError(f"{path}: {key}={n} is not a period of layers (expected a list or n >= 1)")
  return tuple(0 if (i + 1) % n == 0 else window for i in range(num_layers))


def layer_windows(meta: Mapping[str, Any], arch: str, num_layers: int, path: Path,
                  max_position: int | None = None) -> tuple[int, ...]:
  """Each layer's attention window (0: global), () when none is windowed.

  llama: ``llama.attention.sliding_window`` on every layer when present.  gemma2/gemma3:
  ``attention.sliding_window`` on all but every ``GEMMA_GLOBAL_EVERY``-th layer, unless the file lists the
  layers (``attention.sliding_window_pattern``).  A window as long as the context (``max_position``) is no
  window, but where the windowed layers have a RoPE base of their own (gemma3)."""
  key = f"{arch}.attention.sliding_window"
  if arch == "llama":
    window = int(_get(meta, key, path, default=0) or 0)
    windows = (window,) * num_layers
  elif arch in GEMMA_GLOBAL_EVERY:
    window = int(_get(meta, key, path, default=GEMMA2_DEFAULTS["attention.sliding_window"],
                      required=arch == "gemma3"))
    pattern = meta.get(f"{key}_pattern", GEMMA_GLOBAL_EVERY[arch])
    windows = _pattern_windows(pattern, window, num_layers, f"{key}_pattern", path)
  else:
    return ()
  long = max_position is not None and window >= max_position and arch not in GEMMA_LOCAL_ROPE_THETA
  return () if long or not any(windows) else windows


def family_fields(meta: Mapping[str, Any], arch: str, path: Path, tensors: Mapping[str, Any], num_layers: int,
                  d_model: int, num_heads: int, head_dim: int, max_position: int) -> dict[str, Any]:
  """The ModelConfig fields a family sets (``models.config.FAMILY_FIELDS``): q/k norms and sandwich norms from
  the tensors present, windows from the metadata, and Gemma's activation, scales and soft-caps."""
  fields: dict[str, Any] = {"family": FAMILY_OF_ARCH[arch], "qk_norm": "blk.0.attn_q_norm.weight" in tensors,
                            "sandwich_norms": "blk.0.post_attention_norm.weight" in tensors,
                            "layer_windows": layer_windows(meta, arch, num_layers, path, max_position)}
  if arch not in GEMMA_GLOBAL_EVERY:
    return fields
  scalar = d_model // num_heads if num_layers == GEMMA_27B_LAYERS[arch] else head_dim
  defaults = GEMMA2_DEFAULTS if arch == "gemma2" else {}
  caps = {k: _get(meta, f"{arch}.{key}", path, default=defaults.get(key)) for k, key in
          (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping"))}
  fields.update(activation="gelu_tanh", embed_scale=math.sqrt(d_model), query_scale=scalar ** -0.5,
                local_rope_theta=GEMMA_LOCAL_ROPE_THETA.get(arch) if fields["layer_windows"] else None,
                **{k: None if v is None else float(v) for k, v in caps.items()})
  return fields


# ----------------------------------------------------------------------------------------------------------
# The config


def config_from_metadata(meta: Mapping[str, Any], tensors: Mapping[str, Any], path: Path,
                         tokenizer: Tokenizer | None = None,
                         rope_freqs_R: np.ndarray | None = None) -> ModelConfig:
  """A ModelConfig from GGUF metadata, the tensor table (name -> reader tensor: only names and shapes are
  read) and, when the file has one, the dequantized ``rope_freqs.weight``."""
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
  max_position = int(_get(meta, f"{arch}.context_length", path, default=2048))
  bos = meta.get("tokenizer.ggml.bos_token_id")
  eos = (tokenizer.eos_token_ids if tokenizer is not None else
         tuple(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id",) if k in meta))
  try:
    return ModelConfig(
        name=path.stem, vocab_size=vocab_size, num_layers=num_layers, d_model=d_model,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        ffn_dim=int(_get(meta, f"{arch}.feed_forward_length", path, required=True)),
        rope_theta=theta, rope_scaling=_rope_scaling(meta, arch, path, rope_freqs_R, head_dim, theta),
        norm_eps=float(_get(meta, f"{arch}.attention.layer_norm_rms_epsilon", path, default=1e-5)),
        tie_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
        max_position=max_position, bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(eos),
        **family_fields(meta, arch, path, tensors, num_layers, d_model, num_heads, head_dim, max_position))
  except ValueError as e:
    raise CheckpointError(f"{path}: inconsistent model metadata ({e})") from e
