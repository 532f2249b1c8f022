"""The OpenAI request bodies ``specjax serve`` accepts: which fields are known, which values stand for "no
effect", and parsing a body into the batcher's submission (``parse_request``), with a ``BadRequest`` whose
``param`` names the offending field."""
from __future__ import annotations

from typing import Any

from specjax.models import sampling

KNOWN_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                "top_k", "seed", "stop", "stream", "stream_options", "n", "user", "logprobs", "top_logprobs",
                "presence_penalty", "frequency_penalty", "echo", "suffix", "best_of", "logit_bias",
                "response_format", "tools", "tool_choice", "parallel_tool_calls"}
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False, "best_of": 1,
           "suffix": None, "logit_bias": None, "response_format": None, "tools": None,
           "tool_choice": None, "parallel_tool_calls": None}


class BadRequest(Exception):
  def __init__(self, message: str, status: int = 400, param: str | None = None):
    super().__init__(message)
    self.status, self.param = status, param



def _number(body: dict, name: str, default, lo=None, hi=None, kind=float):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
    raise BadRequest(f"'{name}' must be a{'n integer' if kind is int else ' number'}, got {v!r}", param=name)
  v = kind(v)
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}", param=name)
  return v


def parse_request(body: Any, chat: bool, server_sp, default_max_tokens: int) -> dict:
  """Validate an OpenAI request body: the fields this server knows, their types and ranges."""
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object")
  unknown = sorted(set(body) - KNOWN_FIELDS)
  if unknown:
    raise BadRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
  for name, neutral in NEUTRAL.items():
    if name in body and body[name] not in (neutral, None):
      raise BadRequest(f"'{name}' = {body[name]!r} is not supported by this server (leave it unset)", param=name)
  max_tokens = _number(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                       default_max_tokens, 1, None, int)
  temperature = _number(body, "temperature", server_sp.temperature, 0.0, 2.0)
  top_p = _number(body, "top_p", server_sp.top_p, 0.0, 1.0)
  if top_p <= 0.0:
    raise BadRequest("'top_p' must be in (0, 1] (1 keeps every token), got 0", param="top_p")
  top_k = _number(body, "top_k", server_sp.top_k, -1, None, int)
  sp = sampling.SamplingParams(temperature, max(top_k, 0), top_p)     # top_k -1 or 0: no top-k filter
  seed = body.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
    raise BadRequest(f"'seed' must be an integer in [0, 2^63), got {seed!r}", param="seed")
  logprobs = _logprobs(body, chat)
  stop = body.get("stop")
  if stop is None:
    stops = []
  elif isinstance(stop, str):
    stops = [stop]
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
    stops = list(stop)
  else:
    raise BadRequest("'stop' must be a string or a list of up to 4 strings", param="stop")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise BadRequest("'stream' must be true or false", param="stream")
  if chat:
    msgs = body.get("messages")
    if (not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)):
      raise BadRequest("'messages' must be a non-empty list of {role, content} objects with string content",
                       param="messages")
    prompt = msgs
  else:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
      prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
      raise BadRequest("'prompt' must be a non-empty string", param="prompt")
  so = body.get("stream_options") or {}
  if not isinstance(so, dict):
    raise BadRequest("'stream_options' must be an object", param="stream_options")
  return {"prompt": prompt, "max_tokens": max_tokens, "stops": [s for s in stops if s], "stream": stream,
          "model": body.get("model"), "include_usage": bool(so.get("include_usage", False)), "sampling": sp,
          "seed": seed, "logprobs": logprobs}


def _logprobs(body: dict, chat: bool) -> bool:
  """Whether the chosen tokens' log-probabilities are asked for: chat ``logprobs: true``, completions
  ``logprobs: 0`` (an int: its top alternatives, which this server does not offer beyond 0)."""
  lp, top = body.get("logprobs"), body.get("top_logprobs")
  if top not in (None, 0):
    raise BadRequest(f"'top_logprobs' = {top!r}: top alternatives are not offered; leave it unset or 0 (the "
                     "chosen tokens' log-probabilities come with logprobs)", param="top_logprobs")
  if lp is None:
    return False
  if chat:
    if not isinstance(lp, bool):
      raise BadRequest(f"'logprobs' must be true or false for chat completions, got {lp!r}", param="logprobs")
    return lp
  if isinstance(lp, bool) or not isinstance(lp, int) or lp != 0:
    raise BadRequest(f"'logprobs' = {lp!r}: this server returns the chosen tokens' log-probabilities "
                     "(logprobs: 0), not top alternatives", param="logprobs")
  return True
