"""One `specjax bench` command at two commits, alternated in one run on one machine: did a change make decoding
faster or slower here?

  python scripts/ab_bench.py --base 5d7346c [--head HEAD] [--rounds 3] [--out ab.json] -- BENCH ARGS...

e.g. the check issue 13 asks for on an AVX-512 machine (its numbers must not get worse than before the ISA
work, whose last commit is 5d7346c):

  python scripts/ab_bench.py --base 5d7346c --rounds 3 -- --model smollm2-135m --batch-size 1 --limit 8 \
      --max-new-tokens 64

Each commit is checked out in a temporary git worktree and run as `python -m specjax bench ARGS --json` from
its own folder (its code, not the installed one), in the order base, head, head, base, base, ... so that drift
on a shared machine hits both alike.  A first, unrecorded run of each builds its kernels and fills the caches
(`--no-warm-up` skips it).  Prints each run's tokens/s and roofline fraction, then the head/base ratio of
tokens/s per round (the paired comparison) and its median; the roofline fraction divides by a read probe
that swings run to run here, so the paired tokens/s ratio is the number to quote.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path = ROOT) -> str:
  return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _last_json(text: str) -> dict:
  """The bench's JSON object: the last line of stdout that parses as one (older commits print other lines)."""
  for line in reversed(text.strip().splitlines()):
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        continue
  try:
    return json.loads(text)        # pretty-printed over several lines
  except json.JSONDecodeError as e:
    raise RuntimeError(f"no JSON result in the bench's output:\n{text[-2000:]}") from e


def run_bench(tree: Path, bench_args: list[str]) -> dict:
  env = dict(os.environ, PYTHONPATH=str(tree))
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "specjax", "bench", *bench_args, "--json"], cwd=tree, env=env,
                        capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"bench failed in {tree} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  result = _last_json(proc.stdout)
  result["_wall_s"] = time.perf_counter() - t0
  return result


def _machine() -> dict:
  sys.path.insert(0, str(ROOT))
  from specjax import machine
  return {"cpu": machine.cpu_name(), "cpu_flags": [f for f in machine.RELEVANT_FLAGS
                                                     if f in machine.cpu_info()["flags"]],
          "cores": len(os.sched_getaffinity(0))}


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" not in argv:
    print("usage: ab_bench.py --base COMMIT [--head COMMIT] [--rounds N] [--out FILE] -- BENCH ARGS...",
          file=sys.stderr)
    return 2
  split = argv.index("--")
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--base", required=True, help="the commit to compare against (e.g. before a change)")
  ap.add_argument("--head", default="HEAD", help="the commit under test (default HEAD; uncommitted edits are "
                  "not included: commit first)")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--no-warm-up", action="store_true")
  ap.add_argument("--out", default=None, help="write every run's JSON and the summary here")
  args = ap.parse_args(argv[:split])
  bench_args = argv[split + 1:]
  if "--json" in bench_args:
    bench_args.remove("--json")
  commits = {"base": _git("rev-parse", "--verify", f"{args.base}^{{commit}}"),
             "head": _git("rev-parse", "--verify", f"{args.head}^{{commit}}")}
  machine = _machine()
  print(f"[ab] {machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['cpu_flags'])}", file=sys.stderr)
  print(f"[ab] base {commits['base'][:10]}  head {commits['head'][:10]}  bench {' '.join(bench_args)}",
        file=sys.stderr)
  runs: list[dict] = []
  with tempfile.TemporaryDirectory(prefix="specjax-ab-") as tmp:
    trees = {}
    for side, commit in commits.items():
      trees[side] = Path(tmp) / side
      _git("worktree", "add", "--detach", str(trees[side]), commit)
    try:
      if not args.no_warm_up:
        for side in ("base", "head"):
          print(f"[ab] warm-up {side} (builds its kernels, fills the caches)", file=sys.stderr, flush=True)
          run_bench(trees[side], bench_args)
      for r in range(args.rounds):
        order = ("base", "head") if r % 2 == 0 else ("head", "base")
        for side in order:
          res = run_bench(trees[side], bench_args)
          row = {"round": r, "side": side, "tokens_per_s": res["ar_tokens_per_s"],
                 "roofline_fraction": res.get("roofline_fraction"),
                 "read_bandwidth_gbs": res.get("read_bandwidth_gbs"),
                 "kernel_path": (res.get("machine") or {}).get("kernel_path", "(not recorded)"),
                 "wall_s": res["_wall_s"], "result": res}
          runs.append(row)
          print(f"[ab] round {r} {side}: {row['tokens_per_s']:.2f} tok/s, roofline fraction "
                f"{row['roofline_fraction']:.3f}, probe {row['read_bandwidth_gbs']:.1f} GB/s, "
                f"{row['kernel_path']}", file=sys.stderr, flush=True)
    finally:
      for side in trees:
        subprocess.run(["git", "worktree", "remove", "--force", str(trees[side])], cwd=ROOT, capture_output=True)
  tps = {(row["round"], row["side"]): row["tokens_per_s"] for row in runs}
  ratios = [tps[(r, "head")] / tps[(r, "base")] for r in range(args.rounds)]
  summary = {
      "machine": machine, "commits": commits, "bench_args": bench_args, "rounds": args.rounds,
      "base_tokens_per_s": [tps[(r, "base")] for r in range(args.rounds)],
      "head_tokens_per_s": [tps[(r, "head")] for r in range(args.rounds)],
      "head_over_base_per_round": ratios, "head_over_base_median": statistics.median(ratios),
  }
  print(json.dumps(summary))
  if args.out:
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
