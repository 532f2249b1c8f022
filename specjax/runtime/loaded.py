"""A loaded model ready to run (``Model``), loading by name or path, and moving it onto a mesh."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import settings
from specjax.models import decoder as model_lib, quant
from specjax.checkpoints import LoadedModel, Tokenizer, load_model
from specjax.models.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.kernels import dispatch
from specjax.runtime import huge_pages
from specjax.runtime.compiled import Executables


@dataclasses.dataclass
class Model:
  """A loaded model ready to run.

  ``params`` is the canonical (stacked) pytree; ``exec_params`` the layout the decode loop runs (on the CPU,
  per-layer arrays in a list, which streams weights faster than a scan over stacked ones).
  """
  cfg: ModelConfig
  params: Any
  tokenizer: Tokenizer
  source: str
  exec_params: Any = None
  load_s: float = 0.0          # seconds ``load`` took (reading or converting weights, building the tokenizer)
  mesh: Any = None             # a jax Mesh when the parameters are sharded over devices (``on_mesh``)
  executables: Executables = dataclasses.field(default_factory=Executables, repr=False)
  companions: dict = dataclasses.field(default_factory=dict, repr=False)
  """Models and heads loaded for this target (the registry's draft, a trained head at a weight type), kept
  with it so that a second decode loads none of them again."""

  def __post_init__(self):
    if self.exec_params is None:
      self.exec_params = default_exec_params(self.params)

  @classmethod
  def from_loaded(cls, loaded: LoadedModel) -> "Model":
    return cls(cfg=loaded.cfg, params=loaded.params, tokenizer=loaded.tokenizer, source=loaded.source)

  @property
  def prefill_params(self):
    """The layout prefill runs: the stacked one.  Prefill is compute-bound, so the copy XLA:CPU makes of each
    scanned layer costs nothing measurable there, and a scan compiles about 5x faster than unrolled layers."""
    return self.params

  @property
  def dtype(self):
    """The dtype the activations and the KV buffers run in (``--dtype``; the weights' own with fp32 or bf16
    weights, else ``quant.activation_dtype``)."""
    return quant.activation_dtype(self.params)

  @property
  def weights(self) -> str:
    """The layer matrices' weight type: fp32, bf16, int8 or int4 (``--weights``)."""
    return quant.weights_kind(self.params)

  @property
  def weight_bytes(self) -> int:
    return model_lib.param_bytes(self.params)


def on_mesh(m: Model, mesh) -> Model:
  """The model with its parameters sharded over ``mesh`` (a ``jax.sharding.Mesh`` or 'DATAxMODEL'), by
  ``sharding.RULES``; the decode loop then runs the stacked sharded parameters too (GSPMD partitions both)."""
  from specjax.parallel import sharding
  mesh = sharding.make_mesh(mesh) if isinstance(mesh, str) else mesh
  params = sharding.shard_params(m.params, mesh)
  acts = m.cfg.backends.activations if m.cfg.backends is not None else None
  cfg = m.cfg.replace(backends=dispatch.resolve(mesh, activations=acts))   # the native kernels step aside on several devices
  return dataclasses.replace(m, cfg=cfg, params=params, exec_params=params, mesh=mesh,
                             executables=Executables(), companions={})


def default_exec_params(params):
  """On the CPU, per-layer arrays (see ``model.unstack_layers``), cut as views of the stacked ones: no copy,
  no XLA dispatch (under ``SPECJAX_HUGE_PAGES=1`` copied into 2 MB pages instead, with the other weights:
  ``runtime/huge_pages.py``); elsewhere the stacked parameters themselves."""
  if jax.default_backend() != "cpu":
    return params
  layers = params["layers"]
  huge = settings.huge_pages_wanted()
  if isinstance(layers, (list, tuple)):
    return huge_pages.tree_to_huge_pages(params) if huge else params
  host = jax.tree_util.tree_map(np.asarray, layers)       # zero-copy views of CPU buffers
  L = jax.tree_util.tree_leaves(host)[0].shape[0]
  view = lambda x: jax.device_put(x, may_alias=True)
  place = (lambda x: huge_pages.copy_to_huge_pages(view(x))) if huge else view
  per_layer = [jax.tree_util.tree_map(lambda x, i=i: place(x[i]), host) for i in range(L)]
  rest = {k: v for k, v in params.items() if k != "layers"}
  if huge:
    rest = huge_pages.tree_to_huge_pages(rest)
  return {**rest, "layers": per_layer}

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def default_dtype(backend: str | None = None) -> str:
  """What ``dtype="auto"`` means: bfloat16 on accelerators (GPU, TPU: their matmul units and bandwidth are
  built for it), float32 on the CPU (where the native kernels are fp32)."""
  return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def load(name_or_path: str, dtype: str = "auto", weights: str = "auto", activations: str = "auto") -> Model:
  """Load a registry model (downloaded once), a GGUF file or a Hugging Face safetensors directory.

  ``dtype``: the activations and KV buffers (and, with ``weights="auto"``, the weights): float32, bfloat16
  or auto (``default_dtype``).  ``weights``: auto (= ``dtype``), fp32, bf16, int8 or int4: the layer
  matrices, embedding and head quantized at load (``quant.py`` says the policy and the formats), then
  dequantized inside the matmuls.  Quantized weights need float32 activations on the CPU.  ``activations``:
  what int8/int4 weights multiply in decode-sized matmuls, fp32 or int8 (``kernels/cpu_qdot.py``; auto:
  ``SPECJAX_ACTIVATIONS``, else ``dispatch.default_activations()``: int8 where the integer-dot kernel runs on
  AVX-512 VNNI, else fp32)."""
  if dtype == "auto":
    dtype = default_dtype()
  if dtype not in _DTYPES:
    raise SpecjaxError(f"unknown dtype '{dtype}': use one of auto, {', '.join(sorted(_DTYPES))}")
  weights = {"float32": "fp32", "bfloat16": "bf16"}.get(weights, weights)
  if weights not in ("auto", *quant.KINDS):
    raise SpecjaxError(f"unknown weight type '{weights}': use one of auto, {', '.join(quant.KINDS)}")
  act = jnp.dtype(_DTYPES[dtype])
  if weights == "fp32" and act == jnp.bfloat16:
    raise SpecjaxError("fp32 weights with bfloat16 activations: use --dtype float32, or --weights bf16")
  quantize_to = None if weights in ("auto", "fp32") or (weights == "bf16" and act == jnp.bfloat16) else weights
  if quantize_to is not None and act != quant.compute_dtype():
    raise SpecjaxError(f"--weights {weights} runs with {quant.compute_dtype().name} activations on "
                       f"{jax.default_backend()}: drop --dtype {dtype} (or use auto)")
  dispatch.check_activations(activations)     # a bad name fails before anything loads
  from specjax.runtime import compile_cache
  from specjax.kernels import native
  from specjax.checkpoints import resolve
  t0 = time.perf_counter()
  resolve(name_or_path)     # a bad name or path fails here, before anything starts in the background
  native.start_build()      # a first run compiles the CPU kernels while the weights load
  loaded = load_model(name_or_path, dtype=_DTYPES[dtype], quantize_to=quantize_to)
  compile_cache.enable()    # registers the kernels before any cached executable can be read
  from specjax.measure import kernel_paths
  kernel_paths.ensure()     # the CPU kernel paths, measured once per machine before anything is traced
  backends = dispatch.resolve(activations=activations)
  if backends.activations != "fp32" and backends.native_quant:   # the integer-dot kernel's layout, made once
    loaded = dataclasses.replace(loaded, params=quant.in_tiles(loaded.params, loaded.cfg.tie_embeddings))
  m = Model.from_loaded(loaded)
  m.cfg = m.cfg.replace(backends=backends)   # made once, rides in the config
  m.load_s = time.perf_counter() - t0
  return m
