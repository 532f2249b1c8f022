"""Training data recorded by the decode loop (``Engine.record``): the target's features and top-k at every
position the loop commits.

The verify forwards compute both already, so a drafter's training data (``training/data.py``) and the online
adapter's replay buffer (``training/online.py``) cost no second target pass.  ``init`` records the prompt
(``start``); every step records the root and the accepted path (``record_path``).  When a feature drafter
(EAGLE) drafts while the loop records, one forward returns the taps of both: ``forward_taps`` says which, and
``drafter_features`` cuts out what the drafter reads.

Shape letters: the legend in ``engine.py`` (here J is the positions recorded at once: D1 per step, 1 after the
prompt; K the recorded top-k).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models import decoder as model_lib
from specjax.models.config import ModelConfig


class Record(NamedTuple):
  """What the loop records at every position it commits (``Engine.record``): the target's residual stream
  after ``taps`` (layer outputs, concatenated: F = d_model × len(taps)) and its ``top_k`` most likely next
  tokens with their log-probabilities."""
  taps: tuple[int, ...]
  top_k: int = 8
  final: bool = True           # also the final hidden state (after the final norm; d_model more columns, last)

  def forward_taps(self, num_layers: int) -> tuple[int, ...]:
    return tuple(self.taps) + ((num_layers - 1,) if self.final else ())


@struct.dataclass
class Recorded:
  feats_BxSxF: jax.Array       # float16: the tapped layers' outputs of the token at each position
  topk_ids_BxSxK: jax.Array    # int32: the target's top-k next tokens after each position
  topk_lp_BxSxK: jax.Array     # float16: their log-probabilities


def forward_taps(record: Record | None, drafter_taps: tuple[int, ...] | None,
                 num_layers: int) -> tuple[int, ...] | None:
  """The ``feature_layers`` of the engine's target forwards: the drafter's (``drafter_taps``; None when it
  reads none), or what ``record`` asks for (a feature drafter's own layers then come first:
  ``drafter_features``)."""
  if record is None:
    return drafter_taps
  if drafter_taps is not None and tuple(drafter_taps) != tuple(record.taps):
    raise ValueError(f"recording layers {list(record.taps)} while a feature drafter reading layers "
                     f"{list(drafter_taps)} drafts: record the drafter's own layers (Record(taps=its feature_layers))")
  return record.forward_taps(num_layers)


def drafter_features(record: Record | None, drafter_taps: tuple[int, ...] | None, cfg: ModelConfig,
                     target_params, features_BxTxF: jax.Array) -> jax.Array:
  """What a feature drafter reads of the target forward's ``features_BxTxF``: all of them, unless the engine
  also records, when the forward returns the recorded taps (the drafter's layers, then the last layer's raw
  output) and the drafter's part is cut out of them — its fused layers, or the final hidden state (the last
  layer's output under the final norm, as ``model.forward`` computes it)."""
  if record is None or drafter_taps is None:
    return features_BxTxF
  M = cfg.d_model
  if drafter_taps:
    return features_BxTxF[..., :len(drafter_taps) * M]
  if not record.final:          # taps () and no final column: the forward returned the final state
    return features_BxTxF
  return model_lib.rms_norm(features_BxTxF[..., -M:], target_params["final_norm"], cfg.norm_eps)


def recorded_features(record: Record, cfg: ModelConfig, target_params, features_BxTxF: jax.Array) -> jax.Array:
  """The forward's tapped outputs as recorded (float16): the last tap normalised into the final hidden state
  when ``record.final``."""
  if record.final:
    M = cfg.d_model
    last = model_lib.rms_norm(features_BxTxF[..., -M:].astype(jnp.float32), target_params["final_norm"],
                              cfg.norm_eps)
    features_BxTxF = jnp.concatenate([features_BxTxF[..., :-M].astype(jnp.float32), last], axis=-1)
  return features_BxTxF.astype(jnp.float16)


def record_topk(recorded: Recorded, logits_BxJxV: jax.Array, pos_BxJ: jax.Array) -> Recorded:
  """The top-k next tokens of the distributions ``logits_BxJxV`` written at positions ``pos_BxJ`` (S:
  dropped); nothing with ``Record.top_k = 0``."""
  if recorded.topk_ids_BxSxK.shape[-1] == 0:
    return recorded
  lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits_BxJxV.astype(jnp.float32), axis=-1),
                          recorded.topk_ids_BxSxK.shape[-1])
  b = jnp.arange(pos_BxJ.shape[0])[:, None]
  return recorded.replace(topk_ids_BxSxK=recorded.topk_ids_BxSxK.at[b, pos_BxJ].set(ids, mode="drop"),
                          topk_lp_BxSxK=recorded.topk_lp_BxSxK.at[b, pos_BxJ].set(lp.astype(jnp.float16),
                                                                                  mode="drop"))


def start(record: Record, cfg: ModelConfig, target_params, features_BxPxF: jax.Array,
          last_logits_BxV: jax.Array, prompt_lens_B: jax.Array, S: int) -> Recorded:
  """What ``init`` records: the prompt's features (prefill's ``features_BxPxF``), and the top-k after its last
  token, in buffers of S positions per sequence."""
  (B, P, F), K = features_BxPxF.shape, record.top_k
  recorded = Recorded(feats_BxSxF=jnp.zeros((B, S, F), jnp.float16).at[:, :P].set(
                          recorded_features(record, cfg, target_params, features_BxPxF)),
                      topk_ids_BxSxK=jnp.zeros((B, S, K), jnp.int32),
                      topk_lp_BxSxK=jnp.zeros((B, S, K), jnp.float16))
  return record_topk(recorded, last_logits_BxV[:, None], (prompt_lens_B - 1)[:, None])


def record_path(recorded: Recorded, record: Record, cfg: ModelConfig, target_params, features_BxN1xF: jax.Array,
                logits_BxN1xV: jax.Array, path_BxD1: jax.Array, j_1xD1: jax.Array, count_B: jax.Array,
                lengths_B: jax.Array) -> Recorded:
  """What a step records: the features of the root and the accepted nodes (``path_BxD1``: node ids, -1 past
  the leaf; ``j_1xD1``: 0..D) at the positions the step committed (``lengths_B`` on; ``count_B`` of them),
  and the top-k after each."""
  B, S = recorded.feats_BxSxF.shape[:2]
  safe_path = jnp.maximum(path_BxD1, 0)[:, :, None]
  pos_BxD1 = jnp.where(j_1xD1 < count_B[:, None], lengths_B[:, None] + j_1xD1, S)
  feats = recorded_features(record, cfg, target_params, jnp.take_along_axis(features_BxN1xF, safe_path, axis=1))
  recorded = recorded.replace(feats_BxSxF=recorded.feats_BxSxF.at[jnp.arange(B)[:, None], pos_BxD1].set(
      feats, mode="drop"))
  return record_topk(recorded, jnp.take_along_axis(logits_BxN1xV, safe_path, axis=1), pos_BxD1)
