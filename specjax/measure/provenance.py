"""What a number was measured with: recorded in every ``bench`` JSON, every run directory and every
calibration (the machine, its kernel path and the kernel choices made on it, jax and its devices)."""
from __future__ import annotations

import jax

from specjax import machine
from specjax.kernels import choices, native


def describe() -> dict:
  """The machine, as recorded next to every benchmark number."""
  info = machine.cpu_info()
  path = native.path_name()
  return {
      "cpu": machine.cpu_name(),
      "cpu_flags": [f for f in machine.RELEVANT_FLAGS if f in info["flags"]],
      "cores": machine.cores(),
      "kernel_path": path,
      "kernel_choices": choices.summary() if path != "xla" else None,
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": sorted({d.device_kind for d in jax.devices()}),
  }


def short(d: dict | None = None) -> str:
  """One line: 'AMD EPYC (family 25 model 17), 2 cores, native-avx512, jax 0.10.2 cpu'."""
  d = d or describe()
  return f"{d['cpu']}, {d['cores']} cores, {d['kernel_path']}, jax {d['jax']} {d['backend']}"
