"""The ``serve-sim``, ``serve``, ``loadgen`` and ``trace`` commands: the continuous-batching engine in process,
over HTTP, a load generator for it, and the request traces both replay."""
from __future__ import annotations

from specjax.cli import common, flags


def register(sub) -> dict:
  """Add the serve-sim, serve, loadgen parsers; returns their commands."""
  ss = sub.add_parser("serve-sim", help="the continuous-batching engine in process on a request trace (Poisson "
                                        "at --rate, or --trace FILE): throughput, time to first token, "
                                        "inter-token latency percentiles and the k chosen over time")
  common.add_model_flags(ss)
  common.add_drafter_flags(ss, trees=False, default="ngram")
  common.add_serving_flags(ss)
  common.add_mesh_flags(ss)
  common.add_adapt_flags(ss)
  ss.add_argument("--rate", type=flags.RATE, default=1.0, help="requests per second (Poisson; 0: all at once)")
  ss.add_argument("--requests", type=flags.COUNT, default=16)
  ss.add_argument("--trace", default=None, help="JSONL of {arrival, prompt, max_tokens} instead of --rate")
  ss.add_argument("--prompts", default="specjax-prompts", help="prompt file for the Poisson trace")
  ss.add_argument("--category", action="append", default=None)
  ss.add_argument("--max-new-tokens", type=flags.COUNT, default=64)
  ss.add_argument("--plot", default=None, help="write the k-over-time plot (PNG) here")
  ss.add_argument("--json", action="store_true")

  sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                    "/health, /metrics) over the continuous-batching engine")
  common.add_model_flags(sv)
  common.add_drafter_flags(sv, trees=False, default="none")
  common.add_serving_flags(sv)
  common.add_mesh_flags(sv)
  common.add_adapt_flags(sv)
  sv.add_argument("--host", default="127.0.0.1")
  sv.add_argument("--port", type=flags.PORT, default=8000)
  sv.add_argument("--temperature", type=flags.TEMPERATURE, default=0.0, help="the sampling temperature of every request")
  sv.add_argument("--top-p", type=flags.PROBABILITY, default=1.0)
  sv.add_argument("--max-queue", type=flags.COUNT, default=256, help="requests waiting for a slot before 429s")
  sv.add_argument("--default-max-tokens", type=flags.COUNT, default=256)

  lg = sub.add_parser("loadgen", help="drive a running server over HTTP with a Poisson trace: throughput, time "
                                       "to first token, inter-token latency, the k chosen over time")
  lg.add_argument("--url", default="http://127.0.0.1:8000")
  lg.add_argument("--rate", type=flags.RATE, default=1.0, help="requests per second (0: all at once)")
  lg.add_argument("--requests", type=flags.COUNT, default=16)
  lg.add_argument("--prompts", default="specjax-prompts")
  lg.add_argument("--category", action="append", default=None)
  lg.add_argument("--max-tokens", type=flags.COUNT, default=64)
  lg.add_argument("--seed", type=flags.NONNEG, default=0)
  lg.add_argument("--trace", default=None, help="JSONL of {arrival, prompt, max_tokens} instead of --rate")
  lg.add_argument("--mixed-sampling", action="store_true",
                  help="send a mix of greedy and seeded sampled requests (temperature, top-p, top-k)")
  lg.add_argument("--plot", default=None, help="write the k-over-time plot (PNG) here")
  lg.add_argument("--json", action="store_true")

  tr = sub.add_parser("trace", help="write a request trace (JSONL) for serve-sim --trace and loadgen --trace: "
                                    "'repeated' (the same tasks asked again, reworded) or 'shifted' (the "
                                    "traffic moves from one prompt set to another)")
  tr.add_argument("kind", choices=("repeated", "shifted"))
  tr.add_argument("--prompts", default="specjax-prompts", help="prompt file (a HumanEval JSONL works)")
  tr.add_argument("--category", action="append", default=None, help="'repeated': the tasks' categories")
  tr.add_argument("--tasks", type=flags.COUNT, default=8, help="'repeated': distinct tasks")
  tr.add_argument("--repeats", type=flags.COUNT, default=3, help="'repeated': times each task is asked")
  tr.add_argument("--first", action="append", default=None, help="'shifted': categories before the shift")
  tr.add_argument("--then", action="append", default=None, help="'shifted': categories after it")
  tr.add_argument("--requests", type=flags.COUNT, default=32, help="'shifted': requests in all")
  tr.add_argument("--rate", type=flags.RATE, default=0.0, help="requests per second (0: all at once)")
  tr.add_argument("--max-tokens", type=flags.COUNT, default=128)
  tr.add_argument("--seed", type=flags.NONNEG, default=0)
  tr.add_argument("--out", required=True, help="the JSONL file to write")
  return {"serve-sim": cmd_serve_sim, "serve": cmd_serve, "loadgen": cmd_loadgen, "trace": cmd_trace}


def cmd_trace(args) -> int:
  from specjax.errors import SpecjaxError
  from specjax.prompts import load_prompts
  from specjax.serving import trace as trace_lib
  if args.kind == "repeated":
    prompts = [p.text for p in load_prompts(args.prompts, args.category)]
    items = trace_lib.repeated(prompts, args.tasks, args.repeats, args.rate, args.seed, args.max_tokens)
  else:
    if not args.first or not args.then:
      raise SpecjaxError("a shifted trace needs --first CATEGORY and --then CATEGORY (the traffic before and "
                         "after the shift)")
    items = trace_lib.shifted([p.text for p in load_prompts(args.prompts, args.first)],
                              [p.text for p in load_prompts(args.prompts, args.then)], args.requests, args.rate,
                              args.seed, args.max_tokens)
  trace_lib.save(items, args.out)
  common.log(f"[trace] {len(items)} requests ({args.kind}) over {items[-1]['arrival']:.1f}s → {args.out}")
  return 0


def cmd_serve_sim(args) -> int:
  from specjax.models import buffers
  from specjax.prompts import load_prompts
  from specjax.serving import batcher as bt, buckets as bk, latency, trace as trace_lib
  common.check_drafter(args)
  if args.trace:
    reqs = trace_lib.load(args.trace, args.max_new_tokens)
  else:
    prompts = [p.text for p in load_prompts(args.prompts, args.category)]
    reqs = trace_lib.poisson(prompts, args.rate, args.requests, args.seed, args.max_new_tokens)
  m = common.load_model(args)
  encoded = [m.tokenizer.encode_chat(r["prompt"]) for r in reqs]
  longest = max(len(e) for e in encoded)
  max_len = args.max_len or buffers.buffer_length(longest, max(r["max_tokens"] for r in reqs), common.serving_nodes(args))
  eng = common.serving_engine(args, m, max_len)
  requests = [bt.Request(e, r["max_tokens"], rid=i, arrival=r["arrival"],   # a trace's own speculation, checked
                         pin=None if r.get("speculation") is None else bk.pin_key(r["speculation"], eng.bucket_info))
              for i, (e, r) in enumerate(zip(encoded, reqs))]                # before anything compiles
  common.log(f"[serve-sim] {args.slots} slots × {max_len} KV slots, policy {eng.policy.name}, "
             f"buckets {list(eng.bucket_info)}: compiling…")
  common.log(f"[serve-sim] warm-up {eng.warmup(longest):.1f}s; replaying {len(reqs)} requests")
  rep = eng.run(requests, log=common.log)
  rep.update({"policy": eng.policy.name, "drafter": args.drafter, "slots": args.slots, "max_len": max_len,
              "rate": args.rate if not args.trace else None, "buckets": list(eng.bucket_info)})
  for field in ("round", "phase", "speculation"):    # a repeated or shifted trace, or pins: the requests split
    if any(field in r for r in reqs):
      rep[f"by_{field}"] = latency.split_report(requests, [r.get(field) for r in reqs])
  if eng.adapter is not None:
    eng.adapter.close()
  if args.plot:
    from specjax.serving import plots
    plots.k_over_time(rep, args.plot)

  def human(r):
    print(f"{r['served']}/{r['requests']} served ({r['refused']} refused) in {r['wall_s']:.1f}s: "
          f"{r['tokens_per_s']:.1f} tok/s, mean k {r['mean_k']:.2f}, mean live {r['mean_live']:.1f}")
    if "adapt" in r:
      a = r["adapt"]
      print(f"  adaptation: {a['steps']} steps ({a['train_s']:.1f}s), replay buffer {a['buffer_tokens']}/"
            f"{a['buffer_capacity']} positions from {a['requests_seen']} requests")
    for name in ("ttft_s", "latency_s", "itl_s", "token_gap_s"):
      q = r[name]
      if q["p50"] is not None:
        print(f"  {name[:-2]:10s} p50 {q['p50'] * 1e3:8.1f} ms  p90 {q['p90'] * 1e3:8.1f} ms  "
              f"p99 {q['p99'] * 1e3:8.1f} ms")
  common.emit(rep, args.json, human)
  return 0


def cmd_serve(args) -> int:
  from specjax.models import sampling
  from specjax.errors import SpecjaxError
  from specjax.serving import server
  common.check_drafter(args)
  try:
    import uvicorn
  except ImportError as e:
    raise SpecjaxError("specjax serve needs uvicorn and fastapi: pip install 'specjax[serve]'") from e
  try:
    sp = sampling.SamplingParams(args.temperature, 0, args.top_p)
  except ValueError as e:
    raise SpecjaxError(str(e)) from e
  m = common.load_model(args)
  max_len = args.max_len or 2048
  eng = common.serving_engine(args, m, max_len, sp=sp, max_queue=args.max_queue, per_request=True)
  common.log(f"[serve] {args.slots} slots × {max_len} KV slots, drafter {args.drafter}, "
             f"policy {eng.policy.name}, buckets {list(eng.bucket_info)}: compiling…")
  common.log(f"[serve] warm-up {eng.warmup(512):.1f}s")
  worker = server.EngineWorker(eng, max_queue=args.max_queue)
  worker.start()
  app = server.create_app(worker, m.tokenizer, m.source if hasattr(m, "source") else args.model, sp,
                          args.default_max_tokens)
  common.log(f"[serve] listening on http://{args.host}:{args.port}")
  uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
  worker.stop()
  worker.join(timeout=60)          # the adapted head's last checkpoint (--adapt-dir) is written on the way out
  return 0


def cmd_loadgen(args) -> int:
  from specjax.prompts import load_prompts
  from specjax.errors import SpecjaxError
  from specjax.serving import loadgen, trace as trace_lib
  from urllib.parse import urlparse
  url = urlparse(args.url)
  if url.scheme not in ("http", "https") or not url.netloc:
    raise SpecjaxError(f"--url must be a server's address like http://127.0.0.1:8000, got {args.url!r}")
  if args.trace:
    tr = trace_lib.load(args.trace, args.max_tokens)
  else:
    prompts = [p.text for p in load_prompts(args.prompts, args.category)]
    tr = trace_lib.poisson(prompts, args.rate, args.requests, args.seed, args.max_tokens)
  if args.mixed_sampling:
    tr = loadgen.mixed_sampling(tr, args.seed)
  rep = loadgen.run(args.url, tr, log=common.log)
  if args.plot:
    from specjax.serving import plots
    plots.k_over_time(rep, args.plot)

  def human(r):
    print(f"{r['served']}/{r['requests']} served ({r['failed']} failed) in {r['wall_s']:.1f}s: "
          f"{r['tokens_per_s']:.1f} tok/s")
    for name in ("ttft_s", "itl_s"):
      q = r[name]
      if q["p50"] is not None:
        print(f"  {name[:-2]:5s} p50 {q['p50'] * 1e3:8.1f} ms  p90 {q['p90'] * 1e3:8.1f} ms  p99 {q['p99'] * 1e3:8.1f} ms")
  common.emit(rep, args.json, human)
  return 0
