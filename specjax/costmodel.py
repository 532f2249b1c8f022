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
import json
from pathlib import Path
from typing import Sequence

from specjax.config import ModelConfig
from specjax.errors import SpecjaxError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------------------
# Devices


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """A device's roofline: peak FLOP/s per dtype, memory bandwidth, memory size, interconnect, step floor."""
  name: str
  peak_flops: dict                 # dtype name → FLOP/s (dense)
  mem_bandwidth: float             # bytes/s (device memory, or DRAM read bandwidth on a CPU)
  memory_bytes: float              # device memory (or the RAM a CPU process may use)
  interconnect_bandwidth: float = 0.0   # bytes/s per chip and direction (NVLink, ICI); 0: single device
  floor_s: float = 0.0             # fixed cost of a step (dispatch, launches, the sampling tail)
  floor_per_layer_s: float = 0.0   # and per layer (kernel launches, small ops)
  source: str = ""                 # where the numbers come from
  overlap: float = 1.0             # how much compute hides behind memory traffic: 1 = perfectly (the roofline's
                                   # max; accelerators), 0 = not at all (a sum; CPU cores that both stream and
                                   # compute); ``calibrate`` measures it
  link_latency_s: float = 0.0      # fixed cost of one collective over the interconnect

  def peak(self, dtype: str) -> float:
    if dtype not in self.peak_flops or not self.peak_flops[dtype]:
      raise SpecjaxError(f"device '{self.name}' has no peak FLOP/s for {dtype} (it lists "
                         f"{', '.join(sorted(self.peak_flops))}): choose one of those dtypes")
    return float(self.peak_flops[dtype])

  def ridge(self, dtype: str) -> float:
    """Arithmetic intensity (FLOP/byte) at which a step turns from memory-bound to compute-bound."""
    return self.peak(dtype) / self.mem_bandwidth

  def floor(self, num_layers: int) -> float:
    return self.floor_s + self.floor_per_layer_s * num_layers

  def combine(self, compute_s: float, memory_s: float) -> float:
    """max(compute, memory) + (1 − overlap) · min(compute, memory): the roofline when the two overlap."""
    return max(compute_s, memory_s) + (1.0 - self.overlap) * min(compute_s, memory_s)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "DeviceSpec":
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in known})


T_ = 1e12
G_ = 1e9
# Small all-reduce latencies (not datasheet values): NCCL over NVLink within a node, ~10 µs for a few-KB
# message; TPU ICI a few µs.
_NVLINK_LATENCY = 10e-6
_ICI_LATENCY = 5e-6
# Published datasheet numbers (dense, no sparsity).  Floors are typical per-step launch overheads of a
# jitted decode step on these devices (a few µs per layer), not datasheet values.
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec("h100-sxm", {"bfloat16": 989 * T_, "float16": 989 * T_, "float32": 67 * T_},
               3.35 * T_, 80 * G_, 450 * G_, 20e-6, 4e-6,
               "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 3.35 TB/s HBM3, "
               "NVLink 900 GB/s bidirectional", link_latency_s=_NVLINK_LATENCY),
    DeviceSpec("h200", {"bfloat16": 989 * T_, "float16": 989 * T_, "float32": 67 * T_},
               4.8 * T_, 141 * G_, 450 * G_, 20e-6, 4e-6,
               "NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 4.8 TB/s HBM3e, 141 GB, "
               "NVLink 900 GB/s bidirectional", link_latency_s=_NVLINK_LATENCY),
    DeviceSpec("a100-sxm-80gb", {"bfloat16": 312 * T_, "float16": 312 * T_, "float32": 19.5 * T_},
               2.039 * T_, 80 * G_, 300 * G_, 20e-6, 5e-6,
               "NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s bf16, 19.5 TFLOP/s fp32, 2,039 GB/s HBM2e, "
               "NVLink 600 GB/s bidirectional", link_latency_s=_NVLINK_LATENCY),
    DeviceSpec("tpu-v5e", {"bfloat16": 197 * T_},
               0.819 * T_, 16 * G_, 200 * G_, 20e-6, 4e-6,
               "Google Cloud TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM2, 16 GB, ICI 1,600 Gbps",
               link_latency_s=_ICI_LATENCY),
)}


def device_spec(name: str) -> DeviceSpec:
  """A published spec by name, or a calibration JSON by path."""
  if name in DEVICES:
    return DEVICES[name]
  p = Path(name).expanduser()
  if p.is_file():
    return load_spec(p)
  raise SpecjaxError(f"unknown device '{name}': choose one of {', '.join(DEVICES)}, or give the path of a "
                     "calibration JSON (specjax calibrate)")


def load_spec(path) -> DeviceSpec:
  try:
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    return DeviceSpec.from_dict(d["spec"] if "spec" in d else d)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SpecjaxError(f"cannot read the device calibration {path}: {e} — run `specjax calibrate` again") from e


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
      from specjax.sharding import parse_mesh
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

  @property
  def bytes(self) -> float:
    return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.other_bytes

  @property
  def intensity(self) -> float:
    return self.flops / self.bytes


def layer_weight_count(cfg: ModelConfig) -> int:
  """Matrix entries of one decoder layer (q, k, v, o, gate, up, down); norms and biases are counted in
  ``layer_param_count``."""
  D, H, K, E, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  return D * (H + 2 * K) * E + H * E * D + 3 * D * F


def layer_param_count(cfg: ModelConfig) -> int:
  extra = 2 * cfg.d_model + ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0)
  return layer_weight_count(cfg) + extra


def attended_slots(T: int, context: int) -> int:
  """Σ over the T new rows of the slots each attends to: row t sees the C committed slots and t + 1 new ones
  (a causal block; a tree's rows see their ancestors only, fewer — this is the upper bound a dense kernel
  computes)."""
  return T * context + T * (T + 1) / 2


def layer_cost(cfg: ModelConfig, B: int, T: int, context: int, dtype_bytes: int = 4,
               kv_dtype_bytes: int | None = None) -> StepCost:
  """One decoder layer over B × T new tokens at ``context`` committed tokens."""
  kvb = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  flops = 2 * B * T * layer_weight_count(cfg) + 4 * B * H * E * attended_slots(T, context)
  return StepCost(flops=float(flops), weight_bytes=float(layer_param_count(cfg) * dtype_bytes),
                  kv_read_bytes=float(B * (context + T) * 2 * K * E * kvb),
                  kv_write_bytes=float(B * T * 2 * K * E * kvb), other_bytes=0.0)


def step_cost(cfg: ModelConfig, B: int, T: int, context: int, dtype_bytes: int = 4,
              kv_dtype_bytes: int | None = None, head_rows: int | None = None) -> StepCost:
  """A whole forward: L layers, the final norm, the head over ``head_rows`` rows (default B·T; prefill
  needs only B), the embedding rows read and the fp32 logits written."""
  lay = layer_cost(cfg, B, T, context, dtype_bytes, kv_dtype_bytes)
  L, D, V = cfg.num_layers, cfg.d_model, cfg.vocab_size
  rows = B * T if head_rows is None else head_rows
  head_bytes = V * D * dtype_bytes * (1 if cfg.tie_embeddings else 2)   # tied: the embedding is the head
  return StepCost(flops=L * lay.flops + 2.0 * rows * D * V,
                  weight_bytes=L * lay.weight_bytes + head_bytes + D * dtype_bytes,
                  kv_read_bytes=L * lay.kv_read_bytes, kv_write_bytes=L * lay.kv_write_bytes,
                  other_bytes=float(B * T * D * dtype_bytes + rows * V * 4))


def step_time(spec: DeviceSpec, cfg: ModelConfig, B: int, T: int, context: int, dtype: str = "float32",
              kv_dtype: str | None = None, mesh=None) -> float:
  """Predicted seconds for one forward: max(compute, memory) (+ the part that does not overlap) + floor; on a
  ``mesh`` (``MeshShape.of``) each device's share of both, plus the communication (``comm_time``)."""
  ms = MeshShape.of(mesh)
  b_local = -(-B // ms.data)
  c = step_cost(cfg, b_local, T, context, DTYPE_BYTES[dtype], DTYPE_BYTES[kv_dtype or dtype])
  M = ms.model
  compute = c.flops / M / spec.peak(dtype)
  memory = (c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes) / M / spec.mem_bandwidth + (
      c.other_bytes / spec.mem_bandwidth)
  return spec.combine(compute, memory) + comm_time(spec, cfg, B, T, ms, dtype) + spec.floor(cfg.num_layers)


def ragged_step_time(spec: DeviceSpec, cfg: ModelConfig, rows_B: Sequence[int], contexts_B: Sequence[int],
                     dtype: str = "float32", skips_dead_rows: bool = True) -> float:
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
  flops = L * (2.0 * R * layer_weight_count(cfg) + 4.0 * H * E * slots) + 2.0 * R * D * V
  kv_slot = 2 * K * E * b
  weights = L * layer_param_count(cfg) * b + V * D * b * (1 if cfg.tie_embeddings else 2) + D * b
  kv = L * kv_slot * (sum(c + r for r, c in zip(rows, ctx) if r) + R)
  other = R * D * b + R * V * 4
  return spec.combine(flops / spec.peak(dtype), (weights + kv + other) / spec.mem_bandwidth) + spec.floor(L)


def rows_step_time(spec: DeviceSpec, cfg: ModelConfig, total_rows, contexts_B: Sequence[int],
                   dtype: str = "float32", mesh=None):
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
  flops = L * (2.0 * R * layer_weight_count(cfg) + 4.0 * H * E * R * (mean_ctx + 1)) + 2.0 * R * D * V
  kv_slot = 2 * K * E * b
  weights = L * layer_param_count(cfg) * b + V * D * b * (1 if cfg.tie_embeddings else 2) + D * b
  split = (weights + L * kv_slot * (float(ctx.sum()) / ms.data + 2 * R)) / ms.model
  nbytes = split + R * (D * b + V * 4)
  comp, mem = flops / ms.model / spec.peak(dtype), nbytes / spec.mem_bandwidth
  comm = 0.0
  if ms.model > 1:
    if not spec.interconnect_bandwidth:
      comm_time(spec, cfg, 1, 1, ms, dtype)            # raises the clear error
    ring = (ms.model - 1) / ms.model
    comm = (2 * L + 1) * spec.link_latency_s + ring * R * (4 * L * D * b + V * 4) / spec.interconnect_bandwidth
  return np.maximum(comp, mem) + (1.0 - spec.overlap) * np.minimum(comp, mem) + comm + spec.floor(L)


def breakdown(spec: DeviceSpec, cfg: ModelConfig, B: int, T: int, context: int, dtype: str = "float32",
              mesh=None) -> dict:
  """The numbers behind ``step_time`` (per device on a ``mesh``), for tables and plots."""
  ms = MeshShape.of(mesh)
  c = step_cost(cfg, -(-B // ms.data), T, context, DTYPE_BYTES[dtype])
  compute_s = c.flops / ms.model / spec.peak(dtype)
  memory_s = ((c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes) / ms.model + c.other_bytes) / spec.mem_bandwidth
  comm_bytes, collectives = comm_per_step(cfg, B, T, ms, DTYPE_BYTES[dtype])
  return {"B": B, "T": T, "context": context, "mesh": str(ms), "flops": c.flops / ms.model,
          "bytes": c.bytes / ms.model, "intensity": c.intensity, "ridge": spec.ridge(dtype),
          "compute_s": compute_s, "memory_s": memory_s, "comm_bytes": comm_bytes, "collectives": collectives,
          "comm_s": comm_time(spec, cfg, B, T, ms, dtype), "floor_s": spec.floor(cfg.num_layers),
          "bound": "compute" if compute_s > memory_s else "memory",
          "predicted_s": step_time(spec, cfg, B, T, context, dtype, mesh=ms)}


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
               dtype: str = "float32", per_draft_s: float | None = None, mesh=None) -> float:
  """The drafter's cost for a chain of k: a measured per-draft time if given, else k + 1 single-row forwards
  of the draft model (the root forward reads two tokens), or nothing for a free drafter (n-gram)."""
  if k <= 0:
    return 0.0
  if per_draft_s is not None:
    return per_draft_s * k
  if draft_cfg is None:
    return 0.0
  return step_time(spec, draft_cfg, B, 2, context, dtype, mesh=mesh) + (k - 1) * step_time(
      spec, draft_cfg, B, 1, context, dtype, mesh=mesh)


def iteration_time(spec: DeviceSpec, cfg: ModelConfig, B: int, k: int, context: int, dtype: str = "float32",
                   draft_cfg: ModelConfig | None = None, per_draft_s: float | None = None, mesh=None) -> float:
  """One speculative iteration with a chain of k (k = 0: a plain step); target and draft on ``mesh``."""
  return step_time(spec, cfg, B, k + 1, context, dtype, mesh=mesh) + draft_time(
      spec, draft_cfg, B, k, context, dtype, per_draft_s, mesh=mesh)


def predicted_speedup(spec: DeviceSpec, cfg: ModelConfig, acceptance_by_position: Sequence[float], k: int,
                      B: int = 1, context: int = 256, dtype: str = "float32",
                      draft_cfg: ModelConfig | None = None, per_draft_s: float | None = None,
                      mesh=None) -> float:
  """Committed tokens per second with speculation ÷ without: τ(k) · t_plain ÷ t_iteration(k)."""
  plain = step_time(spec, cfg, B, 1, context, dtype, mesh=mesh)
  return expected_accepted(acceptance_by_position, k) * plain / iteration_time(
      spec, cfg, B, k, context, dtype, draft_cfg, per_draft_s, mesh=mesh)


def crossover_batch(spec: DeviceSpec, cfg: ModelConfig, acceptance_by_position: Sequence[float], k: int,
                    batches: Sequence[int], context: int = 256, dtype: str = "float32",
                    draft_cfg: ModelConfig | None = None, per_draft_s: float | None = None,
                    mesh=None) -> int | None:
  """The smallest batch of ``batches`` at which speculation with k no longer pays (predicted speedup < 1);
  None if it pays at every one.  ``mesh``: the target (and draft) sharded over it."""
  for B in sorted(batches):
    if predicted_speedup(spec, cfg, acceptance_by_position, k, B, context, dtype, draft_cfg, per_draft_s,
                         mesh) < 1.0:
      return B
  return None
