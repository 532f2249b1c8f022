"""Weights in 2 MB pages: the arrays a CPU decode step streams, copied out of the page-cache mapping.

A converted model is memory-mapped (``checkpoints/converted.py``) and handed to XLA without a copy, so a decode
step streams its weights through 4 KB pages of the page cache: one TLB walk per 4 KB, a cost that grows with
the stream's speed.  Copied into anonymous memory that the kernel backs with 2 MB pages
(``madvise(MADV_HUGEPAGE)``, which transparent huge pages honour in their default ``madvise`` mode), the same
weights decode a little faster: measured on a 2-core Zen 4, Qwen2.5-Coder-1.5B, paired
(``scripts/probes/huge_pages_ab.py``), +1.7% to +7.7% in fp32 and +1.3% to +4.6% at int4 (docs/benchmarks-log.md,
"Quantized weights").

Opt-in (``SPECJAX_HUGE_PAGES=1``, read by ``runtime/loaded.default_exec_params``): the copy costs time at load
(measured: 3 s at int4, 15 s for the 7 GB fp32 1.5B) and the model then sits in memory twice while the page
cache keeps the file (prefill still reads the mapped, stacked weights).  Where the kernel gives no huge pages (THP ``never``) the copy is
plain anonymous memory: no faster, no slower.
"""
from __future__ import annotations

import mmap

import jax
import numpy as np

_HUGE = 2 << 20
MIN_BYTES = _HUGE   # smaller arrays stay where they are (read at each call)


def copy_to_huge_pages(x, min_bytes: int | None = None):
  """``x`` (a CPU array, or anything ``np.asarray`` takes) copied into a fresh anonymous mapping advised for
  2 MB pages, and handed to XLA without a further copy; an array smaller than ``min_bytes`` (default
  ``MIN_BYTES``, one huge page: a norm's scale, a bias) is returned as it is, since a page of its own would
  waste most of 2 MB.
  The mapping lives as long as the returned array (the array keeps the NumPy view, which keeps the mapping)."""
  a = np.asarray(x)
  if a.nbytes < (MIN_BYTES if min_bytes is None else min_bytes):
    return x
  size = max(_HUGE, -(-a.nbytes // _HUGE) * _HUGE)
  region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  if hasattr(mmap, "MADV_HUGEPAGE"):
    region.madvise(mmap.MADV_HUGEPAGE)
  b = np.frombuffer(region, dtype=a.dtype, count=a.size).reshape(a.shape)
  b[...] = a
  return jax.device_put(b, may_alias=True)


def tree_to_huge_pages(tree, min_bytes: int | None = None):
  """Every array leaf of ``tree`` (``QWeight`` fields included) through ``copy_to_huge_pages``."""
  return jax.tree_util.tree_map(lambda x: copy_to_huge_pages(x, min_bytes), tree)
