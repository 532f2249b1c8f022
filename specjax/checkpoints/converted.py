"""The converted-weight cache: convert a checkpoint once, memory-map the result on every later load.

A GGUF file has to be converted before it can run: its tensors dequantized, llama.cpp's q/k row permutation
undone, layers stacked, and the tokenizer rebuilt from the vocabulary and merges in its metadata.  That takes
seconds; reading the result back takes a fraction of one.  The first load of a source writes the converted
model into the specjax cache, later loads read it:

  <cache>/converted/<sha256 of the source, 32 hex>-<dtype>-v<LAYOUT_VERSION>/
      params.safetensors   the canonical (stacked) parameter pytree, one tensor per leaf, named by its path
                           ("embed", "layers.w_qkv", ...)
      model.json           the ModelConfig, the tokenizer (``Tokenizer.to_json``) and a manifest: the source's
                           digest, dtype, layout version, and the size and per-64-MiB-block CRC-32s of params.safetensors

An entry is written into a temporary directory beside its final place and renamed into place whole, so a
conversion that is killed leaves nothing behind.  On read the manifest, the file size and the CRC-32 are
checked; a missing, truncated or damaged entry is reported in one line on stderr, deleted and rebuilt from
the source — never used.  Bump ``LAYOUT_VERSION`` whenever the parameter layout or the tokenizer
serialisation changes: old entries are then simply not found.

The source digest (SHA-256 of the file) is remembered per (path, size, mtime) under ``converted/sources/``,
so an unchanged file is not hashed again on every load.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from specjax import settings
from specjax.checkpoints.tokenizer import Tokenizer
from specjax.models.config import ModelConfig
from specjax.cache_location import cache_dir

LAYOUT_VERSION = 2   # 2: the config carries its model family (ModelConfig.family and the family fields)
PARAMS_FILE = "params.safetensors"
MODEL_FILE = "model.json"
_CHUNK = 1 << 24


class CorruptEntry(Exception):
  """A cache entry that must not be used (the message says why)."""


def _log(message: str) -> None:
  sys.stderr.write(f"[specjax] {message}\n")   # one write: other threads may log at the same moment
  sys.stderr.flush()


def root() -> Path:
  return cache_dir() / "converted"


def enabled() -> bool:
  """``SPECJAX_WEIGHT_CACHE=0`` turns the converted-weight cache off (every load converts again)."""
  return settings.weight_cache_wanted()


# ----------------------------------------------------------------------------------------------------------
# Source digests


def file_sha256(path: Path) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def source_digest(path: Path) -> str:
  """SHA-256 of a source file, remembered per (real path, size, mtime) so an unchanged file is hashed once."""
  path = Path(path).resolve()
  st = path.stat()
  memo = root() / "sources" / (hashlib.sha1(str(path).encode()).hexdigest() + ".json")
  stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
  try:
    known = json.loads(memo.read_text())
    if all(known.get(k) == v for k, v in stamp.items()) and len(known.get("sha256", "")) == 64:
      return known["sha256"]
  except (OSError, ValueError):
    pass
  digest = file_sha256(path)
  try:
    _atomic_write_text(memo, json.dumps({**stamp, "sha256": digest}))
  except OSError:   # a read-only cache: hash again next time
    pass
  return digest


def entry_dir(digest: str, dtype) -> Path:
  return root() / f"{digest[:32]}-{np.dtype(dtype).name}-v{LAYOUT_VERSION}"


# ----------------------------------------------------------------------------------------------------------
# Parameter pytrees <-> flat named tensors


def flatten_params(params) -> dict[str, np.ndarray]:
  """{"embed": ..., "layers.w_qkv": ...}: a dict pytree's leaves by their dotted path."""
  flat = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(f"{prefix}.{k}" if prefix else k, v)
    else:
      flat[prefix] = np.asarray(node)

  walk("", params)
  return flat


def unflatten_params(flat: dict) -> dict:
  params: dict = {}
  for name, value in flat.items():
    node = params
    *parents, leaf = name.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return params


# ----------------------------------------------------------------------------------------------------------
# Writing and reading an entry


def _atomic_write_text(path: Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
  with os.fdopen(fd, "w") as f:
    f.write(text)
  os.replace(tmp, path)


CRC_BLOCK = 1 << 26      # the manifest keeps one CRC-32 per 64 MiB block, checked on all cores at once


def _crc32_range(path: Path, start: int, length: int) -> int:
  crc = 0
  with open(path, "rb") as f:
    f.seek(start)
    while length > 0 and (chunk := f.read(min(_CHUNK, length))):
      crc = zlib.crc32(chunk, crc)
      length -= len(chunk)
  return crc


def block_crcs(path: Path, block: int = CRC_BLOCK, mapped: np.ndarray | None = None) -> list[int]:
  """CRC-32 of each ``block``-byte block of ``path``, computed on a thread per core (zlib releases the
  GIL): a second load of a 7 GB model checks every byte in about half the time of one CRC.  ``mapped``: the
  whole file already memory-mapped (uint8), read in place instead of copied out block by block."""
  from concurrent.futures import ThreadPoolExecutor

  size = path.stat().st_size if mapped is None else mapped.size
  starts = range(0, max(size, 1), block)
  if mapped is None:
    crc = lambda s: _crc32_range(path, s, min(block, size - s))   # noqa: E731
  else:
    crc = lambda s: zlib.crc32(mapped[s:s + block])               # noqa: E731
  with ThreadPoolExecutor(max_workers=max(1, min(len(starts), os.cpu_count() or 1))) as pool:
    return list(pool.map(crc, starts))


def _crc32_file(path: Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def _header_length(path: Path) -> tuple[int, int]:
  """(header length n, trailing pad spaces) of a safetensors file."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = f.read(n)
  return n, len(header) - len(header.rstrip(b" "))


_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "int8": "I8",
              "uint8": "U8"}


def _dtype_of(dtype, name: str) -> np.dtype:
  """One dtype for every tensor, or ``dtype[name]`` when ``dtype`` is a dict."""
  return np.dtype(dtype[name] if isinstance(dtype, dict) else dtype)


def _safetensors_header(shapes: dict[str, tuple[int, ...]], dtype, align: int = 64) -> tuple[bytes, dict]:
  """The header of a safetensors file holding zero-filled tensors of ``shapes`` in ``dtype`` (one dtype, or
  a dict of them by name): (the bytes up to the data, {name: data offset}).  The JSON is padded with spaces
  (the format allows it) so that the data starts at a multiple of ``align`` bytes: every tensor whose offset
  is a multiple of ``align`` can then be handed to XLA without a copy (``jax.device_put(..., may_alias=True)``)."""
  header, offsets, pos = {}, {}, 0
  for name, shape in shapes.items():
    dt = _dtype_of(dtype, name)
    n = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    header[name] = {"dtype": _ST_DTYPES[dt.name], "shape": list(shape), "data_offsets": [pos, pos + n]}
    offsets[name] = pos
    pos += n
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * ((-(8 + len(text))) % align)
  return struct.pack("<Q", len(text)) + text, offsets


def write_safetensors_streaming(path: Path, shapes: dict[str, tuple[int, ...]], dtype, pieces) -> None:
  """Write a safetensors file piece by piece, never holding more than one piece in memory.

  ``pieces`` yields (tensor name, element offset, flat array in ``dtype``); each is written at its place
  with ``os.pwrite`` (nothing is memory-mapped, so the written data costs the process no resident memory).
  Raises CheckpointError if the pieces do not cover every tensor exactly."""
  from specjax.errors import CheckpointError

  head, offsets = _safetensors_header(shapes, dtype)
  sizes = {name: int(np.prod(shape, dtype=np.int64)) for name, shape in shapes.items()}
  written = dict.fromkeys(shapes, 0)
  data_bytes = sum(_dtype_of(dtype, n).itemsize * sizes[n] for n in shapes)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
  try:
    os.ftruncate(fd, len(head) + data_bytes)
    os.pwrite(fd, head, 0)
    for name, offset, flat in pieces:
      dt = _dtype_of(dtype, name)
      if flat.dtype != dt or offset < 0 or offset + flat.size > sizes[name]:
        raise CheckpointError(f"conversion wrote {flat.size} {flat.dtype} values at {offset} of tensor '{name}' "
                              f"({sizes[name]} {dt.name} values)")
      buf = memoryview(np.ascontiguousarray(flat).reshape(-1).view(np.uint8))
      pos, done = len(head) + offsets[name] + offset * dt.itemsize, 0
      while done < len(buf):                 # pwrite may write less than asked (large buffers)
        done += os.pwrite(fd, buf[done:], pos + done)
      written[name] += flat.size
    os.fsync(fd)
  finally:
    os.close(fd)
  short = [n for n in shapes if written[n] != sizes[n]]
  if short:
    raise CheckpointError(f"conversion left tensor(s) {', '.join(short[:3])} incomplete "
                          f"({written[short[0]]} of {sizes[short[0]]} values)")


def save_entry_streaming(entry: Path, src, dtype, source: dict) -> None:
  """Write an entry whole, straight from an opened checkpoint (``gguf_loader.GGUFSource``), tensor by tensor
  (``write_safetensors_streaming``: peak memory is one tensor block, not the model)."""
  save_entry(entry, src.leaf_shapes(), dtype, src.pieces(dtype), src.cfg, src.tokenizer, source)


def save_entry(entry: Path, shapes: dict, dtype, pieces, cfg, tokenizer, source: dict,
               manifest_extra: dict | None = None, meta_extra: dict | None = None) -> None:
  """Write an entry whole: ``pieces`` (see ``write_safetensors_streaming``; ``dtype`` one or per tensor) into
  params.safetensors in a temporary directory, the manifest (with ``manifest_extra``) and model.json (with
  ``meta_extra``) after it, then one rename (a whole entry that another process wrote meanwhile is kept)."""
  entry.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
  try:
    write_safetensors_streaming(tmp / PARAMS_FILE, shapes, dtype, pieces)
    manifest = {"layout_version": LAYOUT_VERSION, **(manifest_extra or {}), "source": source,
                "params": {"file": PARAMS_FILE, "size": (tmp / PARAMS_FILE).stat().st_size,
                           "crc32_block": CRC_BLOCK, "crc32_blocks": block_crcs(tmp / PARAMS_FILE)}}
    (tmp / MODEL_FILE).write_text(json.dumps({"manifest": manifest, "config": cfg.to_dict(),
                                              "tokenizer": tokenizer.to_json(), **(meta_extra or {})}))
    if (entry / MODEL_FILE).is_file():
      # Another process converting the same model finished first and may be reading its entry now (two
      # processes of one multi-process run start together): keep theirs, never delete it under them.  A
      # broken entry is removed by the caller before it converts again, so a whole one here is theirs.
      shutil.rmtree(tmp, ignore_errors=True)
      return
    if entry.exists():
      shutil.rmtree(entry, ignore_errors=True)   # a partial entry without its manifest
    try:
      os.replace(tmp, entry)
    except OSError:
      if not (entry / MODEL_FILE).is_file():
        raise
      shutil.rmtree(tmp, ignore_errors=True)   # another process finished the same entry first: keep theirs
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _read_safetensors_mmap(path: Path, mm: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Every tensor of a safetensors file as a read-only view of one memory map (no copy, no parse of the data;
  ``mm``: the file already mapped, uint8).

  The header is read with the format's documented layout (8-byte length, JSON); the library's ``safe_open``
  copies each tensor out, which we avoid so that loading costs no more than the pages actually touched."""
  if mm is None:
    if path.stat().st_size == 0:
      raise CorruptEntry(f"{path.name} is 0 bytes, too short for a safetensors header")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
  size = mm.size
  if size < 8:
    raise CorruptEntry(f"{path.name} is {size} bytes, too short for a safetensors header")
  (n,) = struct.unpack("<Q", mm[:8].tobytes())
  if n > size - 8:
    raise CorruptEntry(f"{path.name}: header of {n} bytes does not fit in {size} bytes")
  try:
    header = json.loads(mm[8:8 + n].tobytes())
  except ValueError as e:
    raise CorruptEntry(f"{path.name}: unreadable header ({e})") from None
  dtypes = {code: jax.numpy.bfloat16 if name == "bfloat16" else np.dtype(name) for name, code in _ST_DTYPES.items()}
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    start, end = info["data_offsets"]
    dt = np.dtype(dtypes[info["dtype"]])
    if 8 + n + end > size or end - start != dt.itemsize * int(np.prod(info["shape"], dtype=np.int64)):
      raise CorruptEntry(f"{path.name}: tensor '{name}' lies outside the file (truncated?)")
    out[name] = mm[8 + n + start:8 + n + end].view(dt).reshape(info["shape"])
  return out


def load_entry(entry: Path, check_crc: bool = True):
  """(cfg, params as read-only numpy views, tokenizer) from an entry; CorruptEntry if anything is off."""
  model_file, params_file = entry / MODEL_FILE, entry / PARAMS_FILE
  try:
    meta = json.loads(model_file.read_text())
    manifest = meta["manifest"]
  except (OSError, ValueError, KeyError) as e:
    raise CorruptEntry(f"{MODEL_FILE} missing or unreadable ({type(e).__name__})") from None
  if manifest.get("layout_version") != LAYOUT_VERSION:
    raise CorruptEntry(f"layout version {manifest.get('layout_version')} != {LAYOUT_VERSION}")
  if not params_file.is_file():
    raise CorruptEntry(f"{PARAMS_FILE} is missing")
  size = params_file.stat().st_size
  if size != manifest["params"]["size"]:
    raise CorruptEntry(f"{PARAMS_FILE} is {size} bytes, the manifest says {manifest['params']['size']} "
                       "(truncated or partly written)")
  crc: list = []
  checker = None
  info = manifest["params"]
  # One memory map serves the check and the parameters: the check reads the file in place (no copy into
  # fresh buffers) and leaves its pages mapped for the first forward pass.
  mapped = np.memmap(params_file, dtype=np.uint8, mode="r") if size else None
  if check_crc:   # CRC-32s on helper threads (zlib releases the GIL) while the tokenizer is rebuilt
    if "crc32_blocks" in info:
      want = info["crc32_blocks"]
      work = lambda: crc.append(block_crcs(params_file, info["crc32_block"], mapped))   # noqa: E731
    else:           # entries written before per-block CRCs
      want = info["crc32"]
      work = lambda: crc.append(_crc32_file(params_file))   # noqa: E731
    checker = threading.Thread(target=work, daemon=True)
    checker.start()
  try:
    cfg = ModelConfig.from_dict(meta["config"])
    tokenizer = Tokenizer.from_json(meta["tokenizer"])
  except Exception as e:  # noqa: BLE001 -- any damage to model.json means the entry is unusable
    raise CorruptEntry(f"{MODEL_FILE} does not describe a model ({type(e).__name__}: {e})") from None
  params = unflatten_params(_read_safetensors_mmap(params_file, mapped))
  if checker is not None:
    checker.join()
    if crc[0] != want:
      raise CorruptEntry(f"{PARAMS_FILE} fails its CRC-32 check (damaged on disk)")
  return cfg, params, tokenizer


def cached_convert(source: Path, dtype, convert: Callable[[], tuple], open_source: Callable) -> tuple:
  """(cfg, params, tokenizer) for ``source`` in ``dtype``, through the cache.

  A missing entry is written straight from the source (``open_source()`` returns a ``gguf_loader.GGUFSource``),
  tensor by tensor, and then memory-mapped: converting never holds the model in memory.  ``convert()`` loads
  it in memory instead, when the cache is off (``SPECJAX_WEIGHT_CACHE=0``) or cannot be written (read-only or
  full disk: a one-line notice, and the next load converts again).  Returns numpy parameters (memory-mapped
  when read from the cache).  A bad entry is reported in one line, removed and rebuilt."""
  if not enabled():
    return convert()
  source = Path(source)
  digest = source_digest(source)
  entry = entry_dir(digest, dtype)
  if entry.exists():
    try:
      return load_entry(entry)
    except CorruptEntry as e:
      _log(f"converted-weight cache entry {entry} is unusable ({e}); rebuilding it from {source.name}")
      shutil.rmtree(entry, ignore_errors=True)
  _log(f"converting {source.name} (first load; the result is cached for later loads)")
  meta = {"path": str(source.resolve()), "sha256": digest, "dtype": np.dtype(dtype).name}
  try:
    save_entry_streaming(entry, open_source(), dtype, meta)
  except OSError as e:
    _log(f"could not write the converted-weight cache at {entry} ({e}); converting in memory, the next load "
         "converts again")
    return convert()
  return load_entry(entry, check_crc=False)   # its CRC-32s were just computed from the written file


def converted_bytes(source: Path) -> int:
  """Bytes of the converted entries of ``source`` in the cache (0 if its digest was never computed: this
  never hashes the file)."""
  try:
    path = Path(source).resolve()
    memo = root() / "sources" / (hashlib.sha1(str(path).encode()).hexdigest() + ".json")
    digest = json.loads(memo.read_text())["sha256"]
  except (OSError, ValueError, KeyError):
    return 0
  return sum(f.stat().st_size for d in root().glob(f"{digest[:32]}-*") if d.is_dir()
             for f in d.iterdir() if f.is_file())
