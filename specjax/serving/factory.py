"""Building a serving engine from settings (CLI, gin, the server): the batcher, its policy and the cost
functions the goodput policy predicts with."""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from specjax.measure import costmodel
from specjax.models import quant
from specjax.kernels import dispatch
from specjax.speculative import registry as drafter_registry
from specjax.serving import policies as pol
from specjax.runtime.checks import check_memory
from specjax.errors import SpecjaxError
from specjax.serving import buckets as bk
from specjax.serving.batcher import ContinuousBatcher


def cost_functions(spec: costmodel.DeviceSpec, m, drafter: str, slots: int, draft=None, draft_layers=None):
  """(rows_s(total_rows, live contexts), draft_s(k, batch, rows=1)) for the goodput policy.  Verification: the
  cost model's step over the rows the live sequences compute (idle slots cost nothing).  Drafting: k forwards
  of ``rows`` rows (a chain: one; a tree: its widest depth) of the draft model over every slot (a model or
  layer-skip drafter computes all slots), nothing for n-gram lookup."""
  cfg = m.cfg
  mesh = costmodel.MeshShape.of(getattr(m, "mesh", None))   # a sharded model: per-device cost + communication
  if mesh.model > 1 and not spec.interconnect_bandwidth:
    mesh = costmodel.MeshShape(mesh.data, 1)      # a calibrated CPU spec has no interconnect: price the split alone

  # The weights' dtype sets the bytes each step streams; a spec without a peak for it (a CPU calibration
  # measures fp32 only) is priced in fp32.
  dtype = jnp.dtype(m.dtype).name
  if dtype not in costmodel.DTYPE_BYTES or not spec.peak_flops.get(dtype):
    dtype = "float32"

  weights = quant.weights_kind(m.params) if getattr(m, "params", None) else "fp32"   # the bytes per weight

  def rows_s(total_rows, contexts):
    return costmodel.rows_step_time(spec, cfg, total_rows, contexts, dtype=dtype, mesh=mesh, weights=weights)

  kind = drafter_registry.get(drafter)
  layers = None
  if kind.layers:
    from specjax.api import parse_layers
    layers = parse_layers(draft_layers, cfg.num_layers)
  dcfg = drafter_registry.draft_config(kind, cfg, draft.cfg if kind.draft_model and draft is not None else None,
                                      layers)

  draft_weights = quant.weights_kind(draft.params) if kind.draft_model and draft is not None else weights

  def draft_s(k, batch, rows=1):
    if dcfg is None or k <= 0:
      return 0.0
    return k * costmodel.step_time(spec, dcfg, slots, rows, 256, dtype=dtype, mesh=mesh, weights=draft_weights)

  return rows_s, draft_s


def make_batcher(m, *, drafter: str = "ngram", policy: str = "fixed", k: int = 4,
                 buckets: Sequence[int] = (0, 1, 2, 4, 8), slots: int = 8, max_len: int = 1024,
                 max_batch: int = 4, min_reach: float = 0.3, spec: costmodel.DeviceSpec | None = None,
                 draft=None, draft_layers=None, per_sequence: bool = True, trees: Sequence[str] = (),
                 **kwargs) -> ContinuousBatcher:
  """A batcher whose compiled buckets cover the policy: ``fixed``/``off-above`` compile {0, k}, or {0, the
  tree} with one of ``trees`` (token-tree specs, ``--tree``); ``adaptive`` compiles ``buckets``, ``goodput``
  ``buckets`` and ``trees``."""
  kind = drafter_registry.get(drafter)
  trees = tuple(trees) if kind.speculates else ()
  if policy in ("fixed", "off-above") and len(trees) > 1:
    raise SpecjaxError(f"--policy {policy} runs one bucket: give one --tree (or --policy goodput to choose "
                       "among several)")
  if policy == "adaptive" and trees:
    raise SpecjaxError("--policy adaptive chooses chain lengths: drop --tree, or use --policy goodput")
  tree_b = [bk.tree_bucket(t, drafter, max_len) for t in trees]
  if not kind.speculates:
    buckets = (0,)
  elif policy in ("fixed", "off-above"):
    buckets = (0,) if tree_b else (0, k)
    k = tree_b[0].key if tree_b else k
  # Slots whose buffers cannot fit are refused with the bill before any calibration, allocation or compile.
  check_memory(m, max_len, max([max(buckets)] + [t.nodes for t in tree_b]), slots,
               draft.cfg if kind.draft_model and draft is not None else None, batch_flag="--slots")
  rows_s = draft_s = None
  if policy == "goodput":
    if spec is None:
      from specjax.measure import calibrate
      spec = calibrate.load_or_calibrate()
    rows_s, draft_s = cost_functions(spec, m, drafter, slots, draft, draft_layers)
  # Price the rows this path computes: only the live ones on the native CPU path, every slot's elsewhere.
  computed_slots = None if dispatch.skips_dead_rows(m.cfg.backends, m.dtype) else slots
  p = pol.make_policy(policy if kind.speculates else "fixed", k=k if kind.speculates else 0,
                      buckets=buckets, max_batch=max_batch, min_reach=min_reach, rows_s=rows_s, draft_s=draft_s,
                      per_sequence=per_sequence, computed_slots=computed_slots, trees=tree_b)
  extra = {"draft_layers": draft_layers} if kind.layers else {}
  return ContinuousBatcher(m, slots=slots, max_len=max_len, drafter=drafter, draft=draft, buckets=buckets,
                           policy=p, trees=trees, **extra, **kwargs)
