"""The ``run``, ``train``, ``merge-data``, ``eval-draft`` and ``eval-code`` commands: experiments from gin files,
drafter training and evaluation, pass@1 of code."""
from __future__ import annotations

import json
from pathlib import Path

from specjax.cli import common, flags


def register(sub) -> dict:
  """Add the run, train, merge-data, eval-draft, eval-code parsers; returns their commands."""
  r = sub.add_parser("run", help="run an experiment bound in a gin file")
  r.add_argument("config", nargs="+", help="one or more .gin files")
  r.add_argument("--gin-binding", action="append", default=[], help="e.g. 'quickstart.max_new_tokens = 32'")
  r.add_argument("--out", default=None, help="run directory (default runs/<config>-<time>)")
  common.add_process_flags(r)     # a config whose experiment binds a mesh, run on several processes
  r.add_argument("--json", action="store_true")

  tr = sub.add_parser("train", help="train a drafter with a gin config (data, training, export, evaluation)")
  tr.add_argument("config", nargs="+", help="one or more .gin files, e.g. configs/eagle_smollm2.gin")
  tr.add_argument("--gin-binding", action="append", default=[], help="e.g. 'train_eagle.steps = 200'")
  tr.add_argument("--run-dir", default=None, help="run directory (default runs/<config name>)")
  tr.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
  common.add_mesh_flags(tr)
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
  e.add_argument("--limit", type=flags.COUNT, default=None)
  e.add_argument("--per-category", type=flags.COUNT, default=None)
  e.add_argument("--max-new-tokens", type=flags.COUNT, default=128)
  e.add_argument("--max-len", type=flags.COUNT, default=None)
  e.add_argument("--k", type=flags.NONNEG, default=4)
  e.add_argument("--tree", default=None)
  e.add_argument("--temperature", type=flags.TEMPERATURE, default=1.0)
  e.add_argument("--seed", type=flags.NONNEG, default=0)
  e.add_argument("--no-speed", action="store_true", help="skip the greedy speed comparison (acceptance only)")
  e.add_argument("--json", action="store_true")

  ec = sub.add_parser("eval-code", help="pass@1 of code tasks (HumanEval records): each reply's test runs in "
                                        "its own subprocess with a timeout")
  ec.add_argument("--prompts", required=True, help="the HumanEval JSONL the tasks come from (by path)")
  ec.add_argument("--limit", type=flags.COUNT, default=None, help="use only the first N tasks")
  ec.add_argument("--completions", default=None,
                  help="replies to test: JSON Lines (`bench --outputs`: method, question_id, text) or a "
                       "`generate --json` result (method = the file's name); without it the model generates "
                       "them (greedy, --max-new-tokens)")
  ec.add_argument("--max-new-tokens", type=flags.COUNT, default=256)
  ec.add_argument("--timeout", type=flags.POSITIVE, default=10.0, help="seconds each test may run (default 10)")
  ec.add_argument("--batch-size", type=flags.COUNT, default=1)
  common.add_model_flags(ec)
  common.add_drafter_flags(ec)
  ec.add_argument("--json", action="store_true")
  return {"run": cmd_run, "train": cmd_train, "merge-data": cmd_merge_data, "eval-draft": cmd_eval_draft,
          "eval-code": cmd_eval_code}


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


def cmd_run(args) -> int:
  from specjax.cli import runner
  result, out_dir = runner.run_from_files(args.config, args.gin_binding, args.out, log=common.log)
  from specjax.eval.report import write_json_files
  write_json_files(result.get("files", {}), out_dir)
  if args.json:
    common.emit(result, True, None)
  else:
    from specjax.eval.report import print_table
    print_table(result["rows"], title=result.get("title", "results"))
    common.log(f"[specjax] results in {out_dir}")
  return 0


def cmd_train(args) -> int:
  from specjax.cli import runner
  summary = runner.train_from_files(args.config, args.gin_binding, args.run_dir, args.resume, args.mesh)

  def human(s):
    if "drafter" not in s:           # data_only: the data is made, nothing trained yet
      print(f"data: {s['data_dir']}  ({s['sequences']} sequences, {s['data_tokens']} tokens, {s['data_s']:.0f}s)")
      return
    print(f"drafter: {s['drafter']}  (train {s['train_s']:.0f}s, {s['steps']} steps, "
          f"{s['data_tokens']} tokens of data)")
    if "tvd_acceptance_by_position" in s:
      print("held-out 1 - TVD by position: " + " ".join(f"{a:.3f}" for a in s["tvd_acceptance_by_position"]))
  common.emit(summary, args.json, human)
  return 0


def cmd_merge_data(args) -> int:
  from specjax.training import data
  out = data.merge_stores(args.sources, args.out)
  meta = json.loads((out / data.FEATURES / "meta.json").read_text())
  res = {"data_dir": str(out), "sequences": meta["sequences"], "tokens": meta["tokens"],
         "merged_from": meta["merged_from"]}
  common.emit(res, args.json, lambda r: print(f"{r['data_dir']}: {r['sequences']} sequences, {r['tokens']} "
                                              f"tokens from {len(r['merged_from'])} data directories"))
  return 0


def cmd_eval_draft(args) -> int:
  from specjax.checkpoints import drafter_io
  from specjax.prompts import load_prompts
  from specjax.training import evaluate
  drafter_io.read_config(args.draft)
  prompts = load_prompts(args.prompts, args.category, args.limit, args.per_category)
  m = common.load_model(args)
  res = evaluate.eval_draft(m, args.draft, prompts, k=args.k, tree=args.tree, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, seed=args.seed, max_len=common.default_max_len(args),
                            speed=not args.no_speed, log=common.log)

  def human(r):
    f = lambda xs: " ".join(f"{x:.3f}" for x in xs)
    print(f"1 - TVD by position:          {f(r['tvd_acceptance_by_position'])}")
    print(f"measured (T={r['temperature']}) by position: {f(r['measured_acceptance_by_position'])}")
    print(f"1 - TVD at the iteration starts: {r['tvd_acceptance_at_iteration_starts']:.3f} "
          f"({r['iteration_starts_scored']} contexts)")
    if "speedup" in r:
      print(f"greedy: τ {r['mean_accepted_length']:.3f}, speedup {r['speedup']:.3f}")
  common.emit(res, args.json, human)
  return 0


def cmd_eval_code(args) -> int:
  from specjax.eval import codeeval
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
    ds = common.decode_spec(args)          # every check once, before loading
    m = common.load_model(args)
    outputs, _ = api.generate(m, tasks, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                              max_len=args.max_len, progress=True, spec_=ds, draft=common.load_draft(args, m, ds))
    label = args.drafter if ds.kind.speculates else "autoregressive"
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
  common.emit(res, args.json, human)
  return 0
