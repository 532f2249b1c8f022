"""Device specs for the roofline cost model: a machine's peak FLOP/s, memory bandwidth and size, interconnect,
step floor, and (measured on a CPU) the rate at which its kernels unpack quantized weights.

``DEVICES`` holds published numbers for common accelerators; ``specjax calibrate`` measures this machine's
(``measure/calibrate.py``) and saves them as JSON, which ``device_spec`` reads by path.

A datasheet gives the roofline, not the latency floor, and the floor depends on how the implementation issues
its kernels more than on the chip: ``REGIMES`` names two (``in_regime``).  A draft step is mostly floor, so a
spec without the right one over-predicts what a small draft buys.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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
  regime: str = "xla"              # how its floors were set (``REGIMES``): one compiled program, or eager launches
  iteration_floor_s: float = 0.0   # fixed cost of a speculative iteration beyond its forwards (eager: the drafting
                                   # lookup, the acceptance and the cache cut are ops launched from the host;
                                   # inside one compiled program: nothing)
  weight_rates: dict = dataclasses.field(default_factory=dict)
                                   # weight type → {"rows": [M...], "s_per_weight": [t...]}: the quantized
                                   # matmul's measured seconds per weight at M rows (``calibrate``, this
                                   # machine's kernels); a type not listed computes at the dtype's peak (XLA
                                   # fuses the dequantization on accelerators)

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

  def matrix_seconds(self, weights: str, num_weights: float, rows, dtype: str):
    """Compute time of the matrix products over ``num_weights`` weights of type ``weights`` and ``rows`` rows
    (a number or a numpy array): the measured time per weight, interpolated between the probed row counts
    (and extended along the last two past them), or 2 FLOPs per weight and row at the dtype's peak."""
    rate = self.weight_rates.get(weights)
    if not rate:
      return 2.0 * num_weights * rows / self.peak(dtype)
    import numpy as np
    ms, ts = np.asarray(rate["rows"], float), np.asarray(rate["s_per_weight"], float)
    r = np.asarray(rows, float)
    slope = (ts[-1] - ts[-2]) / (ms[-1] - ms[-2]) if len(ms) > 1 else 0.0
    t = np.where(r > ms[-1], ts[-1] + slope * (r - ms[-1]), np.interp(r, ms, ts))
    out = num_weights * t
    return float(out) if out.ndim == 0 else out

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


@dataclasses.dataclass(frozen=True)
class Regime:
  """How an implementation issues a decode step's kernels, and the fixed costs that follows (None: the spec's own)."""
  name: str
  summary: str
  floor_s: float | None = None
  floor_per_layer_s: float | None = None
  overlap: float | None = None
  iteration_floor_s: float | None = None


# Eager: Spec-Bench's Hugging Face implementations (PyTorch 2.0.1, A100 80GB, 64 host cores), every op a kernel
# launched from Python.  Two numbers are fitted, to the seven rows of Spec-Bench's A100 leaderboard for Vicuna-7B
# (τ → speedup; ``measure/published.py``, ``scripts/spec_bench_projection.py`` refits them): the floor of one
# forward or host step, and its growth per decoder layer.  A third, discrete choice made by the same comparison
# between the two values the cost model already knows: overlap 0 (one kernel's arithmetic does not hide behind
# another's memory traffic; with 1 the best fit misses Lookahead by 21%, against 8%).  The iteration's own
# overhead (lookup, acceptance, cache cut) is tied to one forward's floor, not fitted apart.  Other GPUs: assumed
# the same (host-bound launches).
EAGER_FLOOR_S = 0.80e-3
EAGER_FLOOR_PER_LAYER_S = 0.255e-3
REGIMES: dict[str, Regime] = {r.name: r for r in (
    Regime("xla", "one compiled program per step or decode loop (specjax; a captured CUDA graph): the spec's own "
                  "floors of a few µs per layer"),
    Regime("eager", "PyTorch eager (Hugging Face generate, Spec-Bench): a launch per op from Python; floors fitted "
                    "to Spec-Bench's A100 leaderboard", floor_s=EAGER_FLOOR_S,
           floor_per_layer_s=EAGER_FLOOR_PER_LAYER_S, overlap=0.0, iteration_floor_s=EAGER_FLOOR_S),
)}


def in_regime(spec: "DeviceSpec", regime: str) -> "DeviceSpec":
  """``spec`` with the floors (and overlap) of an implementation regime.  A calibration measured this machine's
  own compiled steps, so it has the ``xla`` regime only."""
  if regime not in REGIMES:
    raise SpecjaxError(f"unknown regime '{regime}': choose one of {', '.join(REGIMES)}")
  if regime == spec.regime:
    return spec
  if spec.name not in DEVICES:
    raise SpecjaxError(f"device '{spec.name}' is a calibration of this machine's compiled steps (regime xla); "
                       f"the {regime} regime's floors belong to a published spec: use --device "
                       f"{', '.join(DEVICES)}")
  r = REGIMES[regime]
  changes = {f: getattr(r, f) for f in ("floor_s", "floor_per_layer_s", "overlap", "iteration_floor_s")
             if getattr(r, f) is not None}
  return dataclasses.replace(spec, regime=regime, **changes)


def device_spec(name: str) -> DeviceSpec:
  """A published spec by name, or a calibration JSON by path."""
  if name in DEVICES:
    return DEVICES[name]
  p = Path(name).expanduser()
  if p.is_file():
    return load_spec(p)
  raise SpecjaxError(f"unknown device '{name}': choose one of {', '.join(DEVICES)}, or give the path of a "
                     "calibration JSON (specjax calibrate)")


def published_spec(name: str, regime: str = "xla") -> DeviceSpec:
  """A published spec by name, in ``regime``: what a measured result is projected onto (``--project``)."""
  if name not in DEVICES:
    raise SpecjaxError(f"unknown device spec '{name}': choose one of {', '.join(DEVICES)}")
  return in_regime(DEVICES[name], regime)


def load_spec(path) -> DeviceSpec:
  try:
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    return DeviceSpec.from_dict(d["spec"] if "spec" in d else d)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SpecjaxError(f"cannot read the device calibration {path}: {e} — run `specjax calibrate` again") from e


