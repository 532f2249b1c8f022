"""Running a model over a device mesh with named axes ("data", "model"), on jax's own SPMD machinery.

Parameters are placed with ``NamedSharding``s chosen by parameter name from ``RULES`` (the one table of
sharding decisions); the KV buffers over batch ("data") and KV heads ("model"); then the ordinary jitted
functions (the speculative step, the whole-generation loop) run unchanged: GSPMD partitions them from their
inputs' shardings and inserts the collectives (an all-reduce after each row-parallel matmul).

    mesh = sharding.make_mesh("2x4")                  # DATA x MODEL devices
    params = sharding.shard_params(params, mesh)
    cache = sharding.shard_cache(init_cache(cfg, B, S), mesh)
    cfg = cfg.replace(backends=dispatch.resolve(mesh))   # what ``api.on_mesh`` does: the kernels know the mesh
    state = speculative.generate(params, (), cache, ..., engine=Engine(cfg=cfg, ...))

The native CPU kernels are XLA custom calls that GSPMD cannot split: on a mesh of more than one device the
model takes its XLA paths instead (``kernels.dispatch.Backends.distributed``), so no weight is gathered to run
them.  The Pallas
tree-attention kernel (GPU, TPU) is a custom call too, but attention is independent per sequence and per KV
head: ``attention_per_shard`` runs it under ``jax.shard_map``, each device on its own sequences and heads of
the KV buffer, with no collective at all.

A dimension whose size the mesh axis does not divide stays replicated on that dimension (a toy model with 4
heads on 8 devices still runs, with less sharding); ``spec_for`` says what each parameter gets.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.models import quant
from specjax.errors import SpecjaxError

AXES = ("data", "model")

# Parameter name -> partition of its trailing dimensions (a leading stacked-layer dimension stays whole).
# Weights are stored [out, in]:
#   column-parallel (output features split: no collective) then row-parallel (input features split: the
#   partial products are all-reduced), per attention block and per MLP, as in Megatron-LM.
RULES: dict[str, tuple] = {
    "embed": (None, "model"),       # [V, D]: a lookup of D-slices needs no collective; a tied head's logits
                                    #         are partial sums over D (all-reduced)
    "lm_head": ("model", None),     # [V, D]: logits split by vocabulary
    "w_qkv": ("model", None),       # [(H + 2K)·E, D]: column-parallel (q, k, v heads)
    "b_qkv": ("model",),            # [(H + 2K)·E]
    "wo": (None, "model"),          # [D, H·E]: row-parallel
    "w_gate_up": ("model", None),   # [2F, D]: column-parallel
    "w_down": (None, "model"),      # [D, F]: row-parallel
    "attn_norm": (None,),           # norms: replicated
    "mlp_norm": (None,),
    "q_norm": (None,),              # [E] per head (Qwen3, Gemma 3)
    "k_norm": (None,),
    "post_attn_norm": (None,),      # Gemma's norms after attention and after the MLP
    "post_mlp_norm": (None,),
    "final_norm": (None,),
}
# KV buffers [L, B, S, K, E]: sequences over "data", KV heads over "model"; lengths [B] over "data".
CACHE_SPEC = (None, "data", None, "model", None)

_LOCAL = threading.local()


def parse_mesh(text: str) -> tuple[int, int]:
  """'2x4' -> (2, 4): DATA x MODEL."""
  try:
    data, model = (int(v) for v in text.lower().split("x"))
    if data < 1 or model < 1:
      raise ValueError
  except ValueError:
    raise SpecjaxError(f"--mesh {text!r}: expected DATAxMODEL with positive sizes, e.g. 2x4") from None
  return data, model


def make_mesh(shape: str | tuple[int, int], devices=None) -> Mesh:
  """A (data, model) mesh over ``devices`` (default: all of jax's devices, whose count must match)."""
  data, model = parse_mesh(shape) if isinstance(shape, str) else shape
  devices = list(jax.devices() if devices is None else devices)
  if data * model != len(devices):
    raise SpecjaxError(
        f"mesh {data}x{model} needs {data * model} devices, {len(devices)} "
        f"{'is' if len(devices) == 1 else 'are'} visible: choose a mesh whose product is {len(devices)} "
        f"(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")
  return Mesh(np.asarray(devices).reshape(data, model), AXES)


def _fit(spec: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
  """The rule's partition for trailing dims, leading dims whole, axes that do not divide a dim dropped."""
  spec = (None,) * (len(shape) - len(spec)) + tuple(spec)
  return P(*[a if a is None or shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(spec)])


def spec_for(name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  """The partition of parameter ``name`` (the last key of its path) with this shape on this mesh."""
  if name not in RULES:   # a drafter's own parameters (a feature drafter's fusion, ...): small, replicated
    return P()
  return _fit(RULES[name], shape, mesh)


def _leaf_name(path) -> str:
  keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
  return str(keys[-1]) if keys else ""


def _quantized_specs(name: str, w: quant.QWeight, mesh: Mesh) -> quant.QWeight:
  """A quantized weight's specs: the data as its matrix's rule; the group scales and offsets [rows, groups]
  the same rule (an axis that does not divide their groups is left whole)."""
  rule = RULES.get(name)
  spec = lambda x: None if x is None else (P() if rule is None else _fit(rule, x.shape, mesh))   # noqa: E731
  return dataclasses.replace(w, data=spec(w.data), scale=spec(w.scale), offset=spec(w.offset))


def param_specs(params, mesh: Mesh):
  """The PartitionSpec of every parameter (same tree structure as ``params``; a quantized weight's data and
  scales each get one)."""
  def one(path, x):
    if quant.is_quantized(x):
      return _quantized_specs(_leaf_name(path), x, mesh)
    return spec_for(_leaf_name(path), x.shape, mesh)
  return jax.tree_util.tree_map_with_path(one, params, is_leaf=quant.is_quantized)


def shard_params(params, mesh: Mesh):
  """Place every parameter on the mesh by ``RULES``."""
  specs = param_specs(params, mesh)
  return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def cache_shardings(cache, mesh: Mesh):
  """The KV cache's placement (a KVCache of NamedShardings): KV buffers over (data: sequences, model: KV
  heads), lengths over data."""
  kv = NamedSharding(mesh, _fit(CACHE_SPEC, tuple(cache.k.shape), mesh))
  lengths = NamedSharding(mesh, _fit(("data",), tuple(cache.lengths.shape), mesh))
  return type(cache)(k=kv, v=kv, lengths=lengths)


def shard_cache(cache, mesh: Mesh):
  """The cache's arrays placed by ``cache_shardings``."""
  return jax.device_put(cache, cache_shardings(cache, mesh))


def abstract_cache(cache, mesh: Mesh):
  """``shard_cache`` for a cache of ShapeDtypeStructs (ahead-of-time compilation)."""
  return with_shardings(cache, cache_shardings(cache, mesh))


def batch_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
  """A per-sequence array [B, ...]: over the data axis (replicated where B does not divide)."""
  return NamedSharding(mesh, _fit(("data",) + (None,) * (len(shape) - 1), tuple(shape), mesh))


def state_shardings(abstract_state, mesh: Mesh, batch_size: int):
  """The placement of a decoding state or result (any pytree of arrays or ShapeDtypeStructs), by shape: a
  KV buffer [L, B, S, K, E] by ``CACHE_SPEC``, any other array whose leading dimension is the batch over
  "data", everything else (scalars, per-depth counters, the random key) replicated.  Used as the explicit
  out_shardings of the prefill, the decode loop and the serving step, and as the loop's in_shardings."""
  def one(x):
    shape = tuple(x.shape)
    if len(shape) == 5 and shape[1] == batch_size:
      return NamedSharding(mesh, _fit(CACHE_SPEC, shape, mesh))
    if shape and shape[0] == batch_size:
      return batch_sharding(shape, mesh)
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map(one, abstract_state)


def with_shardings(abstract, shardings):
  """ShapeDtypeStructs of ``abstract`` carrying ``shardings`` (ahead-of-time lowering)."""
  return jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract,
                                shardings)


def shard_batch(x, mesh: Mesh):
  """A per-sequence array [B, ...] over the data axis (replicated where B does not divide)."""
  return jax.device_put(x, batch_sharding(np.shape(x), mesh))


@contextlib.contextmanager
def use(mesh: Mesh | None):
  """Trace a config built by hand (``cfg.backends`` None: a trainer's, a test's) for ``mesh``: while active (on
  this thread) such a forward resolves its backends for this mesh.  A loaded model's config carries its own
  (``on_mesh``) and needs none of this."""
  prev = getattr(_LOCAL, "mesh", None)
  _LOCAL.mesh = mesh
  try:
    yield mesh
  finally:
    _LOCAL.mesh = prev


def current() -> Mesh | None:
  return getattr(_LOCAL, "mesh", None)


def attention_per_shard(kernel, mesh: Mesh, q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU,
                        lo_BxT=None, softcap=None):
  """``kernel`` (same signature, e.g. ``specjax.kernels.pallas.tree_attention``) on each device's shard of
  ``mesh``: sequences over "data", query heads and KV heads over "model" (query head h reads KV head
  h // G, so the model axis splitting both H and K keeps each group on one device).  An axis that does not
  divide B (or H and K) is left whole on that dimension: correct, just less split.  ``lo_BxT``: a windowed
  layer's first visible slots (split like the sequences); ``softcap`` is passed on."""
  B, T, H, _ = q_BxTxHxE.shape
  K = k_LxBxSxKxE.shape[3]
  d = "data" if B % mesh.shape["data"] == 0 else None
  m = "model" if H % mesh.shape["model"] == 0 and K % mesh.shape["model"] == 0 else None
  q_spec, kv_spec = P(d, None, m, None), P(None, d, None, m, None)
  lo_BxT = jnp.zeros((B, T), jnp.int32) if lo_BxT is None else lo_BxT

  def run(q, k, v, layer, lengths, mask, lo):
    return kernel(q, k, v, layer, lengths, mask, lo, softcap=softcap)
  per_device = jax.shard_map(run, mesh=mesh, check_vma=False,
                             in_specs=(q_spec, kv_spec, kv_spec, P(), P(d), P(d, None, None), P(d, None)),
                             out_specs=q_spec)
  return per_device(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, lo_BxT)


def describe(mesh: Mesh, params) -> list[dict]:
  """The table a reader can check: parameter, shape, partition."""
  rows = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = _leaf_name(path)
    rows.append({"param": jax.tree_util.keystr(path), "shape": list(x.shape),
                 "partition": str(spec_for(name, x.shape, mesh)) + ("" if name in RULES else " (no rule)")})
  return rows
