"""This machine, at the bottom of the house (it imports nothing of specjax): its CPU, its cores and one tag
naming it.

The same command can differ by 2x between two of the machines these benchmarks run on (an AVX-512 Intel and
an AVX2-only AMD, say), so every stored measurement (calibration, kernel choices, compiled executables) is
filed under ``tag()``, and every number is recorded with ``specjax.measure.provenance.describe()``.
"""
from __future__ import annotations

import hashlib
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


def cores() -> int:
  """The cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def tag() -> str:
  """The one name of this machine for everything stored per machine: readable (CPU, cores, backend), then a
  hash of what an executable or a measurement also depends on (jax version, the full CPU flags; the
  accelerators' kinds).  Stores that depend on more say so after it (the kernel build, the kernel path)."""
  backend = jax.default_backend()
  readable = f"{cpu_name()}-{cores()}c-{backend}"
  parts = [backend, jax.__version__]
  if backend == "cpu":
    info = cpu_info()
    parts += [info["model"], str(info["family"]), str(info["model_number"]), " ".join(info["flags"])]
  else:
    parts += sorted({d.device_kind for d in jax.devices()})
  digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
  return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in readable)[:100] + f"-{digest}"
