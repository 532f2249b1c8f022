"""EAGLE-1/2 drafters in their published layout (the ``eagle`` package's ``cnets.Model``, EAGLE-2 drafting with
the same weights): a directory with a Llama-style ``config.json`` (the drafter's: ``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``rms_norm_eps``,
``num_hidden_layers`` = 1) and ``model.safetensors`` with ``fc.weight`` [D, 2D] (+ ``fc.bias``),
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight`` and
``layers.0.post_attention_layernorm.weight``; no norm before the layer's attention and none before the head
(the target's), RoPE at base 10000 as the package computes it.  ``embed_tokens.weight``, when present, must be
the target's embedding (the drafter reads the target's).  The older pickled ``pytorch_model.bin`` is refused
with the one-line conversion to run where torch is installed."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.checkpoints.pickled import conversion_advice
from specjax.errors import SpecjaxError

WEIGHTS, PICKLE = "model.safetensors", "pytorch_model.bin"
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")


def is_eagle1_dir(path) -> bool:
  """A directory whose config.json is a model config (``hidden_size``) rather than specjax's own drafter
  config or Medusa's."""
  f = Path(path) / "config.json"
  try:
    config = json.loads(f.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError):
    return False
  return isinstance(config, dict) and "specjax_drafter" not in config and "medusa_num_heads" not in config \
      and "hidden_size" in config


def _tensors(path: Path) -> dict[str, np.ndarray]:
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  f = path / WEIGHTS
  if not f.is_file():
    if (path / PICKLE).is_file():
      raise SpecjaxError(conversion_advice(path / PICKLE, f))
    raise SpecjaxError(f"{path}: no {WEIGHTS} (an EAGLE-1/2 drafter directory holds config.json and {WEIGHTS})")
  try:
    return load_file(str(f))
  except (SafetensorError, OSError, ValueError) as e:
    raise SpecjaxError(f"{f} is damaged ({' '.join(str(e).split())})") from e


def _check_config(path: Path, config: dict, target_cfg) -> None:
  D, V = target_cfg.d_model, target_cfg.vocab_size
  want = {"hidden_size": D, "vocab_size": V, "num_attention_heads": target_cfg.num_heads,
          "num_key_value_heads": target_cfg.num_kv_heads, "intermediate_size": target_cfg.ffn_dim}
  for key, value in want.items():
    got = config.get(key, config.get("num_attention_heads") if key == "num_key_value_heads" else None)
    if got is not None and int(got) != value:
      raise SpecjaxError(f"EAGLE drafter {path}: {key}={got}, the target {target_cfg.name} has {value}: a drafter "
                         "for another target, or a layer shape specjax's one-layer head does not take")
  if int(config.get("num_hidden_layers", 1)) != 1:
    raise SpecjaxError(f"EAGLE drafter {path}: {config['num_hidden_layers']} layers, specjax reads one-layer drafters")
  scaling = config.get("rope_scaling")
  if scaling and scaling.get("type", scaling.get("rope_type")) not in (None, "default"):
    raise SpecjaxError(f"EAGLE drafter {path}: rope_scaling {scaling} is not supported (supported: none)")


def load_eagle1(path, target_cfg, target_params):
  """(EagleConfig with layout "eagle1", draft parameters with the target's frozen part, config dict)."""
  from specjax.speculative import eagle
  path = Path(path)
  config = json.loads((path / "config.json").read_text(encoding="utf-8"))
  _check_config(path, config, target_cfg)
  t = _tensors(path)
  ecfg = eagle.EagleConfig(target_cfg, (), 0, layout="eagle1")
  cfg, D = ecfg.layer_cfg, target_cfg.d_model
  HE, KE = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  shapes = {"fc.weight": (D, 2 * D), "layers.0.self_attn.q_proj.weight": (HE, D),
            "layers.0.self_attn.k_proj.weight": (KE, D), "layers.0.self_attn.v_proj.weight": (KE, D),
            "layers.0.self_attn.o_proj.weight": (D, HE), "layers.0.mlp.gate_proj.weight": (cfg.ffn_dim, D),
            "layers.0.mlp.up_proj.weight": (cfg.ffn_dim, D), "layers.0.mlp.down_proj.weight": (D, cfg.ffn_dim),
            "layers.0.post_attention_layernorm.weight": (D,)}
  for name, shape in shapes.items():
    if name not in t:
      raise SpecjaxError(f"{path / WEIGHTS} lacks '{name}': not an EAGLE-1/2 drafter")
    if tuple(t[name].shape) != shape:
      raise SpecjaxError(f"{path / WEIGHTS}: '{name}' has shape {tuple(t[name].shape)}, expected {shape}")
  if "embed_tokens.weight" in t and not np.allclose(t["embed_tokens.weight"], np.asarray(target_params["embed"],
                                                                                           np.float32)):
    raise SpecjaxError(f"{path / WEIGHTS}: its embed_tokens are not the target's embedding: a drafter for "
                       f"another target than {target_cfg.name}")
  g = lambda n: np.asarray(t[f"layers.0.{n}.weight"], np.float32)        # noqa: E731
  layers = {"attn_norm": np.ones((1, D), np.float32),                       # unused: no norm before attention
            "mlp_norm": g("post_attention_layernorm")[None],
            "w_qkv": np.concatenate([g("self_attn.q_proj"), g("self_attn.k_proj"), g("self_attn.v_proj")])[None],
            "wo": g("self_attn.o_proj")[None],
            "w_gate_up": np.concatenate([g("mlp.gate_proj"), g("mlp.up_proj")])[None],
            "w_down": g("mlp.down_proj")[None]}
  params = {"fc": jnp.asarray(t["fc.weight"], jnp.float32), "final_norm": jnp.ones((D,), jnp.float32),
            "layers": {k: jnp.asarray(v) for k, v in layers.items()},
            **eagle.frozen_from_target(ecfg, target_params)}
  if "fc.bias" in t:
    params["fc_bias"] = jnp.asarray(t["fc.bias"], jnp.float32)
  return ecfg, params, config
