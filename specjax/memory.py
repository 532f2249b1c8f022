"""The memory bill of a decode: target and draft weights, KV buffers with speculative headroom, and the
logits workspace; the largest batch that fits a budget, and a one-line refusal naming the ways out when it
does not.  ``api.check_memory`` charges every decode with it before anything is allocated."""
from __future__ import annotations

import dataclasses

from specjax.config import ModelConfig
from specjax.costmodel import DTYPE_BYTES, MeshShape
from specjax.errors import SpecjaxError


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int = 4) -> int:
  return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
  return cfg.param_count() * dtype_bytes


@dataclasses.dataclass(frozen=True)
class KVBill:
  """Memory per sequence and in total for a batch: weights are paid once, the rest per sequence."""
  target_kv_per_seq: int        # target K/V for max_len slots (prompt + new tokens + speculative headroom)
  draft_kv_per_seq: int         # the draft model's own K/V (0 for n-gram, layer-skip shares nothing)
  workspace_per_seq: int        # logits of the verified rows (fp32) and, when sampling, q over the vocabulary
  weights: int                  # target + draft weights

  @property
  def per_seq(self) -> int:
    return self.target_kv_per_seq + self.draft_kv_per_seq + self.workspace_per_seq

  def total(self, B: int) -> int:
    return self.weights + B * self.per_seq


def kv_bill(cfg: ModelConfig, max_len: int, nodes: int = 0, draft_cfg: ModelConfig | None = None,
            dtype: str = "float32", sampling: bool = False) -> KVBill:
  """The bill for buffers of ``max_len`` slots, verifying ``nodes`` drafts per step (0: no speculation).

  A speculative step writes the N + 1 rows of its tree past the committed length before it knows how many
  it keeps, so each sequence needs N + 1 slots of headroom beyond its longest committed length; the draft
  model needs the same in its own cache."""
  b = DTYPE_BYTES[dtype]
  head = nodes + 1 if nodes else 0
  target_kv = kv_bytes_per_token(cfg, b) * (max_len + head)
  draft_kv = kv_bytes_per_token(draft_cfg, b) * (max_len + head) if (draft_cfg is not None and nodes) else 0
  rows = nodes + 1
  workspace = rows * cfg.vocab_size * 4 * (2 if sampling and nodes else 1)
  weights = weight_bytes(cfg, b) + (weight_bytes(draft_cfg, b) if (draft_cfg is not None and nodes) else 0)
  return KVBill(target_kv, draft_kv, workspace, weights)


def mesh_bill(bill: KVBill, mesh) -> KVBill:
  """The bill summed over a mesh's devices: each data replica holds a whole copy of the weights (split over
  its model devices); KV buffers and workspaces are split, not copied.  Compare with the per-device budget ×
  devices."""
  ms = MeshShape.of(mesh)
  return dataclasses.replace(bill, weights=bill.weights * ms.data)


def max_batch(budget_bytes: float, bill: KVBill) -> int:
  """The largest batch whose weights + per-sequence bill fit ``budget_bytes`` (0 if not even one does)."""
  return max(0, int((budget_bytes - bill.weights) // bill.per_seq))


def check_budget(budget_bytes: float, bill: KVBill, B: int, what: str = "") -> None:
  """Refuse a configuration whose buffers would not fit, naming the numbers and the ways out."""
  need = bill.total(B)
  if need > budget_bytes:
    fits = max_batch(budget_bytes, bill)
    raise SpecjaxError(
        f"{what + ': ' if what else ''}batch {B} needs {need / 2**30:.2f} GiB (weights "
        f"{bill.weights / 2**30:.2f} GiB + {B} × {bill.per_seq / 2**20:.1f} MiB per sequence) but the memory "
        f"budget is {budget_bytes / 2**30:.2f} GiB: at most batch {fits} fits — lower --batch-size, "
        "--max-len or the node budget, or raise --memory-budget")


def fmt_bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"


def fmt_time(s: float) -> str:
  return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"

