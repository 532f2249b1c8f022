"""Run by tests/parallel/test_sharding.py with 8 host CPU devices: the continuous-batching engine over a 4x2 mesh
(requests arriving while others decode, n-gram speculation with k = 3) gives each prompt the
tokens plain greedy decoding gives it alone on one device, in the server's per-request mode (each slot's
sampling settings as sharded data, every row through the sampling rule); prints JSON."""
import json
import os
import sys
import tempfile
from pathlib import Path

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run with 8 host devices"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specjax import api  # noqa: E402
from specjax.serving import batcher as bt, factory  # noqa: E402
from tests.helpers import varied_tiny_gguf  # noqa: E402

PROMPTS = ["hello world " * (i % 4 + 1) + str(i) for i in range(6)]

with tempfile.TemporaryDirectory() as d:
  m = api.load(varied_tiny_gguf(Path(d) / "tiny.gguf"))
plain = [api.generate(m, [p], max_new_tokens=12)[0][0].token_ids for p in PROMPTS]
eng = factory.make_batcher(api.on_mesh(m, "4x2"), drafter="ngram", policy="fixed", k=3, buckets=(0, 3),
                           slots=4, max_len=128, per_request=True)
eng.warmup(32)
reqs = [bt.Request(m.tokenizer.encode_chat(p), 12, rid=i) for i, p in enumerate(PROMPTS)]
pending = list(reqs)
while pending or not all(r.done for r in reqs):
  for _ in range(2):
    if pending:
      eng.submit(pending.pop(0))
  eng.step()
json.dump({"plain": plain, "served": [r.tokens for r in reqs], "ks": [h.k for h in eng.history],
           "cache_sharding": str(eng.state.cache.k.sharding.spec)}, sys.stdout)
