"""The roofline cost model: what a forward costs, what speculation buys, and what the KV cache bills.

A decoding step of B sequences × T new tokens each (T = 1 plain, k + 1 for a chain, a tree's N + 1) at a
context of C committed tokens:

  FLOPs  = matmuls 2·B·T·(per-layer weights)·L + attention 4·B·H·E·Σ_t (C + t + 1) per layer + head 2·B·T·D·V
  bytes  = every weight once per pass + the KV window read (C + T slots) + the new K/V written + token rows
  time   = max(FLOPs ÷ peak, bytes ÷ bandwidth) + (1 − overlap) · min(…) + floor

Below the ridge point (arithmetic intensity = FLOPs ÷ bytes < peak ÷ bandwidth) the step is memory-bound: its
time hardly moves with T, so verifying k drafts costs about one plain step and speculation pays.  Above it
(large B·T) the step is compute-bound and each drafted row costs real time: speculation becomes a loss.

On a (data, model) mesh (``MeshShape``; ``sharding.RULES`` splits heads and FFN columns over "model", the
batch over "data") each device computes and reads its share: FLOPs ÷ (data · model) per device, weights ÷
model, KV ÷ (data · model); and it communicates.  Per layer two all-reduces over the model axis (after the
attention output and the MLP's down projection, each of the device's B/data · T rows × D values: a ring moves
2(M − 1)/M of them) and one gather of the logits over the vocabulary:

  comm   = (2L + 1) · link latency + bytes ÷ interconnect bandwidth    (added to the step, not overlapped)

Communication grows with the rows a step computes, like compute, and its latency is paid once per step, like
the floor: so the batch at which speculation stops paying moves with the mesh (``crossover_batch``).

``DeviceSpec`` holds a machine's numbers: published ones for common accelerators (``DEVICES``), or this
machine's, measured by ``calibrate`` (a bandwidth probe, a matmul probe and the floor of a tiny model's step)
and saved as JSON under the specjax cache.  ``predicted_speedup`` combines the cost with a drafter's
per-position acceptance; ``kv_bill`` / ``max_batch`` size the KV memory with and without speculation.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from specjax.models import quant
from specjax.models.config import ModelConfig
from specjax.measure.devices import DEVICES, DTYPE_BYTES, REGIMES, DeviceSpec, device_spec, in_regime, load_spec
from specjax.errors import SpecjaxError

__all__ = ["DEVICES", "DTYPE_BYTES", "REGIMES", "DeviceSpec", "device_spec", "in_regime", "load_spec", "MeshShape",
           "StepCost", "step_cost", "step_time", "ragged_step_time", "rows_step_time", "breakdown", "weight_bytes",
           "expected_accepted", "draft_time", "iteration_time", "predicted_speedup", "crossover_batch"]


# ----------------------------------------------------------------------------------------------------------
# Meshes


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """How many devices split a step: ``data`` (sequences) × ``model`` (heads, FFN columns, vocabulary)."""
  data: int = 1
  model: int = 1

  @property
  def devices(self) -> int:
    return self.data * self.model

  @classmethod
  def of(cls, mesh) -> "MeshShape":
    """None (one device), 'DATAxMODEL', (data, model), a MeshShape or a jax Mesh with axes data, model."""
    if mesh is None:
      return cls()
    if isinstance(mesh, cls):
      return mesh
    if isinstance(mesh, str):
      from specjax.parallel.sharding import parse_mesh
      return cls(*parse_mesh(mesh))
    if hasattr(mesh, "shape") and isinstance(mesh.shape, dict):
      return cls(int(mesh.shape.get("data", 1)), int(mesh.shape.get("model", 1)))
    data, model = mesh
    return cls(int(data), int(model))

  def __str__(self) -> str:
    return f"{self.data}x{self.model}"


def comm_per_step(cfg: ModelConfig, B: int, T: int, mesh: MeshShape, dtype_bytes: int = 4,
                  head_rows: int | None = None) -> tuple[float, int]:
  """(bytes each device sends over the interconnect, collectives) for one forward on ``mesh``: per layer two
  ring all-reduces over the model axis of the device's B/data · T rows × D, and a gather of the fp32 logits
  split over the vocabulary.  (0, 0) when the model axis is 1 (data parallelism alone needs no collective
  in a forward)."""
  M = mesh.model
  if M <= 1:
    return 0.0, 0
  b_local = -(-B // mesh.data)
  rows = b_local * T
  head = b_local * T if head_rows is None else -(-head_rows // mesh.data)
  ring = (M - 1) / M
  per_layer = 2 * (2 * ring * rows * cfg.d_model * dtype_bytes)
  logits = ring * head * cfg.vocab_size * 4
  return cfg.num_layers * per_layer + logits, 2 * cfg.num_layers + 1


def comm_time(spec: "DeviceSpec", cfg: ModelConfig, B: int, T: int, mesh: MeshShape, dtype: str = "float32") -> float:
  nbytes, count = comm_per_step(cfg, B, T, mesh, DTYPE_BYTES[dtype])
  if not count:
    return 0.0
  if not spec.interconnect_bandwidth:
    raise SpecjaxError(f"device '{spec.name}' has no interconnect bandwidth, so a model axis of {mesh.model} "
                       "cannot be priced: use a published spec (h100-sxm, h200, ...) or a mesh of 1 model device")
  return count * spec.link_latency_s + nbytes / spec.interconnect_bandwidth


# ----------------------------------------------------------------------------------------------------------
# What a step costs


@dataclasses.dataclass(frozen=True)
class StepCost:
  flops: float
  weight_bytes: float
  kv_read_bytes: float
  kv_write_bytes: float
  other_bytes: float       # token embedding rows, logits written
  layer_weights: float = 0.0   # matrix entries the layers multiply (L · per layer) over ``rows`` rows
  head_weights: float = 0.0    # and the head (V · D) over ``head_rows`` rows
  rows: float = 0.0
  head_rows: float = 0.0

  @property
  def bytes(self) -> float:
    return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.other_bytes

  @property
  def intensity(self) -> float:
    return self.flops / self.bytes


def layer_matrices(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """One decoder layer's matrices as (out, in), by parameter name."""
  D, H, K, E, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  return {"w_qkv": ((H + 2 * K) * E, D), "wo": (D, H * E), "w_gate_up": (2 * F, D), "w_down": (D, F)}


def layer_weight_count(cfg: ModelConfig) -> int:
  """Matrix entries of one decoder layer (q, k, v, o, gate, up, down); norms and biases are counted in
  ``layer_param_count``."""
  return sum(n * d for n, d in layer_matrices(cfg).values())


def layer_param_count(cfg: ModelConfig) -> int:
  extra = 2 * cfg.d_model + ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0)
  return layer_weight_count(cfg) + extra


def matrix_bytes(name: str, N: int, D: int, weights: str, dtype_bytes: int) -> float:
  """Bytes of an [N, D] matrix stored as ``weights`` by ``quant``'s policy (``fp32``: the compute dtype's
  bytes, as the model runs unquantized weights; int8 and int4 with their group scales and offsets)."""
  kind, group = quant.weight_kind(name, weights, D)
  if kind == "fp32":
    return float(N * D * dtype_bytes)
  if kind == "bf16":
    return 2.0 * N * D
  if kind == "int8":
    return N * D + 4.0 * N * D / group
  return N * D / 2 + 8.0 * N * D / group


def head_kind(weights: str) -> str:
  """The weight type the LM head takes when the model is quantized to ``weights`` (int8 under int4)."""
  return "int8" if weights == "int4" else weights


def weight_bytes(cfg: ModelConfig, weights: str = "fp32", dtype_bytes: int = 4) -> tuple[float, float]:
  """(bytes of one decoder layer, bytes of the embedding, head and final norm) with matrices stored as
  ``weights``; norms and biases in the compute dtype.  An untied model counts both vocabulary matrices."""
  if weights not in quant.KINDS:
    raise SpecjaxError(f"unknown weight type '{weights}': use one of {', '.join(quant.KINDS)}")
  layer = sum(matrix_bytes(name, n, d, weights, dtype_bytes) for name, (n, d) in layer_matrices(cfg).items())
  layer += (layer_param_count(cfg) - layer_weight_count(cfg)) * dtype_bytes
  V, D = cfg.vocab_size, cfg.d_model
  vocab = matrix_bytes("embed", V, D, weights, dtype_bytes) * (1 if cfg.tie_embeddings else 2)
  return layer, vocab + D * dtype_bytes


def attended_slots(T: int, context: int) -> int:
  """Σ over the T new rows of the slots each attends to: row t sees the C committed slots and t + 1 new ones
  (a causal block; a tree's rows see their ancestors only, fewer — this is the upper bound a dense kernel
  computes)."""
  return T * context + T * (T + 1) / 2


def step_cost(cfg: ModelConfig, B: int, T: int, context: int, dtype_bytes: int = 4,
              kv_dtype_bytes: int | None = None, head_rows: int | None = None, weights: str = "fp32") -> StepCost:
  """A whole forward: L layers over B × T new tokens at ``context`` committed tokens, the final norm, the head
  over ``head_rows`` rows (default B·T; prefill needs only B), the embedding rows read and the fp32 logits
  written; the weights stored as ``weights``."""
  kvb = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
  L, D, V, H, K, E = (cfg.num_layers, cfg.d_model, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim)
  R = B * T
  rows = R if head_rows is None else head_rows
  layer_b, vocab_b = weight_bytes(cfg, weights, dtype_bytes)
  lw = L * layer_weight_count(cfg)
  flops = 2.0 * R * lw + L * 4.0 * B * H * E * attended_slots(T, context) + 2.0 * rows * D * V
  return StepCost(flops=flops, weight_bytes=L * layer_b + vocab_b,
                  kv_read_bytes=float(L * B * (context + T) * 2 * K * E * kvb),
                  kv_write_bytes=float(L * R * 2 * K * E * kvb),
                  other_bytes=float(R * D * dtype_bytes + rows * V * 4),
                  layer_weights=float(lw), head_weights=float(V * D), rows=float(R), head_rows=float(rows))


def compute_seconds(spec: DeviceSpec, c: StepCost, dtype: str, weights: str = "fp32"):
  """Compute time of a step: the attention's FLOPs at the dtype's peak, the matrix products by the weight
  type (``DeviceSpec.matrix_seconds``: at the peak, or at the measured unpack rate of a quantized kernel)."""
  matrix_flops = 2.0 * (c.rows * c.layer_weights + c.head_rows * c.head_weights)
  return ((c.flops - matrix_flops) / spec.peak(dtype)
          + spec.matrix_seconds(weights, c.layer_weights, c.rows, dtype)
          + spec.matrix_seconds(head_kind(weights), c.head_weights, c.head_rows, dtype))


def step_time(spec: DeviceSpec, cfg: ModelConfig, B: int, T: int, context: int, dtype: str = "float32",
              kv_dtype: str | None = None, mesh=None, weights: str = "fp32") -> float:
  """Predicted seconds for one forward: max(compute, memory) (+ the part that does not overlap) + floor; on a
  ``mesh`` (``MeshShape.of``) each device's share of both, plus the communication (``comm_time``)."""
  ms = MeshShape.of(mesh)
  b_local = -(-B // ms.data)
  c = step_cost(cfg, b_local, T, context, DTYPE_BYTES[dtype], DTYPE_BYTES[kv_dtype or dtype], weights=weights)
  M = ms.model
  compute = compute_seconds(spec, c, dtype, weights) / M
  memory = (c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes) / M / spec.mem_bandwidth + (
      c.other_bytes / spec.mem_bandwidth)
  return spec.combine(compute, memory) + comm_time(spec, cfg, B, T, ms, dtype) + spec.floor(cfg.num_layers)


def ragged_step_time(spec: DeviceSpec, cfg: ModelConfig, rows_B: Sequence[int], contexts_B: Sequence[int],
                     dtype: str = "float32", skips_dead_rows: bool = True, weights: str = "fp32") -> float:
  """Predicted seconds for one forward in which sequence b computes rows_B[b] new rows at context
  contexts_B[b] (0 rows: a finished sequence or an idle slot, which the native kernels skip and which reads
  no KV).  Equals ``step_time`` when every sequence has the same rows and context.  ``skips_dead_rows``
  False (every path but the native CPU one: ``dispatch.skips_dead_rows``): the forward computes the
  compiled shape, max(rows_B) rows for every sequence, and those are priced."""
  b = DTYPE_BYTES[dtype]
  L, D, V, H, K, E = (cfg.num_layers, cfg.d_model, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim)
  rows = [int(r) for r in rows_B]
  if not skips_dead_rows:
    rows = [max(rows, default=0)] * len(rows)
  ctx = [int(c) for c in contexts_B]
  R = sum(rows)
  if R == 0:
    return spec.floor(L)
  slots = sum(attended_slots(r, c) for r, c in zip(rows, ctx) if r)
  compute = (L * 4.0 * H * E * slots / spec.peak(dtype) + _matrix_seconds(spec, cfg, weights, R, dtype))
  kv_slot = 2 * K * E * b
  layer_b, vocab_b = weight_bytes(cfg, weights, b)
  kv = L * kv_slot * (sum(c + r for r, c in zip(rows, ctx) if r) + R)
  other = R * D * b + R * V * 4
  return spec.combine(compute, (L * layer_b + vocab_b + kv + other) / spec.mem_bandwidth) + spec.floor(L)


def _matrix_seconds(spec: DeviceSpec, cfg: ModelConfig, weights: str, R, dtype: str):
  """The layers' and the head's matrix products over R rows (a number or an array)."""
  return (spec.matrix_seconds(weights, cfg.num_layers * layer_weight_count(cfg), R, dtype)
          + spec.matrix_seconds(head_kind(weights), cfg.vocab_size * cfg.d_model, R, dtype))


def rows_step_time(spec: DeviceSpec, cfg: ModelConfig, total_rows, contexts_B: Sequence[int],
                   dtype: str = "float32", mesh=None, weights: str = "fp32"):
  """``ragged_step_time`` as a function of the total rows alone (vectorised over ``total_rows``), for a
  scheduler weighing many choices per iteration: the live sequences' contexts give the KV reads; each row
  attends to the mean context (+ 1).  On a ``mesh`` each device's share (rows over data) plus the
  communication, as in ``step_time``."""
  import numpy as np
  ms = MeshShape.of(mesh)
  b = DTYPE_BYTES[dtype]
  L, D, V, H, K, E = (cfg.num_layers, cfg.d_model, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim)
  R = np.asarray(total_rows, float) / ms.data
  ctx = np.asarray(contexts_B, float)
  mean_ctx = float(ctx.mean()) if ctx.size else 0.0
  compute = L * 4.0 * H * E * R * (mean_ctx + 1) / spec.peak(dtype) + _matrix_seconds(spec, cfg, weights, R, dtype)
  kv_slot = 2 * K * E * b
  layer_b, vocab_b = weight_bytes(cfg, weights, b)
  split = (L * layer_b + vocab_b + L * kv_slot * (float(ctx.sum()) / ms.data + 2 * R)) / ms.model
  nbytes = split + R * (D * b + V * 4)
  comp, mem = compute / ms.model, nbytes / spec.mem_bandwidth
  comm = 0.0
  if ms.model > 1:
    if not spec.interconnect_bandwidth:
      comm_time(spec, cfg, 1, 1, ms, dtype)            # raises the clear error
    ring = (ms.model - 1) / ms.model
    comm = (2 * L + 1) * spec.link_latency_s + ring * R * (4 * L * D * b + V * 4) / spec.interconnect_bandwidth
  return np.maximum(comp, mem) + (1.0 - spec.overlap) * np.minimum(comp, mem) + comm + spec.floor(L)


def breakdown(spec: DeviceSpec, cfg: ModelConfig, B: int, T: int, context: int, dtype: str = "float32",
              mesh=None, weights: str = "fp32") -> dict:
  """The numbers behind ``step_time`` (per device on a ``mesh``), for tables and plots."""
  ms = MeshShape.of(mesh)
  c = step_cost(cfg, -(-B // ms.data), T, context, DTYPE_BYTES[dtype], weights=weights)
  compute_s = compute_seconds(spec, c, dtype, weights) / ms.model
  memory_s = ((c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes) / ms.model + c.other_bytes) / spec.mem_bandwidth
  comm_bytes, collectives = comm_per_step(cfg, B, T, ms, DTYPE_BYTES[dtype])
  return {"B": B, "T": T, "context": context, "mesh": str(ms), "flops": c.flops / ms.model,
          "bytes": c.bytes / ms.model, "intensity": c.intensity, "ridge": spec.ridge(dtype),
          "compute_s": compute_s, "memory_s": memory_s, "comm_bytes": comm_bytes, "collectives": collectives,
          "comm_s": comm_time(spec, cfg, B, T, ms, dtype), "floor_s": spec.floor(cfg.num_layers),
          "bound": "compute" if compute_s > memory_s else "memory",
          "weights": weights, "weight_bytes": c.weight_bytes,
          "predicted_s": step_time(spec, cfg, B, T, context, dtype, mesh=ms, weights=weights)}


# ----------------------------------------------------------------------------------------------------------
# What speculation buys


def expected_accepted(acceptance_by_position: Sequence[float], k: int) -> float:
  """τ(k) = 1 + Σ_{i ≤ k} Π_{j ≤ i} α_j: tokens committed per chain iteration, where α_j is the probability
  that draft j is accepted given drafts 1..j−1 were (the engine's ``acceptance_by_position``).  Positions
  past the measured ones repeat the last measured rate."""
  if k <= 0:
    return 1.0
  alphas = list(acceptance_by_position) or [0.0]
  tau, p = 1.0, 1.0
  for i in range(k):
    p *= min(max(float(alphas[min(i, len(alphas) - 1)]), 0.0), 1.0)
    tau += p
  return tau


def draft_time(spec: DeviceSpec, draft_cfg: ModelConfig | None, B: int, k: int, context: int,
               dtype: str = "float32", per_draft_s: float | None = None, mesh=None,
               weights: str = "fp32") -> float:
  """The drafter's cost for a chain of k: a measured per-draft time if given, else k + 1 single-row forwards
  of the draft model (the root forward reads two tokens), or nothing for a free drafter (n-gram)."""
  if k <= 0:
    return 0.0
  if per_draft_s is not None:
    return per_draft_s * k
  if draft_cfg is None:
    return 0.0
  return step_time(spec, draft_cfg, B, 2, context, dtype, mesh=mesh, weights=weights) + (k - 1) * step_time(
      spec, draft_cfg, B, 1, context, dtype, mesh=mesh, weights=weights)


def iteration_time(spec: DeviceSpec, cfg: ModelConfig, B: int, k: int, context: int, dtype: str = "float32",
                   draft_cfg: ModelConfig | None = None, per_draft_s: float | None = None, mesh=None,
                   weights: str = "fp32", draft_weights: str | None = None) -> float:
  """One speculative iteration with a chain of k (k = 0: a plain step); target and draft on ``mesh``, their
  weights stored as ``weights`` and ``draft_weights`` (default: the target's); plus the regime's fixed cost of
  an iteration (``DeviceSpec.iteration_floor_s``: 0 inside one compiled program)."""
  return step_time(spec, cfg, B, k + 1, context, dtype, mesh=mesh, weights=weights) + draft_time(
      spec, draft_cfg, B, k, context, dtype, per_draft_s, mesh=mesh, weights=draft_weights or weights) + (
      spec.iteration_floor_s if k > 0 else 0.0)


def predicted_speedup(spec: DeviceSpec, cfg: ModelConfig, acceptance_by_position: Sequence[float], k: int,
                      B: int = 1, context: int = 256, dtype: str = "float32",
                      draft_cfg: ModelConfig | None = None, per_draft_s: float | None = None,
                      mesh=None, weights: str = "fp32", draft_weights: str | None = None) -> float:
  """Committed tokens per second with speculation ÷ without: τ(k) · t_plain ÷ t_iteration(k)."""
  plain = step_time(spec, cfg, B, 1, context, dtype, mesh=mesh, weights=weights)
  return expected_accepted(acceptance_by_position, k) * plain / iteration_time(
      spec, cfg, B, k, context, dtype, draft_cfg, per_draft_s, mesh=mesh, weights=weights,
      draft_weights=draft_weights)


def crossover_batch(spec: DeviceSpec, cfg: ModelConfig, acceptance_by_position: Sequence[float], k: int,
                    batches: Sequence[int], context: int = 256, dtype: str = "float32",
                    draft_cfg: ModelConfig | None = None, per_draft_s: float | None = None,
                    mesh=None, weights: str = "fp32", draft_weights: str | None = None) -> int | None:
  """The smallest batch of ``batches`` at which speculation with k no longer pays (predicted speedup < 1);
  None if it pays at every one.  ``mesh``: the target (and draft) sharded over it."""
  for B in sorted(batches):
    if predicted_speedup(spec, cfg, acceptance_by_position, k, B, context, dtype, draft_cfg, per_draft_s,
                         mesh, weights, draft_weights) < 1.0:
      return B
  return None
