"""Trained drafters on disk: a directory with ``config.json`` and ``model.safetensors`` (Hugging Face style).

    config.json        {"specjax_drafter": "eagle", "format_version": 1, "target": {name, vocab_size,
                        d_model, num_layers, tokenizer_sha256}, "feature_layers": [...], "vocab_size": Vr,
                        "architectures": [...], "hidden_size", ... (the layer's shape, HF names), "training"}
    model.safetensors  fc.weight [D, 2D], fuse.weight [D, F] (fused features only), norm.weight [D],
                        layers.0.{input_layernorm, post_attention_layernorm}.weight,
                        layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
                        d2t [Vr] int64 (reduced vocabulary: draft index -> target token id)

The head and embedding are the target's (frozen in training), so they are not stored: ``load_drafter``
takes them from the target and refuses a target whose vocabulary or tokenizer differs.  ``save_drafter``
writes into a temporary directory and renames it: a directory with a config.json is always complete.
Saved drafters are also listed in the specjax cache's ``drafters.json`` (``specjax models``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from specjax.errors import SpecjaxError

FORMAT_VERSION = 1
HEAD_FORMAT = "eagle"          # the "specjax_drafter" tag of a trained feature drafter's directory


def tokenizer_fingerprint(tokenizer) -> str:
  """SHA-256 of the tokenizer's vocabulary (token -> id): drafters and targets must agree on it."""
  vocab = sorted(tokenizer.hf.get_vocab(with_added_tokens=True).items())
  return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _index_path() -> Path:
  from specjax.cache_location import cache_dir
  return cache_dir() / "drafters.json"


def _register(path: Path, config: dict) -> None:
  register(path, config["specjax_drafter"], config["target"]["name"])


def register(path: Path, kind: str, target: str) -> None:
  """Add a saved drafter to the cache's index (``specjax models`` lists it while it exists)."""
  idx = _index_path()
  try:
    entries = json.loads(idx.read_text()) if idx.exists() else []
  except json.JSONDecodeError:
    entries = []
  entries = [e for e in entries if e.get("path") != str(path)]
  entries.append({"path": str(path), "kind": kind, "target": target, "saved": time.strftime("%Y-%m-%dT%H:%M:%S")})
  idx.parent.mkdir(parents=True, exist_ok=True)
  tmp = idx.with_suffix(".tmp")
  tmp.write_text(json.dumps(entries, indent=1))
  os.replace(tmp, idx)


def list_drafters() -> list[dict]:
  """Drafters saved on this machine that still exist, with their path, kind and target."""
  idx = _index_path()
  if not idx.exists():
    return []
  try:
    entries = json.loads(idx.read_text())
  except json.JSONDecodeError:
    return []
  return [e for e in entries if (Path(e["path"]) / "config.json").exists()]



def _layer_tensors(layers, cfg) -> dict[str, np.ndarray]:
  H, K, E, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  lp = {k: np.asarray(v)[0] for k, v in layers.items()}
  q, k, v = np.split(lp["w_qkv"], [H * E, (H + K) * E], axis=0)
  gate, up = np.split(lp["w_gate_up"], [F], axis=0)
  out = {"layers.0.input_layernorm.weight": lp["attn_norm"], "layers.0.post_attention_layernorm.weight":
         lp["mlp_norm"], "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
         "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": lp["wo"],
         "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
         "layers.0.mlp.down_proj.weight": lp["w_down"]}
  if "b_qkv" in lp:            # Qwen2's q/k/v biases
    for name, b in zip("qkv", np.split(lp["b_qkv"], [H * E, (H + K) * E])):
      out[f"layers.0.self_attn.{name}_proj.bias"] = b
  return out


def save_drafter(path: str | Path, ecfg, trainable: dict, *, target_name: str, tokenizer, head_ids=None,
                 training: dict | None = None, register: bool = True) -> Path:
  from safetensors.numpy import save_file
  path = Path(path)
  cfg = ecfg.layer_cfg
  tensors = {"fc.weight": np.asarray(trainable["fc"], np.float32),
             "norm.weight": np.asarray(trainable["final_norm"], np.float32),
             **{k: np.asarray(v, np.float32) for k, v in _layer_tensors(trainable["layers"], cfg).items()}}
  if ecfg.fused:
    tensors["fuse.weight"] = np.asarray(trainable["fuse"], np.float32)
  if ecfg.reduced:
    tensors["d2t"] = np.asarray(head_ids, np.int64)
  if ecfg.parallel:
    tensors["placeholders"] = np.asarray(trainable["placeholders"], np.float32)
  t = ecfg.target
  config = {"specjax_drafter": HEAD_FORMAT, "format_version": FORMAT_VERSION,
            "architectures": ["SpecjaxEagleDrafter"],
            "target": {"name": target_name, "config_name": t.name, "vocab_size": t.vocab_size,
                       "d_model": t.d_model, "num_layers": t.num_layers,
                       "tokenizer_sha256": tokenizer_fingerprint(tokenizer)},
            "feature_layers": list(ecfg.feature_layers), "vocab_size": ecfg.head_size,
            "hidden_size": t.d_model, "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim, "intermediate_size": t.ffn_dim, "rms_norm_eps": t.norm_eps,
            "rope_theta": t.rope_theta, "num_hidden_layers": 1, "parallel_positions": ecfg.parallel,
            "training": training or {}}
  tmp = path.with_name(path.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"))
  (tmp / "config.json").write_text(json.dumps(config, indent=1))
  if path.exists():
    shutil.rmtree(path)
  os.replace(tmp, path)
  if register:
    _register(path.resolve(), config)
  return path


def read_config(path: str | Path) -> dict:
  path = Path(path)
  if not path.is_dir():
    raise SpecjaxError(f"drafter directory not found: {path} (train one with `specjax train "
                       "configs/eagle_smollm2.gin`; `specjax models` lists saved drafters)")
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise SpecjaxError(f"{path} has no config.json: not a specjax drafter, or its save did not finish")
  try:
    config = json.loads(cfg_file.read_text())
  except json.JSONDecodeError as e:
    raise SpecjaxError(f"{cfg_file} is not valid JSON ({e}): the drafter is damaged, export it again") from e
  if not isinstance(config, dict) or "specjax_drafter" not in config:
    raise SpecjaxError(f"{cfg_file} does not say what it holds (no 'specjax_drafter' key): not a directory that "
                       "specjax exported a drafter to; pass one that `specjax train` wrote (`specjax models` lists them)")
  if config.get("specjax_drafter") != HEAD_FORMAT:
    raise SpecjaxError(f"{path} is a '{config.get('specjax_drafter')}' drafter, expected '{HEAD_FORMAT}'")
  if config.get("format_version") != FORMAT_VERSION:
    raise SpecjaxError(f"{path} has drafter format {config.get('format_version')}, this specjax reads "
                       f"{FORMAT_VERSION}: export it again")
  return config


def load_drafter(path: str | Path, target_cfg, target_params, tokenizer, target_name: str = ""):
  """(EagleConfig, draft parameters with the target's frozen part, config dict); checks the target."""
  import jax.numpy as jnp
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  from specjax.speculative import eagle
  path = Path(path)
  from specjax.checkpoints import dflash_io, eagle1_io, eagle3_io
  if dflash_io.is_dflash_dir(path):           # a published DFlash drafter (z-lab / SpecForge)
    return dflash_io.load_dflash(path, target_cfg, target_params, target_name)
  if eagle3_io.is_eagle3_dir(path):           # a published EAGLE-3 drafter (SpecForge/EAGLE or speculators)
    return eagle3_io.load_eagle3(path, target_cfg, target_params, target_name)
  if eagle1_io.is_eagle1_dir(path):           # a published EAGLE-1/2 drafter
    return eagle1_io.load_eagle1(path, target_cfg, target_params)
  config = read_config(path)
  layers_fl = _checked_target(path, config, target_cfg, tokenizer, target_name)
  try:
    ecfg = eagle.EagleConfig(target_cfg, layers_fl, int(config["vocab_size"]),
                             int(config.get("parallel_positions", 0)))
  except ValueError as e:
    raise SpecjaxError(f"drafter {path}: {e}") from e
  try:
    t = load_file(str(path / "model.safetensors"))
  except (SafetensorError, OSError, ValueError) as e:
    raise SpecjaxError(f"{path}/model.safetensors is damaged or missing ({e}): export the drafter again") from e
  cfg = ecfg.layer_cfg
  D = target_cfg.d_model
  need = {"fc.weight": (D, 2 * D), "norm.weight": (D,), **{k: None for k in _layer_tensors_names()}}
  if ecfg.fused:
    need["fuse.weight"] = (D, ecfg.feature_dim)
  if ecfg.reduced:
    need["d2t"] = (ecfg.head_size,)
  if ecfg.parallel:
    need["placeholders"] = (ecfg.parallel - 1, D)
  if target_cfg.qkv_bias:
    need.update({f"layers.0.self_attn.{n}_proj.bias": None for n in "qkv"})
  for name, shape in need.items():
    if name not in t:
      raise SpecjaxError(f"{path}/model.safetensors lacks '{name}': not an EAGLE drafter of this format")
    if shape is not None and tuple(t[name].shape) != shape:
      raise SpecjaxError(f"{path}: '{name}' has shape {tuple(t[name].shape)}, expected {shape}")
  layers = _layer_of(path, t, cfg, D)
  trainable = {"fc": t["fc.weight"], "final_norm": t["norm.weight"],
               "layers": {k: jnp.asarray(v, jnp.float32) for k, v in layers.items()}}
  if ecfg.fused:
    trainable["fuse"] = t["fuse.weight"]
  if ecfg.parallel:
    trainable["placeholders"] = t["placeholders"]
  trainable = {k: (v if isinstance(v, dict) else jnp.asarray(v, jnp.float32)) for k, v in trainable.items()}
  head_ids = t["d2t"].astype(np.int32) if ecfg.reduced else None
  if head_ids is not None and (head_ids.min() < 0 or head_ids.max() >= target_cfg.vocab_size):
    raise SpecjaxError(f"drafter {path}: its vocabulary map points outside the target's vocabulary")
  params = {**trainable, **eagle.frozen_from_target(ecfg, target_params, head_ids)}
  return ecfg, params, config


def _checked_target(path, config: dict, target_cfg, tokenizer, target_name: str) -> tuple[int, ...]:
  """The target layers a drafter of specjax's own format reads, after checking it was trained for this target
  (vocabulary, width, tokenizer, layer count)."""
  want = config["target"]
  if want["vocab_size"] != target_cfg.vocab_size or want["d_model"] != target_cfg.d_model:
    raise SpecjaxError(f"drafter {path} was trained for '{want['name']}' (vocabulary {want['vocab_size']}, "
                       f"width {want['d_model']}), the target '{target_name or target_cfg.name}' has "
                       f"{target_cfg.vocab_size} and {target_cfg.d_model}: use a drafter trained for this target")
  if want.get("tokenizer_sha256") != tokenizer_fingerprint(tokenizer):
    raise SpecjaxError(f"drafter {path} was trained with another tokenizer than the target "
                       f"'{target_name or target_cfg.name}': a drafter must share the target's tokenizer")
  layers_fl = tuple(config["feature_layers"])
  if any(not 0 <= i < target_cfg.num_layers for i in layers_fl):
    raise SpecjaxError(f"drafter {path} reads target layers {list(layers_fl)}, the target has "
                       f"{target_cfg.num_layers}")
  return layers_fl


def _layer_of(path, t: dict, cfg, D: int) -> dict:
  """The drafter's one decoder layer (stacked, L = 1) from its tensors, each shape checked against ``cfg``."""
  g = lambda n: t[f"layers.0.{n}.weight"]                                  # noqa: E731
  try:
    layers = {"attn_norm": g("input_layernorm")[None], "mlp_norm": g("post_attention_layernorm")[None],
              "w_qkv": np.concatenate([g("self_attn.q_proj"), g("self_attn.k_proj"), g("self_attn.v_proj")])[None],
              "wo": g("self_attn.o_proj")[None],
              "w_gate_up": np.concatenate([g("mlp.gate_proj"), g("mlp.up_proj")])[None],
              "w_down": g("mlp.down_proj")[None]}
    if cfg.qkv_bias:
      layers["b_qkv"] = np.concatenate([t[f"layers.0.self_attn.{n}_proj.bias"] for n in "qkv"])[None]
    expect = {"w_qkv": (1, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, D),
              "wo": (1, D, cfg.num_heads * cfg.head_dim), "w_gate_up": (1, 2 * cfg.ffn_dim, D),
              "w_down": (1, D, cfg.ffn_dim)}
    if cfg.qkv_bias:
      expect["b_qkv"] = (1, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    for k, s in expect.items():
      if layers[k].shape != s:
        raise ValueError(f"{k} has shape {layers[k].shape}, expected {s}")
  except ValueError as e:
    raise SpecjaxError(f"drafter {path} does not fit this target's layer shape ({e})") from e
  return layers


def _layer_tensors_names():
  return ["layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
          "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
          "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
          "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight"]
