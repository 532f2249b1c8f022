"""Run by tests/models/test_families.py in a process of its own with 4 host CPU devices: for each family checkpoint
directory given (argv[1], a JSON {dir: [prompt, ...]}), greedy decoding at bf16, int8 and int4 weights on a 2x2
mesh (``RUNS``), plain and speculative; prints JSON
{dir: {weights: {"plain@MESH" | "ngram@MESH" | "tree@MESH": token ids}}}."""
import json
import os
import sys

assert "xla_force_host_platform_device_count=4" in os.environ.get("XLA_FLAGS", ""), "run with 4 host devices"

from specjax import api  # noqa: E402

# Every weight type on the 2x2 mesh (the sharded quantized matrices): plain and an n-gram tree.  (One device at
# int4 and int8: tests/kernels/test_quant.py.)
RUNS = {"bf16": [("2x2", "tree")], "int8": [("2x2", "tree")], "int4": [("2x2", "tree")]}
SETTINGS = {"ngram": dict(drafter="ngram", k=3), "tree": dict(drafter="ngram", tree="branch:2,2")}

out = {}
for path, prompts in json.loads(sys.argv[1]).items():
  out[path] = {}
  for weights, runs_asked in RUNS.items():
    m = api.load(path, weights=weights)
    kw = dict(max_new_tokens=16, chat=False, ignore_eos=True, batch_size=2)
    runs = {}
    for mesh, name in runs_asked:
      for label, settings in (("plain", {}), (name, SETTINGS[name])):
        gens, _ = api.generate(m, prompts, mesh=mesh, **kw, **settings)
        runs[f"{label}@{mesh or 'one'}"] = [g.token_ids for g in gens]
    out[path][weights] = runs
print(json.dumps(out))
