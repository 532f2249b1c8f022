"""The OpenAI-compatible server, over real HTTP (uvicorn on a local port): completions and chat, streaming and
not, with the openai client and httpx; 32 concurrent clients; per-request sampling (requests with their own
temperature, top-k, top-p and seed decoded together give the tokens they give alone; 64 streaming clients with
mixed settings); bad requests get 4xx JSON errors naming the field and the server keeps serving; a client that
disconnects mid-stream frees its slot; a full queue gets 429; /health and /metrics."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from specjax import api
from specjax.models import sampling
from specjax.serving import factory, server
from tests.helpers import CFG, random_hf_params, write_gguf


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Running:
  def __init__(self, m, **kw):
    import uvicorn
    slots, max_queue = kw.pop("slots", 4), kw.pop("max_queue", 64)
    # A fixed k: a seeded request's draws are then the same alone or among others (an adaptive k keeps the
    # distribution, not the draws).
    eng = factory.make_batcher(m, drafter="ngram", policy="fixed", k=2, slots=slots,
                               max_len=256, max_queue=max_queue, per_request=True)
    eng.warmup(64)
    self.worker = server.EngineWorker(eng, max_queue=max_queue)
    self.worker.start()
    app = server.create_app(self.worker, m.tokenizer, "tiny", sampling.SamplingParams(), 32)
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    for _ in range(200):
      if self.server.started:
        break
      time.sleep(0.05)

  def close(self):
    self.server.should_exit = True
    self.thread.join(10)
    self.worker.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = write_gguf(tmp_path_factory.mktemp("srv") / "tiny.gguf", CFG, random_hf_params(CFG, seed=3))
  return api.load(str(path))


@pytest.fixture(scope="module")
def srv(tiny):
  s = Running(tiny)
  yield s
  s.close()


def _plain(tiny, prompt, n, chat):
  g, _ = api.generate(tiny, [prompt], max_new_tokens=n, chat=chat)
  return tiny.tokenizer.decode([t for t in g[0].token_ids if t not in tiny.tokenizer.eos_token_ids])


def test_completions_and_chat_match_plain_greedy(srv, tiny):
  r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello world hello", "max_tokens": 12}, timeout=60)
  assert r.status_code == 200, r.text
  d = r.json()
  assert d["object"] == "text_completion" and d["choices"][0]["text"] == _plain(tiny, "hello world hello", 12, False)
  assert d["usage"]["completion_tokens"] <= 12 and d["choices"][0]["finish_reason"] in ("stop", "length")
  r = httpx.post(f"{srv.url}/v1/chat/completions",
                 json={"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10}, timeout=60)
  assert r.status_code == 200, r.text
  assert r.json()["choices"][0]["message"]["content"] == _plain(tiny, "hi there", 10, True)


def test_openai_client_streaming_and_not(srv, tiny):
  openai = pytest.importorskip("openai")
  client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
  want = _plain(tiny, "tell me", 16, True)
  full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "tell me"}],
                                        max_tokens=16)
  assert full.choices[0].message.content == want
  parts = []
  for ev in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "tell me"}],
                                           max_tokens=16, stream=True):
    if ev.choices and ev.choices[0].delta.content:
      parts.append(ev.choices[0].delta.content)
  assert "".join(parts) == want
  comp = client.completions.create(model="tiny", prompt="abc abc abc", max_tokens=8, stream=True)
  assert "".join(c.choices[0].text for c in comp) == _plain(tiny, "abc abc abc", 8, False)


def test_32_concurrent_clients_none_lost(srv, tiny):
  prompts = [f"question {i} " * (1 + i % 3) for i in range(32)]
  want = {p: _plain(tiny, p, 8, True) for p in set(prompts)}

  async def go():
    async with httpx.AsyncClient(timeout=120) as c:
      async def one(p, stream):
        body = {"messages": [{"role": "user", "content": p}], "max_tokens": 8, "stream": stream}
        if not stream:
          r = await c.post(f"{srv.url}/v1/chat/completions", json=body)
          return r.status_code, r.json()["choices"][0]["message"]["content"]
        text = []
        async with c.stream("POST", f"{srv.url}/v1/chat/completions", json=body) as r:
          async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
              d = json.loads(line[6:])
              text.append(d["choices"][0]["delta"].get("content") or "")
          return r.status_code, "".join(text)
      return await asyncio.gather(*[one(p, i % 2 == 0) for i, p in enumerate(prompts)])

  results = asyncio.run(go())
  assert [s for s, _ in results] == [200] * 32
  assert [t for _, t in results] == [want[p] for p in prompts]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(srv, tiny):
  url = f"{srv.url}/v1/chat/completions"
  ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
  cases = [
      (b"{not json", "not valid JSON"),
      (json.dumps({**ok, "frobnicate": 1}).encode(), "unknown field"),
      (json.dumps({**ok, "max_tokens": -5}).encode(), "max_tokens"),
      (json.dumps({**ok, "messages": "hi"}).encode(), "messages"),
      (json.dumps({**ok, "temperature": 2.5}).encode(), "temperature"),
      (json.dumps({**ok, "top_p": 0}).encode(), "top_p"),
      (json.dumps({**ok, "top_k": -3}).encode(), "top_k"),
      (json.dumps({**ok, "top_k": 2.5}).encode(), "top_k"),
      (json.dumps({**ok, "seed": -1}).encode(), "seed"),
      (json.dumps({**ok, "seed": "abc"}).encode(), "seed"),
      (json.dumps({**ok, "logprobs": 3}).encode(), "logprobs"),
      (json.dumps({**ok, "top_logprobs": 2}).encode(), "top_logprobs"),
      (json.dumps({**ok, "messages": [{"role": "user", "content": "word " * 400}]}).encode(), "does not fit"),
  ]
  for body, needle in cases:
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (needle, r.status_code, r.text)
    err = r.json()["error"]
    assert needle in err["message"], (needle, err)
    if needle in ("temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs"):
      assert err["param"] == needle, err
    assert httpx.post(url, json=ok, timeout=60).status_code == 200        # still serving
  assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"


SAMPLED = [{"temperature": 2.0, "seed": 7}, {"temperature": 1.5, "top_k": 5, "seed": 9}, {"temperature": 0.0},
           {"temperature": 1.0, "top_p": 0.8, "seed": 11}]


def _completion(c, url, prompt, settings):
  body = {"prompt": prompt, "max_tokens": 16, "logprobs": 0, **settings}
  return c.post(f"{url}/v1/completions", json=body)


def test_requests_with_their_own_sampling_give_their_solo_tokens_together(srv, tiny):
  """Each request alone, then all four at once (decoded in the same steps): the same text and logprobs."""
  prompts = ["one two one two", "x", "abc abc", "tell me more"]
  with httpx.Client(timeout=120) as c:
    alone = [_completion(c, srv.url, p, s).json()["choices"][0] for p, s in zip(prompts, SAMPLED)]

  async def together():
    async with httpx.AsyncClient(timeout=120) as c:
      return await asyncio.gather(*[c.post(f"{srv.url}/v1/completions",
                                           json={"prompt": p, "max_tokens": 16, "logprobs": 0, **s})
                                    for p, s in zip(prompts, SAMPLED)])

  both = [r.json()["choices"][0] for r in asyncio.run(together())]
  for a, b, s in zip(alone, both, SAMPLED):
    assert a["text"] == b["text"], s
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"] and a["logprobs"]["tokens"], s
    assert all(lp <= 0 for lp in a["logprobs"]["token_logprobs"])
    assert max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])) < 1e-4
  assert alone[2]["text"] == _plain(tiny, prompts[2], 16, False)          # the greedy one: plain greedy's
  with httpx.Client(timeout=120) as c:                                     # another seed: another sample
    others = [_completion(c, srv.url, "x", {"temperature": 1.5, "seed": s}).json()["choices"][0]["text"]
              for s in (1, 2, 3)]
    chat = c.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 6, "logprobs": True}).json()
  assert len(set(others)) > 1, others
  assert alone[0]["text"] != _plain(tiny, prompts[0], 16, False) or alone[1]["text"] != _plain(tiny, prompts[1], 16, False)
  content = chat["choices"][0]["logprobs"]["content"]
  assert content and all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in content)


def test_64_streaming_clients_with_mixed_sampling(srv):
  """64 streaming clients at once, a quarter each greedy / temperature / top-p / top-k, each seeded: every
  one served with a finish reason; latency percentiles and throughput reported."""
  from specjax.serving import loadgen
  trace = loadgen.mixed_sampling([{"arrival": 0.0, "prompt": f"story {i} " * (1 + i % 4), "max_tokens": 8}
                                  for i in range(64)], seed=100)
  rep = loadgen.run(srv.url, trace)
  print(f"64 mixed clients: {rep['served']} served, {rep['tokens_per_s']:.1f} tok/s, ttft p50 "
        f"{rep['ttft_s']['p50']:.3f}s p99 {rep['ttft_s']['p99']:.3f}s, itl p50 {rep['itl_s']['p50']:.4f}s "
        f"p99 {rep['itl_s']['p99']:.4f}s")
  assert rep["served"] == 64 and rep["failed"] == 0, rep["errors"]
  assert sum(rep["finish_reasons"].values()) == 64 and set(rep["finish_reasons"]) <= {"stop", "length"}
  assert 64 <= rep["tokens"] <= 64 * 8 and rep["tokens_per_s"] > 0
  for q in (rep["ttft_s"], rep["itl_s"]):
    assert 0 < q["p50"] <= q["p99"]
  h = httpx.get(f"{srv.url}/health").json()
  assert h["running"] == 0 and h["queued"] == 0


def test_disconnect_mid_stream_frees_the_slot(srv, tiny):
  body = {"messages": [{"role": "user", "content": "a long story"}], "max_tokens": 200, "stream": True}
  with httpx.Client(timeout=60) as c:
    with c.stream("POST", f"{srv.url}/v1/chat/completions", json=body) as r:
      for line in r.iter_lines():
        if line.startswith("data: "):
          break                        # first chunk, then hang up
  for _ in range(200):
    h = httpx.get(f"{srv.url}/health").json()
    if h["running"] == 0 and h["queued"] == 0:
      break
    time.sleep(0.05)
  assert h["running"] == 0 and h["queued"] == 0
  r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
  assert r.status_code == 200


def test_metrics(srv):
  text = httpx.get(f"{srv.url}/metrics").text
  for name in ("specjax_queue_depth", "specjax_running_slots", "specjax_tokens_per_second", "specjax_k_chosen",
               "specjax_acceptance_rate", "specjax_generated_tokens_total"):
    assert f"\n{name} " in "\n" + text, name


def test_full_queue_gets_429(tiny):
  s = Running(tiny, slots=1, max_queue=2)
  try:
    async def go():
      async with httpx.AsyncClient(timeout=120) as c:
        body = {"prompt": "x y z", "max_tokens": 30}
        return await asyncio.gather(*[c.post(f"{s.url}/v1/completions", json=body) for _ in range(10)])
    codes = [r.status_code for r in asyncio.run(go())]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200
  finally:
    s.close()


def test_loadgen_drives_the_live_server(srv):
  """`specjax loadgen`'s client against the running server: every streamed request served, tokens counted
  from each stream's usage, latency percentiles ordered, and the k the policy chose polled from /metrics."""
  from specjax.serving import loadgen, trace as trace_lib
  tr = trace_lib.poisson([f"tell me about {w}" for w in ("cats", "rivers", "stars")], 20.0, 10, 0, 8)
  rep = loadgen.run(srv.url, tr)
  assert rep["requests"] == rep["served"] == 10 and rep["failed"] == 0, rep["errors"]
  assert 10 <= rep["tokens"] <= 80 and rep["tokens_per_s"] > 0
  for q in (rep["ttft_s"], rep["itl_s"]):
    assert 0 < q["p50"] <= q["p90"] <= q["p99"]
  assert rep["k_over_time"] and all(live >= 0 for _, _, live in rep["k_over_time"])


def test_loadgen_counts_a_server_that_is_not_there_as_failed():
  from specjax.serving import loadgen
  rep = loadgen.run(f"http://127.0.0.1:{_free_port()}", [{"arrival": 0.0, "prompt": "hi", "max_tokens": 4}])
  assert rep["served"] == 0 and rep["failed"] == 1 and "Connect" in rep["errors"][0]


def test_openapi_names_the_request_models():
  """The POST bodies are parsed by hand (for OpenAI-style 400s), yet /openapi.json describes them: each route's
  request body refers to its pydantic model, whose fields carry their types and ranges."""
  import types
  worker = types.SimpleNamespace(batcher=types.SimpleNamespace(eos_ids=[0]))
  app = server.create_app(worker, None, "tiny", sampling.SamplingParams(), 32)
  doc = app.openapi()
  schemas = doc["components"]["schemas"]
  for path, required in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
    body = doc["paths"][path]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    model = schemas[ref.rsplit("/", 1)[-1]]
    fields = model["properties"]
    assert {required, "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "logprobs",
            "stream_options"} <= set(fields), (path, sorted(fields))
    assert model["required"] == [required] and model["additionalProperties"] is False
    assert {"type": "number", "minimum": 0.0, "maximum": 2.0} in fields["temperature"]["anyOf"]
    assert {"type": "integer", "minimum": 1} in fields["max_tokens"]["anyOf"]
  msgs = schemas["ChatCompletionRequest"]["properties"]["messages"]
  assert msgs["minItems"] == 1 and msgs["items"]["$ref"].endswith("/ChatMessage")
  assert set(schemas["ChatMessage"]["required"]) == {"role", "content"}
