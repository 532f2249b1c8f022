"""The memory bill of a decode: target and draft weights, the buffers each sequence holds (target KV, the
drafter's state, token ids) and the logits workspace; the largest batch that fits a budget, and a one-line
refusal naming the ways out when it does not.  ``api.check_memory`` charges every decode with it before
anything is allocated; tests/measure/test_memory_bill.py holds it to the bytes of the arrays a decode allocates, for
every drafter and dtype."""
from __future__ import annotations

import dataclasses

from specjax.models.config import ModelConfig
from specjax.measure import costmodel
from specjax.measure.costmodel import DTYPE_BYTES, MeshShape
from specjax.errors import SpecjaxError


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int = 4) -> int:
  return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 4, weights: str = "fp32") -> int:
  """The model's parameters in bytes: every one in the compute dtype, or the matrices stored as ``weights``
  (``costmodel.weight_bytes``: quant's policy, with group scales)."""
  if weights == "fp32":
    return cfg.param_count() * dtype_bytes
  layer, vocab = costmodel.weight_bytes(cfg, weights, dtype_bytes)
  return int(cfg.num_layers * layer + vocab)


@dataclasses.dataclass(frozen=True)
class KVBill:
  """Memory per sequence and in total for a batch: weights are paid once, the rest per sequence."""
  target_kv_per_seq: int        # target K/V of the buffer's max_len slots (which hold the speculative headroom)
  draft_kv_per_seq: int         # the drafter's state: a draft model's, layer-skip's or EAGLE's own fp32 cache
  workspace_per_seq: int        # logits of the verified rows (fp32) and, when sampling, q over the vocabulary
  weights: int                  # target + draft weights
  tokens_per_seq: int = 0       # the decode's token ids (int32) and iteration starts (bool) per slot

  @property
  def per_seq(self) -> int:
    return self.target_kv_per_seq + self.draft_kv_per_seq + self.workspace_per_seq + self.tokens_per_seq

  def total(self, B: int) -> int:
    return self.weights + B * self.per_seq


DRAFT_KV_BYTES = 4     # drafters keep their caches in fp32 whatever the target's dtype (speculative/drafters.py)


def kv_bill(cfg: ModelConfig, max_len: int, nodes: int = 0, draft_cfg: ModelConfig | None = None,
            dtype: str = "float32", sampling: bool = False, draft_state_per_seq: int | None = None,
            weights: str = "fp32", draft_weights: str | None = None) -> KVBill:
  """The bill for buffers of ``max_len`` slots, verifying ``nodes`` drafts per step (0: no speculation).

  ``max_len`` is the buffer's length: a speculative step writes the N + 1 rows of its tree past the committed
  length before it knows how many it keeps, and ``buffers.buffer_length`` sizes a buffer with that headroom
  inside it.  A draft model's weights and fp32 cache are billed from ``draft_cfg``; ``draft_state_per_seq``
  (a drafter's ``state_bytes_per_seq``) bills what any drafter keeps per sequence instead of the cache."""
  b = DTYPE_BYTES[dtype]
  target_kv = kv_bytes_per_token(cfg, b) * max_len + 4                 # + the cache's int32 length
  drafting = draft_cfg is not None and nodes
  if draft_state_per_seq is None:
    draft_state_per_seq = kv_bytes_per_token(draft_cfg, DRAFT_KV_BYTES) * max_len + 4 if drafting else 0
  rows = nodes + 1
  workspace = rows * cfg.vocab_size * 4 * (2 if sampling and nodes else 1)
  total = weight_bytes(cfg, b, weights) + (weight_bytes(draft_cfg, b, draft_weights or weights) if drafting else 0)
  return KVBill(target_kv, draft_state_per_seq if nodes else 0, workspace, total, tokens_per_seq=5 * max_len)


def mesh_bill(bill: KVBill, mesh) -> KVBill:
  """The bill summed over a mesh's devices: each data replica holds a whole copy of the weights (split over
  its model devices); KV buffers and workspaces are split, not copied.  Compare with the per-device budget ×
  devices."""
  ms = MeshShape.of(mesh)
  return dataclasses.replace(bill, weights=bill.weights * ms.data)


def max_batch(budget_bytes: float, bill: KVBill) -> int:
  """The largest batch whose weights + per-sequence bill fit ``budget_bytes`` (0 if not even one does)."""
  return max(0, int((budget_bytes - bill.weights) // bill.per_seq))


def check_budget(budget_bytes: float, bill: KVBill, B: int, what: str = "", batch_flag: str = "--batch-size") -> None:
  """Refuse a configuration whose buffers would not fit, naming the numbers and the ways out."""
  need = bill.total(B)
  if need > budget_bytes:
    fits = max_batch(budget_bytes, bill)
    raise SpecjaxError(
        f"{what + ': ' if what else ''}batch {B} needs {need / 2**30:.2f} GiB (weights "
        f"{bill.weights / 2**30:.2f} GiB + {B} × {bill.per_seq / 2**20:.1f} MiB per sequence) but the memory "
        f"budget is {budget_bytes / 2**30:.2f} GiB: at most batch {fits} fits — lower {batch_flag}, "
        "--max-len or the node budget, or raise --memory-budget")


def fmt_bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"


def fmt_time(s: float) -> str:
  return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"

