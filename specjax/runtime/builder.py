"""The one builder of a decode: a frozen description (``DecodeSpec``) in, an engine and what it runs with
(``Decode``) out; the drafter is built through the drafter registry with the inputs its kind needs (the
registry's default draft model, a trained head, a layer subset).  ``api.generate``, ``bench`` (every method
of a comparison), the continuous batcher (every k bucket) and, through those, training's evaluation and the
experiments all build here, so a drafter, a tree or a check added once reaches every caller.

  spec = DecodeSpec(drafter="model", k=5)                  # or tree="sequoia:16", acceptance=FILE
  d = build(m, spec, eos_ids=eos, prompt_lens=[120, 300], max_new_tokens=256, batch_size=2)
  d.engine, d.draft_params, d.k_max, d.max_len             # what compiled.run_batch takes
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax

from specjax.models import buffers, decoder as model_lib, quant, sampling
from specjax import speculative as spec
from specjax.errors import SpecjaxError
from specjax.progress import say
from specjax.runtime.checks import check_fits, check_memory, check_same_vocabulary, check_vocab_map, same_tokenizer
from specjax.runtime.loaded import Model, load
from specjax.runtime.request import DecodeSpec
from specjax.runtime.request import TreeChoice, tree_stats
from specjax.speculative import registry as drafter_registry
from specjax.speculative.acceptance import SyntheticAcceptance


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


def build_drafter(m: Model, ds: DecodeSpec, *, max_len: int, draft: "Model | str | None" = None):
  """(drafter, draft_params, k_max) of the checked spec ``ds`` for the target ``m`` and a buffer of
  ``max_len`` slots: N = the tree's nodes or k; the deepest node drafted is the tree's depth (k for a chain).

  ``draft``: the draft model (a kind that runs one; default the registry's) or a trained drafter's directory
  (a head kind), its matrices at ``ds.head_weights`` (default the target's, see ``_eagle_head``)."""
  buckets = buffers.kv_buckets(max_len)
  kind, k = ds.kind, ds.nodes
  if not kind.speculates:
    return drafter_registry.build(kind, m.cfg, m.exec_params, k=0, depth=None, buckets=buckets) + (0,)
  ds.check_room(max_len)
  inputs: dict = {}
  if kind.layers:
    inputs["layers"] = parse_layers(ds.draft_layers, m.cfg.num_layers)
  if kind.head:
    inputs["head"] = (_medusa_head(m, draft) if kind.head_layout == "medusa"
                      else _eagle_head(m, draft, ds.head_weights))
  if kind.draft_model:
    if draft is None:
      draft = default_draft_model(m)
    # The draft runs inside the target's program: with its backends (its mesh, where the target is sharded).
    inputs.update(draft_cfg=draft.cfg.replace(backends=m.cfg.backends), draft_params=draft.exec_params,
                  vocab_map=vocabulary_map(m, draft, kind))
  depth = ds.choice.shape.max_depth if ds.choice is not None else None
  d_obj, d_params = drafter_registry.build(kind, m.cfg, m.exec_params, k=k, depth=depth, buckets=buckets,
                                           ngram=ds.ngram, ngram_caps=ds.ngram_caps, index_tokens=ds.index_tokens,
                                           **inputs)
  return d_obj, d_params, k


def vocabulary_map(m: Model, draft: Model, kind, log=say, width: int | None = None):
  """None when ``draft`` shares the target's tokenizer; else the map between their vocabularies
  (``checkpoints/vocab_map.py``), made once per pair and kept with the draft, its mapped share said in one line.
  ``width``: draft tokens a target token is read as (default ``vocab_map.DEFAULT_WIDTH``; another width makes
  the pair's map again).  Refused in one line for a kind that cannot draft across tokenizers, or a pair that
  shares too little."""
  if same_tokenizer(m, draft):
    return None
  if not kind.across_tokenizers:
    across = ", ".join(n for n, k in drafter_registry.KINDS.items() if k.across_tokenizers)
    check_same_vocabulary(m, draft, f" (--drafter {kind.name} reads the target's tokens; --drafter {across} "
                                    "drafts across tokenizers)")
  from specjax.checkpoints import vocab_map
  key = ("vocab-map", m.source, m.cfg.vocab_size)
  kept = draft.companions.get(key)
  if kept is None or (width is not None and kept.width != width):
    vm = vocab_map.build(m.tokenizer, draft.tokenizer, target_vocab=m.cfg.vocab_size,
                         draft_vocab=draft.cfg.vocab_size, width=width or vocab_map.DEFAULT_WIDTH)
    check_vocab_map(vm, m, draft)
    log(vm.summary(m.source, draft.source) + (f" (read as {vm.width} tokens at most)" if width else ""))
    draft.companions[key] = vm
  return draft.companions[key]


def make_engine(m: Model, drafter, k_max: int, sp: sampling.SamplingParams, eos_ids: tuple[int, ...],
                max_len: int, tree=None, verify: str = "tokenwise",
                synthetic_alpha: float | None = None) -> spec.Engine:
  """``tree``: the engine's shape (``TreeChoice.shape``: a StaticTree or a DynamicShape with k_max nodes);
  None drafts the chain of k_max.  ``verify``: the rule for sampled drafts (``acceptance.VERIFY_RULES``);
  ``synthetic_alpha``: instead, each draft kept with that probability (``acceptance.SyntheticAcceptance``)."""
  rule = None if verify == "tokenwise" else spec.rule_for(sp, verify)
  if synthetic_alpha is not None:
    rule = SyntheticAcceptance(synthetic_alpha)
  return spec.Engine(cfg=m.cfg, drafter=drafter, k_max=k_max, sp=sp, eos_ids=eos_ids,
                     buckets=buffers.kv_buckets(max_len), tree=tree, acceptance=rule)


def default_draft_model(m: Model) -> Model:
  """The registry's draft for the target ``m`` (loaded once, in the target's dtype and weight type, and kept
  with it)."""
  return load_draft(m, DecodeSpec(drafter="model"))


def load_draft(m: Model, ds: DecodeSpec, draft=None, weights: str | None = None, log=say):
  """The draft of ``ds`` for the target ``m``: a loaded draft model (``draft``: a registry name or path; None:
  the registry's draft for ``m``, kept with ``m`` so a second decode loads none) at ``weights`` (default: the
  target's weight type and dtype), a trained drafter's directory (a head kind: passed on, loaded by the
  builder), or None (a kind without a draft)."""
  kind = ds.kind
  if kind.head:
    if not draft:
      raise SpecjaxError(f"--drafter {ds.drafter} needs --draft DIR (a trained drafter; `specjax models` lists "
                         "them, `specjax train configs/eagle_smollm2.gin` makes one)")
    return draft
  if not kind.draft_model:
    return None
  if draft is not None and not isinstance(draft, (str, os.PathLike)):
    return draft                              # already loaded
  name, registry_weights = draft, None
  if name is None:
    from specjax.checkpoints import catalog
    name = catalog.default_draft(m.source)
    if name is None:
      raise SpecjaxError(f"drafter '{ds.drafter}' needs a draft model: pass --draft MODEL ('{m.source}' has no "
                         "default draft in the registry; `specjax models` lists them)")
    if jax.default_backend() == "cpu" and weights in (None, "auto"):   # the type it measured fastest at
      registry_weights = catalog.default_draft_weights(m.source, getattr(m, "weights", None))
    log(f"drafter '{ds.drafter}': the registry's draft for {m.source} is {name}"
        + (f" at {registry_weights} (--draft-weights overrides)" if registry_weights else ""))
  if weights in (None, "auto"):
    weights = registry_weights or (m.weights if quant.holds_quantized(getattr(m, "params", {})) else None)
  backends = getattr(getattr(m, "cfg", None), "backends", None)
  acts = {} if backends is None else {"activations": backends.activations}    # the draft follows its target
  key = ("draft", str(name), weights, *acts.values())
  if key not in m.companions:
    log(f"loading draft {name}")
    m.companions[key] = load(str(name), dtype=str(m.dtype), **acts, **({} if weights is None else {"weights": weights}))
  return m.companions[key]


def _eagle_head(m: Model, draft, weights: str | None = None):
  """A trained feature drafter's config and params (a directory from ``specjax train``) for the target ``m``,
  its matrices at ``weights`` (None: the target's weight type).

  A head's draft step streams its decoder layer, its input projections and its head rows (430 MB at fp32 for
  the 1.5B's head of 32k rows), so its weight type is its speed as the target's is the target's: quantized
  here, once per head and type, by ``quant.quantize_params``'s policy (int4 keeps the head rows int8).  The
  embedding is the target's own and stays as the target holds it."""
  from specjax.checkpoints import drafter_io
  if draft is None or not isinstance(draft, (str, os.PathLike)):
    raise SpecjaxError("drafter 'eagle' needs a trained drafter: pass --draft DIR (`specjax models` lists "
                       "them; `specjax train configs/eagle_smollm2.gin` makes one)")
  if weights is None:
    weights = quant.weights_kind(m.params) if quant.holds_quantized(m.params) else "fp32"
  if weights not in quant.KINDS:
    raise SpecjaxError(f"unknown head weight type '{weights}': use one of {', '.join(quant.KINDS)}")
  key = ("eagle-params", os.path.abspath(draft), weights)
  if key not in m.companions:
    ecfg, params, _ = drafter_io.load_drafter(draft, m.cfg, m.params, m.tokenizer, m.source)
    params = quantize_head(params, weights)
    exec_params = model_lib.unstack_layers(params) if jax.default_backend() == "cpu" else params
    m.companions[key] = (ecfg, exec_params)
  return m.companions[key]


def _medusa_head(m: Model, draft):
  """Medusa heads in their published layout (``checkpoints/medusa_io.py``) for the target ``m``, kept with it."""
  from specjax.checkpoints import medusa_io
  if draft is None or not isinstance(draft, (str, os.PathLike)):
    raise SpecjaxError("drafter 'medusa' needs Medusa heads: pass --draft DIR (config.json with "
                       "medusa_num_heads, medusa_lm_head.safetensors)")
  key = ("medusa-params", os.path.abspath(draft))
  if key not in m.companions:
    m.companions[key] = medusa_io.load_medusa(draft, m.cfg)
  return m.companions[key]


def quantize_head(params: dict, kind: str) -> dict:
  """A feature drafter's params with its layer matrices, ``fc``, ``fuse`` and head rows at ``kind`` (a head
  row matrix already quantized, the target's own rows under a quantized target, is kept as it is)."""
  if kind == "fp32":
    return params
  out = dict(params)
  out["layers"] = quant.quantize_params({"layers": params["layers"]}, kind)["layers"]
  for name in ("lm_head", "fc", "fuse"):
    w = params.get(name)
    if w is not None and not quant.is_quantized(w):
      out[name] = quant.quantize_matrix(name, w, kind)
  return out


@dataclasses.dataclass(frozen=True)
class Decode:
  """A decode, built: the engine (static; a jit argument), the draft's params, N, the tree and the buffer."""
  spec: DecodeSpec
  engine: spec.Engine
  draft_params: Any
  k_max: int
  choice: TreeChoice | None
  max_len: int
  draft: Model | None = None                   # the draft model, for a kind that runs one
  draft_layers: tuple[int, ...] | None = None  # layer-skip: the target's layers it drafts with
  target_weights: str | None = None            # the target's weight type (a draft model's differing is labelled)
  vocab_map: Any = None                        # a draft model of another tokenizer: the map it drafts through

  @property
  def label(self) -> str:
    """'model k=5', 'ngram sequoia:16', 'eagle@int8 k=5' (a head, or a draft model, at weights other than the
    target's), 'eagle-parallel k=4' (``--drafter eagle`` given a parallel head's directory), or 'none k=0' for
    plain decoding."""
    weights = self.spec.head_weights
    if self.draft is not None and self.target_weights is not None and self.draft.weights != self.target_weights:
      weights = self.draft.weights
    drafter = drafter_registry.built_name(self.spec.drafter, self.engine.drafter)
    name = drafter if weights is None else f"{drafter}@{weights}"
    return f"{name} k={self.k_max}" if self.choice is None else f"{name} {self.choice.label}"

  def settings(self) -> dict:
    """What a result records about the method: drafter, k (N), the tree and its statistics."""
    out = {"drafter": self.spec.drafter, "k": self.k_max, **tree_stats(self.choice, self.k_max, self.spec.acceptance)}
    if self.draft_layers is not None:
      out["draft_layers"] = list(self.draft_layers)
    if self.spec.head_weights is not None:
      out["head_weights"] = self.spec.head_weights
    if self.draft is not None:
      out["draft_weights"] = self.draft.weights
    if self.vocab_map is not None:
      out["vocab_map"] = self.vocab_map.to_dict()
    return out

  def engine_for(self, k: int, stats_nodes: int) -> spec.Engine:
    """The same drafter at another k (a scheduler's bucket; counters sized for ``stats_nodes``).  k = 0 of a
    stateless drafter is plain decoding; a drafter with a cache keeps it in step by running k = 1 with
    k_active 0."""
    if k == 0 and self.spec.kind.stateless:
      return self.engine._replace(drafter=spec.NoDrafter(), k_max=0, tree=None, stats_nodes=stats_nodes)
    return self.engine._replace(k_max=max(k, 1), tree=None, stats_nodes=stats_nodes)


def check_window(cfg, nodes: int) -> None:
  """A windowed layer's mask starts each query at its window by slot (committed slot j holds position j), which
  reads a token tree's own slots right only while the verified block (N + 1 rows) fits in the window."""
  windows = [w for w in cfg.layer_windows if w]
  if windows and nodes + 1 > min(windows):
    raise SpecjaxError(f"a tree or chain of {nodes} draft tokens verifies {nodes + 1} rows, more than "
                       f"{cfg.name}'s sliding window of {min(windows)} positions: draft fewer tokens")


def build(m: Model, ds: DecodeSpec, *, eos_ids: Sequence[int] = (), max_len: int | None = None,
          prompt_lens: Sequence[int] = (), max_new_tokens: int = 0, batch_size: int | None = None,
          draft: Model | None = None, memory_budget: float | None = None) -> Decode:
  """Build a decode of ``ds`` for the target ``m``.

  ``draft``: the draft model of a kind that runs one (default: the registry's draft for ``m``).
  ``max_len``: KV slots per sequence; None sizes it to the request (``buffers.buffer_length`` of the longest
  of ``prompt_lens`` + ``max_new_tokens`` + the tree's headroom).  With ``prompt_lens`` the prompts are checked
  to fit; with ``batch_size`` the memory bill (buffers of ``max_len`` slots) must fit
  ``memory_budget`` (default: the device's).  Every bad setting raises a one-line SpecjaxError before anything
  is allocated or compiled."""
  kind, choice = ds.kind, ds.choice
  if kind.draft_model and draft is None:
    draft = default_draft_model(m)             # the registry's draft for the target (or a clear error)
  if max_len is None:
    max_len = buffers.buffer_length(max(prompt_lens, default=0), max_new_tokens, ds.nodes)
  check_window(m.cfg, ds.nodes)
  d_obj, d_params, k_max = build_drafter(m, ds, max_len=max_len, draft=draft)
  if prompt_lens:
    check_fits(list(prompt_lens), max_new_tokens, max_len)
  if batch_size is not None:
    check_memory(m, max_len, k_max, batch_size, draft.cfg if kind.draft_model and draft is not None else None,
                 sampling_=not ds.sampling.greedy, budget=memory_budget, drafter=d_obj)
  engine = make_engine(m, d_obj, k_max, ds.sampling, tuple(eos_ids), max_len,
                       tree=choice.shape if choice else None, verify=ds.verify,
                       synthetic_alpha=ds.synthetic_alpha)
  layers = parse_layers(ds.draft_layers, m.cfg.num_layers) if kind.layers else None
  vmap = vocabulary_map(m, draft, kind) if kind.draft_model else None
  return Decode(ds, engine, d_params, k_max, choice, max_len, draft if kind.draft_model else None, layers,
                m.weights, vmap)
