"""A request's own speculation (``speculation``: off, k=N, or a tree the server was started with) over the
continuous batcher (the ``tiny`` model: tests/conftest.py): the pure pin function (``policies.apply_pins``:
the bucket most rows want, a starved minority's vote growing, k capped, tree and off rows), the text → bucket
lookup (``buckets.pin_key``), overlapping pinned and unpinned requests decoded to plain greedy's tokens with the
pinned tree run and nothing compiled after warm-up, and over HTTP the same plus one-line 400s naming
``speculation``."""
import threading

import numpy as np
import pytest

from specjax import api
from specjax.errors import SpecjaxError
from specjax.models import sampling
from specjax.serving import batcher as bt, buckets as bk, policies as pol, server
from tests.helpers.compile_counter import count_compiles
from tests.helpers.serving import serve_overlapping

TREE = "branch:2,2,1"                                     # 2 + 4 + 4 = 10 nodes
BUCKETS = bk.make_buckets((0, 1, 2, 4), [TREE], "ngram", 128)
OFFERS = "off, k=1, k=2, k=4, branch:2,2,1"
PROMPTS = ["hello world " * (i % 4 + 1) + str(i) for i in range(7)]


def _pins(pins, policy_k, policy_k_B, waits=None, live=None):
  n = len(pins)
  live = np.ones(n, bool) if live is None else np.asarray(live)
  waits = np.zeros(n, np.int64) if waits is None else np.asarray(waits, np.int64)
  dec, w = pol.apply_pins(pol.Decision(policy_k, np.asarray(policy_k_B, np.int32)), pins, live, waits,
                          BUCKETS, 4)
  return dec.k, dec.k_B.tolist(), w.tolist()


# ---------------------------------------------------------------------------------------------- the pure pins


def test_without_pins_the_policy_decides():
  assert _pins([None] * 4, 2, [2, 1, 2, 0]) == (2, [2, 1, 2, 0], [0] * 4)
  assert _pins([None] * 2, 8, [8, 8]) == (4, [8, 8], [0, 0])          # not compiled: the fallback (as before)


def test_the_bucket_most_rows_want_runs_and_tree_rows_get_n():
  # two rows want the tree, one the policy's chain of 4, one the chain of 1: the tree runs, the others plain
  assert _pins([TREE, TREE, None, 1], 4, [4] * 4) == (TREE, [10, 10, 0, 0], [0, 0, 1, 1])
  # the policy's tree wins; a row pinned to a chain gets a plain step in it
  assert _pins([None, None, 2], TREE, [10] * 3) == (TREE, [10, 10, 0], [0, 0, 1])


def test_k_is_capped_at_the_chain_that_runs():
  # policy 2 (two votes) against 4 and 1 (one each): a chain pin gets min(pin, 2), unpinned rows their own k
  assert _pins([4, 1, None, None], 2, [2, 2, 1, 2]) == (2, [2, 1, 1, 2], [1, 0, 0, 0])
  # the chain of 4 wins: the chain of 2 fits in it whole, so its row is served too
  assert _pins([4, 4, None], 2, [2, 2, 2]) == (4, [4, 4, 2], [0, 0, 0])
  # the policy chose a tree, two rows want the chain of 1: an unpinned row's N is capped at 1
  assert _pins([1, 1, None], TREE, [10] * 3) == (1, [1, 1, 1], [0, 0, 1])


def test_off_rows_decode_plainly_and_do_not_vote_and_idle_slots_get_nothing():
  assert _pins([0, 0, None], 4, [4] * 3) == (4, [0, 0, 4], [0, 0, 0])
  assert _pins([0, 0], 4, [4, 4]) == (0, [0, 0], [0, 0])                 # nobody votes: a plain step
  assert _pins([0, TREE, TREE], 4, [4, 0, 4], live=[True, False, True]) == (TREE, [0, 0, 10], [0, 0, 0])


def test_a_pinned_minority_is_not_starved():
  """Three rows pinned to the tree, one unpinned under the chain of 4: the unpinned row's vote grows each step
  it waits until it ties and the policy's choice runs; the tree rows then wait a step, and outweigh it again."""
  pins, waits, ran = [TREE, TREE, TREE, None], [0] * 4, []
  for _ in range(6):
    k, k_B, waits = _pins(pins, 4, [4] * 4, waits)
    ran.append((k, k_B))
  assert [k for k, _ in ran] == [TREE, TREE, 4, TREE, TREE, 4]
  assert ran[2][1] == [0, 0, 0, 4] and ran[0][1] == [10, 10, 10, 0]
  # a lone pin against three unpinned rows also gets its turn, every few steps
  waits, ks = [0] * 4, []
  for _ in range(8):
    k, _, waits = _pins([TREE, None, None, None], 2, [2] * 4, waits)
    ks.append(k)
  assert ks.count(TREE) >= 2 and ks.count(2) >= 4, ks


def test_a_text_names_its_bucket():
  assert [bk.pin_key(t, BUCKETS) for t in ("off", "OFF", "k=0", "k=1", "k = 4", " branch: 2, 2,1 ")] == \
      [0, 0, 0, 1, 4, TREE]
  assert bk.offered(BUCKETS) == OFFERS
  for text, says in (("k=3", "chain of 3"), ("branch:3,1", "restart with --tree branch:3,1"),
                     ("branch:x", "not off, k=N or a tree spec"), ("k=two", "k=N"),
                     ("paths:/nonexistent.json", "tree paths:/nonexistent.json is not served")):
    with pytest.raises(SpecjaxError) as e:
      bk.pin_key(text, BUCKETS)
    assert says in str(e.value) and OFFERS in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def eng(tiny):
  """Chains 0/1/2/4 and the tree over one state, the policy always the chain of 2, per-request sampling (the
  HTTP tests serve through it too)."""
  e = bt.ContinuousBatcher(tiny, slots=3, max_len=128, drafter="ngram", buckets=(0, 1, 2, 4), trees=(TREE,),
                           policy=pol.FixedK(2), per_request=True)
  e.warmup(32)
  return e


@pytest.fixture(scope="module")
def plain(tiny):
  return [api.generate(tiny, [p], max_new_tokens=12)[0][0].token_ids for p in PROMPTS]


def test_pinned_and_unpinned_requests_together_give_plain_greedy_tokens(tiny, eng, plain):
  pins = [TREE, 1, 0, None, TREE, 4, None]
  reqs, (compiles, names), most = serve_overlapping(tiny, eng, PROMPTS, pins=pins)
  assert compiles == 0, names
  assert most == 3
  assert [r.tokens for r in reqs] == plain
  used = [h.bucket for h in eng.history]
  assert TREE in used and "k=2" in used, used
  assert all(r.drafts_offered == 0 for r, p in zip(reqs, pins) if p == 0)     # off: never drafted for
  with pytest.raises(bt.AdmissionError, match="offers off, k=1"):
    eng.submit(bt.Request([1, 2, 3], 4, pin="branch:3,1"))


class _Serving:
  """The batcher behind the FastAPI app, its engine thread running (started and stopped per test: the
  batcher is the module's)."""

  def __init__(self, eng, tiny):
    from fastapi.testclient import TestClient
    self.worker = server.EngineWorker(eng, max_queue=16)
    self.worker.start()
    self.client = TestClient(server.create_app(self.worker, tiny.tokenizer, "tiny", sampling.SamplingParams(), 8))

  def post(self, body, chat=False):
    return self.client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)

  def close(self):
    self.client.close()
    self.worker.stop()
    self.worker.join(10)


@pytest.fixture
def http(eng, tiny):
  s = _Serving(eng, tiny)
  yield s
  s.close()


def _text(tiny, prompt, n):
  g, _ = api.generate(tiny, [prompt], max_new_tokens=n, chat=False)
  return tiny.tokenizer.decode([t for t in g[0].token_ids if t not in tiny.tokenizer.eos_token_ids])


def test_http_pinned_requests_give_plain_greedy_text_and_compile_nothing(http, eng, tiny):
  prompts = ["hello world hello", "abc abc abc", "one two one two", "tell me"]
  want = {p: _text(tiny, p, 10) for p in prompts}
  eng.history.clear()
  out: dict = {}

  def one(p, spec):
    body = {"prompt": p, "max_tokens": 10, **({} if spec is None else {"speculation": spec})}
    out[p] = http.post(body)
  with count_compiles() as compiles:
    threads = [threading.Thread(target=one, args=a)
               for a in zip(prompts, [TREE, "branch: 2,2,1", "off", "k=4"])]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
  assert compiles() == 0
  for p in prompts:
    assert out[p].status_code == 200, out[p].text
    assert out[p].json()["choices"][0]["text"] == want[p]
  assert TREE in {h.bucket for h in eng.history}


@pytest.mark.parametrize("value,says", [
    ("branch:3,1", "'speculation' = 'branch:3,1': the tree branch:3,1 is not served here"),
    ("k=3", "'speculation' = 'k=3': the chain of 3 drafts is not compiled here"),
    ("branch:x", "'speculation' = 'branch:x' is not off, k=N or a tree spec"),
    (4, "'speculation' must be a string"),
    (["off"], "'speculation' must be a string")])
def test_http_refuses_what_the_server_did_not_compile(http, value, says):
  for chat in (False, True):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    r = http.post({**body, "max_tokens": 4, "speculation": value}, chat=chat)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "speculation" and says in err["message"] and "\n" not in err["message"], err
    if isinstance(value, str):
      assert f"this server offers {OFFERS}" in err["message"]
  assert http.post({"prompt": "hi", "max_tokens": 2, "speculation": None}).status_code == 200    # still serving


def test_the_openapi_schema_describes_the_field():
  from specjax.serving.requests import openapi_schemas
  for model in ("CompletionRequest", "ChatCompletionRequest"):
    field = openapi_schemas()[model]["properties"]["speculation"]
    assert {"type": "string", "maxLength": 200} in field["anyOf"] and "branch:2,2,1" in field["description"]
