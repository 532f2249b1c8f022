"""Peak memory and time of converting a registry model, and the time of the load after it.

  python scripts/probes/measure_conversion.py qwen2.5-coder-1.5b [--dtype float32] [--json]

The model's file must be cached already (`specjax models`); it is linked into a fresh temporary cache, so the
conversion starts from nothing and the real cache is not touched. Each load runs in its own process (`python
-c`), and its peak resident set size is that process's ``ru_maxrss`` (resident memory, file pages mapped into
it included), read by the parent with ``resource.getrusage(RUSAGE_CHILDREN)`` after the child ends.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = ("import sys, time; t = time.perf_counter(); from specjax import api; "
         "m = api.load(sys.argv[1], dtype=sys.argv[2]); "
         "print(f'{time.perf_counter() - t:.3f} {m.load_s:.3f} {m.weight_bytes}')")


def _child(name: str, dtype: str, cache: str) -> dict:
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  t0 = time.perf_counter()
  out = subprocess.run([sys.executable, "-c", CHILD, name, dtype], env={**os.environ, "SPECJAX_CACHE": cache},
                       cwd=ROOT, capture_output=True, text=True, check=True)
  wall = time.perf_counter() - t0
  peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss   # the largest child so far
  in_process, load_s, weight_bytes = out.stdout.split()
  return {"process_s": wall, "import_and_load_s": float(in_process), "load_s": float(load_s),
          "weight_bytes": int(weight_bytes), "peak_rss_bytes": peak_kib * 1024,
          "peak_rss_is_this_process": peak_kib > before}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("model")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  sys.path.insert(0, str(ROOT))
  from specjax.checkpoints import catalog as registry
  src = registry.cached_path(args.model)
  if not src.is_file():
    raise SystemExit(f"{args.model} is not cached: run `specjax models` / fetch it first ({src})")
  with tempfile.TemporaryDirectory(prefix="specjax-conv-", dir=Path.home()) as cache:
    dest = Path(cache) / "models" / args.model / src.name
    dest.parent.mkdir(parents=True)
    os.symlink(src, dest)
    first = _child(args.model, args.dtype, cache)      # converts
    second = _child(args.model, args.dtype, cache)     # memory-maps the converted entry
  res = {"model": args.model, "dtype": args.dtype, "conversion": first, "second_load": second,
         "converted_bytes": first["weight_bytes"],
         "budget_bytes": first["weight_bytes"] + 2 * 2**30,
         "within_budget": first["peak_rss_bytes"] <= first["weight_bytes"] + 2 * 2**30}
  if args.json:
    print(json.dumps(res))
  else:
    gib = 2**30
    print(f"{args.model} ({args.dtype}): conversion {first['process_s']:.1f}s, peak RSS "
          f"{first['peak_rss_bytes'] / gib:.2f} GiB for {first['weight_bytes'] / gib:.2f} GiB of weights "
          f"(budget {res['budget_bytes'] / gib:.2f} GiB: {'ok' if res['within_budget'] else 'OVER'}); "
          f"second load {second['load_s']:.2f}s in-process, {second['process_s']:.2f}s for the whole process")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
