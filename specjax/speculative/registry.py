"""The drafters specjax knows, by name: what each needs, what it accepts, and how it is built.

This table is the one place a drafter's name is compared.  Every entry point (the CLI, ``api``, ``bench``,
the continuous batcher, the experiments) asks a ``Kind`` what it needs instead:

  kind = registry.get("hybrid")
  kind.draft_model      # True: runs a separate draft model (``--draft MODEL``; its weights and KV in the bill)
  kind.trees            # False: drafts chains only

A new drafter lands here (one ``Kind`` and one builder) and in its own module beside ``drafters.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.speculative import drafters, eagle, hybrid


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

  @property
  def draft_model(self) -> bool:
    """Runs a separate draft model (its weights and KV cache count in the memory bill)."""
    return self.draft == "model"


KINDS = {k.name: k for k in (
    Kind("none", "plain decoding", speculates=False, trees=False, stateless=True),
    Kind("ngram", "prompt lookup: the continuation of the last n tokens' latest earlier occurrence",
         ngram=True, ngram_caps=True, stateless=True),
    Kind("layerskip", "the target's first layers (or a subset) as its own draft", layers=True),
    Kind("model", "a separate draft model sharing the target's tokenizer", draft="model"),
    Kind("hybrid", "prompt lookup where the last n tokens repeat, the draft model elsewhere", draft="model",
         trees=False, ngram=True, priced=False),
    Kind("eagle", "a trained feature drafter reading the target's hidden states", draft="head"),
)}
NAMES = tuple(KINDS)
DRAFT_MODEL_NAMES = tuple(name for name, k in KINDS.items() if k.draft_model)
TREE_NAMES = tuple(name for name, k in KINDS.items() if k.speculates and k.trees)


def get(name: str) -> Kind:
  """The kind of a drafter name, or a one-line error listing the names."""
  try:
    return KINDS[name]
  except (KeyError, TypeError):
    raise SpecjaxError(f"unknown drafter '{name}': choose one of {', '.join(NAMES)}") from None


def draft_flag_help() -> str:
  """Which drafters take ``--draft`` and what it names (for error messages)."""
  model = " or ".join(DRAFT_MODEL_NAMES)
  heads = " or ".join(n for n, k in KINDS.items() if k.draft == "head")
  return f"--drafter {model} (a draft model) or {heads} (a trained drafter's directory)"


def draft_config(kind: Kind, target_cfg: ModelConfig, draft_cfg: ModelConfig | None = None,
                 layers: Sequence[int] | None = None) -> ModelConfig | None:
  """The configuration of what runs per draft token (the cost model prices its forwards); None for lookup."""
  if kind.draft_model:
    return draft_cfg
  if kind.layers:
    return target_cfg.replace(num_layers=len(layers))
  if kind.draft == "head":
    return target_cfg.replace(num_layers=1)
  return None


def build(kind: Kind, target_cfg: ModelConfig, target_params, *, k: int, depth: int | None, buckets,
          ngram: int = 3, ngram_caps: Sequence[int] = (), layers: Sequence[int] | None = None,
          draft_cfg: ModelConfig | None = None, draft_params=None, head: Any = None):
  """(drafter, draft_params) for a kind whose inputs the caller resolved: the draft model's config and params
  (``draft_model``), the target's layer subset (``layers``), a loaded head (``(EagleConfig, params)``)."""
  name = kind.name
  if name == "none":
    return drafters.NoDrafter(), ()
  if name == "ngram":
    return drafters.NgramDrafter(max_ngram=ngram, match_caps=tuple(ngram_caps)), ()
  if name == "layerskip":
    cfg = target_cfg.replace(name=f"{target_cfg.name}-layers{'_'.join(map(str, layers))}", num_layers=len(layers))
    return drafters.ModelDrafter(cfg, name="layerskip", buckets=buckets), drafters.layer_subset(target_params, layers)
  if name == "model":
    return drafters.ModelDrafter(draft_cfg, name="model", buckets=buckets), draft_params
  if name == "hybrid":
    return hybrid.hybrid_drafter(draft_cfg, k, min_match=ngram, buckets=buckets), draft_params
  if name == "eagle":
    ecfg, params = head
    return eagle.EagleDrafter(ecfg.layer_cfg, name="eagle", buckets=buckets, ecfg=ecfg, max_depth=depth or k), params
  raise AssertionError(f"no builder for drafter kind '{name}'")
