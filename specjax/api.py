"""The Python API: load a model, generate, score, tokenize.  The CLI is a thin layer over these functions.

  import specjax
  model = specjax.load("smollm2-135m")
  outputs, stats = specjax.generate(model, ["Name three primary colours."], max_new_tokens=64)
  print(outputs[0].text)
  print(specjax.score(model, "The cat sat on the mat.").perplexity)
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import buffers, decoder as model_lib, sampling
from specjax.parallel import distributed
from specjax.measure import provenance
from specjax import speculative as spec
from specjax.models.buffers import AUTO_MAX_LEN_LIMIT, DEFAULT_MAX_LEN
from specjax.errors import SpecjaxError
from specjax.models.kv_cache import init_cache
from specjax.progress import say
from specjax.prompts import Prompt, load_prompts
from specjax.runtime.compile_cache import enable as use_compile_cache
from specjax.runtime.checks import check_fits, check_memory, check_same_vocabulary, device_memory_bytes
from specjax.runtime.builder import (Decode, build, build_drafter, default_draft_model, load_draft, make_engine,
                                     parse_layers, vocabulary_map)
from specjax.runtime.request import DEFAULT_NGRAM_CAPS, DecodeSpec, check_draft
from specjax.runtime.compiled import device_inputs, run_batch
from specjax.runtime.loaded import Model, default_dtype, load, on_mesh
from specjax.runtime.request import acceptance_tree, resolve_tree, tree_stats
from specjax.speculative import registry as drafter_registry
from specjax.speculative.trees import specs as tree_shapes


DRAFTERS = drafter_registry.NAMES   # the drafter names (speculative/registry.py says what each needs)

# The API's face: what it runs (below) and what it is built from (specjax/runtime/), under one name.
def make_mesh(mesh):
  """A device mesh from 'DATAxMODEL' (or a jax Mesh), refused in one line when this process cannot make it."""
  from specjax.parallel import sharding
  return sharding.make_mesh(mesh)


__all__ = ["AUTO_MAX_LEN_LIMIT", "DEFAULT_MAX_LEN", "DEFAULT_NGRAM_CAPS", "DRAFTERS", "Decode", "DecodeSpec",
           "Generation", "Model", "build",
           "Prompt", "ScoreResult", "acceptance_vector", "check_draft", "load_draft", "load_prompts", "make_mesh",
           "use_compile_cache", "build_drafter", "check_fits", "check_memory", "check_same_vocabulary",
           "decode_spec", "default_draft_model", "default_dtype", "device_inputs", "device_memory_bytes",
           "encode_prompts", "generate", "load", "make_engine", "on_mesh", "run_batch", "parse_layers", "resolve_tree", "score",
           "spec_metrics", "tokenize", "tree_stats", "vocabulary_map"]


@dataclasses.dataclass
class Generation:
  question_id: Any
  prompt: str
  text: str
  token_ids: list[int]
  prompt_tokens: int
  iteration_starts: list[int] = dataclasses.field(default_factory=list)   # see below
  """Positions (in prompt + reply) of the tokens that rooted a decoding iteration: the contexts in which the
  drafter's first draft was judged (its measured first-position acceptance averages over these)."""
  recorded: dict | None = None
  """With ``generate(record=...)``: the target's ``features`` [T, F] (float16), ``topk_ids`` [T, K] and
  ``topk_logp`` [T, K] at the T = prompt + reply positions (row t: the token at t; its top-k: the next
  token's distribution).  The last position's row is zeros (no step computed it)."""


def encode_prompts(m: Model, prompts: Sequence[str | Prompt], chat: bool | None = None) -> list[list[int]]:
  """Token ids of each prompt: through the chat template (``chat``; None: when the tokenizer has one — a
  model without one is a base model, prompted with plain text), else the text as it is."""
  chat = m.tokenizer.has_chat_template if chat is None else chat
  texts = [p.text if isinstance(p, Prompt) else p for p in prompts]
  return [m.tokenizer.encode_chat(t) if chat else m.tokenizer.encode(t) for t in texts]


def spec_metrics(stats: spec.SpecStats) -> dict:
  """τ, α, acceptance per tree depth (pos_accepted / pos_reached; ``acceptance_by_position`` is the same list
  under its chain-era name) and per-node accepted counts (node 0: live iterations) from the loop's counters."""
  g = distributed.to_host
  committed, steps = g(stats.committed_B).sum(), g(stats.verify_steps_B).sum()
  drafted, accepted = g(stats.drafted_B).sum(), g(stats.accepted_B).sum()
  reached, pos_acc = g(stats.pos_reached_D), g(stats.pos_accepted_D)
  by_depth = [float(a / r) if r else 0.0 for a, r in zip(pos_acc, reached)]
  return {"mean_accepted_length": float(committed / steps) if steps else 1.0,
          "acceptance_rate": float(accepted / drafted) if drafted else 0.0,
          "acceptance_by_depth": by_depth, "acceptance_by_position": by_depth,   # a chain's depth = position
          "node_accepted": g(stats.node_accepted_N1).tolist(),
          "drafted_tokens": int(drafted), "accepted_tokens": int(accepted),
          "target_forwards": int(g(stats.target_forwards)), "draft_forwards": int(g(stats.draft_forwards)),
          "iterations": int(g(stats.iterations)), "verify_rows_steps": g(stats.verify_rows_N1).tolist()}


def generate(m: Model, prompts: Sequence[str | Prompt], *, max_new_tokens: int = 128, batch_size: int = 1,
             seed: int = 0, chat: bool | None = None, max_len: int | None = None, ignore_eos: bool = False,
             progress: bool = False, draft: Model | None = None, memory_budget: float | None = None,
             mesh=None, record: "spec.Record | None" = None, spec_: DecodeSpec | None = None,
             **settings) -> tuple[list[Generation], dict]:
  """Generate a reply for every prompt (batched, each batch one on-device loop), optionally speculatively.

  The decode is ``spec_`` (a ``DecodeSpec``), or the one ``settings`` describe: ``DecodeSpec``'s fields
  (``drafter``, ``k``, ``tree``, ``acceptance``, ``ngram``, ``ngram_caps``, ``draft_layers``,
  ``index_tokens``, ``head_weights``) and the sampling settings ``temperature``, ``top_k``, ``top_p``
  (``decode_spec``).  ``drafter`` is ``none`` (plain decoding) or a name of ``speculative/registry.py``
  (``DRAFTERS``); ``k`` tokens are drafted per step, in a chain, unless ``tree`` (``branch:4,2``,
  ``sequoia:16``, ``dynamic:16``; ``trees/specs.py``) gives a token tree of N draft nodes.  ``draft``: the
  draft model of a kind that runs one (default: the registry's draft for ``m``), or a trained head's
  directory.

  ``mesh`` ('DATAxMODEL' or a jax Mesh): run sharded over that many devices (``sharding``; batches over
  "data", heads and FFN columns over "model"); the tokens are the single device's.
  ``record`` (``speculative.Record``): also return what the target computed at every position — the
  features a drafter is trained on and the top-k it distils — in ``Generation.recorded``.
  Returns the generations and stats: new tokens; seconds spent loading the model (``load_s``), compiling or
  reading executables from the compilation cache (``compile_s``), in prefill (``prefill_s``, which also
  samples each sequence's first token) and in the decode loops (``decode_s``); tokens/s over prefill and
  decoding; τ, α, acceptance per tree depth, forward counts; the tree (``chain:K`` without one) and N.

  ``max_len`` (KV slots per sequence) defaults to what the request needs: the longest prompt +
  ``max_new_tokens`` + the speculative headroom, rounded up to a power of two ≥ 256
  (``buffers.buffer_length``).  The buffers' bill (``memory.kv_bill``) must fit ``memory_budget`` bytes
  (default: the device's memory), else a SpecjaxError says which batch would fit.
  """
  if max_new_tokens < 1:
    raise SpecjaxError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
  if batch_size < 1:
    raise SpecjaxError(f"--batch-size must be >= 1, got {batch_size}")
  ds = spec_ if spec_ is not None else decode_spec(**settings)
  if not prompts:
    raise SpecjaxError("no prompts given")
  if ds.kind.draft_model and draft is None:
    draft = default_draft_model(m)        # the registry's draft for the target (or a clear error)
  if mesh is not None:
    m = on_mesh(m, mesh)
    if draft is not None:
      draft = on_mesh(draft, m.mesh)
  encoded = encode_prompts(m, prompts, chat)
  d = build(m, ds, eos_ids=() if ignore_eos else tuple(m.tokenizer.eos_token_ids), max_len=max_len,
            prompt_lens=[len(e) for e in encoded], max_new_tokens=max_new_tokens, batch_size=batch_size,
            draft=draft, memory_budget=memory_budget)
  engine = d.engine if record is None else d.engine._replace(record=record)
  stats = {"sequences": len(prompts), "new_tokens": 0, "prompt_tokens": int(sum(map(len, encoded))),
           "load_s": m.load_s + getattr(draft, "load_s", 0.0), "compile_s": 0.0,
           "prefill_s": 0.0, "decode_s": 0.0, "batch_size": batch_size, "max_len": d.max_len,
           "drafter": ds.drafter, "k": d.k_max, **tree_stats(d.choice, d.k_max, ds.acceptance)}
  outputs, totals = _decode_batches(m, d, engine, prompts, encoded, max_new_tokens, batch_size,
                                    jax.random.PRNGKey(seed), stats, progress)
  run_s = stats["prefill_s"] + stats["decode_s"]
  stats["tokens_per_s"] = stats["new_tokens"] / run_s if run_s else 0.0
  stats.update(spec_metrics(totals))
  return outputs, stats


def decode_spec(drafter: str = "none", temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                **fields) -> DecodeSpec:
  """A ``DecodeSpec`` from keyword settings (``generate``'s ``settings``): the sampling settings become its
  ``SamplingParams``; a setting it does not have is refused in one line."""
  try:
    sp = sampling.SamplingParams(temperature, top_k, top_p)
  except ValueError as e:
    raise SpecjaxError(str(e)) from e
  known = {f.name for f in dataclasses.fields(DecodeSpec)} - {"drafter", "sampling"}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise SpecjaxError(f"unknown decode setting {', '.join(unknown)}: use drafter, temperature, top_k, top_p, "
                       f"{', '.join(sorted(known))}")
  return DecodeSpec(drafter=drafter, sampling=sp, **fields)


def _decode_batches(m: Model, d: Decode, engine, prompts, encoded, max_new_tokens: int, batch_size: int, key,
                    stats: dict, progress: bool):
  """Each batch of ``batch_size`` prompts through ``compiled.run_batch``; (generations, summed counters)."""
  outputs: list[Generation] = []
  totals, draft_params = None, d.draft_params
  for start in range(0, len(encoded), batch_size):
    chunk = encoded[start:start + batch_size]
    arr, lens = buffers.pad_batch(chunk, batch_size)
    max_new = np.where(np.arange(batch_size) < len(chunk), max_new_tokens, 0).astype(np.int32)
    key, sub = jax.random.split(key)
    run = run_batch(m, engine, draft_params, arr, lens, max_new, np.full((batch_size,), d.k_max, np.int32), sub,
                    d.max_len, log=say if progress else (lambda _: None))
    res = run.result
    for name in ("compile_s", "prefill_s", "decode_s"):
      stats[name] += getattr(run, name)
    totals = res.stats if totals is None else jax.tree_util.tree_map(lambda a, b: a + b, totals, res.stats)
    seq, num_new = distributed.to_host(res.seq_BxS), distributed.to_host(res.num_new_B)
    replies = [seq[i, len(toks):len(toks) + num_new[i]].tolist() for i, toks in enumerate(chunk)]
    if d.spec.kind.learns:    # a learning drafter (suffix) indexes this batch for the batches after it
      draft_params = drafter_registry.absorb(engine.drafter, draft_params,
                                             [list(toks) + ids for toks, ids in zip(chunk, replies)])
    outputs += _generations(m, prompts, start, chunk, replies, res)
    stats["new_tokens"] += sum(map(len, replies))
    if progress:
      print(f"[generate] {min(start + batch_size, len(encoded))}/{len(encoded)} prompts", file=sys.stderr)
  return outputs, totals


def _generations(m: Model, prompts, start: int, chunk, replies, res) -> list[Generation]:
  """The ``Generation`` of each prompt of one batch (``res``: its loop's final state)."""
  starts = distributed.to_host(res.starts_BxS)
  rec = None if res.record is None else jax.tree_util.tree_map(distributed.to_host, res.record)
  out = []
  for i, (toks, ids) in enumerate(zip(chunk, replies)):
    p, n = prompts[start + i], len(toks) + len(ids)
    out.append(Generation(
        question_id=p.question_id if isinstance(p, Prompt) else start + i,
        prompt=p.text if isinstance(p, Prompt) else p,
        text=m.tokenizer.decode(ids), token_ids=ids, prompt_tokens=len(toks),
        iteration_starts=np.flatnonzero(starts[i, :n]).tolist(),
        recorded=None if rec is None else {"features": rec.feats_BxSxF[i, :n], "topk_ids": rec.topk_ids_BxSxK[i, :n],
                                           "topk_logp": rec.topk_lp_BxSxK[i, :n]}))
  return out


def acceptance_vector(m: Model, prompts: Sequence[str | Prompt], *, drafter: str = "ngram", ranks: int = 8,
                      depths: int = 1, max_new_tokens: int = 64, max_len: int = DEFAULT_MAX_LEN,
                      batch_size: int = 1, ngram: int = 3, draft_layers=None, draft: Model | None = None,
                      ngram_caps: Sequence[int] | None = DEFAULT_NGRAM_CAPS, progress: bool = False,
                      index_tokens: int | None = None, replay: bool = False) -> dict:
  """The per-rank acceptance vector of a target/drafter pair, measured by greedy speculative decoding with
  ``acceptance_tree(ranks, depths)``: ``acc[r]`` is the fraction of live iterations in which the target's
  token was the drafter's r-th choice.  With ``depths`` > 1 the result also has ``acceptance_table``: row d
  is the same vector at depth d + 1, counted over the iterations whose best-guess path was accepted down to
  depth d (a row never reached repeats the one above).  Returns the JSON that
  ``tree_shapes.load_acceptance_vector`` reads back (it prefers the table).

  ``replay``: the same counters without speculative decoding — plain greedy decoding gives the outputs (one
  row a step instead of the tree's N + 1), then only the drafter runs over them (``speculative.replay``), whose
  greedy counters are the engine's exactly."""
  if not drafter_registry.get(drafter).speculates:
    raise SpecjaxError(f"acceptance-vector measures a drafter: pass {drafter_registry.speculating_help()}")
  if ranks < 1:
    raise SpecjaxError(f"--ranks must be >= 1, got {ranks}")
  if depths < 1:
    raise SpecjaxError(f"--depths must be >= 1, got {depths}")
  tree = acceptance_tree(ranks, depths)
  label = f"branch:{ranks}" if depths == 1 else f"star of {ranks} at each of {depths} depths"
  spec_ = tree_shapes.TreeSpec("paths", path=f"<{label}>", tree=tree)
  settings = dict(drafter=drafter, ngram=ngram, draft_layers=draft_layers, ngram_caps=ngram_caps, tree=spec_,
                  index_tokens=index_tokens)
  if replay:
    stats = _replayed_stats(m, prompts, decode_spec(**settings), max_new_tokens=max_new_tokens, max_len=max_len,
                            draft=draft)
  else:
    _, stats = generate(m, prompts, max_new_tokens=max_new_tokens, max_len=max_len, batch_size=batch_size,
                        draft=draft, progress=progress, **settings)
  counts_N1 = np.asarray(stats["node_accepted"], dtype=np.float64)
  live = counts_N1[0]
  if live == 0:
    raise SpecjaxError("no speculative iteration ran (every reply ended at its first token): use more prompts "
                       "or a larger --max-new-tokens")
  table, reached = [], []
  for d in range(depths):
    below = live if d == 0 else counts_N1[1 + (d - 1) * ranks]     # the best-guess node at depth d
    if below == 0:
      break
    table.append([float(c / below) for c in counts_N1[1 + d * ranks: 1 + (d + 1) * ranks]])
    reached.append(int(below))
  table += [table[-1]] * (depths - len(table))
  out = {"acceptance_vector": table[0], "model": m.source, "drafter": drafter,
         "ranks": ranks, "depths": depths, "iterations": int(live), "prompts": len(prompts),
         "max_new_tokens": max_new_tokens, "new_tokens": stats["new_tokens"],
         "mean_accepted_length": stats["mean_accepted_length"], "machine": provenance.describe(),
         "measured_by": "replay" if replay else "speculative decoding"}
  if depths > 1:
    out["acceptance_table"] = table
    out["iterations_by_depth"] = reached
  out.update(_drafter_settings(m, drafter, ngram, draft_layers, draft, ngram_caps))
  return out


def record_outputs(m: Model, d: Decode, encoded, outputs) -> list:
  """One ``replay.Known`` per prompt: its prompt and known output in a buffer of ``d``'s length, with what one
  teacher-forced target pass says about them when ``d`` needs it (features, sampled log-probabilities)."""
  from specjax.speculative import replay as rp
  knowns = []
  for enc, toks in zip(encoded, outputs):
    seq_1xS = np.zeros((1, d.max_len), np.int32)
    end = min(len(enc) + len(toks), d.max_len)
    seq_1xS[0, :end] = (list(enc) + list(toks))[:end]
    knowns.append(rp.record(m.exec_params, m.cfg, seq_1xS, [len(enc)], [end], d.engine.sp,
                            taps=d.engine.forward_taps))
  return knowns


def replay_recorded(m: Model, d: Decode, encoded, knowns, max_new_tokens: int, key=None) -> spec.SpecStats:
  """``d``'s counters over recorded outputs by offline replay, one prompt at a time (as its batch-1 run, each
  drafter initialised on that prompt's padded width), summed."""
  from specjax.speculative import replay as rp
  total = None
  for enc, known in zip(encoded, knowns):
    st = rp.replay(d.engine, m.exec_params, d.draft_params, known, max_new_B=[max_new_tokens], key=key,
                   prompt_width=buffers.pad_batch([enc], 1)[0].shape[1])
    total = st.stats if total is None else jax.tree_util.tree_map(lambda a, b: a + b, total, st.stats)
  return total


def _replayed_stats(m: Model, prompts, ds: DecodeSpec, *, max_new_tokens: int, max_len: int, draft) -> dict:
  """Greedy speculative decoding's metrics for ``ds`` by offline replay over plain greedy outputs."""
  encoded = encode_prompts(m, prompts)
  d = build(m, ds, eos_ids=tuple(m.tokenizer.eos_token_ids), max_len=max_len, prompt_lens=list(map(len, encoded)),
            max_new_tokens=max_new_tokens, batch_size=1, draft=draft)
  # outputs known past the budget by the tree's depth + 1: the last step's acceptance is the engine's too
  plain, _ = generate(m, prompts, max_new_tokens=max_new_tokens + d.engine.depth + 1, max_len=d.max_len)
  outputs = [o.token_ids for o in plain]
  stats = replay_recorded(m, d, encoded, record_outputs(m, d, encoded, outputs), max_new_tokens)
  # greedy speculative decoding emits plain greedy's tokens, up to the budget
  return {**spec_metrics(stats), "new_tokens": sum(min(len(t), max_new_tokens) for t in outputs)}


def _drafter_settings(m: Model, drafter: str, ngram: int, draft_layers, draft, ngram_caps) -> dict:
  kind = drafter_registry.get(drafter)
  if kind.ngram_caps:
    return {"ngram": ngram, "ngram_caps": list(ngram_caps or ())}
  if kind.layers:
    return {"draft_layers": list(parse_layers(draft_layers, m.cfg.num_layers))}
  return {"draft": draft.source if draft is not None else None}


@dataclasses.dataclass
class ScoreResult:
  token_ids: list[int]
  tokens: list[str]
  logprobs: list[float]       # log p(token i | tokens < i) for i = 2..n
  perplexity: float


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _score_logprobs(params, tokens_1xT, *, cfg, dtype):
  """log p(token t + 1 | tokens ≤ t) for every t of one padded text, in one forward (one compile per bucket)."""
  T = tokens_1xT.shape[1]
  out = model_lib.forward(params, cfg, tokens_1xT, jnp.arange(T)[None], init_cache(cfg, 1, T, dtype))
  logp = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens_1xT[:, 1:, None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "block"))
def _score_logprobs_by_block(params, tokens_1xT, *, cfg, dtype, block):
  """As ``_score_logprobs``, but the text goes through the cache ``block`` tokens at a time, as decoding
  (block 1) or a verification (block k + 1) feeds it: the numbers the decode-sized kernels compute."""
  T = tokens_1xT.shape[1]

  def step(cache, i):
    toks_1xJ = jax.lax.dynamic_slice(tokens_1xT, (0, i * block), (1, block))
    out = model_lib.forward(params, cfg, toks_1xJ, i * block + jnp.arange(block)[None], cache)
    return out.cache, jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1)

  _, logp_NxJxV = jax.lax.scan(step, init_cache(cfg, 1, T, dtype), jnp.arange(T // block))
  logp_TxV = logp_NxJxV.reshape(T, -1)[:-1]
  return jnp.take_along_axis(logp_TxV, tokens_1xT[0, 1:, None], axis=-1)[None, :, 0]


def score(m: Model, text: str, block: int | None = None) -> ScoreResult:
  """Per-token log-probabilities and perplexity of a raw text (no chat template).  ``block``: feed the text
  that many tokens at a time through the cache (1 as plain decoding does, 5 as a verification of k = 4),
  so the decode-sized kernels compute it; None: one forward (a prefill)."""
  ids = m.tokenizer.encode(text)
  if len(ids) < 2:
    raise SpecjaxError("text must have at least two tokens to score")
  if len(ids) > m.cfg.max_position:
    raise SpecjaxError(f"text has {len(ids)} tokens, more than the model's context of "
                       f"{m.cfg.max_position}: score a shorter text")
  if block is not None and not 1 <= block <= 64:
    raise SpecjaxError(f"score block {block}: use 1..64 tokens (a decode step or a verification)")
  T = buffers.round_up(len(ids), buffers.PROMPT_BUCKET)
  T = T if block is None else -(-T // block) * block
  arr = np.zeros((1, T), np.int32)
  arr[0, :len(ids)] = ids
  if block is None:
    lp = np.asarray(_score_logprobs(m.exec_params, jnp.asarray(arr), cfg=m.cfg, dtype=m.dtype))
  else:
    lp = np.asarray(_score_logprobs_by_block(m.exec_params, jnp.asarray(arr), cfg=m.cfg, dtype=m.dtype,
                                             block=block))
  lp = lp[0, :len(ids) - 1].astype(float)
  pieces = [m.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
  return ScoreResult(token_ids=ids, tokens=pieces, logprobs=lp.tolist(),
                     perplexity=float(math.exp(-lp.mean())))


def tokenize(m: Model, text: str) -> list[int]:
  return m.tokenizer.encode(text)
