"""Held-out greedy agreement of a drafter split by reply offset (<128, >=128) and by whether the text is in a
repetition loop (the 8-gram ending at t occurred earlier in the sequence)."""
import json, sys
import numpy as np
from specjax import api
from specjax.checkpoints import drafter_io
from specjax.training import eagle_train, evaluate

draft, data = sys.argv[1], sys.argv[2]
m = api.load("smollm2-135m")
ecfg, params, _ = drafter_io.load_drafter(draft, m.cfg, m.params, m.tokenizer, m.source)
store = eagle_train.FeatureData(data)
_, held = store.split(0.02, 0)
toks, plens, groups = [], [], {"early": [], "late": [], "loop": [], "fresh": []}
for s in held:
  t = np.asarray(store.tokens[store.offsets[s]:store.offsets[s + 1]]).tolist()
  p = int(store.prompt_lens[s])
  toks.append(t); plens.append(p)
  seen, loop = set(), []
  for i in range(len(t)):
    g = tuple(t[max(0, i - 7):i + 1])
    loop.append(len(g) == 8 and g in seen)
    seen.add(g)
  # scoring position i predicts tokens i+1 (bonus) and i+2 (first draft): loop if the 8-gram ending at i+2 repeats
  rng = range(max(p - 1, 0), len(t) - 1)
  groups["early"].append([i for i in rng if i - p < 128])
  groups["late"].append([i for i in rng if i - p >= 128])
  groups["loop"].append([i for i in rng if i + 2 < len(t) and loop[i + 2]])
  groups["fresh"].append([i for i in rng if i + 2 < len(t) and not loop[i + 2]])
out = {}
for name, at in groups.items():
  r = evaluate.sequence_tvd(m, ecfg, params, toks, plens, positions=3, at=at)
  out[name] = {"positions": sum(map(len, at)), **{k: [round(x, 3) for x in v] for k, v in r.items() if isinstance(v, list)}}
  print(name, out[name], flush=True)
json.dump(out, open(sys.argv[3], "w"), indent=1)
