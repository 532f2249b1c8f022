#!/bin/bash
# greedy outputs and JSON keys before (64e1003, /tmp/wt) vs after (/work/main) on the real model
set -e
PY=${PY:-/work/main/.venv/bin/python}  # an environment with jax; both sides run from source via PYTHONPATH
for side in before after; do
  if [ $side = before ]; then dir=/tmp/wt; else dir=/work/main; fi
  for d in none ngram; do
    (cd $dir && PYTHONPATH=$dir $PY -m specjax.cli generate --model smollm2-135m --prompts specjax-prompts --limit 20 \
      --max-new-tokens 64 --drafter $d --json > /tmp/ba/${side}_gen_$d.json 2>/tmp/ba/${side}_gen_$d.log)
  done
  (cd $dir && PYTHONPATH=$dir $PY -m specjax.cli bench --model smollm2-135m --limit 3 --max-new-tokens 32 \
     --drafter ngram --json > /tmp/ba/${side}_bench.json 2>/tmp/ba/${side}_bench.log)
done
$PY - <<'PY'
import json
def keys(o, p=""):
  out=set()
  if isinstance(o, dict):
    for k,v in o.items():
      out.add(p+"/"+k); out|=keys(v, p+"/"+k)
  elif isinstance(o, list) and o and isinstance(o[0], dict):
    out|=keys(o[0], p+"[]")
  return out
for name in ["gen_none","gen_ngram","bench"]:
  b=json.load(open(f"/tmp/ba/before_{name}.json")); a=json.load(open(f"/tmp/ba/after_{name}.json"))
  kb, ka = keys(b), keys(a)
  print(name, "keys only before:", sorted(kb-ka), "only after:", sorted(ka-kb))
  if name.startswith("gen"):
    same=sum(x["token_ids"]==y["token_ids"] for x,y in zip(b["outputs"],a["outputs"]))
    print(name, f"identical token ids: {same}/{len(b['outputs'])}", "new tokens", b["stats"]["new_tokens"], a["stats"]["new_tokens"])
  else:
    print("bench identical:", [m.get("outputs_identical") for m in a.get("methods",[a])], "kernel choices before", b["machine"].get("kernel_choices"), "after", a["machine"].get("kernel_choices"))
PY
