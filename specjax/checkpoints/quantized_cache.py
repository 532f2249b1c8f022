"""Quantized weights in the converted-weight cache: quantize a model once, memory-map the result after that.

``specjax.load(..., weights="int4")`` (and bf16, int8) of a GGUF source quantizes the converted fp32 model
(``quant.quantize_params``) the first time and writes the result beside the fp32 entry; later loads map it:

  <cache>/converted/<sha256 of the source, 32 hex>-<kind>-q<QUANT_VERSION>-v<LAYOUT_VERSION>/
      params.safetensors   every leaf, a ``QWeight`` as NAME.data, NAME.scale and NAME.offset (each in its own
                           dtype: uint8, int8, bfloat16, float32); tensors whose size is a multiple of 64
                           bytes come first, so each of them stays aligned and is aliased, not copied
      model.json           as an fp32 entry's (config, tokenizer, manifest with per-block CRC-32s), plus
                           "qweights": {NAME: {"kind", "group"}}

At int4 the layer matrices that the GGUF file stores in 4-bit blocks (Q4_0, Q4_1, Q4_K) are taken over
from those blocks exactly (``gguf_blocks.py``) rather than requantized.  The fp32 entry is only read to make
a quantized one, so a machine that runs int4 alone keeps 1.5 GB mapped for the 1.5B instead of 7.1 GB.  Writing, checking and rebuilding follow ``converted.py``: a temporary
directory renamed into place whole, the manifest and CRC-32s checked on read, a bad entry reported in one
line and rebuilt.  Bump ``QUANT_VERSION`` when ``quant.quantize_params`` changes what it produces.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from specjax.models import quant
from specjax.checkpoints import converted, gguf_blocks

QUANT_VERSION = 2    # 2: int4 layer matrices taken over from GGUF 4-bit blocks (gguf_blocks.py)


def entry_dir(digest: str, kind: str) -> Path:
  return converted.root() / f"{digest[:32]}-{kind}-q{QUANT_VERSION}-v{converted.LAYOUT_VERSION}"


def flatten(params) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
  """({dotted name: host array}, {name of each QWeight: its kind and group}) of a parameter pytree."""
  qweights = {}

  def expand(prefix, node):   # a QWeight becomes a dict of its fields
    if isinstance(node, quant.QWeight):
      node = node.in_rows()    # stored in rows (tiles are made at load, for the kernel that reads them)
      qweights[prefix] = {"kind": node.kind, "group": node.group}
      return {f: getattr(node, f) for f in ("data", "scale", "offset") if getattr(node, f) is not None}
    if isinstance(node, dict):
      return {k: expand(f"{prefix}.{k}" if prefix else k, v) for k, v in node.items()}
    return node

  return converted.flatten_params(expand("", params)), qweights


def with_qweights(params: dict, qweights: dict) -> dict:
  """The inverse of ``flatten``'s expansion: each listed node (a dict of fields) back into a QWeight."""
  for name, info in qweights.items():
    *parents, leaf = name.split(".")
    node = params
    for p in parents:
      node = node[p]
    fields = node[leaf]
    node[leaf] = quant.QWeight(fields["data"], fields.get("scale"), info["kind"], info["group"],
                               fields.get("offset"))
  return params


def save(entry: Path, params, cfg, tokenizer, source: dict) -> None:
  """Write a quantized entry whole (``converted.save_entry``: temporary directory, then one rename), one
  tensor at a time."""
  arrays, qweights = flatten(params)
  order = sorted(arrays, key=lambda n: arrays[n].nbytes % 64 != 0)   # stable: aligned sizes first
  converted.save_entry(entry, {n: arrays[n].shape for n in order}, {n: arrays[n].dtype for n in order},
                       ((n, 0, arrays[n].reshape(-1)) for n in order), cfg, tokenizer, source,
                       manifest_extra={"quant_version": QUANT_VERSION}, meta_extra={"qweights": qweights})


def load(entry: Path, check_crc: bool = True):
  """(cfg, params with QWeight leaves as memory-mapped numpy views, tokenizer); CorruptEntry if anything is
  off (``converted.load_entry``'s checks, and a manifest that is not this quantization's)."""
  cfg, flat, tokenizer = converted.load_entry(entry, check_crc)
  try:
    meta = json.loads((entry / converted.MODEL_FILE).read_text())
    qweights = meta["qweights"]
  except (OSError, ValueError, KeyError):
    raise converted.CorruptEntry(f"{converted.MODEL_FILE} does not list the quantized tensors") from None
  if meta["manifest"].get("quant_version") != QUANT_VERSION:
    raise converted.CorruptEntry(f"quantization version {meta['manifest'].get('quant_version')} != {QUANT_VERSION}")
  try:
    return cfg, with_qweights(flat, qweights), tokenizer
  except (KeyError, TypeError) as e:
    raise converted.CorruptEntry(f"a quantized tensor is missing its fields ({e})") from None


def quantize_gguf(params, kind: str, open_source: Callable | None):
  """``quant.quantize_params``, then at int4 the layer matrices stored as Q4_0/Q4_1/Q4_K in the GGUF source
  (``open_source()``, a ``gguf_loader.GGUFSource``) taken over from their blocks exactly (``gguf_blocks``)."""
  qparams = quant.quantize_params(params, kind)
  if kind == "int4" and open_source is not None:
    src = open_source()
    qparams, taken, seen = gguf_blocks.take_over_int4(qparams, src)
    if taken:
      rest = "" if taken == seen else ", the rest requantized"
      converted._log(f"int4: {taken} of {seen} layer tensors of {src.path.name} taken over from their 4-bit "
                     f"blocks exactly{rest}")
  return qparams


def cached_quantize(source: Path, kind: str, load_fp32: Callable[[], tuple],
                    open_source: Callable | None = None) -> tuple:
  """(cfg, params quantized to ``kind``, tokenizer) for ``source``, through the cache: read the entry if it
  is there and sound, else quantize ``load_fp32()``'s parameters (``quantize_gguf``: at int4, GGUF 4-bit
  blocks taken over), write the entry and map it (so the quantized copy made in memory is freed).  With the
  cache off or unwritable, quantize in memory the same way."""
  if not converted.enabled():
    cfg, params, tok = load_fp32()
    return cfg, quantize_gguf(params, kind, open_source), tok
  digest = converted.source_digest(source)
  entry = entry_dir(digest, kind)
  if entry.exists():
    try:
      return load(entry)
    except converted.CorruptEntry as e:
      converted._log(f"quantized-weight cache entry {entry} is unusable ({e}); quantizing {source.name} again")
      shutil.rmtree(entry, ignore_errors=True)
  cfg, params, tok = load_fp32()
  converted._log(f"quantizing {source.name} to {kind} (first load at this type; the result is cached)")
  qparams = quantize_gguf(params, kind, open_source)
  meta = {"path": str(Path(source).resolve()), "sha256": digest, "weights": kind}
  try:
    save(entry, qparams, cfg, tok, meta)
  except OSError as e:
    converted._log(f"could not write the quantized-weight cache at {entry} ({e}); the next load quantizes "
                   "again")
    return cfg, qparams, tok
  del qparams
  return load(entry, check_crc=False)
