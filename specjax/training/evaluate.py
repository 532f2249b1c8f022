"""How good a trained drafter is, before and through the engine.

``tvd_by_position``: the expected acceptance of speculative sampling at draft position s, estimated as
1 − TVD(p, q) averaged over response positions of held-out sequences, where q is the drafter at unroll step s
(its own features for s > 1, as at tree depth s − 1) and p the target's full distribution; also the greedy
analogue (the drafter's first choice equals the target's).  At s = 1 this is exact in expectation for the
engine's first draft position when the contexts are the ones the engine visits (``sequence_tvd`` runs it on
any token sequences, e.g. the engine's own sampled outputs).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import decoder as model_lib
from specjax.models.kv_cache import init_cache
from specjax.speculative import eagle
from specjax.training import eagle_train


@partial(jax.jit, static_argnames=("ecfg", "positions", "temperature"))
def _batch_sums(params, target_head, ecfg, batch, positions: int, temperature: float = 1.0):
  """Per step s: (sum of 1 − TVD, sum of first-choice agreement) over loss positions, and their count; p and
  q at ``temperature`` (the engine samples both at the same one)."""
  # (a parallel drafter computes its K positions together: all of them are scored)
  logits_S, _ = eagle_train.train_forward(params, ecfg, batch, ecfg.parallel or positions)
  q = jax.nn.softmax(eagle.to_target_vocab(params, ecfg, logits_S) / temperature, axis=-1)  # [S, B, T, V]
  p_logits = jnp.einsum("btd,vd->btv", batch["final"].astype(jnp.float32), target_head)
  p = jax.nn.softmax(p_logits / temperature, axis=-1)
  m = batch["loss_mask"]
  acc = 1.0 - 0.5 * jnp.sum(jnp.abs(p[None] - q), axis=-1)                                 # [S, B, T]
  top1 = jnp.argmax(q, -1) == jnp.argmax(p_logits, -1)[None]
  return (jnp.sum(jnp.where(m[None], acc, 0), axis=(1, 2)), jnp.sum(top1 & m[None], axis=(1, 2)),
          jnp.sum(m))


def _head(m):
  return m.params["embed"] if m.cfg.tie_embeddings else m.params["lm_head"]


def _accumulate(params, head, ecfg, batches, positions, temperature: float = 1.0):
  acc = np.zeros(ecfg.parallel or positions)
  top1 = np.zeros(ecfg.parallel or positions)
  n = 0
  for batch in batches:
    a, t, c = jax.device_get(_batch_sums(params, head, ecfg, batch, positions, float(temperature)))
    acc += a
    top1 += t
    n += int(c)
  n = max(n, 1)
  return {"tvd_acceptance_by_position": (acc / n).tolist(), "greedy_match_by_position": (top1 / n).tolist(),
          "eval_positions_scored": n}


def tvd_by_position(m, ecfg, params, store: eagle_train.FeatureData, indices, *, positions: int = 5,
                    seq_len: int = 512) -> dict:
  """1 − TVD and first-choice agreement per draft position on stored (held-out) sequences."""
  if len(indices) == 0:
    return {}
  feats = store.features_for(ecfg)
  batcher = eagle_train.PackedBatcher(store, feats, np.asarray(indices), batch_size=1, seq_len=seq_len)
  rows = batcher._pack(0)
  batches = (batcher.assemble([r]) for r in rows)
  return _accumulate(params, _head(m), ecfg, batches, positions)


def sequence_tvd(m, ecfg, params, token_lists, prompt_lens, *, positions: int = 5, at=None,
                 temperature: float = 1.0) -> dict:
  """The same measure on any sequences (prompt + response ids): the target's features are computed here.
  ``at``: per sequence, the positions to score (default every response position), e.g. the iteration starts
  of the run that produced them; ``temperature``: the one that run sampled at (no top-k / top-p)."""
  cfg = m.cfg
  taps = ecfg.feature_layers
  temperature = temperature if temperature > 0 else 1.0    # greedy: greedy_match_by_position is the measure

  @jax.jit
  def target_pass(tparams, toks_1xT):
    T = toks_1xT.shape[1]
    out = model_lib.forward(tparams, cfg, toks_1xT, jnp.arange(T, dtype=jnp.int32)[None],
                            init_cache(cfg, 1, T, jnp.float32), feature_layers=taps)
    return out.features, out.hidden

  def batches():
    for i, (toks, p) in enumerate(zip(token_lists, prompt_lens)):
      n = len(toks)
      T = max(64, -(-n // 64) * 64)
      arr = np.zeros((1, T), np.int32)
      arr[0, :n] = toks
      feats, final = target_pass(m.prefill_params, jax.device_put(arr))
      mask = np.zeros((1, T), bool)
      if at is None:
        mask[0, max(p - 1, 0):n - 1] = True
      else:
        pos = np.asarray([t for t in at[i] if t < n - 1], np.int64)
        mask[0, pos] = True
      yield {"tokens": arr, "pos": np.arange(T, dtype=np.int32)[None], "seg": (np.arange(T) < n)[None].astype(
          np.int32), "loss_mask": mask, "feats": feats, "final": final}

  return _accumulate(params, _head(m), ecfg, batches(), positions, temperature)


def eval_draft(m, draft_path: str, prompts, *, k: int = 4, tree=None, max_new_tokens: int = 128,
               temperature: float = 1.0, seed: int = 0, max_len: int = 2048, positions: int | None = None,
               repeats: int = 1, speed: bool = True, log=print) -> dict:
  """A trained feature drafter end to end on ``prompts``:

  * sampling at ``temperature`` through the engine: the measured acceptance per draft position, and on the
    very sequences it produced, 1 − TVD per position (the prediction; position 1 is exact in expectation);
  * greedy, paired against plain decoding (``bench``): τ, acceptance per position, speedup.
  """
  from specjax import api
  from specjax.eval import bench
  from specjax.checkpoints import drafter_io
  ecfg, params, config = drafter_io.load_drafter(draft_path, m.cfg, m.params, m.tokenizer, m.source)
  log(f"[eval-draft] sampling at temperature {temperature} with {draft_path}")
  gens, st = api.generate(m, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                          max_len=max_len, drafter="eagle", draft=draft_path, k=k, tree=tree)
  depth = len(st["acceptance_by_position"])
  n_pos = positions or depth
  log(f"[eval-draft] 1 - TVD on the {len(gens)} sampled sequences")
  seqs = [api.encode_prompts(m, [p])[0] + g.token_ids for p, g in zip(prompts, gens)]
  plens = [g.prompt_tokens for g in gens]
  tvd = sequence_tvd(m, ecfg, params, seqs, plens, positions=n_pos, temperature=temperature)
  # at exactly the contexts where the engine judged its first draft: equal to the measured first-position
  # acceptance in expectation
  tvd_starts = sequence_tvd(m, ecfg, params, seqs, plens, positions=1, at=[g.iteration_starts for g in gens],
                            temperature=temperature)
  out = {"draft": str(draft_path), "drafter_config": {k_: v for k_, v in config.items() if k_ != "training"},
          "model": m.source, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "k": k, "tree": tree,
          "temperature": temperature,
          "tvd_acceptance_by_position": tvd["tvd_acceptance_by_position"],
          "tvd_positions_scored": tvd["eval_positions_scored"],
          "tvd_acceptance_at_iteration_starts": tvd_starts["tvd_acceptance_by_position"][0],
          "iteration_starts_scored": tvd_starts["eval_positions_scored"],
          "greedy_match_by_position": tvd["greedy_match_by_position"],
          "measured_acceptance_by_position": st["acceptance_by_position"],
          "sampling_iterations": st["iterations"],
          "sampling_mean_accepted_length": st["mean_accepted_length"]}
  if not speed:
    from specjax.measure import provenance
    return {**out, "machine": provenance.describe()}
  log("[eval-draft] greedy speed against plain decoding")
  b = bench.bench(m, prompts, max_new_tokens=max_new_tokens, max_len=max_len, drafter="eagle", draft=draft_path,
                  k=k, tree=tree, repeats=repeats, log=log)
  return {**out, "mean_accepted_length": b["mean_accepted_length"],
          "greedy_acceptance_by_position": b["acceptance_by_position"],
          "speedup": b["speedup"], "speedup_median": b.get("speedup_median"),
          "speedup_ci95": b.get("speedup_ci95"), "tokens_per_s": b.get("spec_tokens_per_s"),
          "autoregressive_tokens_per_s": b.get("tokens_per_s"), "machine": b["machine"]}
