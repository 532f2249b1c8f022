"""Replaying a deterministic drafter on known greedy outputs (offline τ, no target forwards).

Greedy speculative decoding commits exactly the plain greedy output, so the steps it takes on a prompt are
fixed by that output and the drafter: each step the drafter proposes from the tokens known so far, the
proposals that match the output's next tokens are accepted, and one more token is committed.  Running the
engine's own ``propose`` over a stored output therefore gives the τ (and the verification rows per step) a
real run would measure — for any number of drafter settings from one plain generation.  Only for drafters
whose proposals depend on the token sequence alone (``NgramDrafter``), and at batch 1 per sequence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import sampling
from specjax.speculative.drafters import propose_chain


def replay_greedy(drafter, seq_BxS: np.ndarray, prompt_lens_B: np.ndarray, ends_B: np.ndarray, K: int):
  """Steps of greedy speculative decoding over known sequences ``seq[b, :ends[b]]`` (prompt, then the greedy
  output; its first token comes from prefill).  Returns (committed tokens per sequence [B], verification
  rows per step (live drafts + 1), as one flat array over all sequences' steps)."""
  S = seq_BxS.shape[1]
  if np.any(ends_B + K >= S):
    raise ValueError(f"seq needs {K} spare slots past the longest sequence (S={S})")

  @jax.jit
  def propose(seq, lengths):
    known = jnp.where(jnp.arange(S)[None, :] <= lengths[:, None], seq, -1)   # nothing from the future
    last = jnp.take_along_axis(known, lengths[:, None], axis=1)[:, 0]
    _, toks, limit = propose_chain(drafter, (), (), known, lengths, last, K, None, sampling.SamplingParams())
    idx = lengths[:, None] + 1 + jnp.arange(K)[None, :]
    right = (toks == jnp.take_along_axis(seq, idx, axis=1)) & (jnp.arange(K)[None, :] < limit[:, None])
    return limit, jnp.sum(jnp.cumprod(right, axis=1), axis=1)

  seq = jnp.asarray(seq_BxS, jnp.int32)
  ends = np.asarray(ends_B, np.int64)
  L = np.asarray(prompt_lens_B, np.int64).copy()   # index of the newest known token
  committed = np.zeros_like(L)
  rows = []
  while np.any(L < ends - 1):
    limit, accepted = (np.asarray(a, np.int64) for a in propose(seq, jnp.asarray(L, jnp.int32)))
    live = L < ends - 1
    step = np.where(live, np.minimum(accepted, ends - 2 - L) + 1, 0)   # the output's end cuts a step short
    committed += step
    rows.append(np.where(live, limit + 1, 0))
    L = L + step
  rows = np.stack(rows, axis=1) if rows else np.zeros((len(L), 0), np.int64)
  return committed, rows[rows > 0]
