"""Suffix decoding on served traffic: a repeated-task trace through the continuous batcher, plain decoding,
prompt lookup (n-gram) and suffix decoding paired request by request in one run.

The trace (``serving.trace.repeated``): ``tasks`` prompts, each asked ``repeats`` times, reworded each round
(``trace.REWORDINGS``), round after round.  Each method has its own batcher (``serving.factory``: the server's
engine, the fixed-k policy, one slot); request i is served by every method back to back, the order rotated,
so each method's speed is measured beside the others' on the same request.  The suffix drafter's index fills
as its batcher finishes requests (``ContinuousBatcher._finish``); n-gram lookup sees only the request itself.

``concurrent``: afterwards each method also replays the whole trace at once over ``slots`` slots (continuous
batching; the suffix index starts empty again), for the throughput under load.

Rows: one per (method, round): tokens/s, speedup over plain decoding, tokens per step; the summary has each
method's overall speedup, the ratio suffix / n-gram, greedy outputs identical to plain decoding's, and the
index's fill against its capacity.
"""
from __future__ import annotations

import time

import numpy as np

from specjax import api
from specjax.measure import paired
from specjax.serving import batcher as bt, factory, trace as trace_lib
from specjax.speculative import suffix
from experiments.common import encode_trace, pick_prompts


def _serve_one(b: bt.ContinuousBatcher, ids: list[int], max_new: int) -> tuple[list[int], float, int]:
  """One request alone through a batcher: (tokens, seconds from submission to its last token, prefill
  included, steps)."""
  r = bt.Request(list(ids), max_new, arrival=0.0)
  steps0 = len(b.history)
  t0 = time.perf_counter()
  b.run([r])
  return r.tokens, time.perf_counter() - t0, len(b.history) - steps0


def suffix_trace(model: str = "smollm2-135m", weights: str = "auto", prompts: str = "specjax-prompts",
                 categories=None, tasks: int = 8, repeats: int = 3, max_new_tokens: int = 128,
                 max_len: int = 1024, k: int = 8, ngram_k: int = 5, slots: int = 4, concurrent: bool = True,
                 index_tokens: int = suffix.DEFAULT_CORPUS_TOKENS, seed: int = 0, log=print) -> dict:
  """``index_tokens``: the suffix index's size in token slots (the oldest evicted past it)."""
  chosen = pick_prompts(prompts, categories, None, None)
  reqs = trace_lib.repeated([p.text for p in chosen], tasks, repeats, 0.0, seed, max_new_tokens)
  m = api.load(model, weights=weights)
  encoded, longest = encode_trace(m, reqs, max_new_tokens, k, max_len, "suffix_trace")
  methods = {"plain": dict(drafter="none", k=0), f"ngram k{ngram_k}": dict(drafter="ngram", k=ngram_k),
             f"suffix k{k}": dict(drafter="suffix", k=k)}
  log(f"[suffix_trace] {model}: {len(reqs)} requests ({tasks} tasks x {repeats} rounds), "
      f"{max_new_tokens} new tokens, methods {', '.join(methods)}")

  def make(slots_: int):
    out = {name: factory.make_batcher(m, policy="fixed", slots=slots_, max_len=max_len, **kw)
           for name, kw in methods.items()}
    out[f"suffix k{k}"].draft_params = suffix.empty_index(index_tokens)    # before warm-up: compiled for it
    return out

  batchers = make(1)
  for b in batchers.values():
    b.warmup(longest)
  names = list(batchers)
  out = {n: {"tokens": [], "seconds": [], "steps": []} for n in names}
  order = paired.schedule(len(names), len(reqs))
  for n, (_, i, j) in enumerate(order):
    name = names[j]
    toks, s, steps = _serve_one(batchers[name], encoded[i], reqs[i]["max_tokens"])
    for key, v in (("tokens", toks), ("seconds", s), ("steps", steps)):
      out[name][key].append(v)            # one repeat: request i is each method's i-th
    if (n + 1) % (len(names) * max(1, len(reqs) // 6)) == 0:
      log(f"[suffix_trace] {i + 1}/{len(reqs)} requests")

  rounds = [r["round"] for r in reqs]
  plain_tps = np.array([len(t) / s for t, s in zip(out["plain"]["tokens"], out["plain"]["seconds"])])
  rows, summary = [], {"trace": {"tasks": tasks, "repeats": repeats, "requests": len(reqs),
                                 "max_new_tokens": max_new_tokens, "prompts": prompts,
                                 "rewordings": list(trace_lib.REWORDINGS[:repeats])}}
  for name in names:
    o = out[name]
    tps = np.array([len(t) / s for t, s in zip(o["tokens"], o["seconds"])])
    same = sum(t == p for t, p in zip(o["tokens"], out["plain"]["tokens"]))
    for rnd in ["all"] + [str(r) for r in sorted(set(rounds))]:
      sel = [i for i, r in enumerate(rounds) if rnd == "all" or str(r) == rnd]
      toks = sum(len(o["tokens"][i]) for i in sel)
      secs = sum(o["seconds"][i] for i in sel)
      ptoks = sum(len(out["plain"]["tokens"][i]) for i in sel)
      psecs = sum(out["plain"]["seconds"][i] for i in sel)
      ratio = tps[sel] / plain_tps[sel]
      rows.append({"method": name, "round": rnd, "requests": len(sel), "tokens": toks,
                   "tokens_per_s": round(toks / secs, 2), "speedup": round((toks / secs) / (ptoks / psecs), 3),
                   "speedup_mean_of_requests": round(float(np.mean(ratio)), 3),
                   "tokens_per_step": round(toks / max(1, sum(o["steps"][i] for i in sel)), 3),
                   "identical": f"{sum(o['tokens'][i] == out['plain']['tokens'][i] for i in sel)}/{len(sel)}"})
    summary[name] = {"speedup": next(r["speedup"] for r in rows if r["method"] == name and r["round"] == "all"),
                     "identical": f"{same}/{len(reqs)}"}
  sname, nname = f"suffix k{k}", f"ngram k{ngram_k}"
  summary["suffix_over_ngram"] = round(summary[sname]["speedup"] / summary[nname]["speedup"], 3)
  summary["index"] = batchers[sname].index_stats()
  paired_line = ", ".join(f"{n} {summary[n]['speedup']:.2f}x" for n in names[1:])
  log(f"[suffix_trace] paired: {paired_line}; "
      f"suffix / ngram {summary['suffix_over_ngram']:.2f}")
  del batchers

  if concurrent:
    conc = {}
    for name, b in make(slots).items():
      b.warmup(longest)
      rs = [bt.Request(list(e), r["max_tokens"], rid=i, arrival=0.0) for i, (e, r) in enumerate(zip(encoded, reqs))]
      rep = b.run(rs)
      same = sum(r.tokens == p for r, p in zip(rs, out["plain"]["tokens"]))
      conc[name] = {"tokens_per_s": round(rep["tokens_per_s"], 2), "wall_s": round(rep["wall_s"], 2),
                    "itl_p50_ms": None if rep["itl_s"]["p50"] is None else round(rep["itl_s"]["p50"] * 1e3, 2),
                    "itl_p99_ms": None if rep["itl_s"]["p99"] is None else round(rep["itl_s"]["p99"] * 1e3, 2),
                    "identical": f"{same}/{len(reqs)}", **({"index": rep["index"]} if "index" in rep else {})}
      log(f"[suffix_trace] {slots} slots, {name}: {rep['tokens_per_s']:.1f} tok/s")
    base = conc["plain"]["tokens_per_s"]
    for c in conc.values():
      c["speedup"] = round(c["tokens_per_s"] / base, 3)
    summary["concurrent"] = {"slots": slots, **conc}
  return {
      "title": f"suffix decoding on a repeated-task trace: {model}, {tasks} tasks x {repeats} rounds, greedy, "
               f"{max_new_tokens} new tokens",
      "rows": rows,
      "summary": summary,
      "plots": [{"file": "speedup_by_round.png", "x": "round", "y": "speedup", "group": "method", "kind": "bar",
                 "title": "speedup over plain decoding by round of the repeated trace (paired per request)"}],
  }
