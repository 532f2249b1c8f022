"""Online adaptation on a shifted trace: a trained feature head served with and without adaptation.

The trace (``serving.trace.shifted``): ``requests`` arrivals at ``rate`` per second, the first half drawn from
the ``first`` categories, the rest from ``then`` (the traffic moves to another kind of request).  The same
trace is replayed in real time through two fresh batchers (``serving.factory``: the server's engine, the
fixed-k policy, ``slots`` slots) with the same trained head (``draft``): once as it is, once with ``--adapt``
(``training/online.py``: recorded features into a replay buffer, optax steps while the engine is idle, or
every ``every`` busy steps, the weights swapped in between steps).

Reported: acceptance (accepted ÷ offered drafts) in time windows and by phase, with the phase after the shift
split into thirds; and paired by request (each request is served in both runs with the same tokens, so
acceptance on − off over the same requests removes the request-to-request spread): adaptation should lift the
later thirds after the shift; greedy
tokens of the two runs compared request by request (the target's, whatever the head); request latency
(arrival to last token), time to first token and inter-token latency percentiles of both runs (on within 10%
of off is the goal); compilations during each
replay (after warm-up: none expected); the replay buffer's fill against its bound.
"""
from __future__ import annotations

import numpy as np

from specjax import api
from specjax.errors import SpecjaxError
from specjax.measure.compiles import count_compiles
from specjax.serving import batcher as bt, factory, plots, trace as trace_lib
from specjax.training import online
from experiments.common import encode_trace, pick_prompts

CHAT = ("writing", "roleplay", "humanities", "stem", "reasoning", "extraction", "qa", "summarization")


def _acceptance(points, a: float, b: float) -> float | None:
  """Accepted ÷ offered drafts over the steps in [a, b) of a run's ``accept_over_time``."""
  sel = [(o, x) for t, o, x in points if a <= t < b]
  offered = sum(o for o, _ in sel)
  return round(sum(x for _, x in sel) / offered, 4) if offered else None


def _request_acceptance(reqs, idx) -> float | None:
  """Accepted ÷ offered drafts over the requests ``idx`` of one run (None when none was offered)."""
  offered = sum(reqs[i].drafts_offered for i in idx)
  return sum(reqs[i].drafts_accepted for i in idx) / offered if offered else None


def online_adapt(model: str = "smollm2-135m", weights: str = "auto", draft: str | None = None,
                 prompts: str = "specjax-prompts", first=CHAT, then=("code", "coding"), then_generated: int = 0,
                 requests: int = 48,
                 rate: float = 0.4, max_new_tokens: int = 128, max_len: int = 1024, k: int = 4, slots: int = 2,
                 learning_rate: float = 3e-4, buffer_tokens: int = 16384, batch_size: int = 2, seq_len: int = 256,
                 unroll: int = 2, replay: float = 4.0, every: int = 0, accumulate: int = 1,
                 matmul_dtype: str = "float32", window_s: float = 10.0,
                 adapt_dir: str | None = None, seed: int = 0, log=print) -> dict:
  """``draft``: a trained feature drafter's directory (``specjax train configs/eagle_smollm2.gin``).
  ``then_generated`` > 0: after the shift, that many distinct code tasks made by the project
  (``training.code_prompts.code_requests``, seeded) instead of the ``then`` categories of ``prompts``.
  ``adapt_dir``: where the adapted head is checkpointed (None: not saved)."""
  if not draft:
    raise SpecjaxError("online_adapt needs a trained feature drafter: bind online_adapt.draft = 'RUN/drafter' "
                       "(`specjax train configs/eagle_smollm2.gin` makes one)")
  if then_generated:
    from specjax.training.code_prompts import code_requests
    second = [r["prompt"] for r in code_requests(then_generated, seed)]
    then = (f"{then_generated} generated code tasks",)
  else:
    second = [p.text for p in pick_prompts(prompts, list(then))]
  items = trace_lib.shifted([p.text for p in pick_prompts(prompts, list(first))], second, requests, rate, seed,
                            max_new_tokens)
  m = api.load(model, weights=weights)
  encoded, longest = encode_trace(m, items, max_new_tokens, k, max_len, "online_adapt")
  cfg = online.AdaptConfig(learning_rate=learning_rate, batch_size=batch_size, seq_len=seq_len, unroll=unroll,
                           buffer_tokens=buffer_tokens, min_tokens=seq_len, every=every, replay=replay,
                           accumulate=accumulate, matmul_dtype=matmul_dtype, seed=seed)
  shift = next(r["arrival"] for r in items if r["phase"] == 1)
  log(f"[online_adapt] {model}: {requests} requests at {rate}/s, {', '.join(first)} then {', '.join(then)} "
      f"(shift at {shift:.1f}s), {max_new_tokens} new tokens, k {k}, {slots} slots")
  runs, served = {}, {}
  for label, adapt in (("adaptation off", False), ("adaptation on", True)):
    factory_fn = None
    if adapt:
      factory_fn = lambda d, p: online.OnlineAdapter.for_engine(d, p, cfg, checkpoint_dir=adapt_dir,  # noqa: E731
                                                                log=log)
    b = factory.make_batcher(m, drafter="eagle", draft=draft, policy="fixed", k=k, slots=slots, max_len=max_len,
                             adapter_factory=factory_fn)
    warm = b.warmup(longest)
    reqs = [bt.Request(list(e), r["max_tokens"], rid=i, arrival=r["arrival"]) for i, (e, r) in
            enumerate(zip(encoded, items))]
    names: list = []
    with count_compiles(names) as compiles:
      rep = b.run(reqs, log=log)
    rep["warmup_s"], rep["compiles_after_warmup"], rep["compiled"] = warm, compiles(), sorted(set(names))[:8]
    if b.adapter is not None:
      b.adapter.close()
    runs[label], served[label] = rep, reqs
    log(f"[online_adapt] {label}: {rep['tokens_per_s']:.1f} tok/s, acceptance "
        f"{_acceptance(rep['accept_over_time'], 0, 1e9)}, {rep['compiles_after_warmup']} compiles after warm-up"
        + (f", {rep['adapt']['steps']} adaptation steps" if "adapt" in rep else ""))

  end = max(max(p[0] for p in rep["accept_over_time"]) for rep in runs.values()) + 1e-6
  thirds = np.linspace(shift, end, 4)
  rows, summary = [], {"trace": {"requests": requests, "rate": rate, "first": list(first), "then": list(then),
                                 "shift_s": round(shift, 2), "max_new_tokens": max_new_tokens, "prompts": prompts},
                       "adapt_settings": cfg.__dict__}
  for label, rep in runs.items():
    pts = rep["accept_over_time"]
    for t, a in zip(*plots.windowed_acceptance(pts, window_s)):
      rows.append({"run": label, "t_s": round(t, 1), "acceptance": round(a, 4), "phase": int(t >= shift)})
    s = {"before_shift": _acceptance(pts, 0, shift), "after_shift": _acceptance(pts, shift, end),
         "after_shift_thirds": [_acceptance(pts, a, b) for a, b in zip(thirds, thirds[1:])],
         "tokens_per_s": round(rep["tokens_per_s"], 2),
         "ttft_ms": {q: None if v is None else round(v * 1e3, 1) for q, v in rep["ttft_s"].items()},
         "itl_ms": {q: None if v is None else round(v * 1e3, 1) for q, v in rep["itl_s"].items()},
         "latency_ms": {q: None if v is None else round(v * 1e3, 1) for q, v in rep["latency_s"].items()},
         "compiles_after_warmup": rep["compiles_after_warmup"], "compiled": rep["compiled"]}
    if "adapt" in rep:
      s["adapt"] = {k_: v for k_, v in rep["adapt"].items() if k_ != "log"}
      s["adapt"]["bounded"] = rep["adapt"]["buffer_tokens"] <= rep["adapt"]["buffer_capacity"]
    summary[label] = s
  off, on = served["adaptation off"], served["adaptation on"]
  summary["identical"] = f"{sum(a.tokens == b.tokens for a, b in zip(off, on))}/{len(off)}"
  # Paired by request (the same request, the same tokens in both runs): acceptance with adaptation minus
  # without, over the requests of each phase and of each third of the phase after the shift (arrival order).
  phase = [r["phase"] for r in items]
  after = [i for i, p in enumerate(phase) if p == 1]
  groups = {"before_shift": [i for i, p in enumerate(phase) if p == 0], "after_shift": after,
            **{f"after_shift_third_{j + 1}": list(part) for j, part in enumerate(np.array_split(after, 3))}}

  paired = {g: (_request_acceptance(off, idx), _request_acceptance(on, idx), len(idx)) for g, idx in groups.items() if idx}
  summary["paired_by_request"] = {
      g: {"off": round(a, 4), "on": round(b, 4), "on_minus_off": round(b - a, 4), "requests": n}
      for g, (a, b, n) in paired.items() if a is not None}
  summary["requests"] = [{"i": i, "phase": phase[i], "arrival_s": round(items[i]["arrival"], 2),
                          "tokens": len(off[i].tokens),
                          "acceptance_off": round(_request_acceptance(off, [i]) or 0.0, 4),
                          "acceptance_on": round(_request_acceptance(on, [i]) or 0.0, 4)}
                         for i in range(len(items))]
  for q in ("p50", "p99"):
    for name in ("latency", "ttft", "itl"):
      a, b = runs["adaptation off"][f"{name}_s"][q], runs["adaptation on"][f"{name}_s"][q]
      summary[f"{name}_{q}_on_over_off"] = round(b / a, 3) if a and b else None
  pr = summary["paired_by_request"]
  log(f"[online_adapt] paired by request, on - off: before the shift {pr['before_shift']['on_minus_off']:+.3f}, "
      f"after it by thirds " + ", ".join(f"{pr[f'after_shift_third_{j}']['on_minus_off']:+.3f}" for j in (1, 2, 3)
                                         if f"after_shift_third_{j}" in pr)
      + f"; identical {summary['identical']}; "
      f"p99 on/off: latency {summary['latency_p99_on_over_off']}, time to first token "
      f"{summary['ttft_p99_on_over_off']}, inter-token {summary['itl_p99_on_over_off']}")
  return {"title": f"online adaptation of a trained head on a shifted trace: {model}, {requests} requests, "
                   f"{', '.join(first)} then {', '.join(then)}",
          "rows": rows, "summary": summary, "window_s": window_s,
          "series": {label: {"accept_over_time": rep["accept_over_time"],
                             "adapt": {"log": rep.get("adapt", {}).get("log", [])}} for label, rep in runs.items()}}


def plot(result: dict, out_dir) -> None:
  """Acceptance by time, both runs, the shift and the adaptation steps marked."""
  series = result.get("series")
  if not series:
    return
  reqs = result["summary"].get("requests", [])
  plots.acceptance_over_time(series, str(out_dir / "acceptance_over_time.png"), window_s=result.get("window_s", 10.0),
                             shift_s=result["summary"]["trace"]["shift_s"],
                             paired=[(r["arrival_s"], r["acceptance_on"] - r["acceptance_off"]) for r in reqs])
