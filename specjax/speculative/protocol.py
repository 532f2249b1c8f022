"""What the engine asks of a drafter (``Drafter``), and what some drafters add (``FeatureDrafter``,
``LearningDrafter``).

A drafter is a frozen dataclass: static and hashable (it rides in ``Engine``, a jit static argument).  Its
parameters and its state are pytrees passed in and returned, never kept on the drafter.  Every drafter the
registry builds satisfies ``Drafter`` (``tests/speculative/test_drafter_registry.py``): ``NoDrafter``, ``NgramDrafter``,
``ModelDrafter`` (a draft model, or layer-skip), ``CrossVocabDrafter`` (a draft model of another tokenizer),
``HybridDrafter``, ``EagleDrafter``, ``ParallelEagleDrafter``, ``EagleLookupDrafter``, ``MedusaDrafter``,
``DFlashDrafter`` and ``SuffixDrafter``.

One step, as ``engine.spec_step`` calls it:

  state, draft = drafter.propose(draft_params, state, seq_BxS, lengths_B, last_B, shape, key, sp)
  ...the target verifies ``draft``; the acceptance rule picks a path...
  state = drafter.commit(state, lengths_B, path_slots_BxD1, new_lengths_B)

``lengths_B`` is the target cache's committed length: ``seq_BxS[:, :lengths + 1]`` is known, and
``seq[b, lengths[b]] == last_B[b]`` is the newest token, the tree's root, in no cache yet.  Shape letters: the
legend in ``engine.py``.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, TypeAlias, Union, runtime_checkable

import jax

from specjax.models.kv_cache import KVCache
from specjax.models.sampling import SamplingParams
from specjax.models.sampling_rows import RowSampling
from specjax.speculative.cross_vocab import CrossVocabState
from specjax.speculative.drafters import Draft, DynamicShape
from specjax.speculative.eagle import EagleState
from specjax.speculative.eagle_lookup import EagleLookupState
from specjax.speculative.hybrid import HybridState
from specjax.speculative.medusa import MedusaState
from specjax.speculative.trees.static import StaticTree

DraftState: TypeAlias = Union[tuple[()], KVCache, EagleState, HybridState, EagleLookupState, MedusaState,
                              CrossVocabState]
"""A drafter's state between steps (a pytree; ``SpecState.draft``), as its ``init`` makes it: ``()`` for the
drafters that keep none (``NoDrafter``, ``NgramDrafter``, ``SuffixDrafter``: they read the engine's sequence
buffer), the draft model's own KV cache (``ModelDrafter``), ``EagleState`` (``EagleDrafter``,
``ParallelEagleDrafter``; ``DFlashDrafter``'s context cache), ``HybridState`` (``HybridDrafter``),
``EagleLookupState`` (``EagleLookupDrafter``), ``MedusaState`` (``MedusaDrafter``: the root's producing hidden
state), ``CrossVocabState`` (``CrossVocabDrafter``: a draft model of another tokenizer, its cache in its own
spelling)."""

DraftShape: TypeAlias = Union[StaticTree, DynamicShape]
"""The tree a step drafts: a static shape (chain, branching, paths, Sequoia) or one chosen every step."""

DraftSampling: TypeAlias = Union[SamplingParams, RowSampling]
"""The sampling rule: one for the batch (static), or each row's settings as data (per-row mode)."""

DraftParams: TypeAlias = Any
"""A drafter's parameters (a pytree): a draft model's weights, a feature head's, the suffix index, or ``()``."""


@runtime_checkable
class Drafter(Protocol):
  """Everything the engine, the memory bill and the results call on any drafter."""

  name: str                               # what results call it ("ngram", "eagle-parallel", ...)
  siblings_without_replacement: bool      # a node's children are drawn without replacement (the sampling
                                          # acceptance rule must know; deterministic drafters: False)

  def init(self, draft_params: DraftParams, prompt_BxP: jax.Array, prompt_lens_B: jax.Array,
           max_len: int) -> DraftState:
    """The state after the prompts (right-padded ``prompt_BxP``, ``prompt_lens_B`` long), for buffers of
    ``max_len`` (S) positions per sequence: a draft model prefills its cache; a stateless drafter gives ()."""

  def state_bytes_per_seq(self, max_len: int) -> int:
    """Bytes ``init`` allocates per sequence (the memory bill)."""

  def forwards(self, shape: DraftShape) -> int:
    """Draft forwards one ``propose`` over ``shape`` runs (statistics and the cost model; 0 for lookup)."""

  def propose(self, draft_params: DraftParams, state: DraftState, seq_BxS: jax.Array, lengths_B: jax.Array,
              last_B: jax.Array, shape: DraftShape, key: jax.Array | None,
              sp: DraftSampling) -> tuple[DraftState, Draft]:
    """A token tree of ``shape.num_nodes`` (N) nodes under the root ``last_B``: ``Draft`` holds each node's
    token, parent and validity [B, N1] (node 0 the root), the distribution its children were drawn from (q
    [B, N1, V]; None when deterministic or greedy: acceptance then never reads it), and where each node
    sits in the drafter's own cache (None: node i at slot i).  The node of rank r below a node is the
    drafter's r-th choice there.  ``key``: one PRNG key, or one per row in per-row mode."""

  def commit(self, state: DraftState, lengths_B: jax.Array, path_slots_BxD1: jax.Array,
             new_lengths_B: jax.Array) -> DraftState:
    """The state after the target accepted a root-to-leaf path, given as the drafter's own slots
    (``Draft.slots``; -1 past the leaf) and the committed lengths before and after (a drafter with a cache
    moves the path's entries next to the prefix)."""


@runtime_checkable
class FeatureDrafter(Drafter, Protocol):
  """A drafter that reads the target's features (EAGLE): the engine's target forwards return
  ``feature_layers``' outputs, given to ``init`` for the prompt and to ``commit`` along the accepted path."""

  feature_layers: tuple[int, ...]         # the target's layers it reads; () = the final hidden state

  def init(self, draft_params: DraftParams, prompt_BxP: jax.Array, prompt_lens_B: jax.Array, max_len: int,
           target_features_BxPxF: jax.Array | None = None) -> DraftState:
    """``Drafter.init``, reading the prompt's target features."""

  def commit(self, state: DraftState, lengths_B: jax.Array, path_slots_BxD1: jax.Array, new_lengths_B: jax.Array,
             path_features_BxD1xF: jax.Array | None = None) -> DraftState:
    """``Drafter.commit``, with the target's features of the accepted path (root first)."""


@runtime_checkable
class LearningDrafter(Drafter, Protocol):
  """A drafter whose params are an index of finished sequences (suffix decoding): ``absorb`` grows it."""

  def absorb(self, draft_params: DraftParams, sequences: Sequence[Sequence[int]]) -> DraftParams:
    """The params after ``sequences`` (prompt + output token ids) were seen; same shapes (no recompile)."""


def feature_layers(drafter: Drafter) -> tuple[int, ...] | None:
  """What a feature drafter reads from the target's forwards (``FeatureDrafter.feature_layers``); None for
  the others."""
  return getattr(drafter, "feature_layers", None)
