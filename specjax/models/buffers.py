"""Every bucketing rule in one place: how long a KV buffer is, which attention windows are compiled, how far a
prompt is padded.  Buckets keep the number of compiled shapes small: nearby requests share executables.

  buffer_length   a request's KV buffer: prompt + new tokens + speculative headroom, to a power of two ≥ 256
  kv_buckets      the attention windows a forward compiles: powers of two from 256 up to the buffer
  prompt_bucket   a prompt's padded length: 64, 128, 192, 256, then quarter-power-of-two steps (≤ ~25% padding)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

PROMPT_BUCKET = 64     # prompts are right-padded to a multiple of this (a few compiled prefill shapes)
DEFAULT_MAX_LEN = 2048           # KV slots per sequence when a caller sizes nothing
AUTO_MAX_LEN_LIMIT = 1 << 20     # only for checking a tree spec before the buffer size is known


def round_up(n: int, m: int) -> int:
  """n up to a multiple of m (at least m)."""
  return max(m, -(-n // m) * m)


def round_up_bucket(n: int, smallest: int = 256) -> int:
  """The buffer size for n slots: powers of two from ``smallest``, so nearby requests share executables."""
  b = smallest
  while b < n:
    b *= 2
  return b


def buffer_length(longest_prompt: int, max_new_tokens: int, nodes: int = 0, smallest: int = 256) -> int:
  """Default KV buffer length: the longest prompt + new tokens + speculative headroom (N + 2 slots: the
  tree's N + 1 rows past the last committed token, which itself sits one past the length), to a bucket."""
  need = longest_prompt + max_new_tokens + (nodes + 2 if nodes else 1)
  return round_up_bucket(need, smallest)


def kv_buckets(max_len: int, smallest: int = 256) -> tuple[int, ...]:
  """Attention window sizes to compile: powers of two from ``smallest`` up to (and including) max_len."""
  sizes, w = [], smallest
  while w < max_len:
    sizes.append(w)
    w *= 2
  sizes.append(max_len)
  return tuple(sizes)


def prompt_bucket(n: int) -> int:
  """Padded prompt length: 64, 128, 192, 256, then steps of a quarter of the power of two below (few shapes
  to compile, at most ~25% padding)."""
  if n <= 4 * PROMPT_BUCKET:
    return round_up(n, PROMPT_BUCKET)
  step = 1 << (n.bit_length() - 3)
  return round_up(n, step)


def pad_batch(token_lists: Sequence[Sequence[int]], batch_size: int, pad_to: int | None = None):
  """Right-pad prompts into [B, P] (P from ``prompt_bucket`` unless given); missing rows repeat the last."""
  rows = list(token_lists) + [token_lists[-1]] * (batch_size - len(token_lists))
  P = pad_to or prompt_bucket(max(len(r) for r in rows))
  arr = np.zeros((batch_size, P), np.int32)
  for i, r in enumerate(rows):
    arr[i, :len(r)] = r
  return arr, np.array([len(r) for r in rows], np.int32)

