"""Published EAGLE-3 drafters in their own layouts: read the config, check it against the target in one line
before any weight is read, then load the tensors into ``speculative/eagle.py``'s parameter names.

Two layouts (``describe`` tells them apart from config.json alone):

- ``specforge``: the original EAGLE-3 release, SpecForge and AngelSlim.  A Llama ``config.json`` with
  ``draft_vocab_size`` (and ``architectures`` naming an Eagle3 class); the capture layers in
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (or top-level), each the *output* of that target layer,
  default [1, L/2 - 1, L - 4]; tensors ``fc``, ``midlayer.{hidden_norm, input_layernorm, self_attn.*, mlp.*,
  post_attention_layernorm}``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, optionally ``embed_tokens`` and
  ``fc_norm.{i}``.
- ``speculators`` (what vLLM loads): ``speculators_model_type: "eagle3"``, the layer's own config in
  ``transformer_layer_config`` (a Llama or Qwen3 layer), flags ``norm_before_residual``, ``fc_norm``,
  ``norm_before_fc``, ``norm_output``; capture ids are hidden-state *indices* (0 = the embeddings, i = the
  output of layer i - 1), default [2, L/2, L - 3]; tensors as above under ``layers.0.*``, ``input_norm``
  for ``norm_before_fc``.

Target id = draft id + d2t[draft id]; without ``d2t`` the draft vocabulary must be the target's.  Without
``embed_tokens`` the drafter embeds with the target's embedding.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from specjax.checkpoints import weights_file
from specjax.checkpoints.weights_file import read_config
from specjax.errors import SpecjaxError

_LAYER = ("hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
          "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# The layer fields a published drafter may set for itself (ModelConfig names).
LAYER_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "ffn_dim", "rope_theta", "rope_scaling", "norm_eps",
                "qk_norm", "qkv_bias")


@dataclasses.dataclass(frozen=True)
class Eagle3Description:
  """What config.json says, checked against the target (no weight read)."""
  layout: str                           # "specforge" or "speculators"
  taps: tuple[int, ...]                 # specjax tap ids: the output of these target layers
  draft_vocab: int
  layer: tuple[tuple[str, Any], ...]    # the drafter layer's ModelConfig fields
  prefix: str                           # "midlayer." or "layers.0."
  norm_before_residual: bool = False
  norm_output: bool = False             # speculators: deeper nodes feed the normed output
  head_norm: bool = True                # SpecForge's norm_output=False: the head reads the un-normed output
  fc_norm: bool = False
  norm_before_fc: bool = False


def layout_of(config: dict | None) -> str | None:
  """"speculators", "specforge" or None (not an EAGLE-3 drafter)."""
  if not config:
    return None
  if config.get("speculators_model_type") == "eagle3":
    return "speculators"
  archs = " ".join(config.get("architectures") or []).lower()
  if "specjax_drafter" not in config and "draft_vocab_size" in config and ("eagle3" in archs
                                                                          or "eagle_config" in config):
    return "specforge"
  return None


def is_eagle3_dir(path) -> bool:
  return layout_of(read_config(Path(path))) is not None


def _taps(path: Path, layout: str, ids, L: int, target_name: str) -> tuple[int, ...]:
  """The config's capture ids as specjax taps (the output of these layers), defaults as each project's."""
  if ids is None:
    return (1, L // 2 - 1, L - 4)
  ids = [int(i) for i in ids]
  taps = [i - 1 for i in ids] if layout == "speculators" else ids
  if any(not 0 <= t < L for t in taps):
    # (the last layer's capture is its output before the final norm, as SGLang and vLLM take it; transformers'
    # hidden_states[L] is after the norm)
    rng = f"1..{L}" if layout == "speculators" else f"0..{L - 1}"
    raise SpecjaxError(f"EAGLE-3 drafter {path}: capture layers {ids} do not fit the target {target_name} "
                       f"({L} layers; {layout} ids in {rng}): a drafter for another target")
  return tuple(taps)


def _layer_fields(path: Path, layer_config: dict) -> tuple[tuple[str, Any], ...]:
  from specjax.models.families.hf_config import config_from_hf
  c = {**layer_config, "num_hidden_layers": 1}
  c.setdefault("model_type", "llama")
  c.pop("architectures", None)
  if c["model_type"] not in ("llama", "qwen3"):
    raise SpecjaxError(f"EAGLE-3 drafter {path}: a {c['model_type']} layer is not supported (supported: llama, "
                       "qwen3)")
  try:
    cfg = config_from_hf(c, "eagle3-layer", str(path))
  except SpecjaxError:
    raise
  except Exception as e:  # noqa: BLE001  (the family reader's own errors name the key)
    raise SpecjaxError(f"EAGLE-3 drafter {path}: its layer config is not readable ({e})") from e
  return tuple((f, getattr(cfg, f)) for f in LAYER_FIELDS)


def describe(path, target_cfg, target_name: str = "") -> Eagle3Description:
  """Check an EAGLE-3 directory's config.json against the target, in one line naming both sides."""
  path = Path(path)
  config = read_config(path)
  layout = layout_of(config)
  if layout is None:
    raise SpecjaxError(f"{path}: not an EAGLE-3 drafter (config.json has neither speculators_model_type "
                       "'eagle3' nor draft_vocab_size)")
  name = target_name or target_cfg.name
  spec = layout == "speculators"
  layer = dict(config.get("transformer_layer_config") or {}) if spec else config
  D, V = target_cfg.d_model, target_cfg.vocab_size
  for key, want in (("hidden_size", D), ("target_hidden_size", D), ("vocab_size", V)):
    got = (config.get(key) if key == "target_hidden_size" else layer.get(key))
    if got is not None and int(got) != want:
      raise SpecjaxError(f"EAGLE-3 drafter {path}: {key}={got}, the target {name} has {want}: a drafter for "
                         "another target")
  if int(layer.get("num_hidden_layers", 1)) != 1:
    raise SpecjaxError(f"EAGLE-3 drafter {path}: {layer['num_hidden_layers']} layers; specjax reads one-layer "
                       "EAGLE-3 drafters")
  draft_vocab = int(config.get("draft_vocab_size") or V)
  if not 0 < draft_vocab <= V:
    raise SpecjaxError(f"EAGLE-3 drafter {path}: draft_vocab_size={draft_vocab}, the target {name} has {V} tokens")
  ids = config.get("eagle_aux_hidden_state_layer_ids")
  if not spec and ids is None:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  if spec and ids is None:
    ids = [2, target_cfg.num_layers // 2, target_cfg.num_layers - 3]
  taps = _taps(path, layout, ids, target_cfg.num_layers, name)
  return Eagle3Description(
      layout=layout, taps=taps, draft_vocab=draft_vocab, layer=_layer_fields(path, layer),
      prefix="layers.0." if spec else "midlayer.",
      norm_before_residual=bool(config.get("norm_before_residual", False)) if spec else False,
      norm_output=bool(config.get("norm_output", False)) if spec else False,
      head_norm=True if spec else bool(config.get("norm_output", True)),
      fc_norm=bool(config.get("fc_norm", False)), norm_before_fc=spec and bool(config.get("norm_before_fc")))


def _expected(desc: Eagle3Description, D: int, V: int) -> dict[str, tuple[int, ...] | None]:
  """Tensor name -> shape (None: any) that the description needs."""
  f = dict(desc.layer)
  H, K, E, F, n = f["num_heads"], f["num_kv_heads"], f["head_dim"], f["ffn_dim"], len(desc.taps)
  p = desc.prefix
  need = {"fc.weight": (D, n * D), "norm.weight": (D,), "lm_head.weight": (desc.draft_vocab, D),
          f"{p}hidden_norm.weight": (D,), f"{p}input_layernorm.weight": (D,),
          f"{p}post_attention_layernorm.weight": (D,), f"{p}self_attn.q_proj.weight": (H * E, 2 * D),
          f"{p}self_attn.k_proj.weight": (K * E, 2 * D), f"{p}self_attn.v_proj.weight": (K * E, 2 * D),
          f"{p}self_attn.o_proj.weight": (D, H * E), f"{p}mlp.gate_proj.weight": (F, D),
          f"{p}mlp.up_proj.weight": (F, D), f"{p}mlp.down_proj.weight": (D, F)}
  if desc.draft_vocab != V:
    need["d2t"] = (desc.draft_vocab,)
  if f["qk_norm"]:
    need.update({f"{p}self_attn.q_norm.weight": (E,), f"{p}self_attn.k_norm.weight": (E,)})
  if f["qkv_bias"]:
    need.update({f"{p}self_attn.{x}_proj.bias": None for x in "qkv"})
  if desc.fc_norm:
    need.update({f"fc_norm.{i}.weight": (D,) for i in range(n)})
  if desc.norm_before_fc:
    need["input_norm.weight"] = (n * D,)
  return need


def _head_ids(f: Path, t: dict, desc: Eagle3Description, V: int) -> np.ndarray | None:
  if desc.draft_vocab == V:
    if "d2t" in t and np.any(t["d2t"]):
      raise SpecjaxError(f"{f}: a d2t map over the whole vocabulary that moves tokens is not supported")
    return None
  ids = np.arange(desc.draft_vocab, dtype=np.int64) + t["d2t"].astype(np.int64)
  if ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) != len(ids):
    raise SpecjaxError(f"{f}: its d2t map sends draft tokens outside the target's {V} tokens or two to one")
  return ids.astype(np.int32)


def _params(t: dict, desc: Eagle3Description, D: int) -> dict:
  """The tensors in ``eagle.py``'s names (float32 numpy)."""
  p = desc.prefix
  g = lambda n: np.asarray(t[f"{p}{n}.weight"], np.float32)            # noqa: E731
  layers = {"attn_norm": g("hidden_norm")[None], "mlp_norm": g("post_attention_layernorm")[None],
            "w_qkv": np.concatenate([g("self_attn.q_proj"), g("self_attn.k_proj"), g("self_attn.v_proj")])[None],
            "wo": g("self_attn.o_proj")[None],
            "w_gate_up": np.concatenate([g("mlp.gate_proj"), g("mlp.up_proj")])[None],
            "w_down": g("mlp.down_proj")[None]}
  if dict(desc.layer)["qk_norm"]:
    layers["q_norm"], layers["k_norm"] = g("self_attn.q_norm")[None], g("self_attn.k_norm")[None]
  if dict(desc.layer)["qkv_bias"]:
    layers["b_qkv"] = np.concatenate([np.asarray(t[f"{p}self_attn.{x}_proj.bias"], np.float32) for x in "qkv"])[None]
  out = {"fuse": t["fc.weight"], "final_norm": t["norm.weight"], "embed_norm": g("input_layernorm"),
         "lm_head": t["lm_head.weight"], "layers": layers}
  if desc.norm_before_residual:
    out["hidden_norm"] = g("hidden_norm")
  if desc.fc_norm:
    out["fuse_norm"] = np.stack([t[f"fc_norm.{i}.weight"] for i in range(len(desc.taps))])
  if desc.norm_before_fc:
    out["fuse_norm"] = t["input_norm.weight"]
  if "embed_tokens.weight" in t:
    out["embed"] = t["embed_tokens.weight"]
  return out


def load_eagle3(path, target_cfg, target_params, target_name: str = ""):
  """(EagleConfig with layout "eagle3", draft parameters, config dict)."""
  import jax
  import jax.numpy as jnp
  from specjax.speculative import eagle
  path = Path(path)
  desc = describe(path, target_cfg, target_name)
  D, V = target_cfg.d_model, target_cfg.vocab_size
  f = weights_file.checked(path, _expected(desc, D, V), "an EAGLE-3 drafter")
  t = weights_file.read(f)
  head_ids = _head_ids(f, t, desc, V)
  layer = desc.layer + ((("final_norm", False),) if not desc.head_norm else ())
  ecfg = eagle.EagleConfig(target_cfg, desc.taps, desc.draft_vocab if head_ids is not None else 0,
                           layout="eagle3", layer=layer, norm_before_residual=desc.norm_before_residual,
                           norm_output=desc.norm_output)
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _params(t, desc, D))
  frozen = {"embed": target_params["embed"]}
  if head_ids is not None:
    frozen["head_ids"] = jnp.asarray(head_ids)
  return ecfg, {**frozen, **params}, {**read_config(path), "layout": f"eagle3-{desc.layout}"}
