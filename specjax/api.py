"""The Python API: load a model, generate, score, tokenize.  The CLI is a thin layer over these functions.

  import specjax
  model = specjax.load("smollm2-135m")
  outputs, stats = specjax.generate(model, ["Name three primary colours."], max_new_tokens=64)
  print(outputs[0].text)
  print(specjax.score(model, "The cat sat on the mat.").perplexity)
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import costmodel, decode, distributed, machine, model as model_lib, sampling
from specjax import speculative as spec
from specjax.speculative import hybrid, tree_shapes
from specjax.speculative.drafters import DynamicShape, shape_for
from specjax.checkpoints import LoadedModel, Tokenizer, load_model
from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.kv_cache import init_cache
from specjax.prompts import Prompt

DEFAULT_MAX_LEN = 2048
PROMPT_BUCKET = 64     # prompts are right-padded to a multiple of this (a few compiled prefill shapes)


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
  _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

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
    """The dtype of the weights, which the KV buffers and activations follow (``--dtype``)."""
    return jnp.dtype(jax.tree_util.tree_leaves(self.params)[0].dtype)

  @property
  def weight_bytes(self) -> int:
    return model_lib.param_bytes(self.params)


def on_mesh(m: Model, mesh) -> Model:
  """The model with its parameters sharded over ``mesh`` (a ``jax.sharding.Mesh`` or 'DATAxMODEL'), by
  ``sharding.RULES``; the decode loop then runs the stacked sharded parameters too (GSPMD partitions both)."""
  from specjax import sharding
  mesh = sharding.make_mesh(mesh) if isinstance(mesh, str) else mesh
  params = sharding.shard_params(m.params, mesh)
  return dataclasses.replace(m, params=params, exec_params=params, mesh=mesh, _compiled={})


def default_exec_params(params):
  """On the CPU, per-layer arrays (see ``model.unstack_layers``), cut as views of the stacked ones: no copy,
  no XLA dispatch; elsewhere the stacked parameters themselves."""
  if jax.default_backend() != "cpu":
    return params
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  host = jax.tree_util.tree_map(np.asarray, layers)       # zero-copy views of CPU buffers
  L = jax.tree_util.tree_leaves(host)[0].shape[0]
  per_layer = [jax.tree_util.tree_map(lambda x, i=i: jax.device_put(x[i], may_alias=True), host)
               for i in range(L)]
  return {**params, "layers": per_layer}


_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def default_dtype(backend: str | None = None) -> str:
  """What ``dtype="auto"`` means: bfloat16 on accelerators (GPU, TPU: their matmul units and bandwidth are
  built for it), float32 on the CPU (where the native kernels are fp32)."""
  return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def load(name_or_path: str, dtype: str = "auto") -> Model:
  """Load a registry model (downloaded once), a GGUF file or a Hugging Face safetensors directory, with
  weights (and so KV buffers and activations) in ``dtype``: float32, bfloat16 or auto (``default_dtype``)."""
  if dtype == "auto":
    dtype = default_dtype()
  if dtype not in _DTYPES:
    raise SpecjaxError(f"unknown dtype '{dtype}': use one of auto, {', '.join(sorted(_DTYPES))}")
  from specjax import compile_cache
  from specjax.kernels import native
  from specjax.checkpoints import resolve
  t0 = time.perf_counter()
  resolve(name_or_path)     # a bad name or path fails here, before anything starts in the background
  native.start_build()      # a first run compiles the CPU kernels while the weights load
  loaded = load_model(name_or_path, dtype=_DTYPES[dtype])
  compile_cache.enable()    # registers the kernels before any cached executable can be read
  m = Model.from_loaded(loaded)
  m.load_s = time.perf_counter() - t0
  return m


# ----------------------------------------------------------------------------------------------------------
# Generation


@dataclasses.dataclass
class Generation:
  question_id: Any
  prompt: str
  text: str
  token_ids: list[int]
  prompt_tokens: int
  iteration_starts: list[int] = dataclasses.field(default_factory=list)   # see below
  """Positions (in prompt + reply) of the tokens that rooted a decoding iteration: the contexts in which the
  drafter's first draft was judged (its measured first-position acceptance averages over these)."""


def _round_up(n: int, m: int) -> int:
  return max(m, -(-n // m) * m)


def encode_prompts(m: Model, prompts: Sequence[str | Prompt], chat: bool = True) -> list[list[int]]:
  texts = [p.text if isinstance(p, Prompt) else p for p in prompts]
  return [m.tokenizer.encode_chat(t) if chat else m.tokenizer.encode(t) for t in texts]


AUTO_MAX_LEN_LIMIT = 1 << 20     # only for checking a tree spec before the buffer size is known


def device_memory_bytes() -> float:
  """Memory the buffers may use: the accelerator's (bytes_limit), or the machine's RAM on the CPU."""
  dev = jax.devices()[0]
  try:
    stats = dev.memory_stats() or {}
  except Exception:  # noqa: BLE001 -- the CPU client has no memory stats
    stats = {}
  if stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  try:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    return float("inf")


def check_memory(m: "Model", max_len: int, nodes: int, batch_size: int, draft_cfg=None, sampling_: bool = False,
                 budget: float | None = None) -> None:
  """Refuse buffers whose bill (target and draft KV with speculative headroom, logits workspace, weights)
  would not fit the memory budget, before anything is allocated."""
  dtype = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}.get(
      jnp.dtype(jax.tree_util.tree_leaves(m.params)[0].dtype), "float32")
  bill = costmodel.kv_bill(m.cfg, max_len, nodes, draft_cfg, dtype, sampling_)
  costmodel.check_budget(budget if budget is not None else device_memory_bytes(), bill, batch_size,
                         what=f"KV buffers of {max_len} slots")


def check_fits(prompt_lens: Sequence[int], max_new_tokens: int, max_len: int, extra: int = 0) -> None:
  longest = max(prompt_lens)
  if longest + max_new_tokens + extra > max_len:
    raise SpecjaxError(
        f"prompt of {longest} tokens + {max_new_tokens} new tokens"
        + (f" + {extra} speculative slots" if extra else "")
        + f" does not fit the KV cache of {max_len} positions: raise --max-len or shorten the prompt "
        "or --max-new-tokens")


def prompt_bucket(n: int) -> int:
  """Padded prompt length: 64, 128, 192, 256, then steps of a quarter of the power of two below (few shapes
  to compile, at most ~25% padding)."""
  if n <= 4 * PROMPT_BUCKET:
    return _round_up(n, PROMPT_BUCKET)
  step = 1 << (n.bit_length() - 3)
  return _round_up(n, step)


def pad_batch(token_lists: Sequence[Sequence[int]], batch_size: int, pad_to: int | None = None):
  """Right-pad prompts into [B, P] (P from ``prompt_bucket`` unless given); missing rows repeat the last."""
  rows = list(token_lists) + [token_lists[-1]] * (batch_size - len(token_lists))
  P = pad_to or prompt_bucket(max(len(r) for r in rows))
  arr = np.zeros((batch_size, P), np.int32)
  for i, r in enumerate(rows):
    arr[i, :len(r)] = r
  return arr, np.array([len(r) for r in rows], np.int32)


DRAFTERS = ("none", "ngram", "layerskip", "model", "hybrid", "eagle")
MODEL_DRAFTERS = ("model", "hybrid")   # drafters that run a separate draft model (``--draft``, its memory bill)
# Draft at most 1 token after a 1-token n-gram match and 3 after a 2-token one (k after longer matches).
# Chosen by replaying prompt lookup on greedy outputs (docs/BENCHMARKS.md, "Verification widths").
DEFAULT_NGRAM_CAPS = (1, 3)


def parse_layers(spec, num_layers: int) -> tuple[int, ...]:
  """``--draft-layers``: an int L (the first L layers) or a list / comma string of layer indices."""
  if spec is None:
    spec = max(1, num_layers // 2)
  if isinstance(spec, str):
    spec = [int(x) for x in spec.split(",") if x.strip()] if "," in spec else int(spec)
  layers = tuple(range(spec)) if isinstance(spec, int) else tuple(int(i) for i in spec)
  if not layers or any(not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
    raise SpecjaxError(f"--draft-layers {spec!r}: give a count 1..{num_layers} or distinct layer indices in "
                       f"[0, {num_layers})")
  return layers


def build_drafter(m: Model, drafter: str = "none", *, k: int = 4, ngram: int = 3, draft_layers=None,
                  draft: "Model | str | None" = None, max_len: int = DEFAULT_MAX_LEN,
                  ngram_caps: Sequence[int] | None = DEFAULT_NGRAM_CAPS, depth: int | None = None):
  """(drafter, draft_params, k_max) for a drafter name; bad combinations raise SpecjaxError.

  ``draft``: the draft model (``model``) or a trained drafter's directory (``eagle``).  ``depth``: the
  deepest tree node drafted (default k, a chain).

  ``ngram_caps``: proposals allowed after an n-gram match of only 1, 2, ... tokens (see ``NgramDrafter``);
  ``None`` or ``()`` drafts k after any match."""
  buckets = decode.kv_buckets(max_len)
  if drafter not in DRAFTERS:
    raise SpecjaxError(f"unknown drafter '{drafter}': choose one of {', '.join(DRAFTERS)}")
  if drafter == "none":
    return spec.NoDrafter(), (), 0
  if k < 1:
    raise SpecjaxError(f"--k must be >= 1 for drafter '{drafter}', got {k}")
  if k + 2 > max_len:
    raise SpecjaxError(f"--k {k} needs {k + 1} speculative slots per step, more than the KV cache of "
                       f"{max_len} positions allows: lower --k or raise --max-len")
  if drafter == "ngram":
    if ngram < 1:
      raise SpecjaxError(f"--ngram must be >= 1, got {ngram}")
    caps = tuple(int(c) for c in (ngram_caps or ()))
    if any(c < 0 for c in caps):
      raise SpecjaxError(f"--ngram-caps must be counts >= 0, got {','.join(map(str, caps))}")
    return spec.NgramDrafter(max_ngram=ngram, match_caps=caps), (), k
  if drafter == "layerskip":
    layers = parse_layers(draft_layers, m.cfg.num_layers)
    cfg = m.cfg.replace(name=f"{m.cfg.name}-layers{'_'.join(map(str, layers))}", num_layers=len(layers))
    return (spec.ModelDrafter(cfg, name="layerskip", buckets=buckets),
            spec.layer_subset(m.exec_params, layers), k)
  if drafter == "eagle":
    return _eagle_drafter(m, draft, depth or k, buckets) + (k,)
  if draft is None:
    draft = default_draft_model(m)
  check_same_vocabulary(m, draft)
  if drafter == "hybrid":
    if ngram < 1:
      raise SpecjaxError(f"--ngram must be >= 1, got {ngram}")
    if depth not in (None, k):
      raise SpecjaxError("drafter 'hybrid' drafts chains only: drop --tree (or give chain:K)")
    return hybrid.hybrid_drafter(draft.cfg, k, min_match=ngram, buckets=buckets), draft.exec_params, k
  return spec.ModelDrafter(draft.cfg, name="model", buckets=buckets), draft.exec_params, k


def default_draft_model(m: Model) -> Model:
  """The registry's draft for the target ``m`` (loaded once, in the target's dtype, and kept with it)."""
  from specjax.checkpoints import registry
  name = registry.default_draft(m.source)
  if name is None:
    raise SpecjaxError(f"drafter 'model' needs a draft model: pass --draft MODEL ('{m.source}' has no default "
                       "draft in the registry; `specjax models` lists them)")
  key = ("default-draft", name)
  if key not in m._compiled:
    _log(f"drafter 'model': loading the registry's draft for {m.source}, {name}")
    m._compiled[key] = load(name, dtype=str(m.dtype))
  return m._compiled[key]


def _eagle_drafter(m: Model, draft, depth: int, buckets):
  """A trained feature drafter (a directory from ``specjax train``) for the target ``m``."""
  from specjax.checkpoints import drafter_io
  if draft is None or not isinstance(draft, (str, os.PathLike)):
    raise SpecjaxError("drafter 'eagle' needs a trained drafter: pass --draft DIR (`specjax models` lists "
                       "them; `specjax train configs/eagle_smollm2.gin` makes one)")
  key = ("eagle-params", os.path.abspath(draft))
  if key not in m._compiled:
    ecfg, params, _ = drafter_io.load_drafter(draft, m.cfg, m.params, m.tokenizer, m.source)
    exec_params = model_lib.unstack_layers(params) if jax.default_backend() == "cpu" else params
    m._compiled[key] = (ecfg, exec_params)
  ecfg, params = m._compiled[key]
  return spec.EagleDrafter(ecfg.layer_cfg, name="eagle", buckets=buckets, ecfg=ecfg, max_depth=depth), params


def check_same_vocabulary(target: Model, draft: Model) -> None:
  tv, dv = target.tokenizer.vocab_size, draft.tokenizer.vocab_size
  if target.cfg.vocab_size != draft.cfg.vocab_size or tv != dv:
    raise SpecjaxError(f"draft model '{draft.source}' has a vocabulary of {draft.cfg.vocab_size} tokens but the "
                       f"target '{target.source}' has {target.cfg.vocab_size}: a draft must share the "
                       "target's tokenizer")
  sample = ["Hello world", " the", "<|im_end|>", "123 + 456 = 579", "naïve café"]
  if any(target.tokenizer.encode(t) != draft.tokenizer.encode(t) for t in sample):
    raise SpecjaxError(f"draft model '{draft.source}' tokenizes text differently from the target "
                       f"'{target.source}': a draft must share the target's tokenizer")


def _log(message: str) -> None:
  sys.stderr.write(f"[specjax] {message}\n")   # one write per line: helper threads may log too
  sys.stderr.flush()


def _shape_key(engine: spec.Engine) -> str:
  key = f"{engine.drafter.name} k={engine.k_max}"
  if engine.tree is not None:
    key += f" ({type(engine.tree).__name__}, depth {engine.depth})"
  return key


def _sharded_jits(mesh, batch_size: int):
  """jit builders for the prefill and the decode loop on ``mesh`` with explicit out_shardings (from the
  abstract output: ``sharding.state_shardings``); inputs carry theirs as ShapeDtypeStruct shardings."""
  from specjax import sharding

  def init_fn(out_abs):
    return jax.jit(spec.init, static_argnames=("engine",), donate_argnames=("cache",),
                   out_shardings=sharding.state_shardings(out_abs, mesh, batch_size))

  def loop_fn(out_abs):
    return jax.jit(spec.decode_loop, static_argnames=("engine",), donate_argnames=("state",),
                   out_shardings=sharding.state_shardings(out_abs, mesh, batch_size))
  return init_fn, loop_fn


def compile_generate(m: Model, engine: spec.Engine, batch_size: int, prompt_pad: int, max_len: int,
                     draft_params=(), log=_log):
  """The two executables of a generation, each compiled once per shape that matters to it:

    prefill  (``speculative.init``, on ``m.prefill_params``): once per (engine, batch, prompt bucket, buffer
             length)
    decode loop (``speculative.decode_loop``): once per (engine, batch, buffer length), whatever the prompts

  Whatever is missing is lowered here and compiled on two threads at once (XLA compiles on one core each),
  or read back from the persistent compilation cache.  Returns (prefill_fn, loop_fn, seconds spent); call
  ``prefill_fn(m.prefill_params, ...)`` and ``loop_fn(m.exec_params, ...)``.
  """
  from specjax import compile_cache

  init_key = ("init", engine, batch_size, prompt_pad, max_len)
  loop_key = ("loop", engine, batch_size, max_len)
  if init_key in m._compiled and loop_key in m._compiled:
    return m._compiled[init_key], m._compiled[loop_key], 0.0
  t0 = time.perf_counter()
  before = compile_cache.counts()
  from specjax import sharding
  cache = jax.eval_shape(lambda: init_cache(m.cfg, batch_size, max_len, m.dtype))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  if m.mesh is not None:            # the inputs' shardings are part of what is compiled
    cache = sharding.abstract_cache(cache, m.mesh)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding.batch_sharding(s, m.mesh))  # noqa
  B = batch_size
  made = [k for k in (init_key, loop_key) if k not in m._compiled]
  with sharding.use(m.mesh):
    init_args = (m.prefill_params, draft_params, cache, i32(B, prompt_pad), i32(B), i32(B), jax.random.PRNGKey(0))
    todo = {}
    if m.mesh is None:
      init_traced = spec.init_jit.trace(engine, *init_args)
      state_info = init_traced.out_info       # the state's shapes come from the prefill's trace
      if init_key not in m._compiled:
        todo[init_key] = init_traced.lower()
      if loop_key not in m._compiled:
        todo[loop_key] = spec.decode_loop_jit.lower(engine, m.exec_params, draft_params, state_info, i32(B))
    else:
      # On a mesh both executables get explicit shardings: the prefill's state out (KV over data and model,
      # per-sequence arrays over data: sharding.state_shardings), the loop's state in and result out; the
      # two then compile independently, like on one device.
      init_fn, loop_fn = _sharded_jits(m.mesh, B)
      state_abs = jax.eval_shape(functools.partial(spec.init, engine), *init_args)
      state_info = sharding.with_shardings(state_abs, sharding.state_shardings(state_abs, m.mesh, B))
      if init_key not in m._compiled:
        todo[init_key] = init_fn(state_abs).lower(engine, *init_args)
      if loop_key not in m._compiled:
        loop_args = (m.exec_params, draft_params, state_info, i32(B))
        res_abs = jax.eval_shape(functools.partial(spec.decode_loop, engine), *loop_args)
        todo[loop_key] = loop_fn(res_abs).lower(engine, *loop_args)
  if not todo:
    pass
  elif len(todo) == 1:
    (key, lowered), = todo.items()
    m._compiled[key] = lowered.compile()
  else:
    with ThreadPoolExecutor(len(todo)) as pool:
      for key, fn in zip(todo, pool.map(lambda lowered: lowered.compile(), todo.values())):
        m._compiled[key] = fn
  seconds = time.perf_counter() - t0
  what = " and ".join({"init": f"prefill (prompt bucket {prompt_pad})", "loop": "decode loop"}[k[0]]
                      for k in made)
  log(f"{what} for {_shape_key(engine)}, batch {B}, buffer {max_len}: "
      f"{compile_cache.describe(compile_cache.since(before))} in {seconds:.1f}s")
  return m._compiled[init_key], m._compiled[loop_key], seconds


def make_engine(m: Model, drafter, k_max: int, sp: sampling.SamplingParams, eos_ids: tuple[int, ...],
                max_len: int, tree=None) -> spec.Engine:
  """``tree``: the engine's shape (``TreeChoice.shape``: a StaticTree or a DynamicShape with k_max nodes);
  None drafts the chain of k_max."""
  return spec.Engine(cfg=m.cfg, drafter=drafter, k_max=k_max, sp=sp, eos_ids=eos_ids,
                     buckets=decode.kv_buckets(max_len), tree=tree)


# ----------------------------------------------------------------------------------------------------------
# Token trees


@dataclasses.dataclass(frozen=True)
class TreeChoice:
  """A ``--tree`` spec resolved: the parsed spec, the engine's shape and the acceptance vector (if given)."""
  spec: tree_shapes.TreeSpec
  shape: Any                               # StaticTree | DynamicShape
  acc: tuple | None = None                 # a vector, or a per-depth table of them

  @property
  def label(self) -> str:
    return str(self.spec)

  @property
  def num_nodes(self) -> int:
    return self.shape.num_nodes


def load_acceptance(acceptance):
  """An acceptance vector (or depth-conditioned table) from a file written by ``specjax acceptance-vector``,
  or from a list of numbers (or of per-depth lists); None passes through."""
  if acceptance is None:
    return None
  if isinstance(acceptance, (str, os.PathLike)):
    return tree_shapes.load_acceptance_vector(acceptance)
  return tree_shapes.acceptance_tuple(acceptance)


def resolve_tree(tree, acceptance=None, *, drafter: str = "ngram",
                 max_len: int = DEFAULT_MAX_LEN) -> TreeChoice | None:
  """Parse and check a ``--tree`` spec (text or ``TreeSpec``) before any model work; None when no tree is
  given (the chain of ``--k``).  Node i is verified at KV slot length + i, so N + 2 <= max_len."""
  if drafter == "none" and (tree is not None or acceptance is not None):
    flag = "--tree" if tree is not None else "--acceptance"
    raise SpecjaxError(f"{flag} needs a drafter to fill the tree: pass --drafter ngram, layerskip or model")
  acc = load_acceptance(acceptance)
  if tree is None:
    return None
  spec_ = tree if isinstance(tree, tree_shapes.TreeSpec) else _parse_tree(str(tree))
  spec_.check_budget(max_len - 2)
  if not spec_.is_static and acc is not None:
    raise SpecjaxError(f"--acceptance is not used by the dynamic tree '{spec_}' (chosen every step): drop it "
                       "or use --tree sequoia:N")
  return TreeChoice(spec_, shape_for(spec_, acc), acc)


def _parse_tree(text: str) -> tree_shapes.TreeSpec:
  """``parse_tree_spec``, naming the file when a ``paths:`` file does not hold a tree."""
  try:
    return tree_shapes.parse_tree_spec(text)
  except SpecjaxError as e:
    kind, _, file = text.partition(":")
    if kind.strip().lower() != "paths" or file.strip() in str(e):
      raise
    raise SpecjaxError(f"tree paths file '{file.strip()}' is not a tree: {e}") from None


def tree_stats(choice: TreeChoice | None, k_max: int, acceptance=None) -> dict:
  """The tree keys of a result: spec text (``chain:K`` without a tree), nodes N, and τ predicted from the
  acceptance vector for a static tree."""
  if choice is None:
    acc = load_acceptance(acceptance)
    out = {"tree": f"chain:{k_max}", "nodes": k_max}
    shape = tree_shapes.chain(k_max)
  else:
    acc, shape = choice.acc, choice.shape
    out = {"tree": choice.label, "nodes": choice.num_nodes}
  if acc is not None and not isinstance(shape, DynamicShape) and k_max > 0:
    out["predicted_mean_accepted_length"] = tree_shapes.predicted_tau(shape, acc)
  return out


def spec_metrics(stats: spec.SpecStats) -> dict:
  """τ, α, acceptance per tree depth (pos_accepted / pos_reached; ``acceptance_by_position`` is the same list
  under its chain-era name) and per-node accepted counts (node 0: live iterations) from the loop's counters."""
  g = distributed.to_host
  committed, steps = g(stats.committed_B).sum(), g(stats.verify_steps_B).sum()
  drafted, accepted = g(stats.drafted_B).sum(), g(stats.accepted_B).sum()
  reached, pos_acc = g(stats.pos_reached_K), g(stats.pos_accepted_K)
  by_depth = [float(a / r) if r else 0.0 for a, r in zip(pos_acc, reached)]
  return {"mean_accepted_length": float(committed / steps) if steps else 1.0,
          "acceptance_rate": float(accepted / drafted) if drafted else 0.0,
          "acceptance_by_depth": by_depth, "acceptance_by_position": by_depth,   # a chain's depth = position
          "node_accepted": g(stats.node_accepted_N1).tolist(),
          "drafted_tokens": int(drafted), "accepted_tokens": int(accepted),
          "target_forwards": int(g(stats.target_forwards)), "draft_forwards": int(g(stats.draft_forwards)),
          "iterations": int(g(stats.iterations)), "verify_rows_steps": g(stats.verify_rows_K1).tolist()}


def device_inputs(m: Model, batch_size: int, max_len: int, *host_arrays):
  """A fresh KV cache and the per-sequence host arrays [B, ...] on the model's devices: ``device_put``
  (jnp.asarray would compile a copy per new shape), or on a mesh the cache over (data, model) and the arrays
  over data (every process of a multi-process run passes the same whole arrays)."""
  cache = init_cache(m.cfg, batch_size, max_len, m.dtype)
  if m.mesh is None:
    return cache, jax.device_put(host_arrays)
  from specjax import sharding
  return sharding.shard_cache(cache, m.mesh), tuple(sharding.shard_batch(x, m.mesh) for x in host_arrays)


def generate(m: Model, prompts: Sequence[str | Prompt], *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             batch_size: int = 1, chat: bool = True, max_len: int | None = None,
             ignore_eos: bool = False, progress: bool = False, drafter: str = "none", k: int = 4,
             ngram: int = 3, draft_layers=None, draft: Model | None = None,
             ngram_caps: Sequence[int] | None = DEFAULT_NGRAM_CAPS, tree=None,
             acceptance=None, memory_budget: float | None = None,
             mesh=None) -> tuple[list[Generation], dict]:
  """Generate a reply for every prompt (batched, each batch one on-device loop), optionally speculatively.

  ``mesh`` ('DATAxMODEL' or a jax Mesh): run sharded over that many devices (``sharding``; batches over
  "data", heads and FFN columns over "model"); the tokens are the single device's.

  ``drafter`` is ``none`` (plain decoding), ``ngram`` (prompt lookup, ``ngram`` = longest n), ``layerskip``
  (the target's own ``draft_layers``: a count of first layers or a list of indices) or ``model`` (``draft``:
  a small model with the same tokenizer); ``k`` tokens are drafted per step, in a chain, unless ``tree``
  (a spec such as ``branch:4,2``, ``sequoia:16`` or ``dynamic:16``; see ``tree_shapes``) gives the token tree
  of N draft nodes (``k`` is then ignored).  ``acceptance`` (a file or a list) feeds ``sequoia`` trees.
  Returns the generations and stats: new tokens; seconds spent loading the model (``load_s``), compiling or
  reading executables from the compilation cache (``compile_s``), in prefill (``prefill_s``, which also
  samples each sequence's first token) and in the decode loops (``decode_s``); tokens/s over prefill and
  decoding; τ, α, acceptance per tree depth, forward counts; the tree (``chain:K`` without one) and N.

  ``max_len`` (KV slots per sequence) defaults to what the request needs: the longest prompt +
  ``max_new_tokens`` + the speculative headroom, rounded up to a power of two ≥ 256
  (``costmodel.buffer_length``).  The buffers' bill (``costmodel.kv_bill``) must fit ``memory_budget`` bytes
  (default: the device's memory), else a SpecjaxError says which batch would fit.
  """
  if max_new_tokens < 1:
    raise SpecjaxError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
  if batch_size < 1:
    raise SpecjaxError(f"--batch-size must be >= 1, got {batch_size}")
  try:
    sp = sampling.SamplingParams(temperature, top_k, top_p)
  except ValueError as e:
    raise SpecjaxError(str(e)) from e
  if not prompts:
    raise SpecjaxError("no prompts given")
  if drafter in MODEL_DRAFTERS and draft is None:
    draft = default_draft_model(m)        # the registry's draft for the target (or a clear error)
  if mesh is not None:
    m = on_mesh(m, mesh)
    if draft is not None:
      draft = on_mesh(draft, m.mesh)
  encoded = encode_prompts(m, prompts, chat)
  choice = resolve_tree(tree, acceptance, drafter=drafter, max_len=max_len or AUTO_MAX_LEN_LIMIT)
  nodes = 0 if drafter == "none" else (choice.num_nodes if choice else k)
  if max_len is None:
    max_len = costmodel.buffer_length(max(len(e) for e in encoded), max_new_tokens, max(nodes, 0))
  drafter_obj, draft_params, k_max = build_drafter(
      m, drafter, k=choice.num_nodes if choice else k, ngram=ngram, draft_layers=draft_layers, draft=draft,
      depth=choice.shape.max_depth if choice else None,
      max_len=max_len, ngram_caps=ngram_caps)
  check_fits([len(e) for e in encoded], max_new_tokens, max_len)
  check_memory(m, max_len, k_max, batch_size, draft.cfg if drafter in MODEL_DRAFTERS and draft is not None else None,
               sampling_=temperature > 0, budget=memory_budget)
  eos_ids = () if ignore_eos else tuple(m.tokenizer.eos_token_ids)
  engine = make_engine(m, drafter_obj, k_max, sp, eos_ids, max_len, tree=choice.shape if choice else None)
  key = jax.random.PRNGKey(seed)
  outputs: list[Generation] = []
  stats = {"sequences": len(prompts), "new_tokens": 0, "prompt_tokens": int(sum(map(len, encoded))),
           "load_s": m.load_s + getattr(draft, "load_s", 0.0), "compile_s": 0.0,
           "prefill_s": 0.0, "decode_s": 0.0, "batch_size": batch_size, "max_len": max_len,
           "drafter": drafter, "k": k_max,
           **tree_stats(choice, k_max, acceptance)}
  totals = None
  for start in range(0, len(encoded), batch_size):
    chunk = encoded[start:start + batch_size]
    arr, lens = pad_batch(chunk, batch_size)
    max_new = np.where(np.arange(batch_size) < len(chunk), max_new_tokens, 0).astype(np.int32)
    init_fn, loop_fn, compile_s = compile_generate(m, engine, batch_size, arr.shape[1], max_len, draft_params,
                                                   log=_log if progress else (lambda _: None))
    stats["compile_s"] += compile_s
    key, sub = jax.random.split(key)
    cache, (arr_d, lens_d, max_new_d, k_active) = device_inputs(
        m, batch_size, max_len, arr, lens, max_new, np.full((batch_size,), k_max, np.int32))
    t0 = time.perf_counter()
    state = jax.block_until_ready(init_fn(m.prefill_params, draft_params, cache, arr_d, lens_d, max_new_d, sub))
    t1 = time.perf_counter()
    res = loop_fn(m.exec_params, draft_params, state, k_active)
    seq = distributed.to_host(res.seq_BxS)
    starts = distributed.to_host(res.starts_BxS)
    stats["prefill_s"] += t1 - t0
    stats["decode_s"] += time.perf_counter() - t1
    totals = res.stats if totals is None else jax.tree_util.tree_map(lambda a, b: a + b, totals, res.stats)
    num_new = distributed.to_host(res.num_new_B)
    for i, toks in enumerate(chunk):
      ids = seq[i, len(toks):len(toks) + num_new[i]].tolist()
      p = prompts[start + i]
      outputs.append(Generation(
          question_id=p.question_id if isinstance(p, Prompt) else start + i,
          prompt=p.text if isinstance(p, Prompt) else p,
          text=m.tokenizer.decode(ids), token_ids=ids, prompt_tokens=len(toks),
          iteration_starts=np.flatnonzero(starts[i, :len(toks) + len(ids)]).tolist()))
      stats["new_tokens"] += len(ids)
    if progress:
      print(f"[generate] {min(start + batch_size, len(encoded))}/{len(encoded)} prompts", file=sys.stderr)
  run_s = stats["prefill_s"] + stats["decode_s"]
  stats["tokens_per_s"] = stats["new_tokens"] / run_s if run_s else 0.0
  stats.update(spec_metrics(totals))
  return outputs, stats


def acceptance_tree(ranks: int, depths: int = 1) -> tree_shapes.StaticTree:
  """The measuring tree: the drafter's ``ranks`` best choices under the root and, for ``depths`` > 1, under
  each node of its best-guess path down to depth ``depths`` (``ranks`` x ``depths`` nodes)."""
  return tree_shapes.from_paths([(0,) * d + (r,) for d in range(depths) for r in range(ranks)])


def acceptance_vector(m: Model, prompts: Sequence[str | Prompt], *, drafter: str = "ngram", ranks: int = 8,
                      depths: int = 1, max_new_tokens: int = 64, max_len: int = DEFAULT_MAX_LEN,
                      batch_size: int = 1, ngram: int = 3, draft_layers=None, draft: Model | None = None,
                      ngram_caps: Sequence[int] | None = DEFAULT_NGRAM_CAPS, progress: bool = False) -> dict:
  """The per-rank acceptance vector of a target/drafter pair, measured by greedy speculative decoding with
  ``acceptance_tree(ranks, depths)``: ``acc[r]`` is the fraction of live iterations in which the target's
  token was the drafter's r-th choice.  With ``depths`` > 1 the result also has ``acceptance_table``: row d
  is the same vector at depth d + 1, counted over the iterations whose best-guess path was accepted down to
  depth d (a row never reached repeats the one above).  Returns the JSON that
  ``tree_shapes.load_acceptance_vector`` reads back (it prefers the table)."""
  if drafter == "none":
    raise SpecjaxError("acceptance-vector measures a drafter: pass --drafter ngram, layerskip or model")
  if ranks < 1:
    raise SpecjaxError(f"--ranks must be >= 1, got {ranks}")
  if depths < 1:
    raise SpecjaxError(f"--depths must be >= 1, got {depths}")
  tree = acceptance_tree(ranks, depths)
  label = f"branch:{ranks}" if depths == 1 else f"star of {ranks} at each of {depths} depths"
  spec_ = tree_shapes.TreeSpec("paths", path=f"<{label}>", tree=tree)
  _, stats = generate(m, prompts, max_new_tokens=max_new_tokens, max_len=max_len, batch_size=batch_size,
                      drafter=drafter, ngram=ngram, draft_layers=draft_layers, draft=draft,
                      ngram_caps=ngram_caps, tree=spec_, progress=progress)
  counts_N1 = np.asarray(stats["node_accepted"], dtype=np.float64)
  live = counts_N1[0]
  if live == 0:
    raise SpecjaxError("no speculative iteration ran (every reply ended at its first token): use more prompts "
                       "or a larger --max-new-tokens")
  table, reached = [], []
  for d in range(depths):
    below = live if d == 0 else counts_N1[1 + (d - 1) * ranks]     # the best-guess node at depth d
    if below == 0:
      break
    table.append([float(c / below) for c in counts_N1[1 + d * ranks: 1 + (d + 1) * ranks]])
    reached.append(int(below))
  table += [table[-1]] * (depths - len(table))
  out = {"acceptance_vector": table[0], "model": m.source, "drafter": drafter,
         "ranks": ranks, "depths": depths, "iterations": int(live), "prompts": len(prompts),
         "max_new_tokens": max_new_tokens, "new_tokens": stats["new_tokens"],
         "mean_accepted_length": stats["mean_accepted_length"], "machine": machine.describe()}
  if depths > 1:
    out["acceptance_table"] = table
    out["iterations_by_depth"] = reached
  out.update(_drafter_settings(m, drafter, ngram, draft_layers, draft, ngram_caps))
  return out


def _drafter_settings(m: Model, drafter: str, ngram: int, draft_layers, draft, ngram_caps) -> dict:
  if drafter == "ngram":
    return {"ngram": ngram, "ngram_caps": list(ngram_caps or ())}
  if drafter == "layerskip":
    return {"draft_layers": list(parse_layers(draft_layers, m.cfg.num_layers))}
  return {"draft": draft.source if draft is not None else None}


# ----------------------------------------------------------------------------------------------------------
# Scoring


@dataclasses.dataclass
class ScoreResult:
  token_ids: list[int]
  tokens: list[str]
  logprobs: list[float]       # log p(token i | tokens < i) for i = 2..n
  perplexity: float


@jax.jit
def _next_token_logprobs(logits_BxTxV, tokens_BxT):
  logp = jax.nn.log_softmax(logits_BxTxV[:, :-1].astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens_BxT[:, 1:, None], axis=-1)[..., 0]


def score(m: Model, text: str) -> ScoreResult:
  """Per-token log-probabilities and perplexity of a raw text (no chat template)."""
  ids = m.tokenizer.encode(text)
  if len(ids) < 2:
    raise SpecjaxError("text must have at least two tokens to score")
  if len(ids) > m.cfg.max_position:
    raise SpecjaxError(f"text has {len(ids)} tokens, more than the model's context of "
                       f"{m.cfg.max_position}: score a shorter text")
  T = _round_up(len(ids), PROMPT_BUCKET)
  arr = np.zeros((1, T), np.int32)
  arr[0, :len(ids)] = ids
  fn = m._compiled.get(("score", T))
  if fn is None:
    cfg = m.cfg

    dtype = m.dtype

    def run(params, tokens_1xT):
      cache = init_cache(cfg, 1, T, dtype)
      out = model_lib.forward(params, cfg, tokens_1xT, jnp.arange(T)[None], cache)
      return _next_token_logprobs(out.logits, tokens_1xT)

    fn = m._compiled[("score", T)] = jax.jit(run)
  lp = np.asarray(fn(m.exec_params, jnp.asarray(arr)))[0, :len(ids) - 1].astype(float)
  pieces = [m.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
  return ScoreResult(token_ids=ids, tokens=pieces, logprobs=lp.tolist(),
                     perplexity=float(math.exp(-lp.mean())))


def tokenize(m: Model, text: str) -> list[int]:
  return m.tokenizer.encode(text)
