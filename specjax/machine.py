"""What machine a measurement was made on: recorded in every ``bench`` JSON and every run directory.

The same command can differ by 2x between two of the machines these benchmarks run on (an AVX-512 Intel
and an AVX2-only AMD, say), so a number without its machine cannot be compared with anything.
"""
from __future__ import annotations

import os
import platform

import jax

# The CPU features that decide which kernel path runs (and that explain a number).
RELEVANT_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                  "avx512_vnni", "amx_tile", "asimd", "sve")


def cpu_info() -> dict:
  """CPU model name, family/model numbers and ISA flags (Linux /proc/cpuinfo; platform strings elsewhere)."""
  info = {"model": platform.processor() or platform.machine(), "family": None, "model_number": None,
          "flags": []}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name":
          info["model"] = value
        elif key == "cpu family" and info["family"] is None:
          info["family"] = value
        elif key == "model" and info["model_number"] is None:
          info["model_number"] = value
        elif key in ("flags", "Features") and not info["flags"]:
          info["flags"] = sorted(value.split())
        elif not line.strip() and info["flags"]:
          break                                      # first processor block is enough
  except OSError:
    pass
  return info


def cpu_name() -> str:
  """'AMD EPYC (family 25 model 17)': the model string, with family/model numbers where the model string is
  as vague as virtual machines often make it."""
  info = cpu_info()
  name = info["model"]
  if info["family"] is not None:
    name += f" (family {info['family']} model {info['model_number']})"
  return name


def describe() -> dict:
  """The machine, as recorded next to every benchmark number."""
  from specjax.kernels import native
  info = cpu_info()
  backend = jax.default_backend()
  kernels = native.isa() if backend == "cpu" else None
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count()
  return {
      "cpu": cpu_name(),
      "cpu_flags": [f for f in RELEVANT_FLAGS if f in info["flags"]],
      "cores": cores,
      "kernel_path": (f"native-{kernels}" + ("-emulated" if native.emulating() else "")) if kernels else "xla",
      "kernel_choices": _kernel_choices() if kernels else None,
      "jax": jax.__version__,
      "backend": backend,
      "devices": sorted({d.device_kind for d in jax.devices()}),
  }


def _kernel_choices() -> dict:
  """Native or XLA per weight-size class and the thread count, as measured on this machine (autotune.py)."""
  from specjax.kernels import autotune
  return autotune.summary()


def short(d: dict | None = None) -> str:
  """One line: 'AMD EPYC (family 25 model 17), 2 cores, native-avx512, jax 0.10.2 cpu'."""
  d = d or describe()
  return f"{d['cpu']}, {d['cores']} cores, {d['kernel_path']}, jax {d['jax']} {d['backend']}"
