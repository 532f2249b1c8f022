"""DFlash drafters in their published layouts: read the config, check it against the target in one line before
any weight is read, then load the tensors into ``speculative/dflash.py``'s parameter names.

Two layouts (``layout_of`` tells them apart from config.json alone); the tensors are the same — ``fc.weight``
[D, n·D], ``hidden_norm.weight``, ``norm.weight`` and per draft layer ``layers.{i}.{input_layernorm,
post_attention_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight`` (a Qwen3 layer):

- ``zlab``: z-lab's DFlash releases, SpecForge's ``DFlashDraftModel.save_pretrained``.  A Qwen3 ``config.json``
  for the draft layers (``num_hidden_layers`` = L' draft layers, their own heads, head size, MLP width and rope;
  ``hidden_size`` and ``vocab_size`` the target's) with ``block_size``, ``num_target_layers`` and
  ``dflash_config`` {``target_layer_ids``: each the *output* of that target layer (default: spread over
  1..L-3 as SpecForge does), ``mask_token_id``}.  The embedding (the target's module: with its scale) and the
  head are the target's.
- ``speculators`` (what vLLM loads): ``speculators_model_type: "dflash"``, the draft layers' config in
  ``transformer_layer_config``, ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` as hidden-state
  *indices* (0 = the embeddings, i = the output of layer i - 1; default [2, L/2, L - 3]), ``draft_vocab_size``:
  below the target's, its own ``lm_head.weight`` [Vd, D] and ``d2t`` (target id = draft id + d2t[draft id]);
  else the target's head.  The embedding is the target's raw table (no family scale), as the package loads it.
  ``sample_from_anchor`` (the anchor row drafting too) is refused.

A pickled ``pytorch_model.bin`` is refused with the one-line conversion.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from specjax.checkpoints import weights_file
from specjax.checkpoints.weights_file import read_config
from specjax.errors import SpecjaxError
from specjax.models.config import ModelConfig



@dataclasses.dataclass(frozen=True)
class DFlashDescription:
  """What config.json says, checked against the target (no weight read)."""
  layout: str                         # "zlab" or "speculators"
  layer: ModelConfig                  # the draft layers (vocabulary: the draft head's rows)
  taps: tuple[int, ...]               # specjax taps: the output of these target layers
  block_size: int
  mask_token_id: int


def layout_of(config: dict | None) -> str | None:
  """"zlab", "speculators" or None (not a DFlash drafter); another speculators DFlash variant by its own name."""
  if not config:
    return None
  kind = config.get("speculators_model_type")
  if kind is not None:
    return "speculators" if kind == "dflash" else (str(kind) if "dflash" in str(kind) else None)
  if "dflash_config" in config or any("DFlash" in str(a) for a in config.get("architectures") or []):
    return "zlab"
  return None


def is_dflash_dir(path) -> bool:
  """A directory whose config.json describes a DFlash drafter (either layout)."""
  return layout_of(read_config(path)) is not None


def block_size_of(config: dict) -> object:
  """The config's block size as written (top level, or in ``dflash_config`` in newer z-lab configs)."""
  return config.get("block_size", (config.get("dflash_config") or {}).get("block_size"))


def check_depth(path, depth: int) -> None:
  """Refuse a chain or tree deeper than the directory's block drafts (config.json alone: before any model loads);
  an unreadable block size is left to ``describe``."""
  try:
    bs = int(block_size_of(read_config(path) or {}))
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


def _int(path: Path, key: str, value) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise SpecjaxError(f"DFlash drafter {path}: config.json {key}={value!r} is not an integer") from None


def _layer(path: Path, layer_config: dict, target_cfg: ModelConfig, vocab: int, scaled: bool) -> ModelConfig:
  """The draft layers' config: a Qwen3 layer (DFlash's is, whatever model_type says) of their own shape, a head
  of ``vocab`` rows (the target's when it is the target's vocabulary), embedding as the target (``scaled``) or
  its raw table."""
  from specjax.models.families.hf_config import config_from_hf
  if "sliding_attention" in (layer_config.get("layer_types") or []):
    raise SpecjaxError(f"DFlash drafter {path}: sliding_attention draft layers are not supported (full_attention "
                       "only)")
  c = {k: v for k, v in layer_config.items() if k not in ("architectures", "layer_types", "sliding_window")}
  c.update(model_type="qwen3", use_sliding_window=False, vocab_size=vocab)
  try:
    cfg = config_from_hf(c, f"{target_cfg.name}-dflash", str(path))
  except SpecjaxError:
    raise
  except Exception as e:  # noqa: BLE001  (the family reader's own errors name the key)
    raise SpecjaxError(f"DFlash drafter {path}: its layer config is not readable ({e})") from e
  own_head = vocab != target_cfg.vocab_size
  return cfg.replace(tie_embeddings=target_cfg.tie_embeddings and not own_head,
                     embed_scale=target_cfg.embed_scale if scaled else 1.0, max_position=target_cfg.max_position,
                     bos_token_id=None, eos_token_ids=())


def _fields(path: Path, config: dict, layout: str, L: int) -> tuple[dict, list[int], object, object, int, str]:
  """(the layer config, the layer ids as written, block size, mask token, draft vocabulary (0: the target's),
  what the ids count) of either layout."""
  if layout == "zlab":
    dflash = config.get("dflash_config") or {}
    layers = int(config.get("num_hidden_layers") or 1)
    ids = dflash.get("target_layer_ids")
    ids = default_layer_ids(L, layers) if ids is None else [_int(path, "target_layer_ids", i) for i in ids]
    return config, ids, block_size_of(config), dflash.get("mask_token_id"), 0, "layer"
  if config.get("sample_from_anchor"):
    raise SpecjaxError(f"DFlash drafter {path}: sample_from_anchor drafts from the anchor row too; specjax reads "
                       "blocks whose anchor is the newest token (sample_from_anchor false)")
  ids = config.get("aux_hidden_state_layer_ids")
  ids = [2, L // 2, L - 3] if ids is None else [_int(path, "aux_hidden_state_layer_ids", i) for i in ids]
  vd = config.get("draft_vocab_size")
  return (dict(config.get("transformer_layer_config") or {}), ids, config.get("block_size"),
          config.get("mask_token_id"), 0 if vd is None else _int(path, "draft_vocab_size", vd), "index")


def describe(path, target_cfg: ModelConfig, target_name: str = "") -> DFlashDescription:
  """Check a DFlash directory's config.json against the target, in one line naming both sides."""
  path = Path(path)
  config = read_config(path)
  layout = layout_of(config)
  if layout not in ("zlab", "speculators"):
    raise SpecjaxError(f"{path}: not a DFlash drafter specjax reads (" + (
        f"speculators_model_type '{layout}'; supported: dflash)" if layout else "config.json has no dflash_config)"))
  name = target_name or target_cfg.name
  D, V, L = target_cfg.d_model, target_cfg.vocab_size, target_cfg.num_layers
  layer, ids, bs, mask, vd, counted = _fields(path, config, layout, L)
  for key, got, want in (("hidden_size", layer.get("hidden_size"), D), ("vocab_size", layer.get("vocab_size"), V),
                         ("target_hidden_size", config.get("target_hidden_size"), D),
                         ("num_target_layers", config.get("num_target_layers"), L)):
    if got is not None and _int(path, key, got) != want:
      raise SpecjaxError(f"DFlash drafter {path}: {key}={got}, the target {name} has {want}: a drafter for another "
                         "target")
  if not 0 <= vd <= V:
    raise SpecjaxError(f"DFlash drafter {path}: draft_vocab_size={vd}, the target {name} has {V} tokens")
  if bs is None or _int(path, "block_size", bs) < 2:
    raise SpecjaxError(f"DFlash drafter {path}: block_size={bs} (a block of the root and at least one mask token: "
                       ">= 2)")
  if mask is None or not 0 <= _int(path, "mask_token_id", mask) < V:
    raise SpecjaxError(f"DFlash drafter {path}: mask_token_id={mask}, the target {name} has tokens 0..{V - 1}")
  taps = [i - 1 for i in ids] if counted == "index" else list(ids)
  if not taps or any(not 0 <= t < L - 1 for t in taps):
    # The last layer is left out: transformers' last hidden state is after the final norm, specjax's taps before.
    rng = f"hidden-state indices 1..{L - 1}" if counted == "index" else f"ids 0..{L - 2}"
    key = "aux_hidden_state_layer_ids" if counted == "index" else "target_layer_ids"
    raise SpecjaxError(f"DFlash drafter {path}: {key} {ids} do not fit the target {name} ({L} layers; {rng}): a "
                       "drafter for another target")
  return DFlashDescription(layout=layout, layer=_layer(path, layer, target_cfg, vd or V, layout == "zlab"),
                           taps=tuple(taps), block_size=int(bs), mask_token_id=int(mask))


def _expected(desc: DFlashDescription, D: int, V: int) -> dict[str, tuple[int, ...]]:
  """Tensor name -> shape that the description needs (a draft vocabulary: its head and its d2t map)."""
  c = desc.layer
  H, K, E, F = c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim
  need = {"fc.weight": (D, len(desc.taps) * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
  if c.vocab_size != V:
    need.update({"lm_head.weight": (c.vocab_size, D), "d2t": (c.vocab_size,)})
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
  out = {"layers": {k: np.stack([lp[k] for lp in per_layer]) for k in per_layer[0]},
         "fc": np.asarray(t["fc.weight"], np.float32), "hidden_norm": np.asarray(t["hidden_norm.weight"], np.float32),
         "final_norm": np.asarray(t["norm.weight"], np.float32)}
  if "d2t" in t and len(t["d2t"]) == desc.layer.vocab_size and "lm_head.weight" in t:
    out["lm_head"] = np.asarray(t["lm_head.weight"], np.float32)
  return out


def _head_ids(f: Path, t: dict, vocab: int, V: int) -> np.ndarray | None:
  """A draft vocabulary's target ids (draft id + d2t[draft id]), checked; None over the target's vocabulary."""
  if vocab == V:
    return None
  ids = np.arange(vocab, dtype=np.int64) + t["d2t"].astype(np.int64)
  if ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) != len(ids):
    raise SpecjaxError(f"{f}: its d2t map sends draft tokens outside the target's {V} tokens or two to one")
  return ids.astype(np.int32)


def load_dflash(path, target_cfg: ModelConfig, target_params, target_name: str = ""):
  """(DFlashConfig, draft parameters with the target's embedding and head, config dict)."""
  import jax
  import jax.numpy as jnp
  from specjax.speculative import dflash
  path = Path(path)
  desc = describe(path, target_cfg, target_name)
  V = target_cfg.vocab_size
  f = weights_file.checked(path, _expected(desc, target_cfg.d_model, V), "a DFlash drafter")
  t = weights_file.read(f)
  head_ids = _head_ids(f, t, desc.layer.vocab_size, V)
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _params(t, desc))
  dcfg = dflash.DFlashConfig(target_cfg, desc.layer, desc.taps, desc.block_size, desc.mask_token_id)
  frozen = dflash.frozen_from_target(dcfg, target_params)
  if head_ids is not None:
    frozen["head_ids"] = jnp.asarray(head_ids)
  return dcfg, {**frozen, **params}, {**read_config(path), "layout": f"dflash-{desc.layout}"}
