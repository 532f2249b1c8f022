"""Serving under overlapping arrivals, shared by the batcher tests (test_serving.py, test_serving_trees.py)."""
from specjax.serving import batcher as bt
from tests.helpers.compile_counter import count_compiles


def serve_overlapping(tiny, eng, prompts, max_new: int = 12, pins=None):
  """``prompts`` as requests, two submitted before each step of ``eng`` (warmed up first): later ones arrive
  while earlier ones decode, and some wait in the queue for a slot; ``pins``: each request's own bucket
  (``Request.pin``), if given.  Returns (the requests, compilations after warm-up with their names, the most
  slots running at once)."""
  eng.warmup(32)
  reqs = [bt.Request(tiny.tokenizer.encode_chat(p), max_new, rid=i, pin=None if pins is None else pins[i])
          for i, p in enumerate(prompts)]
  pending, most, names = list(reqs), 0, []
  with count_compiles(names) as compiles:
    while pending or not all(r.done for r in reqs):
      for _ in range(2):
        if pending:
          eng.submit(pending.pop(0))
      eng.step()
      most = max(most, eng.num_running)
  return reqs, (compiles(), names), most
