"""``specjax serve``: an OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with server-sent events or
not; ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``logprobs``, and specjax's
``speculation``: a request's own bucket), ``GET /health``, ``GET /metrics``
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

Here: the engine thread and ``create_app``.  The endpoints are in ``routes``, one request's way from its
parsed body to its response (text, logprobs, events) in ``completion``, the request bodies' pydantic models
(which the OpenAPI document at ``/openapi.json`` shows) in ``requests``.
"""
from __future__ import annotations

import queue
import threading
import time

from specjax.errors import SpecjaxError
from specjax.serving import batcher as bt
from specjax.serving import routes
from specjax.serving.completion import TextStream  # noqa: F401 -- its home was here


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
# The app


def create_app(worker: EngineWorker, tokenizer, model_name: str, server_sp, default_max_tokens: int = 256):
  """The FastAPI app over an ``EngineWorker``: ``server_sp`` and ``default_max_tokens`` are what a
  request that does not set its sampling or its length gets."""
  app = routes.SpecjaxAPI(title="specjax", version="0.1")
  app.state.specjax = routes.ServerState(worker, tokenizer, model_name, server_sp, default_max_tokens,
                                         tuple(worker.batcher.eos_ids), routes.Metrics())
  routes.add_routes(app)
  return app
