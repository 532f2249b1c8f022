"""``specjax serve``: an OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with server-sent events or
not; ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``logprobs``), ``GET /health``, ``GET /metrics``
(Prometheus text: queue depth, running slots, tokens generated and tokens/s, acceptance, the k chosen),
``GET /v1/models``.

One engine thread owns the batcher (``EngineWorker``): it takes submissions and cancellations from a
thread-safe inbox, runs iterations while there is work, and hands each request's tokens to its HTTP handler
(an asyncio queue fed with ``call_soon_threadsafe``).  Bad requests get a 4xx with an OpenAI-style JSON error
body; a full queue gets 429; a client that disconnects mid-stream has its request cancelled, which frees its
slot at the next iteration.

Sampling is per request: ``temperature``, ``top_p``, ``top_k`` and ``seed`` are each request's own data in
the batch (the batcher's per-request mode; ``--temperature`` / ``--top-p`` are the defaults of a request that
does not set them), each request draws from its own seeded key, and acceptance is lossless row by row, so a
seeded request gets the same tokens alone or among others (at a fixed k).  ``logprobs`` reports each token's
log-probability under the model's own distribution (before temperature and filters); top alternatives
(``top_logprobs`` > 0) are not offered.  An invalid value gets a 400 whose ``param`` names the field.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid

import numpy as np
from fastapi import Request as HttpRequest      # at module level: FastAPI resolves handler annotations here

from specjax.errors import SpecjaxError
from specjax.serving import batcher as bt
from specjax.serving.requests import BadRequest, parse_request


class EngineWorker(threading.Thread):
  """The thread that runs the batcher: submissions and cancellations arrive through ``inbox``."""

  def __init__(self, batcher: bt.ContinuousBatcher, max_queue: int = 256):
    super().__init__(daemon=True, name="specjax-engine")
    self.batcher, self.max_queue = batcher, max_queue
    self.inbox: queue.Queue = queue.Queue()
    self.stopping = threading.Event()
    self.lock = threading.Lock()
    self.waiting = 0                 # submitted but not yet admitted to the batcher's queue
    self.tokens_total = 0
    self.requests_total = 0
    self.rate = 0.0                  # tokens/s, smoothed over recent iterations
    self.last_k = 0
    self.accepted_total = 0
    self.drafted_total = 0
    self.errors: list[str] = []

  def submit(self, r: bt.Request) -> None:
    self.batcher.check_request(r)                 # too long etc.: AdmissionError → 400 right away
    with self.lock:
      if self.waiting + len(self.batcher.queue) >= self.max_queue:
        raise bt.QueueFull(f"{self.max_queue} requests are waiting: retry later")
      self.waiting += 1
    self.inbox.put(("submit", r))

  def cancel(self, r: bt.Request) -> None:
    self.inbox.put(("cancel", r))

  def stop(self) -> None:
    self.stopping.set()
    self.inbox.put(("stop", None))

  def _drain(self, block: bool) -> None:
    try:
      item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      op, r = item
      if op == "submit":
        with self.lock:
          self.waiting -= 1
        try:
          self.batcher.submit(r)
        except SpecjaxError as e:
          r.error = str(e)
          self.batcher._finish(r, self.batcher.clock(), "error")
      elif op == "cancel":
        if r.slot is None and any(q is r for q in self.batcher.queue):
          self.batcher.queue.remove(r)
          self.batcher._finish(r, self.batcher.clock(), "cancelled")
        else:
          self.batcher.cancel(r)
      try:
        item = self.inbox.get_nowait()
      except queue.Empty:
        return

  def run(self) -> None:
    b = self.batcher
    while not self.stopping.is_set():
      busy = bool(b.queue) or b.num_running > 0
      learn = not busy and b.adapter is not None and b.adapter.ready
      self._drain(block=not busy and not learn)
      if not (b.queue or b.num_running):
        if learn:              # idle: one adaptation step of the drafter (requests wait at most one step)
          b.adapt()
        continue
      t0 = time.perf_counter()
      try:
        n = b.step()
      except Exception as e:  # noqa: BLE001 -- keep serving; fail the requests in flight
        self.errors.append(f"{type(e).__name__}: {e}")
        for r in list(b.running) + list(b.queue):
          if r is not None and not r.done:
            r.error = "internal error in the decoding engine"
            b._finish(r, b.clock(), "error")
        b.queue.clear()
        continue
      dt = max(time.perf_counter() - t0, 1e-6)
      self.tokens_total += n
      self.rate = 0.9 * self.rate + 0.1 * (n / dt)
      if b.history:
        self.last_k = b.history[-1].k
    if b.adapter is not None:        # the adapted head's last checkpoint
      b.adapter.close()


# ----------------------------------------------------------------------------------------------------------
# Request parsing


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


# ----------------------------------------------------------------------------------------------------------
# The app


def create_app(worker: EngineWorker, tokenizer, model_name: str, server_sp, default_max_tokens: int = 256):
  from fastapi import FastAPI
  from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
  import prometheus_client as prom

  app = FastAPI(title="specjax", version="0.1")
  registry = prom.CollectorRegistry()
  g = {name: prom.Gauge(f"specjax_{name}", doc, registry=registry) for name, doc in (
      ("queue_depth", "requests waiting for a slot"), ("running_slots", "slots decoding a request"),
      ("slots", "slots in the batch"), ("tokens_per_second", "generated tokens per second (smoothed)"),
      ("k_chosen", "draft tokens the policy chose for the latest iteration"),
      ("acceptance_rate", "accepted ÷ drafted tokens so far"),
      ("generated_tokens_total", "tokens generated"), ("requests_total", "requests accepted"),
      ("index_tokens", "a learning drafter's index (suffix): token slots in use, of index_capacity"),
      ("index_capacity", "a learning drafter's index: its size in token slots"),
      ("adapt_steps", "online adaptation (--adapt): optimizer steps taken on served traffic"),
      ("adapt_buffer_tokens", "online adaptation: positions in the replay buffer, of adapt_buffer_capacity"),
      ("adapt_buffer_capacity", "online adaptation: the replay buffer's bound in positions"))}
  eos_ids = tuple(worker.batcher.eos_ids)

  def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                               "param": param, "code": None}})

  @app.exception_handler(BadRequest)
  async def _bad(_, e: BadRequest):
    return error(e.status, str(e), e.param)

  @app.get("/health")
  async def health():
    b = worker.batcher
    return {"status": "ok" if worker.is_alive() else "engine stopped", "running": b.num_running,
            "queued": len(b.queue) + worker.waiting, "slots": b.slots, "policy": b.policy.name}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specjax"}]}

  @app.get("/metrics")
  async def metrics():
    b = worker.batcher
    st = b.state.stats
    try:
      acc, drafted = int(np.sum(st.accepted_B)), int(np.sum(st.drafted_B))
    except Exception:  # noqa: BLE001 -- the state may be mid-donation; report the last value
      acc, drafted = worker.accepted_total, worker.drafted_total
    worker.accepted_total, worker.drafted_total = acc, drafted
    g["queue_depth"].set(len(b.queue) + worker.waiting)
    g["running_slots"].set(b.num_running)
    g["slots"].set(b.slots)
    g["tokens_per_second"].set(worker.rate)
    g["k_chosen"].set(worker.last_k)
    g["acceptance_rate"].set(acc / drafted if drafted else 0.0)
    g["generated_tokens_total"].set(worker.tokens_total)
    g["requests_total"].set(worker.requests_total)
    if b.learns:
      idx = b.index_stats()
      g["index_tokens"].set(idx["tokens"])
      g["index_capacity"].set(idx["capacity"])
    if b.adapter is not None:
      ad = b.adapter.stats()
      g["adapt_steps"].set(ad["steps"])
      g["adapt_buffer_tokens"].set(ad["buffer_tokens"])
      g["adapt_buffer_capacity"].set(ad["buffer_capacity"])
    return PlainTextResponse(prom.generate_latest(registry).decode(), media_type=prom.CONTENT_TYPE_LATEST)

  async def _body(request: HttpRequest):
    try:
      return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
      raise BadRequest(f"the request body is not valid JSON: {e}") from e

  async def _serve(request: HttpRequest, chat: bool):
    p = parse_request(await _body(request), chat, server_sp, default_max_tokens)
    ids = (tokenizer.encode(tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True)) if chat
           else tokenizer.encode(p["prompt"]))
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    r = bt.Request(ids, p["max_tokens"], rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                   sampling=p["sampling"], seed=p["seed"])
    r.on_tokens = lambda req, toks: loop.call_soon_threadsafe(
        events.put_nowait, ("tokens", (toks, req.logprobs[len(req.tokens) - len(toks):])))
    r.on_finish = lambda req: loop.call_soon_threadsafe(events.put_nowait, ("finish", None))
    try:
      worker.submit(r)
    except bt.QueueFull as e:
      return error(429, str(e), kind="rate_limit_exceeded")
    except SpecjaxError as e:
      return error(400, str(e), "max_tokens")
    worker.requests_total += 1
    text = TextStream(tokenizer, eos_ids, p["stops"])
    created = int(time.time())
    model = p["model"] or model_name

    def usage():
      n = len([t for t in r.tokens if t not in eos_ids])
      return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

    lp_sent = [0]

    def logprobs_block(everything=False):
      """The log-probabilities of the tokens kept since the last block (OpenAI's two shapes), or None."""
      if not p["logprobs"]:
        return None
      start = 0 if everything else lp_sent[0]
      entries = text.kept[start:]
      lp_sent[0] = len(text.kept)
      pieces = [tokenizer.decode([i]) for i, _ in entries]
      if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, (_, lp) in zip(pieces, entries)]}
      return {"tokens": pieces, "token_logprobs": [lp for _, lp in entries], "top_logprobs": None}

    def finish_reason():
      if text.stopped or r.finish_reason == "stop":
        return "stop"
      return "length" if r.finish_reason == "length" else (r.finish_reason or "stop")

    async def next_event():
      kind, payload = await events.get()
      if kind == "tokens":
        delta = text.push(*payload)
        if text.stopped and not r.done:
          worker.cancel(r)                  # a stop string: no more tokens are needed
        return delta, False
      return text.flush(), True

    def chunk(delta: str, reason):
      lp = logprobs_block()
      if chat:
        d = {"content": delta} if delta else {}
        c = {"index": 0, "delta": d, "finish_reason": reason}
        if lp is not None:
          c["logprobs"] = lp
        return {"id": r.rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [c]}
      return {"id": r.rid, "object": "text_completion", "created": created, "model": model,
              "choices": [{"index": 0, "text": delta, "finish_reason": reason, "logprobs": lp}]}

    if p["stream"]:
      async def sse():
        try:
          if chat:
            first = chunk("", None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield f"data: {json.dumps(first)}\n\n"
          while True:
            delta, done = await next_event()
            if done:
              if r.error:
                yield f"data: {json.dumps({'error': {'message': r.error, 'type': 'server_error'}})}\n\n"
                break
              if delta:
                yield f"data: {json.dumps(chunk(delta, None))}\n\n"
              yield f"data: {json.dumps(chunk('', finish_reason()))}\n\n"
              if p["include_usage"]:
                last = chunk("", None)
                last["choices"], last["usage"] = [], usage()
                yield f"data: {json.dumps(last)}\n\n"
              break
            if delta:
              yield f"data: {json.dumps(chunk(delta, None))}\n\n"
          yield "data: [DONE]\n\n"
        finally:
          if not r.done:
            worker.cancel(r)                # the client went away: free the slot
      return StreamingResponse(sse(), media_type="text/event-stream")

    try:
      while True:
        _, done = await next_event()
        if done:
          break
    except asyncio.CancelledError:
      worker.cancel(r)
      raise
    if r.error:
      return error(500, r.error, kind="server_error")
    if chat:
      return {"id": r.rid, "object": "chat.completion", "created": created, "model": model, "usage": usage(),
              "choices": [{"index": 0, "message": {"role": "assistant", "content": text.sent},
                           "finish_reason": finish_reason(), "logprobs": logprobs_block(everything=True)}]}
    return {"id": r.rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text.sent, "finish_reason": finish_reason(),
                         "logprobs": logprobs_block(everything=True)}],
            "usage": usage()}

  @app.post("/v1/completions")
  async def completions(request: HttpRequest):
    return await _serve(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: HttpRequest):
    return await _serve(request, chat=True)

  return app
