"""``specjax loadgen``: drive a running server over HTTP with a trace of streaming chat requests.

Each request is sent at its arrival time (seconds after the start) as a streaming ``/v1/chat/completions``;
the time of every server-sent chunk gives time to first token and the inter-token latency.  ``/metrics`` is
polled every half second for the k the server's policy chose.  An item's ``sampling`` (temperature, top_p,
top_k, seed) goes into its request's body: ``mixed_sampling`` gives a trace a mix of greedy and sampled
requests, each seeded; so does its ``speculation`` (the request's own bucket).
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np

from specjax.serving.latency import pct

# The mix ``--mixed-sampling`` cycles through: greedy, and sampled settings with each filter.
MIX = ({"temperature": 0.0}, {"temperature": 0.7}, {"temperature": 1.0, "top_p": 0.9},
       {"temperature": 0.8, "top_k": 20})


def mixed_sampling(trace: list[dict], seed: int = 0) -> list[dict]:
  """The trace with request i sampled by ``MIX[i % 4]`` and seeded (seed + i)."""
  return [{**item, "sampling": {**MIX[i % len(MIX)], "seed": seed + i}} for i, item in enumerate(trace)]


async def _one(client, url: str, item: dict, start: float, out: list) -> None:
  await asyncio.sleep(max(0.0, start + item["arrival"] - time.perf_counter()))
  sent = time.perf_counter()
  times, text, error, tokens, reason = [], [], None, 0, None
  body = {"messages": [{"role": "user", "content": item["prompt"]}], "max_tokens": item["max_tokens"],
          "stream": True, "stream_options": {"include_usage": True}, **item.get("sampling", {}),
          **({"speculation": item["speculation"]} if item.get("speculation") is not None else {})}
  try:
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
      if resp.status_code != 200:
        error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
      else:
        async for line in resp.aiter_lines():
          if not line.startswith("data: ") or line == "data: [DONE]":
            continue
          d = json.loads(line[6:])
          if "error" in d:
            error = d["error"].get("message")
            break
          if d.get("usage"):
            tokens = d["usage"]["completion_tokens"]
          if not d.get("choices"):
            continue
          reason = d["choices"][0].get("finish_reason") or reason
          delta = d["choices"][0].get("delta", {}).get("content")
          if delta:
            times.append(time.perf_counter())
            text.append(delta)
  except Exception as e:  # noqa: BLE001 -- a failed request is counted, not fatal
    error = f"{type(e).__name__}: {e}"
  if error is None and reason is None:
    error = "the stream ended without a finish_reason"
  out.append({"sent": sent, "times": times, "text": "".join(text), "error": error, "tokens": tokens,
              "finish_reason": reason})


async def _poll_k(client, url: str, start: float, stop: asyncio.Event, out: list) -> None:
  while not stop.is_set():
    try:
      r = await client.get(f"{url}/metrics")
      k = re.search(r"^specjax_k_chosen (\S+)", r.text, re.M)
      live = re.search(r"^specjax_running_slots (\S+)", r.text, re.M)
      if k and live:
        out.append([round(time.perf_counter() - start, 3), float(k.group(1)), float(live.group(1))])
    except Exception:  # noqa: BLE001
      pass
    try:
      await asyncio.wait_for(stop.wait(), 0.5)
    except asyncio.TimeoutError:
      pass


async def _run(url: str, trace: list[dict]) -> dict:
  import httpx
  out: list = []
  ks: list = []
  limits = httpx.Limits(max_connections=len(trace) + 4)
  async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
    start = time.perf_counter()
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_k(client, url, start, stop, ks))
    await asyncio.gather(*[_one(client, url, item, start, out) for item in trace])
    stop.set()
    await poller
    end = time.perf_counter()
  ok = [o for o in out if not o["error"] and (o["times"] or o["tokens"] == 0)]
  ttft = [o["times"][0] - o["sent"] for o in ok]
  itl = [(o["times"][-1] - o["times"][0]) / (len(o["times"]) - 1) for o in ok if len(o["times"]) > 1]
  chunks = sum(len(o["times"]) for o in ok)
  tokens = sum(o["tokens"] for o in ok)
  return {"requests": len(trace), "served": len(ok), "failed": len(out) - len(ok),
          "errors": sorted({o["error"] for o in out if o["error"]})[:5], "wall_s": end - start,
          "chunks": chunks, "tokens": tokens,
          "finish_reasons": {k: sum(o["finish_reason"] == k for o in ok) for k in sorted({o["finish_reason"] for o in ok})}, "tokens_per_s": tokens / max(end - start, 1e-9),
          "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
          "itl_s": {"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99)},
          "k_over_time": ks, "mean_k": float(np.mean([k for _, k, _ in ks])) if ks else 0.0,
          "note": "tokens from each stream's usage; inter-token latency = (last chunk − first chunk) ÷ (chunks − 1)"}


def run(url: str, trace: list[dict], log=None) -> dict:
  if log:
    log(f"[loadgen] {len(trace)} requests to {url} over {trace[-1]['arrival']:.1f}s")
  return asyncio.run(_run(url.rstrip("/"), trace))
