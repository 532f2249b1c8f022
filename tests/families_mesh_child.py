"""Run by tests/test_families.py in a process of its own with 4 host CPU devices: for a family checkpoint
directory (argv[1]), greedy decoding at each weight type (fp32, bf16, int8, int4), on one device and on a 2x2
mesh, plain and speculative (n-gram chain, n-gram tree); prints JSON {weights: {run: token ids}}."""
import json
import os
import sys

assert "xla_force_host_platform_device_count=4" in os.environ.get("XLA_FLAGS", ""), "run with 4 host devices"

from specjax import api  # noqa: E402

path, prompts = sys.argv[1], json.loads(sys.argv[2])
out = {}
for weights in ("fp32", "bf16", "int8", "int4"):
  m = api.load(path, weights=weights)
  kw = dict(max_new_tokens=20, chat=False, ignore_eos=True, batch_size=2)
  runs = {}
  for mesh in (None, "2x2"):
    for name, settings in (("plain", {}), ("ngram", dict(drafter="ngram", k=3)),
                           ("tree", dict(drafter="ngram", tree="branch:2,2"))):
      gens, _ = api.generate(m, prompts, mesh=mesh, **kw, **settings)
      runs[f"{name}@{mesh or 'one'}"] = [g.token_ids for g in gens]
  out[weights] = runs
print(json.dumps(out))
