"""The ``models`` and ``cache`` commands: which models are known, what the cache holds, and clearing it."""
from __future__ import annotations

from specjax.cli import common


def register(sub) -> dict:
  """Add the models, cache parsers; returns their commands."""
  m = sub.add_parser("models", help="list known models and whether each is cached; with --draft DIR, what a "
                                     "drafter directory is and what target it expects")
  m.add_argument("--draft", help="a drafter directory (any layout specjax reads): its layout, the --drafter kind "
                                 "that reads it, the target it expects")
  m.add_argument("--model", help="with --draft: check the drafter against this target's config (no weights read)")
  m.add_argument("--json", action="store_true")

  c = sub.add_parser("cache", help="what the specjax cache holds (models, converted weights, kernels, "
                                   "compiled executables), and clearing it")
  c.add_argument("--clear", choices=["converted", "xla", "kernels", "all"],
                 help="delete that part (models/ holds downloads and is kept unless 'all')")
  c.add_argument("--json", action="store_true")
  return {"models": cmd_models, "cache": cmd_cache}


def cmd_models(args) -> int:
  from specjax.checkpoints import drafter_io, list_models
  if args.draft:
    return _describe_draft(args)
  rows = list_models()
  drafters = drafter_io.list_drafters()

  def human(rs):
    from specjax.eval.report import print_table
    print_table(rs, title="models")
    if drafters:
      print_table(drafters, title="trained drafters")
  common.emit({"models": rows, "drafters": drafters}, args.json, lambda o: human(rows))
  return 0


def _describe_draft(args) -> int:
  from specjax.checkpoints import catalog, drafter_info
  info = drafter_info.describe(args.draft)
  if args.model:
    drafter_info.check(args.draft, catalog.load_config(args.model), args.model)
    info["fits"] = args.model
  common.emit(info, args.json, lambda o: print("\n".join(f"{k:>16}: {v}" for k, v in o.items())))
  return 0


def cmd_cache(args) -> int:
  import shutil
  from specjax.cache_location import cache_dir, kernel_dir
  root = cache_dir()
  parts = ("models", "converted", "kernels", "xla")
  where = {part: root / part for part in parts} | {"kernels": kernel_dir()}   # kernels may live elsewhere
  if args.clear:
    for part in parts if args.clear == "all" else (args.clear,):
      for path in {root / part, where[part]}:   # the measured kernel choices stay in the cache's kernels/
        shutil.rmtree(path, ignore_errors=True)
    common.log(f"[specjax] cleared {args.clear} in {root}")

  def size(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0

  def entries(path):   # what a part holds, less temporary files and the source-hash memo
    return len([p for p in path.iterdir() if not p.name.startswith(".") and p.name != "sources"]) \
        if path.is_dir() else 0

  rows = [{"part": part, "path": str(where[part]), "bytes": size(where[part]), "entries": entries(where[part])}
          for part in parts]

  def human(rs):
    from specjax.eval.report import print_table
    print_table([{**r, "MB": round(r["bytes"] / 1e6, 1)} for r in rs], title=f"specjax cache: {root}")
  common.emit({"cache_dir": str(root), "parts": rows}, args.json, lambda o: human(rows))
  return 0
