"""Which CPU path the decode-sized matmuls and attention take on this machine: the stored choice table.

The native kernels (``cpu_matmul.cc``, ``cpu_attention.cc``) beat XLA on the CPUs we measured, but not on
every CPU: where the build falls back to the portable loop (no AVX2), XLA is faster, and on a many-core
machine fewer threads than cores may stream the weights fastest.  So the choice is measured once per machine
(``specjax.measure.kernel_paths``, run when a model is loaded: ``api.load``) and stored in
``<cache>/kernels/choices/<machine tag>-<kernel sources>-<isa>.json``; this module only reads that table.  It
never measures: a forward traced before anything was measured takes the native kernel wherever it is built
for a SIMD instruction set, XLA over the portable build (what the measurement chose on every machine so far).

Per weight-size class (``CLASSES``) one path serves every row count, so a verification row gets the very bits
of a decode row and greedy speculative decoding stays token-exact.  ``SPECJAX_NATIVE`` overrides the table
(``1`` always native, ``0`` never; unset or ``auto``: the table), ``SPECJAX_THREADS=N`` fixes the thread count;
both are read in ``specjax.settings``.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from pathlib import Path

from specjax import settings
from specjax.cache_location import cache_dir
from specjax.kernels import native

VERSION = 3
# Weight-size classes (bytes of one fp32 matrix) and the shape each is measured with: a transformer layer's
# matrices in a small model, where per-call costs show, and large ones (an LM head, a 7B model's layers) that
# only stream.  Two classes keep the measurement to a few seconds (each chain compiles).
CLASSES = (("small", 16 << 20, (1536, 768)), ("large", None, (8192, 1024)))
_STATE: dict = {}
_LOCK = threading.RLock()


def mode() -> str:
  """'native', 'xla' or 'auto' (the stored table), from ``SPECJAX_NATIVE``."""
  return settings.native_mode()


def size_class(N: int, D: int) -> str:
  nbytes = 4 * N * D
  return next(name for name, limit, _ in CLASSES if limit is None or nbytes < limit)


def choices_path() -> Path:
  from specjax import machine
  # The kernel path in the name: a path forced with SPECJAX_CPU_ISA is measured on its own.
  return cache_dir() / "kernels" / "choices" / f"{machine.tag()}-{native.source_digest()}-{native.isa()}.json"


def say(message: str) -> None:
  sys.stderr.write(f"[specjax] {message}\n")
  sys.stderr.flush()


def _read() -> dict:
  path = choices_path()
  try:
    data = json.loads(path.read_text())
    if data.get("version") == VERSION and isinstance(data.get("classes"), dict):
      return data
    say(f"{path} is from another version: the CPU kernel paths will be measured again")
  except FileNotFoundError:
    pass
  except (OSError, ValueError):
    say(f"{path} is unreadable: the CPU kernel paths will be measured again")
  return {"version": VERSION, "machine": None, "threads": None, "classes": {}}


def save(data: dict) -> None:
  path = choices_path()
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(data, indent=2))
  os.replace(tmp, path)                        # a killed process leaves the old file or the new one


def table() -> dict:
  """The table of this process (read once; its thread count applied to the kernels)."""
  with _LOCK:
    if "data" not in _STATE:
      _STATE["data"] = _read()
      if _STATE["data"]["threads"] is not None:
        set_threads(_STATE["data"]["threads"])
    return _STATE["data"]


def missing() -> list[str]:
  """What the table does not know yet: 'threads', class names, 'attention'."""
  data = table()
  return ((["threads"] if data["threads"] is None else []) + [c for c, _, _ in CLASSES if c not in data["classes"]]
          + ([] if "attention" in data else ["attention"]))


def set_threads(n: int | None) -> None:
  """Use n threads (caller + helpers) in the native kernels; None: all."""
  if native.available():
    lib = native._STATE["lib"]
    lib.SpecjaxSetThreads.argtypes = [ctypes.c_int64]
    lib.SpecjaxSetThreads.restype = ctypes.c_int64
    lib.SpecjaxSetThreads(int(n or 0))


def _native_chosen(path_of) -> bool:
  """The rule both decisions share: SPECJAX_NATIVE if set, else the stored path (``path_of(table)``), else
  (nothing measured yet) native unless the kernels are the portable build."""
  m = mode()
  if m != "auto":
    return m == "native"
  stored = path_of(table())
  return stored == "native" if stored is not None else native.isa() != "portable"


def matmul_native(N: int, D: int) -> bool:
  """Whether a decode-sized x · wᵀ with weight [N, D] takes the native kernel here."""
  name = size_class(N, D)
  return _native_chosen(lambda data: data["classes"].get(name, {}).get("path"))


def attention_native() -> bool:
  """Whether decode-sized attention takes the native kernel here."""
  return _native_chosen(lambda data: data.get("attention", {}).get("path"))


def summary() -> dict:
  """What the table says (for bench JSON and run directories): mode, threads and path per class."""
  if mode() != "auto":
    return {"mode": mode()}
  data = _STATE.get("data") or {}
  paths = {c: v["path"] for c, v in (data.get("classes") or {}).items()}
  if "attention" in data:
    paths["attention"] = data["attention"]["path"]
  return {"mode": "auto", "threads": data.get("threads"), "paths": paths}


def forget() -> None:
  """Drop the in-process table (tests; after the cache was cleared)."""
  with _LOCK:
    _STATE.clear()
    if native.available():
      set_threads(None)
