"""DFlash drafters in their published layout: read the config, check it against the target in one line before
any weight is read, then load the tensors into ``speculative/dflash.py``'s parameter names.

The layout (z-lab's DFlash releases; SpecForge's ``DFlashDraftModel.save_pretrained``): a Qwen3 ``config.json``
for the draft layers (``hidden_size``, ``num_hidden_layers`` = L' draft layers, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``, the rope, ``vocab_size`` = the
target's) with ``block_size``, ``num_target_layers`` and ``dflash_config`` {``target_layer_ids``: each the
*output* of that target layer (default: spread over 1..L-3 as SpecForge does), ``mask_token_id``}, and
``model.safetensors`` with ``fc.weight`` [D, n·D], ``hidden_norm.weight``, ``norm.weight`` and per draft layer
``layers.{i}.{input_layernorm, post_attention_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``.  The embedding and the
head are the target's (the draft embeds with the target's embedding module, so with its scale).  A pickled
``pytorch_model.bin`` is refused with the one-line conversion.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from specjax.checkpoints.pickled import conversion_advice
from specjax.errors import SpecjaxError
from specjax.models.config import ModelConfig

WEIGHTS, PICKLE = "model.safetensors", "pytorch_model.bin"


@dataclasses.dataclass(frozen=True)
class DFlashDescription:
  """What config.json says, checked against the target (no weight read)."""
  layer: ModelConfig                  # the draft layers (the target's vocabulary, head and embedding scale)
  taps: tuple[int, ...]               # specjax taps: the output of these target layers
  block_size: int
  mask_token_id: int


def read_config(path) -> dict | None:
  try:
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError):
    return None
  return config if isinstance(config, dict) else None


def is_dflash_dir(path) -> bool:
  """A directory whose config.json describes a DFlash drafter (``dflash_config``, or an architecture so named)."""
  config = read_config(path)
  return bool(config) and ("dflash_config" in config
                           or any("DFlash" in str(a) for a in config.get("architectures") or []))


def check_depth(path, depth: int) -> None:
  """Refuse a chain or tree deeper than the directory's block drafts (config.json alone: before any model loads);
  an unreadable block size is left to ``describe``."""
  try:
    config = read_config(path) or {}
    bs = int(config.get("block_size", (config.get("dflash_config") or {}).get("block_size")))
  except (TypeError, ValueError):
    return
  if depth > bs - 1:
    raise SpecjaxError(f"DFlash drafter {path} drafts blocks of {bs} (depth {bs - 1}); --k/--tree asks for depth "
                       f"{depth}: use --k {bs - 1} or a tree at most {bs - 1} deep")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
  """SpecForge's default when the config names none: the middle layer for one draft layer, else one per draft
  layer spread evenly over target layers 1..L-3."""
  if num_draft_layers == 1:
    return [num_target_layers // 2]
  lo, hi = 1, num_target_layers - 3
  return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _int(path: Path, config: dict, key: str, value) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise SpecjaxError(f"DFlash drafter {path}: config.json {key}={value!r} is not an integer") from None


def _layer(path: Path, config: dict, target_cfg: ModelConfig) -> ModelConfig:
  """The draft layers' config: a Qwen3 layer (DFlash's is, whatever model_type says) of their own shape."""
  from specjax.models.families.hf_config import config_from_hf
  types = config.get("layer_types") or []
  if "sliding_attention" in types:
    raise SpecjaxError(f"DFlash drafter {path}: sliding_attention draft layers are not supported (full_attention "
                       "only)")
  c = {k: v for k, v in config.items() if k not in ("architectures", "layer_types", "sliding_window")}
  c.update(model_type="qwen3", use_sliding_window=False, vocab_size=target_cfg.vocab_size)
  try:
    cfg = config_from_hf(c, f"{target_cfg.name}-dflash", str(path))
  except SpecjaxError:
    raise
  except Exception as e:  # noqa: BLE001  (the family reader's own errors name the key)
    raise SpecjaxError(f"DFlash drafter {path}: its layer config is not readable ({e})") from e
  return cfg.replace(tie_embeddings=target_cfg.tie_embeddings, embed_scale=target_cfg.embed_scale,
                     max_position=target_cfg.max_position, bos_token_id=None, eos_token_ids=())


def describe(path, target_cfg: ModelConfig, target_name: str = "") -> DFlashDescription:
  """Check a DFlash directory's config.json against the target, in one line naming both sides."""
  path = Path(path)
  config = read_config(path)
  if not config or not is_dflash_dir(path):
    raise SpecjaxError(f"{path}: not a DFlash drafter (config.json has no dflash_config)")
  name = target_name or target_cfg.name
  D, V, L = target_cfg.d_model, target_cfg.vocab_size, target_cfg.num_layers
  dflash = config.get("dflash_config") or {}
  for key, want in (("hidden_size", D), ("vocab_size", V), ("num_target_layers", L)):
    got = config.get(key)
    if got is not None and _int(path, config, key, got) != want:
      raise SpecjaxError(f"DFlash drafter {path}: {key}={got}, the target {name} has {want}: a drafter for another "
                         "target")
  bs = config.get("block_size", dflash.get("block_size"))
  if bs is None or _int(path, config, "block_size", bs) < 2:
    raise SpecjaxError(f"DFlash drafter {path}: block_size={bs} (a block of the root and at least one mask token: "
                       ">= 2)")
  mask = dflash.get("mask_token_id")
  if mask is None or not 0 <= _int(path, config, "mask_token_id", mask) < V:
    raise SpecjaxError(f"DFlash drafter {path}: mask_token_id={mask}, the target {name} has tokens 0..{V - 1}")
  layer = _layer(path, config, target_cfg)
  ids = dflash.get("target_layer_ids")
  ids = default_layer_ids(L, layer.num_layers) if ids is None else [_int(path, config, "target_layer_ids", i)
                                                                    for i in ids]
  if not ids or any(not 0 <= i < L - 1 for i in ids):
    # The last layer is left out: transformers' last hidden state is after the final norm, specjax's taps before.
    raise SpecjaxError(f"DFlash drafter {path}: target_layer_ids {ids} do not fit the target {name} ({L} layers; "
                       f"ids 0..{L - 2}): a drafter for another target")
  return DFlashDescription(layer=layer, taps=tuple(ids), block_size=int(bs), mask_token_id=int(mask))


def _expected(desc: DFlashDescription, D: int) -> dict[str, tuple[int, ...]]:
  """Tensor name -> shape that the description needs."""
  c = desc.layer
  H, K, E, F = c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim
  need = {"fc.weight": (D, len(desc.taps) * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
  for i in range(c.num_layers):
    p = f"layers.{i}."
    need.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                 p + "self_attn.q_proj.weight": (H * E, D), p + "self_attn.k_proj.weight": (K * E, D),
                 p + "self_attn.v_proj.weight": (K * E, D), p + "self_attn.o_proj.weight": (D, H * E),
                 p + "self_attn.q_norm.weight": (E,), p + "self_attn.k_norm.weight": (E,),
                 p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                 p + "mlp.down_proj.weight": (D, F)})
    if c.qkv_bias:
      need.update({p + "self_attn.q_proj.bias": (H * E,), p + "self_attn.k_proj.bias": (K * E,),
                   p + "self_attn.v_proj.bias": (K * E,)})
  return need


def _checked_file(path: Path, need: dict) -> Path:
  """The weights file, its header checked against ``need`` (names and shapes) before any tensor is read."""
  from safetensors import SafetensorError, safe_open
  f = path / WEIGHTS
  if not f.is_file():
    if (path / PICKLE).is_file():
      raise SpecjaxError(conversion_advice(path / PICKLE, f))
    raise SpecjaxError(f"{path}: no {WEIGHTS} (a DFlash drafter directory holds config.json and {WEIGHTS})")
  try:
    with safe_open(str(f), framework="numpy") as h:
      shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
  except (SafetensorError, OSError, ValueError) as e:
    raise SpecjaxError(f"{f} is damaged ({' '.join(str(e).split())})") from e
  for name, shape in need.items():
    if name not in shapes:
      raise SpecjaxError(f"{f} lacks '{name}': not a DFlash drafter of the layout its config.json describes")
    if shapes[name] != shape:
      raise SpecjaxError(f"{f}: '{name}' has shape {shapes[name]}, config.json and the target say {shape}")
  return f


def _read(f: Path) -> dict[str, np.ndarray]:
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  try:
    return load_file(str(f))
  except (SafetensorError, OSError, ValueError) as e:
    raise SpecjaxError(f"{f} is damaged ({' '.join(str(e).split())})") from e


def _params(t: dict, desc: DFlashDescription) -> dict:
  """The tensors in ``dflash.py``'s names (float32 numpy; layers stacked on a leading axis)."""
  def layer(i: int) -> dict:
    g = lambda n: np.asarray(t[f"layers.{i}.{n}"], np.float32)            # noqa: E731
    out = {"attn_norm": g("input_layernorm.weight"), "mlp_norm": g("post_attention_layernorm.weight"),
           "w_qkv": np.concatenate([g(f"self_attn.{x}_proj.weight") for x in "qkv"]),
           "wo": g("self_attn.o_proj.weight"), "q_norm": g("self_attn.q_norm.weight"),
           "k_norm": g("self_attn.k_norm.weight"),
           "w_gate_up": np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]),
           "w_down": g("mlp.down_proj.weight")}
    if desc.layer.qkv_bias:
      out["b_qkv"] = np.concatenate([g(f"self_attn.{x}_proj.bias") for x in "qkv"])
    return out
  per_layer = [layer(i) for i in range(desc.layer.num_layers)]
  return {"layers": {k: np.stack([lp[k] for lp in per_layer]) for k in per_layer[0]},
          "fc": np.asarray(t["fc.weight"], np.float32), "hidden_norm": np.asarray(t["hidden_norm.weight"], np.float32),
          "final_norm": np.asarray(t["norm.weight"], np.float32)}


def load_dflash(path, target_cfg: ModelConfig, target_params, target_name: str = ""):
  """(DFlashConfig, draft parameters with the target's embedding and head, config dict)."""
  import jax
  import jax.numpy as jnp
  from specjax.speculative import dflash
  path = Path(path)
  desc = describe(path, target_cfg, target_name)
  f = _checked_file(path, _expected(desc, target_cfg.d_model))
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _params(_read(f), desc))
  dcfg = dflash.DFlashConfig(target_cfg, desc.layer, desc.taps, desc.block_size, desc.mask_token_id)
  return dcfg, {**dflash.frozen_from_target(dcfg, target_params), **params}, {**read_config(path),
                                                                              "layout": "dflash-zlab"}
