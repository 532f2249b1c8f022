"""The drafter of a decode, built through the drafter registry with the inputs its kind needs: the
registry's default draft model, a trained head, a layer subset."""
from __future__ import annotations

import os
from typing import Sequence

import jax

from specjax import buffers, model as model_lib
from specjax.buffers import DEFAULT_MAX_LEN
from specjax.errors import SpecjaxError
from specjax.progress import say
from specjax.runtime.checks import check_same_vocabulary
from specjax.runtime.loaded import Model, load
from specjax.speculative import registry as drafter_registry


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
  buckets = buffers.kv_buckets(max_len)
  kind = drafter_registry.get(drafter)
  if not kind.speculates:
    return drafter_registry.build(kind, m.cfg, m.exec_params, k=0, depth=None, buckets=buckets) + (0,)
  if k < 1:
    raise SpecjaxError(f"--k must be >= 1 for drafter '{drafter}', got {k}")
  if k + 2 > max_len:
    raise SpecjaxError(f"--k {k} needs {k + 1} speculative slots per step, more than the KV cache of "
                       f"{max_len} positions allows: lower --k or raise --max-len")
  if kind.ngram and ngram < 1:
    raise SpecjaxError(f"--ngram must be >= 1, got {ngram}")
  caps = tuple(int(c) for c in (ngram_caps or ())) if kind.ngram_caps else ()
  if any(c < 0 for c in caps):
    raise SpecjaxError(f"--ngram-caps must be counts >= 0, got {','.join(map(str, caps))}")
  if not kind.trees and depth not in (None, k):
    raise SpecjaxError(f"drafter '{drafter}' drafts chains only: drop --tree (or give chain:K)")
  inputs: dict = {}
  if kind.layers:
    inputs["layers"] = parse_layers(draft_layers, m.cfg.num_layers)
  if kind.draft == "head":
    inputs["head"] = _eagle_head(m, draft)
  if kind.draft_model:
    if draft is None:
      draft = default_draft_model(m)
    check_same_vocabulary(m, draft)
    inputs.update(draft_cfg=draft.cfg, draft_params=draft.exec_params)
  d_obj, d_params = drafter_registry.build(kind, m.cfg, m.exec_params, k=k, depth=depth, buckets=buckets,
                                           ngram=ngram, ngram_caps=caps, **inputs)
  return d_obj, d_params, k

def default_draft_model(m: Model) -> Model:
  """The registry's draft for the target ``m`` (loaded once, in the target's dtype, and kept with it)."""
  from specjax.checkpoints import registry
  name = registry.default_draft(m.source)
  if name is None:
    raise SpecjaxError(f"drafter 'model' needs a draft model: pass --draft MODEL ('{m.source}' has no default "
                       "draft in the registry; `specjax models` lists them)")
  key = ("default-draft", name)
  if key not in m._compiled:
    say(f"drafter 'model': loading the registry's draft for {m.source}, {name}")
    m._compiled[key] = load(name, dtype=str(m.dtype))
  return m._compiled[key]

def _eagle_head(m: Model, draft):
  """A trained feature drafter's config and params (a directory from ``specjax train``) for the target ``m``."""
  from specjax.checkpoints import drafter_io
  if draft is None or not isinstance(draft, (str, os.PathLike)):
    raise SpecjaxError("drafter 'eagle' needs a trained drafter: pass --draft DIR (`specjax models` lists "
                       "them; `specjax train configs/eagle_smollm2.gin` makes one)")
  key = ("eagle-params", os.path.abspath(draft))
  if key not in m._compiled:
    ecfg, params, _ = drafter_io.load_drafter(draft, m.cfg, m.params, m.tokenizer, m.source)
    exec_params = model_lib.unstack_layers(params) if jax.default_backend() == "cpu" else params
    m._compiled[key] = (ecfg, exec_params)
  return m._compiled[key]
