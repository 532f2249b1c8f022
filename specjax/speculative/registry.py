"""The drafters specjax knows, by name: what each needs, what it accepts, and how it is built.

This table is the one place a drafter's name is compared.  Every entry point (the CLI, ``api``, ``bench``,
the continuous batcher, the experiments) asks a ``Kind`` what it needs instead:

  kind = registry.get("hybrid")
  kind.draft_model      # True: runs a separate draft model (``--draft MODEL``; its weights and KV in the bill)
  kind.head             # False: ``--draft`` does not name a trained drafter's directory
  kind.trees            # False: drafts chains only

Every drafter it builds satisfies ``protocol.Drafter``.

A new drafter lands here (one ``Kind`` and one entry in ``_BUILDERS``) and in its own module beside
``drafters.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

from specjax.models.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.speculative import (cross_vocab, dflash, drafters, eagle, eagle_lookup, eagle_parallel, hybrid, medusa,
                                 suffix)
from specjax.speculative.protocol import Drafter


@dataclasses.dataclass(frozen=True)
class Kind:
  name: str
  summary: str
  speculates: bool = True       # False: plain decoding (nothing drafted, nothing verified)
  draft: str | None = None      # what ``--draft`` names: "model" (a draft model sharing the target's tokenizer),
                                # "head" (a trained drafter's directory), None (nothing)
  trees: bool = True            # drafts token trees (else chains only)
  ngram: bool = False           # takes ``--ngram`` (the length of the match it looks up)
  ngram_caps: bool = False      # takes ``--ngram-caps``
  layers: bool = False          # takes ``--draft-layers`` (a subset of the target's layers)
  stateless: bool = False       # keeps no draft cache (k = 0 may run a plain engine beside it)
  priced: bool = True           # the cost model prices its chains (a hybrid's steps mix free and model drafts)
  learns: bool = False          # its draft params are an index of finished sequences (``absorb`` them)
  head_layout: str = "specjax"  # a head kind's directory: "specjax" (``specjax train``; a published EAGLE layout
                                # loads there too), "medusa" (published Medusa heads) or "dflash" (published DFlash)
  across_tokenizers: bool = False  # its draft model may have another tokenizer (``cross_vocab``, a vocabulary map)

  @property
  def draft_model(self) -> bool:
    """Runs a separate draft model (its weights and KV cache count in the memory bill)."""
    return self.draft == "model"

  @property
  def dflash(self) -> bool:
    """Reads a published DFlash drafter's directory (``--draft DIR``)."""
    return self.head_layout == "dflash"

  @property
  def head(self) -> bool:
    """Reads a trained drafter (an EAGLE head): ``--draft`` names its directory."""
    return self.draft == "head"


KINDS = {k.name: k for k in (
    Kind("none", "plain decoding", speculates=False, trees=False, stateless=True),
    Kind("ngram", "prompt lookup: the continuation of the last n tokens' latest earlier occurrence",
         ngram=True, ngram_caps=True, stateless=True),
    Kind("layerskip", "the target's first layers (or a subset) as its own draft", layers=True),
    Kind("model", "a separate draft model (another tokenizer drafts through a vocabulary map)", draft="model",
         across_tokenizers=True),
    Kind("hybrid", "prompt lookup where the last n tokens repeat, the draft model elsewhere", draft="model",
         trees=False, ngram=True, priced=False),
    Kind("eagle", "a trained feature drafter reading the target's hidden states (a parallel one if its "
         "directory says so)", draft="head"),
    Kind("eagle-parallel", "a trained parallel feature drafter: all K draft positions in one forward",
         draft="head"),
    Kind("eagle-hybrid", "prompt lookup where the last n tokens repeat, a trained feature drafter elsewhere",
         draft="head", trees=False, ngram=True, priced=False),
    Kind("medusa", "Medusa-1 heads (published layout) on the target's last hidden state, one per depth",
         draft="head", head_layout="medusa"),
    Kind("dflash", "a DFlash drafter (published layout): non-causal layers over a block of mask tokens, reading the "
         "target's features; a whole block in one forward", draft="head", head_layout="dflash"),
    Kind("suffix", "suffix decoding: the most frequent continuations of the longest suffix match in earlier "
         "requests and the batch", stateless=True, learns=True),
)}
NAMES = tuple(KINDS)
DRAFT_MODEL_NAMES = tuple(name for name, k in KINDS.items() if k.draft_model)
TREE_NAMES = tuple(name for name, k in KINDS.items() if k.speculates and k.trees)
SPECULATING_NAMES = tuple(name for name, k in KINDS.items() if k.speculates)


def get(name: str) -> Kind:
  """The kind of a drafter name, or a one-line error listing the names."""
  try:
    return KINDS[name]
  except (KeyError, TypeError):
    raise SpecjaxError(f"unknown drafter '{name}': choose one of {', '.join(NAMES)}") from None


def speculating_help() -> str:
  """The drafters that draft, as an error message's advice: "--drafter ngram, layerskip, model, ..."."""
  return "--drafter " + ", ".join(SPECULATING_NAMES)


def draft_flag_help() -> str:
  """Which drafters take ``--draft`` and what it names (for error messages)."""
  model = " or ".join(DRAFT_MODEL_NAMES)
  heads = " or ".join(n for n, k in KINDS.items() if k.head)
  return f"--drafter {model} (a draft model) or {heads} (a trained drafter's directory)"


def built_name(name: str, drafter) -> str:
  """The name a result gives a drafter built as ``name``: ``eagle`` given a parallel head's directory builds
  the parallel drafter, and is named for it (``eagle-parallel``); every other kind keeps its name."""
  if name == "eagle" and getattr(drafter, "name", name) == "eagle-parallel":
    return "eagle-parallel"
  return name


def absorb(drafter, draft_params, sequences):
  """The draft params after ``sequences`` (finished prompt + output token ids) have been seen: a learning
  drafter's index grows (same shapes, nothing recompiles); every other drafter's params are returned as they
  are."""
  return drafter.absorb(draft_params, sequences) if learns(drafter) else draft_params


def learns(drafter) -> bool:
  """Whether a built drafter learns from finished sequences (its kind's ``learns``: it has ``absorb``)."""
  return hasattr(drafter, "absorb")


def draft_config(kind: Kind, target_cfg: ModelConfig, draft_cfg: ModelConfig | None = None,
                 layers: Sequence[int] | None = None) -> ModelConfig | None:
  """The configuration of what runs per draft token (the cost model prices its forwards); None for lookup."""
  if kind.draft_model:
    return draft_cfg
  if kind.layers:
    return target_cfg.with_layers(layers)
  if kind.head:
    return target_cfg.as_llama(num_layers=1)
  return None


def build(kind: Kind, target_cfg: ModelConfig, target_params, *, k: int, depth: int | None, buckets,
          ngram: int = 3, ngram_caps: Sequence[int] = (), layers: Sequence[int] | None = None,
          draft_cfg: ModelConfig | None = None, draft_params=None, head: Any = None,
          index_tokens: int | None = None, vocab_map: Any = None) -> tuple[Drafter, Any]:
  """(drafter, draft_params) for a kind whose inputs the caller resolved: the draft model's config and params
  (``draft_model``), the target's layer subset (``layers``), a loaded head (``(EagleConfig, params)``), a
  learning drafter's index size in token slots (``index_tokens``, default its own), a draft model's map to
  the target's vocabulary when its tokenizer is another (``vocab_map``: ``checkpoints.vocab_map.VocabMap``)."""
  inputs = _Inputs(target_cfg, target_params, k, depth, buckets, ngram, tuple(ngram_caps), layers, draft_cfg,
                   draft_params, head, index_tokens, vocab_map)
  return _BUILDERS[kind.name](inputs)


class _Inputs(NamedTuple):
  target_cfg: ModelConfig
  target_params: Any
  k: int
  depth: int | None
  buckets: Any
  ngram: int
  ngram_caps: tuple[int, ...]
  layers: Sequence[int] | None
  draft_cfg: ModelConfig | None
  draft_params: Any
  head: Any
  index_tokens: int | None
  vocab_map: Any = None


def _layerskip(x: _Inputs):
  cfg = x.target_cfg.with_layers(x.layers, name=f"{x.target_cfg.name}-layers{'_'.join(map(str, x.layers))}")
  return drafters.ModelDrafter(cfg, name="layerskip", buckets=x.buckets), drafters.layer_subset(x.target_params,
                                                                                                x.layers)


def _feature_head(x: _Inputs, name: str):
  """The loaded head for an EAGLE kind, refused in one line when its directory holds a DFlash drafter."""
  if isinstance(x.head[0], dflash.DFlashConfig):
    raise SpecjaxError(f"drafter '{name}' reads an EAGLE head; this directory holds a DFlash drafter: use "
                       "--drafter dflash")
  return x.head


def _eagle(x: _Inputs):
  ecfg, params = _feature_head(x, "eagle")
  if ecfg.parallel:
    return _eagle_parallel(x)
  return (eagle.EagleDrafter(ecfg.layer_cfg, name="eagle", buckets=x.buckets, ecfg=ecfg, max_depth=x.depth or x.k),
          params)


def _eagle_parallel(x: _Inputs):
  ecfg, params = _feature_head(x, "eagle-parallel")
  depth = x.depth or x.k
  if not ecfg.parallel:
    raise SpecjaxError("drafter 'eagle-parallel' needs a parallel drafter (trained with train_eagle.parallel = "
                       "K); this directory holds a sequential one: use --drafter eagle")
  if depth > ecfg.parallel:
    raise SpecjaxError(f"the parallel drafter drafts {ecfg.parallel} positions per forward; --k/--tree asks for "
                       f"depth {depth}: use --k {ecfg.parallel} or a tree at most {ecfg.parallel} deep")
  return (eagle_parallel.ParallelEagleDrafter(ecfg.layer_cfg, buckets=x.buckets, ecfg=ecfg,
                                              max_depth=ecfg.parallel), params)


def _eagle_hybrid(x: _Inputs):
  ecfg, params = _feature_head(x, "eagle-hybrid")
  if ecfg.parallel:
    raise SpecjaxError("drafter 'eagle-hybrid' pairs prompt lookup with a sequential head; this directory holds a "
                       f"parallel one ({ecfg.parallel} positions): use --drafter eagle-parallel, or a sequential head")
  return (eagle_lookup.EagleLookupDrafter(ecfg.layer_cfg, buckets=x.buckets, ecfg=ecfg, max_depth=x.depth or x.k,
                                          min_match=x.ngram), params)


def _medusa(x: _Inputs):
  mcfg, params = x.head
  depth = x.depth or x.k
  if depth > mcfg.num_heads:
    raise SpecjaxError(f"{mcfg.num_heads} Medusa heads draft {mcfg.num_heads} deep; --k/--tree asks for depth "
                       f"{depth}: use --k {mcfg.num_heads} or a tree at most {mcfg.num_heads} deep")
  return medusa.MedusaDrafter(x.target_cfg, buckets=x.buckets, mcfg=mcfg), params


def _dflash(x: _Inputs):
  dcfg, params = x.head
  if not isinstance(dcfg, dflash.DFlashConfig):
    raise SpecjaxError("drafter 'dflash' needs a DFlash drafter's directory (config.json with dflash_config); this "
                       "one holds an EAGLE head: use --drafter eagle")
  depth = x.depth or x.k
  if depth > dcfg.max_depth:
    raise SpecjaxError(f"the DFlash drafter drafts blocks of {dcfg.block_size} (depth {dcfg.max_depth}); --k/--tree "
                       f"asks for depth {depth}: use --k {dcfg.max_depth} or a tree at most {dcfg.max_depth} deep")
  return dflash.DFlashDrafter(dcfg.layer, buckets=x.buckets, dcfg=dcfg, max_depth=depth), params


# One builder per kind (a new drafter: a Kind above and its builder here).
_BUILDERS = {
    "none": lambda x: (drafters.NoDrafter(), ()),
    "ngram": lambda x: (drafters.NgramDrafter(max_ngram=x.ngram, match_caps=x.ngram_caps), ()),
    "layerskip": _layerskip,
    "model": lambda x: ((drafters.ModelDrafter(x.draft_cfg, name="model", buckets=x.buckets), x.draft_params)
                        if x.vocab_map is None else
                        cross_vocab.build(x.draft_cfg, x.draft_params, x.vocab_map, x.target_cfg, x.buckets)),
    "hybrid": lambda x: (hybrid.hybrid_drafter(x.draft_cfg, x.k, min_match=x.ngram, buckets=x.buckets),
                         x.draft_params),
    "eagle": _eagle,
    "eagle-parallel": _eagle_parallel,
    "eagle-hybrid": _eagle_hybrid,
    "medusa": _medusa,
    "dflash": _dflash,
    "suffix": lambda x: (suffix.SuffixDrafter(), suffix.empty_index(x.index_tokens or suffix.DEFAULT_CORPUS_TOKENS)),
}
assert set(_BUILDERS) == set(KINDS), "every drafter kind needs a builder"
