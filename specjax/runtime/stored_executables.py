"""specjax's own executables, stored under a key computed without tracing.

jax keys its cache on the lowered HLO, so even a hit first traces and lowers the function: for the decode
loop (30 unrolled layers) that is most of a second of Python, more than reading the executable back.  So specjax
also keeps the executables it compiles ahead of time (``compile_and_store``) under a key it can compute
without tracing (``key``), and reads them back with ``read``:

  <cache>/xla/<machine tag>/specjax-aot/<key>.bin   one executable, its argument and result trees

The key hashes everything a trace could depend on: the call's static arguments and the shapes, dtypes and
tree structure of its arguments (pickled: a value that does not pickle, or whose class or function lives
outside specjax, jax, numpy and the standard library, gets no key, and the caller traces as before), the
source of every specjax module, the jax, jaxlib, flax, numpy and Python versions, every jax configuration
value and thread-local override, the devices, and every ``SPECJAX_*``, ``JAX_*`` and ``XLA_*`` environment
variable.  Change any of them and the key changes: the call is traced and compiled (or read from jax's own
cache) as before and stored again.  An entry that cannot be read back (damaged, or from another jax) is
deleted and counts as a miss.  It is on exactly when jax's cache is (``compile_cache.directory()`` is not None).
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import threading
import time
import types
import zlib
from pathlib import Path

import jax

from specjax.runtime import compile_cache

_STATE: dict = {}

STORE_DIR = "specjax-aot"
_FORMAT = 1
# Where a pickled key's classes and functions may come from: specjax (its source is in the key), jax, numpy
# and friends (their versions are), the standard library's containers.  Anything else (a test's or a user's
# own drafter class, say) could change without the key changing: such a call gets no key.
_KEYABLE_ROOTS = frozenset({"specjax", "jax", "jaxlib", "numpy", "ml_dtypes", "flax", "builtins", "collections",
                            "functools", "enum", "copyreg", "_codecs", "operator", "dataclasses", "typing"})
_AT = " at 0x"


class _Unkeyable(Exception):
  pass


class _KeyPickler(pickle.Pickler):
  """Pickles a key's parts, refusing classes and functions from modules outside ``_KEYABLE_ROOTS``, and
  writing every set as its items in sorted order: a set's own order follows string hashes, which differ from
  process to process, and the same parts must give the same bytes in every process."""

  def persistent_id(self, obj):
    if isinstance(obj, (set, frozenset)):
      return (type(obj).__name__, tuple(sorted(obj, key=repr)))
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
      module = getattr(obj, "__module__", None) or ""
      if module.split(".")[0] not in _KEYABLE_ROOTS or "<lambda>" in getattr(obj, "__qualname__", ""):
        raise _Unkeyable(f"{module}.{getattr(obj, '__qualname__', obj)}")
    return None


def _leaf_signature(x):
  """An argument's leaf in a key: an array's shape, dtype and weak type (never its values)."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return ("array", tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
  return ("value", x)


def _source_digest() -> str:
  """SHA-256 of every specjax module's source (once per process)."""
  if "source" not in _STATE:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
      h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    _STATE["source"] = h.hexdigest()
  return _STATE["source"]


def _context() -> bytes:
  """What every key shares: code, versions, jax configuration, devices and environment, as bytes."""
  from jax._src import config as jax_config
  import flax
  import jaxlib
  import numpy as np
  overrides = [r if _AT not in (r := repr(v)) else type(v).__name__ for v in jax_config.trace_context()]
  devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
  env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("SPECJAX_", "JAX_", "XLA_")))
  parts = (_FORMAT, _source_digest(), sys.version, jax.__version__, jaxlib.__version__, flax.__version__,
           np.__version__, sorted((k, repr(v)) for k, v in jax.config.values.items()), overrides, devices,
           jax.process_count(), env)
  return repr(parts).encode()


def key(static: tuple, args: tuple = ()) -> str | None:
  """The key an executable is stored under: ``static`` (the static arguments and whatever else decides the
  trace, pickled whole, values included) and ``args`` (pytrees of arrays passed to the call: only their tree
  structure, shapes and dtypes count, never their values).  None when the persistent cache is off, or a part
  cannot be keyed safely (see ``_KeyPickler``): then trace."""
  if compile_cache.directory() is None:
    return None
  leaves, treedef = jax.tree_util.tree_flatten(args)
  buf = io.BytesIO()
  try:
    _KeyPickler(buf, protocol=5).dump((static, treedef, [_leaf_signature(x) for x in leaves]))
  except (_Unkeyable, pickle.PicklingError, TypeError, AttributeError, RecursionError):
    return None
  return hashlib.sha256(_context() + b"\0" + buf.getvalue()).hexdigest()[:40]


def _stored_path(key: str) -> Path | None:
  d = compile_cache.directory()
  return None if d is None else d / STORE_DIR / f"{key}.bin"


# An executable jax read back from its own cache cannot be serialized again (XLA:CPU keeps no object code
# for it: the copy fails at run time with "Function ... not found").  So while ``compile_and_store`` compiles,
# jax's cache read is watched and the bytes it read are kept (per thread), to be stored as they are.
_WATCH = threading.local()


def _watch_jax_cache_reads() -> bool:
  """Wrap jax's persistent-cache read (once) so that, on a thread that asked, an executable it returns keeps
  the bytes it was read from.  False if this jax has no such function: then nothing read from jax's cache is
  stored (what it compiles still is)."""
  if "watching" not in _STATE:
    try:
      from jax._src import compilation_cache as jcc
      original = jcc.get_executable_and_time
      read_raw = lambda backend, key: jcc.extract_executable_and_time(   # noqa: E731
          jcc.decompress_executable(jcc._get_cache(backend).get(key)))[0]
    except (ImportError, AttributeError):
      _STATE["watching"] = False
      return False

    def get_executable_and_time(cache_key, compile_options, backend, *args, **kwargs):
      exe, compile_time = original(cache_key, compile_options, backend, *args, **kwargs)
      seen = getattr(_WATCH, "read", None)
      if exe is not None and seen is not None:
        try:
          seen[id(exe)] = (exe, read_raw(backend, cache_key))
        except Exception:  # noqa: BLE001 -- not kept: this executable is then not stored
          seen[id(exe)] = (exe, None)
      return exe, compile_time

    jcc.get_executable_and_time = get_executable_and_time
    _STATE["watching"] = True
  return _STATE["watching"]


_SERIALIZE_LOCK = threading.Lock()


def _serialize(compiled, read: dict) -> tuple | None:
  """``serialize_executable.serialize(compiled)``, except that an XLA executable jax read from its cache is
  written as the bytes it was read from (``read``: id -> (executable, bytes or None)).  None if it cannot be."""
  from jax.experimental import serialize_executable as se
  base = se._JaxPjrtPickler

  class Pickler(base):
    def persistent_id(self, obj):
      if id(obj) in read:
        seen, raw = read[id(obj)]
        if seen is obj:
          if raw is None:
            raise _Unkeyable("read from jax's cache without its bytes")
          return ("exec", raw)
      return super().persistent_id(obj)

  with _SERIALIZE_LOCK:     # serialize() picks its pickler class up from its module
    se._JaxPjrtPickler = Pickler
    try:
      return se.serialize(compiled)
    except Exception:  # noqa: BLE001
      return None
    finally:
      se._JaxPjrtPickler = base


def compile_and_store(lowered, key: str | None):
  """``lowered.compile()`` (compiled, or read from jax's cache), and the result stored under ``key`` (a
  ``key``; None: not stored)."""
  path = None if key is None else _stored_path(key)
  if path is None or not _watch_jax_cache_reads():
    return lowered.compile()
  _WATCH.read = read = {}
  try:
    compiled = lowered.compile()
  finally:
    _WATCH.read = None
  try:
    _store(path, compiled, read)
  except Exception:  # noqa: BLE001 -- storing is an optimisation: a failure costs the next run a trace
    pass
  return compiled


def _store(path: Path, compiled, read: dict) -> None:
  if path.is_file():
    return
  serialized = _serialize(compiled, read)
  if serialized is None:
    return
  exe, in_tree, out_tree = serialized
  devices = sorted({d.id for s in jax.tree_util.tree_leaves(compiled.input_shardings) for d in s.device_set})
  payload = pickle.dumps({"format": _FORMAT, "exe": zlib.compress(exe, 1), "in_tree": in_tree,
                          "out_tree": out_tree, "devices": devices}, protocol=5)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
  try:
    tmp.write_bytes(hashlib.sha256(payload).digest() + payload)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def read(key: str | None):
  """The executable stored under ``key`` (counted as read from the compilation cache), or None: then trace
  and compile (``compile_and_store``).  A damaged or unloadable entry is deleted."""
  path = None if key is None else _stored_path(key)
  if path is None:
    return None
  try:
    blob = path.read_bytes()
  except OSError:
    return None
  t0 = time.perf_counter()
  try:
    payload = blob[32:]
    if hashlib.sha256(payload).digest() != blob[:32]:
      raise ValueError("checksum")
    entry = pickle.loads(payload)
    if entry["format"] != _FORMAT:
      raise ValueError("format")
    from jax.experimental import serialize_executable
    by_id = {d.id: d for d in jax.devices()}
    compiled = serialize_executable.deserialize_and_load(
        zlib.decompress(entry["exe"]), entry["in_tree"], entry["out_tree"],
        execution_devices=[by_id[i] for i in entry["devices"]])
  except Exception:  # noqa: BLE001 -- never use what cannot be read back whole: trace and compile instead
    path.unlink(missing_ok=True)
    return None
  compile_cache.count_hit(time.perf_counter() - t0)
  return compiled
