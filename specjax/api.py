"""The Python API: load a model, generate, score, tokenize.  The CLI is a thin layer over these functions.

  import specjax
  model = specjax.load("smollm2-135m")
  outputs, stats = specjax.generate(model, ["Name three primary colours."], max_new_tokens=64)
  print(outputs[0].text)
  print(specjax.score(model, "The cat sat on the mat.").perplexity)
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decode, model as model_lib, sampling
from specjax.checkpoints import LoadedModel, Tokenizer, load_model
from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.kv_cache import init_cache
from specjax.prompts import Prompt

DEFAULT_MAX_LEN = 2048
PROMPT_BUCKET = 64     # prompts are right-padded to a multiple of this (a few compiled prefill shapes)


@dataclasses.dataclass
class Model:
  """A loaded model ready to run.

  ``params`` is the canonical (stacked) pytree; ``exec_params`` the layout the decode loop runs (on the CPU,
  per-layer arrays in a list, which streams weights faster than a scan over stacked ones).
  """
  cfg: ModelConfig
  params: Any
  tokenizer: Tokenizer
  source: str
  exec_params: Any = None
  _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

  def __post_init__(self):
    if self.exec_params is None:
      self.exec_params = default_exec_params(self.params)

  @classmethod
  def from_loaded(cls, loaded: LoadedModel) -> "Model":
    return cls(cfg=loaded.cfg, params=loaded.params, tokenizer=loaded.tokenizer, source=loaded.source)

  @property
  def weight_bytes(self) -> int:
    return model_lib.param_bytes(self.params)


def default_exec_params(params):
  if jax.default_backend() == "cpu":
    return model_lib.unstack_layers(params)
  return params


_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def load(name_or_path: str, dtype: str = "float32") -> Model:
  """Load a registry model (downloaded once), a GGUF file or a Hugging Face safetensors directory."""
  if dtype not in _DTYPES:
    raise SpecjaxError(f"unknown dtype '{dtype}': use one of {sorted(_DTYPES)}")
  return Model.from_loaded(load_model(name_or_path, dtype=_DTYPES[dtype]))


# ----------------------------------------------------------------------------------------------------------
# Generation


@dataclasses.dataclass
class Generation:
  question_id: Any
  prompt: str
  text: str
  token_ids: list[int]
  prompt_tokens: int


def _round_up(n: int, m: int) -> int:
  return max(m, -(-n // m) * m)


def encode_prompts(m: Model, prompts: Sequence[str | Prompt], chat: bool = True) -> list[list[int]]:
  texts = [p.text if isinstance(p, Prompt) else p for p in prompts]
  return [m.tokenizer.encode_chat(t) if chat else m.tokenizer.encode(t) for t in texts]


def check_fits(prompt_lens: Sequence[int], max_new_tokens: int, max_len: int, extra: int = 0) -> None:
  longest = max(prompt_lens)
  if longest + max_new_tokens + extra > max_len:
    raise SpecjaxError(
        f"prompt of {longest} tokens + {max_new_tokens} new tokens"
        + (f" + {extra} speculative slots" if extra else "")
        + f" does not fit the KV cache of {max_len} positions: raise --max-len or shorten the prompt "
        "or --max-new-tokens")


def pad_batch(token_lists: Sequence[Sequence[int]], batch_size: int, bucket: int = PROMPT_BUCKET):
  """Right-pad prompts into [B, P] (P a multiple of ``bucket``); missing rows repeat the last prompt."""
  rows = list(token_lists) + [token_lists[-1]] * (batch_size - len(token_lists))
  P = _round_up(max(len(r) for r in rows), bucket)
  arr = np.zeros((batch_size, P), np.int32)
  for i, r in enumerate(rows):
    arr[i, :len(r)] = r
  return arr, np.array([len(r) for r in rows], np.int32)


def compiled_generate(m: Model, batch_size: int, prompt_pad: int, max_len: int,
                      sp: sampling.SamplingParams, eos_ids: tuple[int, ...]):
  """The AOT-compiled decode loop for these shapes (compiled once per shape; returns (fn, compile_s))."""
  buckets = decode.kv_buckets(max_len)
  key = ("generate", batch_size, prompt_pad, max_len, sp, eos_ids, buckets)
  if key in m._compiled:
    return m._compiled[key], 0.0
  t0 = time.perf_counter()
  cache = jax.eval_shape(lambda: init_cache(m.cfg, batch_size, max_len, jnp.float32))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  fn = decode.generate.lower(m.exec_params, cache, i32(batch_size, prompt_pad), i32(batch_size),
                             i32(batch_size), jax.random.PRNGKey(0), cfg=m.cfg, sp=sp, eos_ids=eos_ids,
                             buckets=buckets).compile()
  m._compiled[key] = fn
  return fn, time.perf_counter() - t0


def generate(m: Model, prompts: Sequence[str | Prompt], *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             batch_size: int = 1, chat: bool = True, max_len: int = DEFAULT_MAX_LEN,
             ignore_eos: bool = False, progress: bool = False) -> tuple[list[Generation], dict]:
  """Generate a reply for every prompt (batched, each batch one on-device loop).

  Returns the generations and stats: new tokens, wall time of the decode loops (compilation excluded and
  reported separately as ``compile_s``), tokens/s, target forwards.
  """
  if max_new_tokens < 1:
    raise SpecjaxError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
  if batch_size < 1:
    raise SpecjaxError(f"--batch-size must be >= 1, got {batch_size}")
  try:
    sp = sampling.SamplingParams(temperature, top_k, top_p)
  except ValueError as e:
    raise SpecjaxError(str(e)) from e
  if not prompts:
    raise SpecjaxError("no prompts given")
  encoded = encode_prompts(m, prompts, chat)
  check_fits([len(e) for e in encoded], max_new_tokens, max_len)
  eos_ids = () if ignore_eos else tuple(m.tokenizer.eos_token_ids)
  key = jax.random.PRNGKey(seed)
  outputs: list[Generation] = []
  stats = {"sequences": len(prompts), "new_tokens": 0, "prompt_tokens": int(sum(map(len, encoded))),
           "decode_s": 0.0, "compile_s": 0.0, "target_forwards": 0, "batch_size": batch_size}
  for start in range(0, len(encoded), batch_size):
    chunk = encoded[start:start + batch_size]
    arr, lens = pad_batch(chunk, batch_size)
    max_new = np.where(np.arange(batch_size) < len(chunk), max_new_tokens, 0).astype(np.int32)
    fn, compile_s = compiled_generate(m, batch_size, arr.shape[1], max_len, sp, eos_ids)
    stats["compile_s"] += compile_s
    key, sub = jax.random.split(key)
    cache = init_cache(m.cfg, batch_size, max_len, jnp.float32)
    t0 = time.perf_counter()
    res = fn(m.exec_params, cache, jnp.asarray(arr), jnp.asarray(lens), jnp.asarray(max_new), sub)
    seq = np.asarray(res.seq_BxS)
    stats["decode_s"] += time.perf_counter() - t0
    stats["target_forwards"] += int(res.steps) + 1
    num_new = np.asarray(res.num_new_B)
    for i, toks in enumerate(chunk):
      ids = seq[i, len(toks):len(toks) + num_new[i]].tolist()
      p = prompts[start + i]
      outputs.append(Generation(
          question_id=p.question_id if isinstance(p, Prompt) else start + i,
          prompt=p.text if isinstance(p, Prompt) else p,
          text=m.tokenizer.decode(ids), token_ids=ids, prompt_tokens=len(toks)))
      stats["new_tokens"] += len(ids)
    if progress:
      print(f"[generate] {min(start + batch_size, len(encoded))}/{len(encoded)} prompts", file=sys.stderr)
  stats["tokens_per_s"] = stats["new_tokens"] / stats["decode_s"] if stats["decode_s"] else 0.0
  return outputs, stats


# ----------------------------------------------------------------------------------------------------------
# Scoring


@dataclasses.dataclass
class ScoreResult:
  token_ids: list[int]
  tokens: list[str]
  logprobs: list[float]       # log p(token i | tokens < i) for i = 2..n
  perplexity: float


@jax.jit
def _next_token_logprobs(logits_BxTxV, tokens_BxT):
  logp = jax.nn.log_softmax(logits_BxTxV[:, :-1].astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens_BxT[:, 1:, None], axis=-1)[..., 0]


def score(m: Model, text: str) -> ScoreResult:
  """Per-token log-probabilities and perplexity of a raw text (no chat template)."""
  ids = m.tokenizer.encode(text)
  if len(ids) < 2:
    raise SpecjaxError("text must have at least two tokens to score")
  if len(ids) > m.cfg.max_position:
    raise SpecjaxError(f"text has {len(ids)} tokens, more than the model's context of "
                       f"{m.cfg.max_position}: score a shorter text")
  T = _round_up(len(ids), PROMPT_BUCKET)
  arr = np.zeros((1, T), np.int32)
  arr[0, :len(ids)] = ids
  fn = m._compiled.get(("score", T))
  if fn is None:
    cfg = m.cfg

    def run(params, tokens_1xT):
      cache = init_cache(cfg, 1, T, jnp.float32)
      out = model_lib.forward(params, cfg, tokens_1xT, jnp.arange(T)[None], cache)
      return _next_token_logprobs(out.logits, tokens_1xT)

    fn = m._compiled[("score", T)] = jax.jit(run)
  lp = np.asarray(fn(m.exec_params, jnp.asarray(arr)))[0, :len(ids) - 1].astype(float)
  pieces = [m.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
  return ScoreResult(token_ids=ids, tokens=pieces, logprobs=lp.tolist(),
                     perplexity=float(math.exp(-lp.mean())))


def tokenize(m: Model, text: str) -> list[int]:
  return m.tokenizer.encode(text)
