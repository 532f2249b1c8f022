"""The HTTP endpoints of ``specjax serve`` (see ``server``), each a module-level handler that finds the
server's state (``ServerState``: the engine worker, the tokenizer, the defaults, the metrics) on its app:
``GET /health``, ``GET /v1/models``, ``GET /metrics``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

The POST bodies are read and validated by hand (``requests.parse_request``), not by FastAPI, so that a bad one
gets this server's OpenAI-style 400 (FastAPI's own would be a 422 of another shape); the request models are
named in the OpenAPI document all the same (``SpecjaxAPI.openapi``)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import prometheus_client as prom
from fastapi import FastAPI
from fastapi import Request as HttpRequest      # at module level: FastAPI resolves handler annotations here
from fastapi.responses import PlainTextResponse, StreamingResponse

from specjax.errors import SpecjaxError
from specjax.serving import buckets as bk, completion
from specjax.serving.requests import BadRequest, ChatCompletionRequest, CompletionRequest, openapi_schemas, parse_request

GAUGES = (
    ("queue_depth", "requests waiting for a slot"), ("running_slots", "slots decoding a request"),
    ("slots", "slots in the batch"), ("tokens_per_second", "generated tokens per second (smoothed)"),
    ("k_chosen", "draft tokens the policy chose for the latest iteration"),
    ("acceptance_rate", "accepted ÷ drafted tokens so far"),
    ("generated_tokens_total", "tokens generated"), ("requests_total", "requests accepted"),
    ("index_tokens", "a learning drafter's index (suffix): token slots in use, of index_capacity"),
    ("index_capacity", "a learning drafter's index: its size in token slots"),
    ("adapt_steps", "online adaptation (--adapt): optimizer steps taken on served traffic"),
    ("adapt_buffer_tokens", "online adaptation: positions in the replay buffer, of adapt_buffer_capacity"),
    ("adapt_buffer_capacity", "online adaptation: the replay buffer's bound in positions"))


class Metrics:
  """The Prometheus gauges of one server (its own registry), set from the worker when scraped."""

  def __init__(self):
    self.registry = prom.CollectorRegistry()
    self.g = {name: prom.Gauge(f"specjax_{name}", doc, registry=self.registry) for name, doc in GAUGES}

  def update(self, worker) -> None:
    b = worker.batcher
    st = b.state.stats
    try:
      acc, drafted = int(np.sum(st.accepted_B)), int(np.sum(st.drafted_B))
    except Exception:  # noqa: BLE001 -- the state may be mid-donation; report the last value
      acc, drafted = worker.accepted_total, worker.drafted_total
    worker.accepted_total, worker.drafted_total = acc, drafted
    for name, value in (("queue_depth", len(b.queue) + worker.waiting), ("running_slots", b.num_running),
                        ("slots", b.slots), ("tokens_per_second", worker.rate), ("k_chosen", worker.last_k),
                        ("acceptance_rate", acc / drafted if drafted else 0.0),
                        ("generated_tokens_total", worker.tokens_total), ("requests_total", worker.requests_total)):
      self.g[name].set(value)
    if b.learns:
      idx = b.index_stats()
      self.g["index_tokens"].set(idx["tokens"])
      self.g["index_capacity"].set(idx["capacity"])
    if b.adapter is not None:
      ad = b.adapter.stats()
      for name in ("steps", "buffer_tokens", "buffer_capacity"):
        self.g[f"adapt_{name}"].set(ad[name])

  def text(self) -> str:
    return prom.generate_latest(self.registry).decode()


@dataclass
class ServerState:
  """What the handlers share: kept on the app as ``app.state.specjax``."""
  worker: object                 # server.EngineWorker
  tokenizer: object
  model_name: str
  server_sp: object              # the default sampling.SamplingParams of a request
  default_max_tokens: int
  eos_ids: tuple
  metrics: Metrics


def _state(request: HttpRequest) -> ServerState:
  return request.app.state.specjax


class SpecjaxAPI(FastAPI):
  """FastAPI, its OpenAPI document also holding the request models the POST routes refer to."""

  def openapi(self) -> dict:
    if self.openapi_schema is None:
      doc = super().openapi()
      doc.setdefault("components", {}).setdefault("schemas", {}).update(openapi_schemas())
    return self.openapi_schema


def _json_body(model: type) -> dict:
  """A route's ``openapi_extra``: its JSON body is ``model`` (in the document's components)."""
  ref = {"$ref": f"#/components/schemas/{model.__name__}"}
  return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# ----------------------------------------------------------------------------------------------------------
# The handlers


async def bad_request(_, e: BadRequest):
  return completion.error_response(e.status, str(e), e.param)


async def health(request: HttpRequest):
  worker = _state(request).worker
  b = worker.batcher
  return {"status": "ok" if worker.is_alive() else "engine stopped", "running": b.num_running,
          "queued": len(b.queue) + worker.waiting, "slots": b.slots, "policy": b.policy.name}


async def models(request: HttpRequest):
  return {"object": "list", "data": [{"id": _state(request).model_name, "object": "model", "owned_by": "specjax"}]}


async def metrics(request: HttpRequest):
  st = _state(request)
  st.metrics.update(st.worker)
  return PlainTextResponse(st.metrics.text(), media_type=prom.CONTENT_TYPE_LATEST)


async def _read_json(request: HttpRequest):
  try:
    return json.loads(await request.body())
  except (ValueError, UnicodeDecodeError) as e:
    raise BadRequest(f"the request body is not valid JSON: {e}") from e


async def _complete(request: HttpRequest, chat: bool):
  """Both POST endpoints: parse, submit, then stream the tokens or wait for them all."""
  st = _state(request)
  p = parse_request(await _read_json(request), chat, st.server_sp, st.default_max_tokens)
  try:                        # a request's own speculation: a bucket this server compiled, before it is queued
    p["pin"] = None if p["speculation"] is None else bk.pin_key(p["speculation"], st.worker.batcher.bucket_info)
  except SpecjaxError as e:
    raise BadRequest(str(e), param="speculation") from None
  c = completion.InFlight(st.worker, st.tokenizer, st.eos_ids, st.model_name, p, chat)
  refused = c.submit()
  if refused is not None:
    return refused
  if p["stream"]:
    return StreamingResponse(completion.sse_events(c), media_type="text/event-stream")
  return await completion.respond_whole(c)


async def completions(request: HttpRequest):
  return await _complete(request, chat=False)


async def chat_completions(request: HttpRequest):
  return await _complete(request, chat=True)


def add_routes(app: FastAPI) -> None:
  app.add_exception_handler(BadRequest, bad_request)
  app.add_api_route("/health", health, methods=["GET"])
  app.add_api_route("/v1/models", models, methods=["GET"])
  app.add_api_route("/metrics", metrics, methods=["GET"])
  app.add_api_route("/v1/completions", completions, methods=["POST"], openapi_extra=_json_body(CompletionRequest))
  app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                    openapi_extra=_json_body(ChatCompletionRequest))
