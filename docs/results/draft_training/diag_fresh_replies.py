"""Teacher-forced agreement of a drafter on fresh greedy replies (128 tokens) to three prompt sets:
MT-bench (the question file's first 40 mt_bench prompts, 5 per category), unseen chat requests, unseen synthesized questions."""
import json, sys
from specjax import api
from specjax.prompts import load_prompts
from specjax.training import chat_prompts, evaluate, synth_prompts
from specjax.checkpoints import drafter_io

draft = sys.argv[1]
m = api.load("smollm2-135m")
ecfg, params, _ = drafter_io.load_drafter(draft, m.cfg, m.params, m.tokenizer, m.source)
mt = [p.text for p in load_prompts("/work/shared/data/spec_bench/question.jsonl", ["mt_bench"], None, 5)]
sets = {"mt_bench": mt,
        "chat (unseen seed)": [r["prompt"] for r in chat_prompts.chat_requests(40, seed=99)],
        "synth (unseen seed)": [r["prompt"] for r in synth_prompts.synthesize(40, seed=99)]}
out = {}
for name, prompts in sets.items():
  gens, _ = api.generate(m, prompts, max_new_tokens=128, temperature=0.0, batch_size=8, max_len=1024)
  enc = api.encode_prompts(m, prompts)
  toks = [e + g.token_ids for e, g in zip(enc, gens)]
  r = evaluate.sequence_tvd(m, ecfg, params, toks, [len(e) for e in enc], positions=3)
  out[name] = {k: [round(x, 3) for x in v] for k, v in r.items() if isinstance(v, list)}
  print(name, out[name], flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
