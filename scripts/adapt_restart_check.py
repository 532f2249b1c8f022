"""A killed `specjax serve --adapt` restarts from its last adapted checkpoint, checked end to end.

Starts the server in its own process with --adapt-dir, sends requests over HTTP, waits until the idle server
has taken adaptation steps and saved a checkpoint, kills it with SIGKILL, starts it again with the same
directory and checks that it restored the newest checkpoint on disk (its log line and /metrics).  Prints
one JSON line.  (The test suite checks the same restore in process: tests/training/test_online_adapt.py.)

  python scripts/adapt_restart_check.py --model smollm2-135m --draft runs/eagle_smollm2_fused/drafter
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--draft", required=True, help="a trained feature drafter's directory")
  ap.add_argument("--requests", type=int, default=6)
  ap.add_argument("--checkpoint-every", type=int, default=4)
  ap.add_argument("--timeout", type=float, default=600)
  args = ap.parse_args(argv)
  work = Path(tempfile.mkdtemp(prefix="adapt-restart-"))
  adapted, port = work / "adapted", _free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "specjax.cli", "serve", "--model", args.model, "--drafter", "eagle", "--draft",
         args.draft, "--k", "3", "--slots", "2", "--max-len", "512", "--port", str(port), "--adapt",
         "--adapt-dir", str(adapted), "--adapt-checkpoint-every", str(args.checkpoint_every),
         "--adapt-seq-len", "128", "--adapt-batch", "1"]

  def start(log: Path):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    t0 = time.time()
    while time.time() - t0 < args.timeout:
      try:
        if httpx.get(f"{url}/health", timeout=1).status_code == 200:
          return proc
      except httpx.HTTPError:
        pass
      if proc.poll() is not None:
        raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
      time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up")

  def adapt_steps() -> int:
    m = re.search(r"^specjax_adapt_steps (\S+)", httpx.get(f"{url}/metrics").text, re.M)
    return int(float(m.group(1)))

  t0 = time.time()
  proc = start(work / "first.log")
  try:
    for i in range(args.requests):
      r = httpx.post(f"{url}/v1/completions", json={"prompt": f"Write a short note about topic {i}.",
                                                    "max_tokens": 64}, timeout=120)
      r.raise_for_status()
    while adapt_steps() < args.checkpoint_every and time.time() - t0 < args.timeout:
      time.sleep(0.5)
    before_kill = adapt_steps()
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
  saved = sorted(int(d.name) for d in adapted.iterdir() if d.name.isdigit()) if adapted.exists() else []
  proc = start(work / "second.log")
  try:
    restored = adapt_steps()
  finally:
    proc.terminate()
    proc.wait(60)
  log2 = (work / "second.log").read_text()
  ok = bool(saved) and restored == saved[-1] and f"restored the adapted head at step {saved[-1]}" in log2
  print(json.dumps({"ok": ok, "steps_before_kill": before_kill, "checkpoints_on_disk": saved,
                    "steps_after_restart": restored, "seconds": round(time.time() - t0, 1), "dir": str(work)}))
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
