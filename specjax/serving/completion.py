"""One completion request on the HTTP side of ``specjax serve``: submitted to the engine thread, its committed
tokens turned into text (``TextStream``: EOS dropped, partial UTF-8 held back, stop strings cut) and into
OpenAI's response shapes, whole (``respond_whole``) or as server-sent events (``sse_events``)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi.responses import JSONResponse

from specjax.errors import SpecjaxError
from specjax.serving import batcher as bt


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
  """An OpenAI-style error body."""
  return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                             "param": param, "code": None}})


class TextStream:
  """Turns committed token ids into text deltas: EOS dropped, partial UTF-8 held back, stop strings cut.
  ``kept``: the (id, log-probability) of every token that made it into the text (up to the one that
  completed a stop string)."""

  def __init__(self, tokenizer, eos_ids, stops):
    self.tok, self.eos, self.stops = tokenizer, set(eos_ids), stops
    self.ids: list[int] = []
    self.kept: list[tuple[int, float | None]] = []
    self.sent = ""
    self.stopped = False

  def push(self, ids, logprobs=None) -> str:
    if self.stopped:
      return ""
    lps = list(logprobs) if logprobs is not None else [None] * len(ids)
    new = [(i, lp) for i, lp in zip(ids, lps) if i not in self.eos]
    text = None
    # With stop strings, token by token: the tokens after the one that completes a stop are not kept.
    for n in ([len(new)] if not self.stops else range(1, len(new) + 1)):
      text = self.tok.decode(self.ids + [i for i, _ in new[:n]])
      hit = [text.find(s) for s in self.stops if s in text]
      if hit:
        text, self.stopped = text[:min(hit)], True
        new = new[:n]
        break
    self.ids += [i for i, _ in new]
    self.kept += new
    if text is None:
      text = self.tok.decode(self.ids)
    if not self.stopped:
      keep = max((len(s) - 1 for s in self.stops), default=0)   # a stop string may still be forming
      safe = text[:len(text) - keep] if keep else text
      if safe.endswith("\ufffd"):
        safe = safe[:-1]
    else:
      safe = text
    delta = safe[len(self.sent):] if safe.startswith(self.sent) else ""
    self.sent += delta
    return delta

  def flush(self) -> str:
    if self.stopped:
      return ""
    text = self.tok.decode(self.ids)
    delta = text[len(self.sent):] if text.startswith(self.sent) else ""
    self.sent += delta
    return delta


class InFlight:
  """A parsed request (``p``, from ``requests.parse_request``) as its HTTP handler sees it: the engine's
  ``bt.Request``, whose token and finish callbacks (on the engine thread) feed ``events`` on this event loop,
  the text so far, and OpenAI's response pieces.  ``submit`` hands it to the engine thread."""

  def __init__(self, worker, tokenizer, eos_ids: tuple, model_name: str, p: dict, chat: bool):
    self.worker, self.tokenizer, self.eos_ids, self.p, self.chat = worker, tokenizer, eos_ids, p, chat
    self.ids = (tokenizer.encode(tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True)) if chat
                else tokenizer.encode(p["prompt"]))
    loop = asyncio.get_running_loop()
    self.events: asyncio.Queue = asyncio.Queue()
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    self.r = r = bt.Request(self.ids, p["max_tokens"], rid=rid, sampling=p["sampling"], seed=p["seed"],
                            pin=p.get("pin"))
    r.on_tokens = lambda req, toks: loop.call_soon_threadsafe(
        self.events.put_nowait, ("tokens", (toks, req.logprobs[len(req.tokens) - len(toks):])))
    r.on_finish = lambda req: loop.call_soon_threadsafe(self.events.put_nowait, ("finish", None))
    self.text = TextStream(tokenizer, eos_ids, p["stops"])
    self.model = p["model"] or model_name
    self.created = 0
    self.lp_sent = 0          # the log-probabilities sent so far (streaming)

  def submit(self) -> JSONResponse | None:
    """Into the engine's inbox; an error response if it is refused (a full queue: 429; too long: 400)."""
    try:
      self.worker.submit(self.r)
    except bt.QueueFull as e:
      return error_response(429, str(e), kind="rate_limit_exceeded")
    except SpecjaxError as e:
      return error_response(400, str(e), "max_tokens")
    self.worker.requests_total += 1
    self.created = int(time.time())
    return None

  async def next_event(self) -> tuple[str, bool]:
    """The next text delta, and whether the request is finished."""
    kind, payload = await self.events.get()
    if kind == "tokens":
      delta = self.text.push(*payload)
      if self.text.stopped and not self.r.done:
        self.worker.cancel(self.r)                  # a stop string: no more tokens are needed
      return delta, False
    return self.text.flush(), True

  def usage(self) -> dict:
    n = len([t for t in self.r.tokens if t not in self.eos_ids])
    return {"prompt_tokens": len(self.ids), "completion_tokens": n, "total_tokens": len(self.ids) + n}

  def logprobs_block(self, everything: bool = False) -> dict | None:
    """The log-probabilities of the tokens kept since the last block (OpenAI's two shapes), or None."""
    if not self.p["logprobs"]:
      return None
    entries = self.text.kept[0 if everything else self.lp_sent:]
    self.lp_sent = len(self.text.kept)
    pieces = [self.tokenizer.decode([i]) for i, _ in entries]
    if self.chat:
      return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                          for t, (_, lp) in zip(pieces, entries)]}
    return {"tokens": pieces, "token_logprobs": [lp for _, lp in entries], "top_logprobs": None}

  def finish_reason(self) -> str:
    if self.text.stopped or self.r.finish_reason == "stop":
      return "stop"
    return "length" if self.r.finish_reason == "length" else (self.r.finish_reason or "stop")

  def chunk(self, delta: str, reason: str | None) -> dict:
    """One streamed chunk: a text delta, or the end with its finish reason."""
    lp = self.logprobs_block()
    if self.chat:
      c = {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": reason}
      if lp is not None:
        c["logprobs"] = lp
      return {"id": self.r.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
              "choices": [c]}
    return {"id": self.r.rid, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": delta, "finish_reason": reason, "logprobs": lp}]}

  def whole(self) -> dict:
    """The response body of a finished request that was not streamed."""
    reason, lp = self.finish_reason(), self.logprobs_block(everything=True)
    if self.chat:
      message = {"role": "assistant", "content": self.text.sent}
      return {"id": self.r.rid, "object": "chat.completion", "created": self.created, "model": self.model,
              "usage": self.usage(),
              "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": lp}]}
    return {"id": self.r.rid, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": self.text.sent, "finish_reason": reason, "logprobs": lp}],
            "usage": self.usage()}


def _data(obj) -> str:
  return f"data: {json.dumps(obj)}\n\n"


async def sse_events(c: InFlight):
  """The server-sent events of a streamed request, ``data: [DONE]`` last; a client that goes away has its
  request cancelled (which frees its slot)."""
  try:
    if c.chat:
      first = c.chunk("", None)
      first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
      yield _data(first)
    while True:
      delta, done = await c.next_event()
      if done:
        break
      if delta:
        yield _data(c.chunk(delta, None))
    if c.r.error:
      yield _data({"error": {"message": c.r.error, "type": "server_error"}})
    else:
      if delta:
        yield _data(c.chunk(delta, None))
      yield _data(c.chunk("", c.finish_reason()))
      if c.p["include_usage"]:
        last = c.chunk("", None)
        last["choices"], last["usage"] = [], c.usage()
        yield _data(last)
    yield "data: [DONE]\n\n"
  finally:
    if not c.r.done:
      c.worker.cancel(c.r)


async def respond_whole(c: InFlight):
  """Wait for the whole completion (a client that goes away cancels it), then its body or a 500."""
  try:
    while True:
      _, done = await c.next_event()
      if done:
        break
  except asyncio.CancelledError:
    c.worker.cancel(c.r)
    raise
  if c.r.error:
    return error_response(500, c.r.error, kind="server_error")
  return c.whole()
