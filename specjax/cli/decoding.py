"""The ``generate``, ``score``, ``tokenize``, ``bench`` and ``acceptance-vector`` commands: decoding with a model
and a drafter."""
from __future__ import annotations

import json
from pathlib import Path

from specjax.cli import common, flags


def register(sub) -> dict:
  """Add the generate, score, tokenize, bench, acceptance-vector parsers; returns their commands."""
  g = sub.add_parser("generate", help="generate replies to prompts (through the chat template when the model "
                                      "has one)")
  common.add_model_flags(g)
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="one user message")
  src.add_argument("--prompts", help="a Spec-Bench .jsonl file (first turn) or a text file, one per line; "
                                     "'specjax-prompts' for the built-in set")
  g.add_argument("--category", action="append", help="keep only this prompt category (repeatable)")
  g.add_argument("--limit", type=flags.COUNT, help="use only the first N prompts")
  g.add_argument("--max-new-tokens", type=flags.COUNT, default=128)
  add_sampling_flags(g)
  g.add_argument("--batch-size", type=flags.COUNT, default=1)
  g.add_argument("--raw", action="store_true", help=RAW_HELP)
  common.add_mesh_flags(g)
  common.add_drafter_flags(g)
  g.add_argument("--json", action="store_true")

  s = sub.add_parser("score", help="per-token log-probabilities and perplexity of a raw text")
  common.add_model_flags(s)
  s.add_argument("--text", required=True)
  s.add_argument("--json", action="store_true")

  t = sub.add_parser("tokenize", help="token ids of a raw text")
  common.add_model_flags(t)
  t.add_argument("--text", required=True)
  t.add_argument("--json", action="store_true")

  b = sub.add_parser("bench", help="decode speed next to the machine's memory roofline, in one run")
  common.add_model_flags(b)
  b.add_argument("--batch-size", type=flags.COUNT, default=1)
  b.add_argument("--max-new-tokens", type=flags.COUNT, default=128)
  b.add_argument("--prompts", default="specjax-prompts")
  b.add_argument("--category", action="append", help="keep only this prompt category (repeatable; "
                                                      "'mt_bench' selects MT-bench's eight categories)")
  b.add_argument("--per-category", type=flags.COUNT, help="use only the first N prompts of each category")
  b.add_argument("--limit", type=flags.COUNT, help="use only the first N prompts")
  b.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
  b.add_argument("--raw", action="store_true", help=RAW_HELP)
  b.add_argument("--repeats", type=flags.COUNT, default=1,
                 help="run the whole interleaved prompt set this many times (speedup median, IQR, spread)")
  b.add_argument("--schedule", choices=["paired", "blocked"], default="paired",
                 help="paired (default): each prompt decoded plainly and speculatively back to back, the "
                      "order alternating; blocked: all plain decoding, then all speculative (for comparison)")
  b.add_argument("--outputs", default=None,
                 help="write every method's output for every prompt here (JSON Lines: method, question_id, "
                      "text, token_ids)")
  b.add_argument("--project", default=None, metavar="DEVICE",
                 help="also predict each speculative result's speedup on a published device spec (h100-sxm, "
                      "h200, a100-sxm-80gb, tpu-v5e) from its measured τ and acceptance, with the draft's cost "
                      "there, as one compiled program (xla) and as PyTorch eager launches (eager)")
  add_sampling_flags(b, seed_help="each prompt batch samples from a key made of it and the batch's tokens, the "
                                    "same for plain and speculative decoding", many_rules=True)
  b.add_argument("--synthetic-alpha", type=flags.FRACTION, default=None, metavar="A",
                 help="not lossless: keep each draft of a chain with probability A whatever the target says, to "
                      "measure the system's cost at a chosen acceptance (τ = A + A^2 + ... + A^k)")
  common.add_drafter_flags(b, many_trees=True)
  common.add_mesh_flags(b)
  b.add_argument("--json", action="store_true")

  a = sub.add_parser("acceptance-vector",
                     help="per-rank acceptance vector of a target/drafter pair (for --tree sequoia:N)")
  common.add_model_flags(a)
  a.add_argument("--prompts", default="specjax-prompts")
  a.add_argument("--category", action="append", help="keep only this prompt category (repeatable)")
  a.add_argument("--limit", type=flags.COUNT, help="use only the first N prompts")
  a.add_argument("--ranks", type=flags.COUNT, default=8, help="drafter choices measured per step (default 8)")
  a.add_argument("--depths", type=flags.COUNT, default=1,
                 help="also measure the vector at depths 2..D along the best-guess path (a depth-conditioned "
                      "table that --tree sequoia:N then uses; default 1: the position-independent vector)")
  a.add_argument("--max-new-tokens", type=flags.COUNT, default=64)
  a.add_argument("--batch-size", type=flags.COUNT, default=1)
  common.add_drafter_flags(a, trees=False, default="ngram")
  a.add_argument("--replay", action="store_true", help="by offline replay: plain decoding, then the drafter alone")
  a.add_argument("--out", default=None, help="write the JSON here (read back by --acceptance FILE)")
  a.add_argument("--json", action="store_true")
  return {"generate": cmd_generate, "score": cmd_score, "tokenize": cmd_tokenize, "bench": cmd_bench,
          "acceptance-vector": cmd_acceptance_vector}


RAW_HELP = ("prompts as plain text, not through the chat template (the default for a model without one: a base "
            "model such as gemma3-270m)")


def cmd_generate(args) -> int:
  from specjax import api
  ds = common.decode_spec(args)              # every check that needs no model, once
  prompts = ([api.Prompt(0, "", args.prompt)] if args.prompt is not None
             else api.load_prompts(args.prompts, args.category, args.limit))
  m = common.load_model(args)
  draft = common.load_draft(args, m, ds)
  outputs, stats = api.generate(m, prompts, spec_=ds, draft=draft, max_new_tokens=args.max_new_tokens,
                                seed=args.seed, batch_size=args.batch_size, max_len=args.max_len, progress=True,
                                mesh=args.mesh, chat=False if args.raw else None)
  stats.update(common.executables())
  result = {"outputs": [{"question_id": o.question_id, "text": o.text, "token_ids": o.token_ids}
                        for o in outputs], "stats": stats}

  def human(res):
    for o in outputs:
      print(f"--- [{o.question_id}] {o.prompt[:80]!r}\n{o.text}\n")
    common.log(f"[specjax] {stats['new_tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s (load "
               f"{stats['load_s']:.1f}s, compile {stats['compile_s']:.1f}s, prefill {stats['prefill_s']:.2f}s, "
               f"decode {stats['decode_s']:.2f}s)")
  common.emit(result, args.json, human)
  return 0


def cmd_score(args) -> int:
  from specjax import api
  m = common.load_model(args)
  r = api.score(m, args.text)
  obj = {"tokens": r.tokens, "token_ids": r.token_ids, "logprobs": r.logprobs, "perplexity": r.perplexity}

  def human(o):
    for tok, lp in zip(r.tokens[1:], r.logprobs):
      print(f"{lp:9.3f}  {tok!r}")
    print(f"perplexity {r.perplexity:.3f} over {len(r.logprobs)} predicted tokens")
  common.emit(obj, args.json, human)
  return 0


def cmd_tokenize(args) -> int:
  from specjax import api
  m = common.load_model(args)
  ids = api.tokenize(m, args.text)
  common.emit({"ids": ids}, args.json, lambda o: print(" ".join(map(str, ids))))
  return 0


def add_sampling_flags(g, seed_help: str | None = None, many_rules: bool = False) -> None:
  """--temperature, --top-k, --top-p, --verify and --seed (generate, bench; bench's --verify may name both
  rules, compared in one paired run)."""
  g.add_argument("--temperature", type=flags.TEMPERATURE, default=0.0, help="0 = greedy")
  g.add_argument("--top-k", type=flags.NONNEG, default=0, help="0 = off")
  g.add_argument("--top-p", type=flags.PROBABILITY, default=1.0, help="1.0 = off")
  rule_help = ("how sampled drafts are judged: token by token, or a chain as a block (Sun et al. 2024: lossless, "
               "accepts at least as much); greedy decoding is the same either way")
  if many_rules:
    g.add_argument("--verify", type=flags.verify_rules, default=["tokenwise"],
                   help=rule_help + "; 'tokenwise,block' compares both in the same paired run")
  else:
    g.add_argument("--verify", choices=flags.VERIFY, default="tokenwise", help=rule_help)
  g.add_argument("--seed", type=flags.NONNEG, default=0, help=seed_help)


def cmd_bench(args) -> int:
  from specjax.eval import bench
  from specjax.measure.devices import published_spec
  from specjax.prompts import load_prompts
  common.check_drafter(args)
  if args.project is not None:
    published_spec(args.project)              # an unknown spec is refused before the model loads
  prompts = load_prompts(args.prompts, args.category, args.limit, args.per_category)
  m = common.load_model(args)
  res = bench.bench(m, prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                    max_len=args.max_len, ignore_eos=args.ignore_eos, draft=common.load_draft(args, m),
                    repeats=args.repeats, paired=args.schedule == "paired", log=common.log, mesh=args.mesh,
                    chat=False if args.raw else None, project=args.project, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, verify=args.verify, seed=args.seed,
                    synthetic_alpha=args.synthetic_alpha,
                    **common.drafter_kwargs(args))
  res.update(common.executables())
  generations = res.pop("generations", [])
  if args.outputs:
    Path(args.outputs).parent.mkdir(parents=True, exist_ok=True)
    with open(args.outputs, "w", encoding="utf-8") as f:
      for row in generations:
        f.write(json.dumps(row) + "\n")
    common.log(f"[bench] each method's outputs written to {args.outputs} (`specjax eval-code --completions` "
               "runs code tasks' tests on them)")

  def human(r):
    from specjax.eval.report import print_table
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
      if "projected" in t:
        print(_projected_line(t))
  common.emit(res, args.json, human)
  return 0


def _projected_line(t: dict) -> str:
  """'model k=4 projected onto h100-sxm: 2.41x xla (draft 0.31 ms, best k 3: 2.50x), 1.62x eager (...); measured
  here 1.30x' (best k: a chain's, from its per-position acceptance)."""
  p = t["projected"]
  parts = [f"{p[r]['speedup']:.2f}x {r} (draft {p[r]['draft_ms']:.2f} ms"
           + (f", best k {p[r]['best_k']}: {p[r]['best_k_speedup']:.2f}x" if "best_k" in p[r] else "") + ")"
           for r in ("xla", "eager")]
  return f"{t['method']} projected onto {p['device']}: " + ", ".join(parts) + f"; measured here {t['speedup']:.2f}x"


def cmd_acceptance_vector(args) -> int:
  from specjax import api
  from specjax.errors import SpecjaxError
  from specjax.prompts import load_prompts
  common.check_drafter(args)
  if not common.drafters().get(args.drafter).speculates:
    raise SpecjaxError(f"acceptance-vector measures a drafter: pass {common.drafters().speculating_help()}")
  if args.ranks < 1:
    raise SpecjaxError(f"--ranks must be >= 1, got {args.ranks}")
  if args.depths < 1:
    raise SpecjaxError(f"--depths must be >= 1, got {args.depths}")
  prompts = load_prompts(args.prompts, args.category, args.limit)
  m = common.load_model(args)
  res = api.acceptance_vector(m, prompts, drafter=args.drafter, ranks=args.ranks, depths=args.depths,
                              max_new_tokens=args.max_new_tokens, max_len=common.default_max_len(args),
                              batch_size=args.batch_size, ngram=args.ngram, draft_layers=args.draft_layers,
                              draft=common.load_draft(args, m), ngram_caps=common.parse_ngram_caps(args.ngram_caps), progress=True,
                              replay=args.replay, **common.index_kwargs(args))
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(res, f, indent=2, default=common.json_default)
    common.log(f"[specjax] acceptance vector written to {args.out}")

  def human(r):
    print(f"acceptance vector of {r['drafter']} on {r['model']} over {r['iterations']} iterations "
          f"({r['prompts']} prompts):")
    for d, row in enumerate(r.get("acceptance_table", [r["acceptance_vector"]])):
      label = f"depth {d + 1}: " if "acceptance_table" in r else ""
      print(label + " ".join(f"{a:.3f}" for a in row))
  common.emit(res, args.json, human)
  return 0
