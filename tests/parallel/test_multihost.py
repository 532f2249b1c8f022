"""Several processes as one program (specjax/parallel/distributed.py): two CPU processes of 2 devices each join through
jax.distributed (gloo collectives) and decode over a 2x2 mesh that spans both; process 0 reports the single
device's tokens, alone on stdout."""
import json
import os
import socket
import subprocess
import sys

import pytest

from specjax.parallel import distributed
from specjax.errors import SpecjaxError


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_decode_the_single_device_tokens(tmp_path):
  from tests.helpers import _single_device_tokens, varied_tiny_gguf
  path = varied_tiny_gguf(tmp_path / "tiny.gguf")
  prompts = tmp_path / "p.txt"
  prompts.write_text("a b c a b c a\nhello hello hello\nthe cat the cat\nx\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_CACHE": str(tmp_path / "cache")}
  args = [sys.executable, "-m", "specjax.cli", "generate", "--model", path, "--prompts", str(prompts),
          "--batch-size", "4", "--max-new-tokens", "12", "--drafter", "ngram", "--k", "3", "--json"]
  want = _single_device_tokens(path, prompts)
  assert len({tuple(w) for w in want}) == 4

  port = _free_port()
  env2 = {**env, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
  procs = [subprocess.Popen(args + ["--mesh", "2x2", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                    "--process-id", str(i)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env2)
           for i in (1, 0)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  (out1, _), (out0, err0) = outs
  assert "process 0 of 2: 2 local of 4 devices" in err0
  assert out1 == ""                                     # only process 0 reports
  got = json.loads(out0)                                # one JSON object: gloo's chatter went to stderr
  assert [o["token_ids"] for o in got["outputs"]] == want


def test_settings_come_from_flags_then_environment():
  assert distributed.settings(environ={}) is None                        # single process: nothing to do
  assert distributed.settings(auto=True, environ={}) == {}               # jax detects the cluster
  env = {"SPECJAX_COORDINATOR": "10.0.0.1:1234", "SPECJAX_NUM_PROCESSES": "4", "SPECJAX_PROCESS_ID": "3"}
  assert distributed.settings(environ=env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                               "process_id": 3}
  assert distributed.settings(process_id=1, environ=env)["process_id"] == 1   # a flag wins
  with pytest.raises(SpecjaxError, match="--process-id missing"):
    distributed.settings("h:1", 2, environ={})
  with pytest.raises(SpecjaxError, match="HOST:PORT"):
    distributed.settings("localhost", 2, 0, environ={})
  with pytest.raises(SpecjaxError, match="must be in 0..1"):
    distributed.settings("h:1", 2, 2, environ={})
  with pytest.raises(SpecjaxError, match="SPECJAX_NUM_PROCESSES"):
    distributed.settings(environ={**env, "SPECJAX_NUM_PROCESSES": "four"})
