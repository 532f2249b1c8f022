"""The ``specjax`` command line: a thin layer over ``specjax.api`` (gin is applied here, nowhere else).

Every measuring command takes ``--json`` and then prints exactly one JSON object on stdout; progress and logs
go to stderr.  Bad input prints one line ``specjax: error: ...`` and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _log(msg: str) -> None:
  sys.stderr.write(msg + "\n")     # one write per line: helper threads may log too
  sys.stderr.flush()


def _emit(obj: Any, as_json: bool, human) -> None:
  from specjax import distributed
  if not distributed.is_main():     # a multi-process run: process 0 reports for all
    return
  if as_json:
    sys.stdout.write(json.dumps(obj, default=_json_default) + "\n")
  else:
    human(obj)


def _json_default(o):
  import numpy as np
  if isinstance(o, (np.integer,)):
    return int(o)
  if isinstance(o, (np.floating,)):
    return float(o)
  if isinstance(o, np.ndarray):
    return o.tolist()
  return str(o)


def _add_model(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="smollm2-135m",
                 help="registry name, a .gguf file, or a Hugging Face safetensors directory")
  p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                 help="weights, KV buffers and activations (logits and softmax statistics stay fp32); auto: "
                      "bfloat16 on GPU and TPU, float32 on the CPU")
  p.add_argument("--max-len", type=int, default=None,
                 help="KV cache positions per sequence (default: generate and bench size them to the longest "
                      "prompt + --max-new-tokens + speculative headroom, rounded up to a power of two ≥ 256; "
                      "other commands 2048)")
  p.add_argument("--no-compile-cache", action="store_true",
                 help="do not read or write the persistent compilation cache (also SPECJAX_COMPILE_CACHE=0)")


def _add_mesh(p: argparse.ArgumentParser) -> None:
  from specjax import distributed
  p.add_argument("--mesh", help="DATAxMODEL devices, e.g. 2x4: shard the model over a device mesh of all "
                                "processes' devices (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                                "makes N devices); docs/MULTI_DEVICE.md")
  distributed.add_flags(p)


def _add_drafter(p: argparse.ArgumentParser, trees: bool = True, default: str = "none",
                 many_trees: bool = False) -> None:
  p.add_argument("--drafter", default=default, help="none | ngram | layerskip | model | hybrid | eagle "
                 "(hybrid: prompt lookup where the last --ngram tokens occurred before, the draft model elsewhere)")
  p.add_argument("--draft", default=None, help="--drafter model or hybrid: a draft model (same tokenizer as --model); "
                 "--drafter eagle: a trained drafter's directory (`specjax models` lists them)")
  if trees:
    p.add_argument("--k", type=int, default=4, help="tokens drafted per speculative step (a chain)")
    p.add_argument("--tree", default=None, action="append" if many_trees else "store",
                   help="token tree of N draft nodes instead of the chain of --k: chain:K, branch:W1,W2,..., "
                        "paths:FILE, sequoia:N[:D] (needs --acceptance) or dynamic:N[:TOPK[:D]]"
                        + ("; repeat it to compare several trees in the same run" if many_trees else ""))
    p.add_argument("--acceptance", default=None,
                   help="acceptance vector file (from `specjax acceptance-vector`) for --tree sequoia:N")
  p.add_argument("--ngram", type=int, default=3, help="longest n-gram matched by --drafter ngram; "
                 "the match --drafter hybrid needs before it drafts by lookup")
  p.add_argument("--ngram-caps", default="1,3",
                 help="--drafter ngram: most tokens drafted after a match of only 1, 2, ... tokens (longer "
                      "matches draft --k); 'none' drafts --k after any match (default 1,3)")
  p.add_argument("--draft-layers", default=None,
                 help="--drafter layerskip: a count L (the first L layers) or indices like 0,1,2,5")


def _add_serving(p: argparse.ArgumentParser) -> None:
  from specjax.serving.policies import POLICIES
  p.add_argument("--k", type=int, default=4, help="k for --policy fixed and off-above")
  p.add_argument("--policy", default="fixed", choices=POLICIES,
                 help="fixed k; off-above (k up to --max-batch live sequences, else 0); adaptive (smoothed "
                      "acceptance moves k); goodput (the cost model's best k, per sequence)")
  p.add_argument("--buckets", default="0,1,2,4,8", help="compiled k values for adaptive and goodput")
  p.add_argument("--max-batch", type=int, default=4, help="--policy off-above: speculate up to this many")
  p.add_argument("--slots", type=int, default=8, help="sequences decoded at once (fixed KV buffers)")
  p.add_argument("--device", default=None, help="cost model for --policy goodput: a published spec or a "
                                               "calibration JSON (default: this machine, calibrated)")
  p.add_argument("--seed", type=int, default=0)


def _buckets(text: str) -> tuple[int, ...]:
  from specjax.errors import SpecjaxError
  try:
    vals = tuple(sorted({int(x) for x in str(text).split(",") if x.strip()}))
  except ValueError:
    raise SpecjaxError(f"--buckets must be comma-separated k values like 0,1,2,4,8, got {text!r}") from None
  if not vals or min(vals) < 0:
    raise SpecjaxError(f"--buckets must be k values >= 0, got {text!r}")
  return vals


def _serving_engine(args, m, max_len: int, **kwargs):
  from specjax import calibrate
  from specjax.serving import factory
  draft = _load_draft(args)
  if getattr(args, "mesh", None):
    from specjax import api
    m = api.on_mesh(m, args.mesh)
    if draft is not None and not isinstance(draft, str):
      draft = api.on_mesh(draft, m.mesh)
  spec = calibrate.load_or_calibrate(args.device, log=_log) if args.policy == "goodput" else None
  return factory.make_batcher(m, drafter=args.drafter, policy=args.policy, k=args.k, buckets=_buckets(args.buckets),
                              slots=args.slots, max_len=max_len, max_batch=args.max_batch, spec=spec,
                              draft=draft, draft_layers=args.draft_layers, seed=args.seed, **kwargs,
                              **({"ngram": args.ngram, "ngram_caps": _ngram_caps(args.ngram_caps)}
                                 if args.drafter == "ngram" else {}))


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="specjax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)

  g = sub.add_parser("generate", help="generate replies (chat template applied) to prompts")
  _add_model(g)
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="one user message")
  src.add_argument("--prompts", help="a Spec-Bench .jsonl file (first turn) or a text file, one per line; "
                                     "'specjax-prompts' for the built-in set")
  g.add_argument("--category", action="append", help="keep only this prompt category (repeatable)")
  g.add_argument("--limit", type=int, help="use only the first N prompts")
  g.add_argument("--max-new-tokens", type=int, default=128)
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  g.add_argument("--top-k", type=int, default=0, help="0 = off")
  g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--batch-size", type=int, default=1)
  _add_mesh(g)
  _add_drafter(g)
  g.add_argument("--json", action="store_true")

  s = sub.add_parser("score", help="per-token log-probabilities and perplexity of a raw text")
  _add_model(s)
  s.add_argument("--text", required=True)
  s.add_argument("--json", action="store_true")

  t = sub.add_parser("tokenize", help="token ids of a raw text")
  _add_model(t)
  t.add_argument("--text", required=True)
  t.add_argument("--json", action="store_true")

  b = sub.add_parser("bench", help="decode speed next to the machine's memory roofline, in one run")
  _add_model(b)
  b.add_argument("--batch-size", type=int, default=1)
  b.add_argument("--max-new-tokens", type=int, default=128)
  b.add_argument("--prompts", default="specjax-prompts")
  b.add_argument("--category", action="append", help="keep only this prompt category (repeatable; "
                                                      "'mt_bench' selects MT-bench's eight categories)")
  b.add_argument("--per-category", type=int, help="use only the first N prompts of each category")
  b.add_argument("--limit", type=int, help="use only the first N prompts")
  b.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
  b.add_argument("--repeats", type=int, default=1,
                 help="run the whole interleaved prompt set this many times (speedup median, IQR, spread)")
  b.add_argument("--schedule", choices=["paired", "blocked"], default="paired",
                 help="paired (default): each prompt decoded plainly and speculatively back to back, the "
                      "order alternating; blocked: all plain decoding, then all speculative (for comparison)")
  b.add_argument("--outputs", default=None,
                 help="write every method's output for every prompt here (JSON Lines: method, question_id, "
                      "text, token_ids)")
  _add_drafter(b, many_trees=True)
  _add_mesh(b)
  b.add_argument("--json", action="store_true")

  a = sub.add_parser("acceptance-vector",
                     help="per-rank acceptance vector of a target/drafter pair (for --tree sequoia:N)")
  _add_model(a)
  a.add_argument("--prompts", default="specjax-prompts")
  a.add_argument("--category", action="append", help="keep only this prompt category (repeatable)")
  a.add_argument("--limit", type=int, help="use only the first N prompts")
  a.add_argument("--ranks", type=int, default=8, help="drafter choices measured per step (default 8)")
  a.add_argument("--depths", type=int, default=1,
                 help="also measure the vector at depths 2..D along the best-guess path (a depth-conditioned "
                      "table that --tree sequoia:N then uses; default 1: the position-independent vector)")
  a.add_argument("--max-new-tokens", type=int, default=64)
  a.add_argument("--batch-size", type=int, default=1)
  _add_drafter(a, trees=False, default="ngram")
  a.add_argument("--out", default=None, help="write the JSON here (read back by --acceptance FILE)")
  a.add_argument("--json", action="store_true")

  r = sub.add_parser("run", help="run an experiment bound in a gin file")
  r.add_argument("config", nargs="+", help="one or more .gin files")
  r.add_argument("--gin-binding", action="append", default=[], help="e.g. 'quickstart.max_new_tokens = 32'")
  r.add_argument("--out", default=None, help="run directory (default runs/<config>-<time>)")
  from specjax import distributed
  distributed.add_flags(r)     # a config whose experiment binds a mesh, run on several processes
  r.add_argument("--json", action="store_true")

  tr = sub.add_parser("train", help="train a drafter with a gin config (data, training, export, evaluation)")
  tr.add_argument("config", nargs="+", help="one or more .gin files, e.g. configs/eagle_smollm2.gin")
  tr.add_argument("--gin-binding", action="append", default=[], help="e.g. 'train_eagle.steps = 200'")
  tr.add_argument("--run-dir", default=None, help="run directory (default runs/<config name>)")
  tr.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
  _add_mesh(tr)
  tr.add_argument("--json", action="store_true")

  md = sub.add_parser("merge-data", help="one distillation data directory from several (responses and "
                                          "features end to end), to train on data made at different times")
  md.add_argument("out", help="the new data directory")
  md.add_argument("sources", nargs="+", help="data directories with complete feature stores")
  md.add_argument("--json", action="store_true")

  e = sub.add_parser("eval-draft", help="a trained drafter: 1 - TVD per position, measured acceptance under "
                                        "sampling, and greedy speedup against plain decoding")
  e.add_argument("--model", default="smollm2-135m")
  e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
  e.add_argument("--drafter", default="eagle", choices=["eagle"])
  e.add_argument("--draft", required=True, help="the drafter's directory")
  e.add_argument("--prompts", default="specjax-prompts")
  e.add_argument("--category", action="append", default=None)
  e.add_argument("--limit", type=int, default=None)
  e.add_argument("--per-category", type=int, default=None)
  e.add_argument("--max-new-tokens", type=int, default=128)
  e.add_argument("--max-len", type=int, default=None)
  e.add_argument("--k", type=int, default=4)
  e.add_argument("--tree", default=None)
  e.add_argument("--temperature", type=float, default=1.0)
  e.add_argument("--seed", type=int, default=0)
  e.add_argument("--no-speed", action="store_true", help="skip the greedy speed comparison (acceptance only)")
  e.add_argument("--json", action="store_true")

  ec = sub.add_parser("eval-code", help="pass@1 of code tasks (HumanEval records): each reply's test runs in "
                                        "its own subprocess with a timeout")
  ec.add_argument("--prompts", required=True, help="the HumanEval JSONL the tasks come from (by path)")
  ec.add_argument("--limit", type=int, default=None, help="use only the first N tasks")
  ec.add_argument("--completions", default=None,
                  help="replies to test: JSON Lines (`bench --outputs`: method, question_id, text) or a "
                       "`generate --json` result (method = the file's name); without it the model generates "
                       "them (greedy, --max-new-tokens)")
  ec.add_argument("--max-new-tokens", type=int, default=256)
  ec.add_argument("--timeout", type=float, default=10.0, help="seconds each test may run (default 10)")
  ec.add_argument("--batch-size", type=int, default=1)
  _add_model(ec)
  _add_drafter(ec)
  ec.add_argument("--json", action="store_true")

  cal = sub.add_parser("calibrate", help="measure this machine's roofline (bandwidth, matmul, step floor) for "
                                         "the cost model; saved in the cache and reused")
  cal.add_argument("--force", action="store_true", help="measure again even if a calibration exists")
  cal.add_argument("--out", default=None, help="write the calibration JSON here instead of the cache")
  cal.add_argument("--json", action="store_true")

  co = sub.add_parser("cost", help="the cost model's prediction: step time, bound, speculative speedup, the KV "
                                   "bill and the largest batch that fits a memory budget")
  co.add_argument("--model", default="smollm2-135m", help="registry name or a model path (only its config is read)")
  co.add_argument("--draft-model", default=None,
                  help="a draft model's config for its step cost, weights and KV (default: the registry's draft for "
                       "--model, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; 'none': no draft model)")
  co.add_argument("--device", default=None,
                  help="a published spec (h100-sxm, h200, a100-sxm-80gb, tpu-v5e) or a calibration JSON; "
                       "default: this machine, calibrated")
  co.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                  help="auto: bfloat16 on a published accelerator spec, float32 on this machine's calibration")
  co.add_argument("--batch-size", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
  co.add_argument("--k", type=int, default=4)
  co.add_argument("--context", type=int, default=256)
  co.add_argument("--acceptance", type=float, nargs="+", default=[0.6],
                  help="per-position acceptance α_1 α_2 ... (the last repeats)")
  co.add_argument("--max-len", type=int, default=2048, help="KV slots per sequence for the bill")
  co.add_argument("--memory-budget", type=float, default=None,
                  help="GiB per device for weights + KV (default: the device's)")
  co.add_argument("--mesh", default=None, help="DATAxMODEL: the target (and draft) sharded over that many "
                                                "devices: per-device share + all-reduce communication per step")
  co.add_argument("--json", action="store_true")

  ss = sub.add_parser("serve-sim", help="the continuous-batching engine in process on a request trace (Poisson "
                                        "at --rate, or --trace FILE): throughput, time to first token, "
                                        "inter-token latency percentiles and the k chosen over time")
  _add_model(ss)
  _add_drafter(ss, trees=False, default="ngram")
  _add_serving(ss)
  _add_mesh(ss)
  ss.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson; 0: all at once)")
  ss.add_argument("--requests", type=int, default=16)
  ss.add_argument("--trace", default=None, help="JSONL of {arrival, prompt, max_tokens} instead of --rate")
  ss.add_argument("--prompts", default="specjax-prompts", help="prompt file for the Poisson trace")
  ss.add_argument("--category", action="append", default=None)
  ss.add_argument("--max-new-tokens", type=int, default=64)
  ss.add_argument("--plot", default=None, help="write the k-over-time plot (PNG) here")
  ss.add_argument("--json", action="store_true")

  sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                    "/health, /metrics) over the continuous-batching engine")
  _add_model(sv)
  _add_drafter(sv, trees=False, default="none")
  _add_serving(sv)
  _add_mesh(sv)
  sv.add_argument("--host", default="127.0.0.1")
  sv.add_argument("--port", type=int, default=8000)
  sv.add_argument("--temperature", type=float, default=0.0, help="the sampling temperature of every request")
  sv.add_argument("--top-p", type=float, default=1.0)
  sv.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 429s")
  sv.add_argument("--default-max-tokens", type=int, default=256)

  lg = sub.add_parser("loadgen", help="drive a running server over HTTP with a Poisson trace: throughput, time "
                                       "to first token, inter-token latency, the k chosen over time")
  lg.add_argument("--url", default="http://127.0.0.1:8000")
  lg.add_argument("--rate", type=float, default=1.0, help="requests per second (0: all at once)")
  lg.add_argument("--requests", type=int, default=16)
  lg.add_argument("--prompts", default="specjax-prompts")
  lg.add_argument("--category", action="append", default=None)
  lg.add_argument("--max-tokens", type=int, default=64)
  lg.add_argument("--seed", type=int, default=0)
  lg.add_argument("--plot", default=None, help="write the k-over-time plot (PNG) here")
  lg.add_argument("--json", action="store_true")

  m = sub.add_parser("models", help="list known models and whether each is cached")
  m.add_argument("--json", action="store_true")

  c = sub.add_parser("cache", help="what the specjax cache holds (models, converted weights, kernels, "
                                   "compiled executables), and clearing it")
  c.add_argument("--clear", choices=["converted", "xla", "kernels", "all"],
                 help="delete that part (models/ holds downloads and is kept unless 'all')")
  c.add_argument("--json", action="store_true")
  return parser


# ----------------------------------------------------------------------------------------------------------
# Commands


def _load(args):
  from specjax import api, compile_cache
  if getattr(args, "no_compile_cache", False):
    compile_cache.enable(False)
  if getattr(args, "mesh", None):          # a mesh that cannot be made fails before the weights load
    from specjax import sharding
    sharding.make_mesh(args.mesh)
  dtype = api.default_dtype() if args.dtype == "auto" else args.dtype
  _log(f"[specjax] loading {args.model} ({dtype})")
  m = api.load(args.model, dtype=dtype)
  _log(f"[specjax] loaded in {m.load_s:.1f}s")
  return m


def _load_draft(args):
  from specjax import api
  from specjax.errors import SpecjaxError
  if args.drafter in api.MODEL_DRAFTERS and not args.draft:
    from specjax.checkpoints import registry
    args.draft = registry.default_draft(args.model)
    if not args.draft:
      raise SpecjaxError(f"--drafter {args.drafter} needs --draft MODEL (a small model sharing the target's tokenizer); "
                         f"'{args.model}' has no default draft in the registry (`specjax models` lists them)")
    _log(f"[specjax] --drafter {args.drafter}: the registry's draft for {args.model} is {args.draft}")
  if args.draft and args.drafter not in api.MODEL_DRAFTERS + ("eagle",):
    raise SpecjaxError(f"--draft is only used with --drafter model, hybrid or eagle (got --drafter {args.drafter})")
  if args.drafter == "eagle":
    if not args.draft:
      raise SpecjaxError("--drafter eagle needs --draft DIR (a trained drafter; `specjax models` lists them, "
                         "`specjax train configs/eagle_smollm2.gin` makes one)")
    from specjax.checkpoints import drafter_io
    drafter_io.read_config(args.draft)      # a bad directory fails before the target loads
    return args.draft
  if not args.draft:
    return None
  _log(f"[specjax] loading draft {args.draft}")
  d = api.load(args.draft, dtype=args.dtype)
  _log(f"[specjax] loaded the draft in {d.load_s:.1f}s")
  return d


def _ngram_caps(text: str) -> tuple[int, ...]:
  from specjax.errors import SpecjaxError
  if text.strip().lower() in ("", "none"):
    return ()
  try:
    return tuple(int(c) for c in text.split(","))
  except ValueError:
    raise SpecjaxError(f"--ngram-caps takes counts separated by commas, like 1,3 (or 'none'), got '{text}'")


def _drafter_kwargs(args) -> dict:
  return {"drafter": args.drafter, "k": args.k, "ngram": args.ngram, "draft_layers": args.draft_layers,
          "ngram_caps": _ngram_caps(args.ngram_caps), "tree": args.tree, "acceptance": args.acceptance}


def _check_drafter(args) -> None:
  """Everything about the drafter and the tree that can fail without a model: before any loading."""
  from specjax import api
  from specjax.errors import SpecjaxError
  if args.drafter not in api.DRAFTERS:
    raise SpecjaxError(f"unknown drafter '{args.drafter}': choose one of {', '.join(api.DRAFTERS)}")
  _ngram_caps(args.ngram_caps)
  if getattr(args, "tree", None) is not None or getattr(args, "acceptance", None) is not None:
    trees = args.tree if isinstance(args.tree, list) else [args.tree]
    for tree in trees:
      acc = None if len(trees) > 1 and str(tree).startswith("dynamic") else args.acceptance
      api.resolve_tree(tree, acc, drafter=args.drafter, max_len=args.max_len or api.AUTO_MAX_LEN_LIMIT)


def _max_len(args) -> int:
  from specjax.api import DEFAULT_MAX_LEN
  return args.max_len or DEFAULT_MAX_LEN


def _executables() -> dict:
  """This process's XLA executables: compiled here, or read back from the persistent compilation cache."""
  from specjax import compile_cache
  c = compile_cache.counts()
  return {"executables_compiled": c["compiled"], "executables_from_cache": c["cache_hits"],
          "compile_cache_dir": str(compile_cache.directory() or "") or None}


def cmd_generate(args) -> int:
  from specjax import api
  from specjax.prompts import Prompt, load_prompts
  _check_drafter(args)
  prompts = ([Prompt(0, "", args.prompt)] if args.prompt is not None
             else load_prompts(args.prompts, args.category, args.limit))
  m = _load(args)
  draft = _load_draft(args)
  outputs, stats = api.generate(m, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                batch_size=args.batch_size, max_len=args.max_len, progress=True,
                                **_drafter_kwargs(args), draft=draft, mesh=args.mesh)
  stats.update(_executables())
  result = {"outputs": [{"question_id": o.question_id, "text": o.text, "token_ids": o.token_ids}
                        for o in outputs], "stats": stats}

  def human(res):
    for o in outputs:
      print(f"--- [{o.question_id}] {o.prompt[:80]!r}\n{o.text}\n")
    _log(f"[specjax] {stats['new_tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s (load "
         f"{stats['load_s']:.1f}s, compile {stats['compile_s']:.1f}s, prefill {stats['prefill_s']:.2f}s, "
         f"decode {stats['decode_s']:.2f}s)")
  _emit(result, args.json, human)
  return 0


def cmd_score(args) -> int:
  from specjax import api
  m = _load(args)
  r = api.score(m, args.text)
  obj = {"tokens": r.tokens, "token_ids": r.token_ids, "logprobs": r.logprobs, "perplexity": r.perplexity}

  def human(o):
    for tok, lp in zip(r.tokens[1:], r.logprobs):
      print(f"{lp:9.3f}  {tok!r}")
    print(f"perplexity {r.perplexity:.3f} over {len(r.logprobs)} predicted tokens")
  _emit(obj, args.json, human)
  return 0


def cmd_tokenize(args) -> int:
  from specjax import api
  m = _load(args)
  ids = api.tokenize(m, args.text)
  _emit({"ids": ids}, args.json, lambda o: print(" ".join(map(str, ids))))
  return 0


def cmd_bench(args) -> int:
  from specjax import bench
  from specjax.prompts import load_prompts
  _check_drafter(args)
  prompts = load_prompts(args.prompts, args.category, args.limit, args.per_category)
  m = _load(args)
  res = bench.bench(m, prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                    max_len=args.max_len, ignore_eos=args.ignore_eos, draft=_load_draft(args),
                    repeats=args.repeats, paired=args.schedule == "paired", log=_log, mesh=args.mesh,
                    **_drafter_kwargs(args))
  res.update(_executables())
  generations = res.pop("generations", [])
  if args.outputs:
    Path(args.outputs).parent.mkdir(parents=True, exist_ok=True)
    with open(args.outputs, "w", encoding="utf-8") as f:
      for row in generations:
        f.write(json.dumps(row) + "\n")
    _log(f"[bench] each method's outputs written to {args.outputs} (`specjax eval-code --completions` runs "
         "code tasks' tests on them)")

  def human(r):
    from specjax.report import print_table
    print_table([{k: v for k, v in r.items() if not isinstance(v, (dict, list))}], title="specjax bench")
    if "speedup_median" in r:
      lo, hi = r["speedup_ci95"]
      print(f"speedup: median {r['speedup_median']:.3f} (95% CI {lo:.3f}-{hi:.3f}, IQR "
            f"{r['speedup_iqr'][0]:.3f}-{r['speedup_iqr'][1]:.3f}) over {r['prompts']} prompts x "
            f"{r['repeats']} repeat(s); ratio of totals {r['speedup']:.3f}")
    for t in r.get("methods", [r]):
      if "acceptance_by_depth" in t:
        print(f"tree {t['tree']} ({t['nodes']} nodes): speedup {t['speedup']:.3f}, median "
              f"{t.get('speedup_median', t['speedup']):.3f}, τ {t['mean_accepted_length']:.3f}, acceptance by "
              "depth " + " ".join(f"{a:.2f}" for a in t["acceptance_by_depth"]))
  _emit(res, args.json, human)
  return 0


def cmd_acceptance_vector(args) -> int:
  from specjax import api
  from specjax.errors import SpecjaxError
  from specjax.prompts import load_prompts
  _check_drafter(args)
  if args.drafter == "none":
    raise SpecjaxError("acceptance-vector measures a drafter: pass --drafter ngram, layerskip or model")
  if args.ranks < 1:
    raise SpecjaxError(f"--ranks must be >= 1, got {args.ranks}")
  if args.depths < 1:
    raise SpecjaxError(f"--depths must be >= 1, got {args.depths}")
  prompts = load_prompts(args.prompts, args.category, args.limit)
  m = _load(args)
  res = api.acceptance_vector(m, prompts, drafter=args.drafter, ranks=args.ranks, depths=args.depths,
                              max_new_tokens=args.max_new_tokens, max_len=_max_len(args),
                              batch_size=args.batch_size, ngram=args.ngram, draft_layers=args.draft_layers,
                              draft=_load_draft(args), ngram_caps=_ngram_caps(args.ngram_caps), progress=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(res, f, indent=2, default=_json_default)
    _log(f"[specjax] acceptance vector written to {args.out}")

  def human(r):
    print(f"acceptance vector of {r['drafter']} on {r['model']} over {r['iterations']} iterations "
          f"({r['prompts']} prompts):")
    for d, row in enumerate(r.get("acceptance_table", [r["acceptance_vector"]])):
      label = f"depth {d + 1}: " if "acceptance_table" in r else ""
      print(label + " ".join(f"{a:.3f}" for a in row))
  _emit(res, args.json, human)
  return 0


def cmd_run(args) -> int:
  from specjax import runner
  result, out_dir = runner.run_from_files(args.config, args.gin_binding, args.out, log=_log)
  from specjax.report import write_json_files
  write_json_files(result.get("files", {}), out_dir)
  if args.json:
    _emit(result, True, None)
  else:
    from specjax.report import print_table
    print_table(result["rows"], title=result.get("title", "results"))
    _log(f"[specjax] results in {out_dir}")
  return 0


def cmd_calibrate(args) -> int:
  from specjax import calibrate
  rec = calibrate.calibrate(path=args.out, force=args.force, log=_log)

  def human(r):
    sp, pr = r["spec"], r["probes"]
    print(f"{sp['name']}\n  stream bandwidth {sp['mem_bandwidth'] / 1e9:.1f} GB/s (raw DRAM probe best "
          f"{pr['raw_read_gb_per_s']['best']:.1f} GB/s)\n  matmul {sp['peak_flops']['float32'] / 1e9:.1f} "
          f"GFLOP/s fp32\n  floor {sp['floor_s'] * 1e6:.0f} µs + {sp['floor_per_layer_s'] * 1e6:.1f} µs per layer"
          f"\n  ridge {sp['peak_flops']['float32'] / sp['mem_bandwidth']:.1f} FLOP/byte")
  _emit(rec, args.json, human)
  return 0


def _model_config(name: str):
  from specjax import api, config
  if name in config.PRESETS:
    return config.PRESETS[name]
  return api.load(name).cfg      # a file or directory: its config (the weights load too)


def cmd_cost(args) -> int:
  from specjax import calibrate, costmodel
  from specjax.errors import SpecjaxError
  cfg = _model_config(args.model)
  if args.draft_model is None:
    from specjax.checkpoints import registry
    args.draft_model = registry.default_draft(args.model)
  dcfg = _model_config(args.draft_model) if args.draft_model and args.draft_model != "none" else None
  spec = calibrate.load_or_calibrate(args.device, log=_log)
  if args.dtype == "auto":
    args.dtype = "bfloat16" if args.device in costmodel.DEVICES else "float32"
  if args.k < 0:
    raise SpecjaxError(f"--k must be >= 0, got {args.k}")
  mesh = costmodel.MeshShape.of(args.mesh)
  budget = (args.memory_budget * 2**30 if args.memory_budget else spec.memory_bytes) * mesh.devices
  rows = []
  for B in args.batch_size:
    plain = costmodel.breakdown(spec, cfg, B, 1, args.context, args.dtype, mesh=mesh)
    ver = costmodel.breakdown(spec, cfg, B, args.k + 1, args.context, args.dtype, mesh=mesh)
    rows.append({"batch": B, "plain_ms": plain["predicted_s"] * 1e3, "plain_bound": plain["bound"],
                 "verify_ms": ver["predicted_s"] * 1e3, "verify_bound": ver["bound"],
                 **({"plain_comm_ms": plain["comm_s"] * 1e3, "verify_comm_ms": ver["comm_s"] * 1e3}
                    if mesh.model > 1 else {}),
                 "tau": costmodel.expected_accepted(args.acceptance, args.k),
                 "predicted_speedup": costmodel.predicted_speedup(spec, cfg, args.acceptance, args.k, B,
                                                                  args.context, args.dtype, dcfg, mesh=mesh)})
  plain_bill = costmodel.mesh_bill(costmodel.kv_bill(cfg, args.max_len, 0, None, args.dtype), mesh)
  spec_bill = costmodel.mesh_bill(costmodel.kv_bill(cfg, args.max_len, args.k, dcfg, args.dtype), mesh)
  out = {"device": spec.to_dict(), "model": cfg.name, "mesh": str(mesh), "k": args.k,
         "acceptance": args.acceptance, "context": args.context, "rows": rows,
         "crossover_batch": costmodel.crossover_batch(spec, cfg, args.acceptance, args.k, args.batch_size,
                                                      args.context, args.dtype, dcfg, mesh=mesh),
         "memory_budget_bytes": budget, "max_len": args.max_len,
         "max_batch_plain": costmodel.max_batch(budget, plain_bill),
         "max_batch_speculative": costmodel.max_batch(budget, spec_bill),
         "per_seq_bytes_plain": plain_bill.per_seq, "per_seq_bytes_speculative": spec_bill.per_seq}

  def human(o):
    from specjax.report import print_table
    print_table(o["rows"], title=f"{o['model']} on {spec.name}" + (f" × {o['mesh']} mesh" if o["mesh"] != "1x1"
                                                                    else "") +
                f": k={o['k']}, context {o['context']}, α={o['acceptance']}")
    print(f"speculation stops paying at batch {o['crossover_batch']}" if o["crossover_batch"] else
          "speculation pays at every batch size listed")
    print(f"memory budget {costmodel.fmt_bytes(budget)}, {o['max_len']} slots per sequence: max batch "
          f"{o['max_batch_plain']} plain ({costmodel.fmt_bytes(plain_bill.per_seq)}/seq), "
          f"{o['max_batch_speculative']} speculative ({costmodel.fmt_bytes(spec_bill.per_seq)}/seq)")
  _emit(out, args.json, human)
  return 0


def cmd_serve_sim(args) -> int:
  from specjax import costmodel
  from specjax.prompts import load_prompts
  from specjax.serving import batcher as bt, trace as trace_lib
  _check_drafter(args)
  if args.trace:
    reqs = trace_lib.load(args.trace, args.max_new_tokens)
  else:
    prompts = [p.text for p in load_prompts(args.prompts, args.category)]
    reqs = trace_lib.poisson(prompts, args.rate, args.requests, args.seed, args.max_new_tokens)
  m = _load(args)
  encoded = [m.tokenizer.encode_chat(r["prompt"]) for r in reqs]
  longest = max(len(e) for e in encoded)
  max_len = args.max_len or costmodel.buffer_length(longest, max(r["max_tokens"] for r in reqs),
                                                    max(_buckets(args.buckets) + (args.k,)))
  eng = _serving_engine(args, m, max_len)
  _log(f"[serve-sim] {args.slots} slots × {max_len} KV slots, policy {eng.policy.name}, buckets {eng.buckets}: "
       "compiling…")
  _log(f"[serve-sim] warm-up {eng.warmup(longest):.1f}s; replaying {len(reqs)} requests")
  requests = [bt.Request(e, r["max_tokens"], rid=i, arrival=r["arrival"]) for i, (e, r) in enumerate(zip(encoded, reqs))]
  rep = eng.run(requests, log=_log)
  rep.update({"policy": eng.policy.name, "drafter": args.drafter, "slots": args.slots, "max_len": max_len,
              "rate": args.rate if not args.trace else None, "buckets": list(eng.buckets)})
  if args.plot:
    from specjax.serving import plots
    plots.k_over_time(rep, args.plot)

  def human(r):
    print(f"{r['served']}/{r['requests']} served ({r['refused']} refused) in {r['wall_s']:.1f}s: "
          f"{r['tokens_per_s']:.1f} tok/s, mean k {r['mean_k']:.2f}, mean live {r['mean_live']:.1f}")
    for name in ("ttft_s", "itl_s", "token_gap_s"):
      q = r[name]
      if q["p50"] is not None:
        print(f"  {name[:-2]:10s} p50 {q['p50'] * 1e3:8.1f} ms  p90 {q['p90'] * 1e3:8.1f} ms  "
              f"p99 {q['p99'] * 1e3:8.1f} ms")
  _emit(rep, args.json, human)
  return 0


def cmd_serve(args) -> int:
  from specjax import sampling
  from specjax.errors import SpecjaxError
  from specjax.serving import server
  _check_drafter(args)
  try:
    import uvicorn
  except ImportError as e:
    raise SpecjaxError("specjax serve needs uvicorn and fastapi: pip install 'specjax[serve]'") from e
  try:
    sp = sampling.SamplingParams(args.temperature, 0, args.top_p)
  except ValueError as e:
    raise SpecjaxError(str(e)) from e
  m = _load(args)
  max_len = args.max_len or 2048
  eng = _serving_engine(args, m, max_len, sp=sp, max_queue=args.max_queue)
  _log(f"[serve] {args.slots} slots × {max_len} KV slots, drafter {args.drafter}, policy {eng.policy.name}, "
       f"buckets {eng.buckets}: compiling…")
  _log(f"[serve] warm-up {eng.warmup(512):.1f}s")
  worker = server.EngineWorker(eng, max_queue=args.max_queue)
  worker.start()
  app = server.create_app(worker, m.tokenizer, m.source if hasattr(m, "source") else args.model, sp,
                          args.default_max_tokens)
  _log(f"[serve] listening on http://{args.host}:{args.port}")
  uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
  worker.stop()
  return 0


def cmd_loadgen(args) -> int:
  from specjax.prompts import load_prompts
  from specjax.serving import loadgen, trace as trace_lib
  prompts = [p.text for p in load_prompts(args.prompts, args.category)]
  tr = trace_lib.poisson(prompts, args.rate, args.requests, args.seed, args.max_tokens)
  rep = loadgen.run(args.url, tr, log=_log)
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
  _emit(rep, args.json, human)
  return 0


def cmd_models(args) -> int:
  from specjax.checkpoints import drafter_io, list_models
  rows = list_models()
  drafters = drafter_io.list_drafters()

  def human(rs):
    from specjax.report import print_table
    print_table(rs, title="models")
    if drafters:
      print_table(drafters, title="trained drafters")
  _emit({"models": rows, "drafters": drafters}, args.json, lambda o: human(rows))
  return 0


def cmd_train(args) -> int:
  from specjax import runner
  summary = runner.train_from_files(args.config, args.gin_binding, args.run_dir, args.resume, args.mesh)

  def human(s):
    print(f"drafter: {s['drafter']}  (train {s['train_s']:.0f}s, {s['steps']} steps, "
          f"{s['data_tokens']} tokens of data)")
    if "tvd_acceptance_by_position" in s:
      print("held-out 1 - TVD by position: " + " ".join(f"{a:.3f}" for a in s["tvd_acceptance_by_position"]))
  _emit(summary, args.json, human)
  return 0


def cmd_merge_data(args) -> int:
  from specjax.training import data
  out = data.merge_stores(args.sources, args.out)
  meta = json.loads((out / data.FEATURES / "meta.json").read_text())
  res = {"data_dir": str(out), "sequences": meta["sequences"], "tokens": meta["tokens"],
         "merged_from": meta["merged_from"]}
  _emit(res, args.json, lambda r: print(f"{r['data_dir']}: {r['sequences']} sequences, {r['tokens']} tokens "
                                        f"from {len(r['merged_from'])} data directories"))
  return 0


def _read_completions(path: str) -> list[tuple[str, str, str]]:
  from specjax.errors import SpecjaxError
  p = Path(path)
  if not p.is_file():
    raise SpecjaxError(f"completions file not found: {p} (write one with `specjax bench ... --outputs FILE`)")
  text = p.read_text(encoding="utf-8")
  try:                            # a `specjax generate --json` result: {"outputs": [...], "stats": ...}
    whole = json.loads(text)
  except ValueError:
    whole = None
  if isinstance(whole, dict) and isinstance(whole.get("outputs"), list):
    return [(p.stem, str(o["question_id"]), str(o["text"])) for o in whole["outputs"]]
  rows = []
  for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
      rows.append((str(obj.get("method", "model")), str(obj["question_id"]), str(obj["text"])))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise SpecjaxError(f"{p}:{n}: not a completion record: expected question_id and text "
                         f"({type(e).__name__}: {e})") from None
  return rows


def cmd_eval_code(args) -> int:
  from specjax import codeeval
  from specjax.prompts import load_prompts
  tasks = load_prompts(args.prompts, None, args.limit)
  if not all(t.task_field("test") for t in tasks):
    from specjax.errors import SpecjaxError
    raise SpecjaxError(f"{args.prompts}: eval-code needs HumanEval records (task_id, prompt, entry_point, test)")
  if args.completions:
    replies = _read_completions(args.completions)
    wanted = {str(t.question_id) for t in tasks}
    replies = [r for r in replies if r[1] in wanted] if args.limit else replies
  else:
    from specjax import api
    _check_drafter(args)
    m = _load(args)
    outputs, _ = api.generate(m, tasks, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                              max_len=args.max_len, progress=True, **_drafter_kwargs(args), draft=_load_draft(args))
    label = "autoregressive" if args.drafter == "none" else args.drafter
    replies = [(label, str(o.question_id), o.text) for o in outputs]
  res = codeeval.evaluate_all(tasks, replies, timeout_s=args.timeout)
  methods = res["methods"]
  first = next(iter(methods.values()))
  for row in methods.values():   # the same tasks passed as the first method (plain decoding in bench output)?
    row["same_outcomes_as_first"] = [o["passed"] for o in row["outcomes"]] == [o["passed"] for o in first["outcomes"]]

  def human(r):
    for name, row in r["methods"].items():
      print(f"{name:32s} pass@1 {row['pass_at_1']:.3f} ({row['passed']}/{row['total']})"
            + ("" if row["same_outcomes_as_first"] else "  (outcomes differ from the first method)"))
  _emit(res, args.json, human)
  return 0


def cmd_eval_draft(args) -> int:
  from specjax.checkpoints import drafter_io
  from specjax.prompts import load_prompts
  from specjax.training import evaluate
  drafter_io.read_config(args.draft)
  prompts = load_prompts(args.prompts, args.category, args.limit, args.per_category)
  m = _load(args)
  res = evaluate.eval_draft(m, args.draft, prompts, k=args.k, tree=args.tree, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, seed=args.seed, max_len=_max_len(args),
                            speed=not args.no_speed, log=_log)

  def human(r):
    f = lambda xs: " ".join(f"{x:.3f}" for x in xs)
    print(f"1 - TVD by position:          {f(r['tvd_acceptance_by_position'])}")
    print(f"measured (T={r['temperature']}) by position: {f(r['measured_acceptance_by_position'])}")
    print(f"1 - TVD at the iteration starts: {r['tvd_acceptance_at_iteration_starts']:.3f} "
          f"({r['iteration_starts_scored']} contexts)")
    if "speedup" in r:
      print(f"greedy: τ {r['mean_accepted_length']:.3f}, speedup {r['speedup']:.3f}")
  _emit(res, args.json, human)
  return 0


def cmd_cache(args) -> int:
  import shutil
  from specjax.checkpoints import cache_dir
  root = cache_dir()
  parts = ("models", "converted", "kernels", "xla")
  if args.clear:
    for part in parts if args.clear == "all" else (args.clear,):
      shutil.rmtree(root / part, ignore_errors=True)
    _log(f"[specjax] cleared {args.clear} in {root}")

  def size(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0

  def entries(path):   # what a part holds, less temporary files and the source-hash memo
    return len([p for p in path.iterdir() if not p.name.startswith(".") and p.name != "sources"]) \
        if path.is_dir() else 0

  rows = [{"part": part, "path": str(root / part), "bytes": size(root / part), "entries": entries(root / part)}
          for part in parts]

  def human(rs):
    from specjax.report import print_table
    print_table([{**r, "MB": round(r["bytes"] / 1e6, 1)} for r in rs], title=f"specjax cache: {root}")
  _emit({"cache_dir": str(root), "parts": rows}, args.json, lambda o: human(rows))
  return 0


COMMANDS = {"generate": cmd_generate, "score": cmd_score, "tokenize": cmd_tokenize, "bench": cmd_bench,
            "acceptance-vector": cmd_acceptance_vector, "run": cmd_run, "models": cmd_models,
            "train": cmd_train, "merge-data": cmd_merge_data, "eval-draft": cmd_eval_draft, "cache": cmd_cache,
            "eval-code": cmd_eval_code,
            "calibrate": cmd_calibrate, "cost": cmd_cost, "serve-sim": cmd_serve_sim,
            "serve": cmd_serve, "loadgen": cmd_loadgen}


def _error(line: str) -> None:
  """The one error line, in a single write (helper threads may log at the same moment)."""
  sys.stderr.write(line + "\n")
  sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  from specjax.errors import SpecjaxError
  try:
    if hasattr(args, "coordinator"):       # before anything touches a device
      from specjax import distributed
      distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed, log=_log)
    return COMMANDS[args.command](args)
  except SpecjaxError as e:
    # one line: gin appends "In call to configurable ..." to errors raised inside a bound function
    _error(f"specjax: error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
    return 2
  except KeyboardInterrupt:
    _error("specjax: interrupted")
    return 130
  except (OSError, MemoryError) as e:
    _error(f"specjax: error: {type(e).__name__}: {e}")
    return 2
  except Exception as e:  # noqa: BLE001 -- keep the one-line contract; SPECJAX_DEBUG=1 shows the traceback
    if os.environ.get("SPECJAX_DEBUG"):
      raise
    _error(f"specjax: error: unexpected {type(e).__name__}: {e} (set SPECJAX_DEBUG=1 for a traceback)")
    return 1


if __name__ == "__main__":
  sys.exit(main())
