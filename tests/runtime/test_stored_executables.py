"""specjax's own executable store (runtime/stored_executables.py): a second process reads the prefill and the
decode loop back without tracing them, gives the same tokens, and survives a damaged entry or one that jax's
own cache served."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import CFG, ROOT, random_hf_params, write_gguf

# A child process: generate on a tiny model with the persistent cache on, counting the traces (``_lower``).
CHILD = r"""
import json, sys
from specjax import api
from specjax.runtime import compiled
lowered = []
original = compiled._lower
def counting(m, engine, B, P, S, draft_params, which):
  lowered.extend(sorted(which))
  return original(m, engine, B, P, S, draft_params, which)
compiled._lower = counting
api.use_compile_cache(True)
m = api.load(sys.argv[1])
outs, _ = api.generate(m, ["a b c a b c a b", "hello hello"], max_new_tokens=10, batch_size=2, drafter="ngram",
                       k=3, chat=False)
print(json.dumps({"lowered": lowered, "tokens": [o.token_ids for o in outs]}))
"""


_RUNS = iter(range(1, 1000))


def _run(path: str, cache) -> dict:
  # Each process hashes strings with another seed: sets (a frozenset in the model config) iterate in another
  # order, which the key must not see.
  env = {**os.environ, "SPECJAX_CACHE": str(cache), "PYTHONHASHSEED": str(next(_RUNS))}
  proc = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, cwd=ROOT, env=env,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _stored(cache) -> list:
  return sorted(cache.glob("xla/*/specjax-aot/*.bin"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return str(write_gguf(tmp_path_factory.mktemp("aot") / "tiny.gguf", CFG, random_hf_params(CFG, seed=5)))


def test_a_second_process_traces_nothing_and_gives_the_same_tokens(tiny, tmp_path):
  cache = tmp_path / "cache"
  first = _run(tiny, cache)
  assert first["lowered"] == ["init", "loop"]
  assert len(_stored(cache)) == 2                      # both executables stored as they were compiled
  second = _run(tiny, cache)
  assert second["lowered"] == [] and second["tokens"] == first["tokens"]

  # A damaged entry is deleted and counts as a miss: that executable is traced again, and stored again.
  damaged = _stored(cache)[0]
  damaged.write_bytes(damaged.read_bytes()[:-100] + b"x" * 100)
  third = _run(tiny, cache)
  assert len(third["lowered"]) == 1 and third["tokens"] == first["tokens"]
  assert len(_stored(cache)) == 2

  # With only jax's own cache (keyed on the traced program), both are traced, read back from it, and stored
  # from the bytes jax read: the next process again traces nothing.
  for path in _stored(cache):
    path.unlink()
  fourth = _run(tiny, cache)
  assert fourth["lowered"] == ["init", "loop"] and fourth["tokens"] == first["tokens"]
  assert len(_stored(cache)) == 2
  fifth = _run(tiny, cache)
  assert fifth["lowered"] == [] and fifth["tokens"] == first["tokens"]


def test_the_key_changes_with_what_decides_the_trace(tmp_path, monkeypatch):
  import jax.numpy as jnp
  import numpy as np
  from specjax.runtime import compile_cache, stored_executables
  monkeypatch.setattr(compile_cache, "directory", lambda: tmp_path)      # as if the persistent cache were on
  a = np.zeros((2, 3), np.float32)
  base = stored_executables.key(("loop", 4, 256), (a,))
  assert base is not None and base == stored_executables.key(("loop", 4, 256), (np.ones((2, 3), np.float32),))
  assert base != stored_executables.key(("loop", 5, 256), (a,))                     # a static argument
  assert base != stored_executables.key(("loop", 4, 256), (np.zeros((2, 4), np.float32),))     # a shape
  assert base != stored_executables.key(("loop", 4, 256), (jnp.zeros((2, 3), jnp.bfloat16),))  # a dtype
  assert base != stored_executables.key(("loop", 4, 256), ({"w": a},))             # the tree's structure

  class NotOurs:            # a class whose source is not in the key: no key, so the caller traces
    pass
  assert stored_executables.key(("loop", NotOurs), (a,)) is None
  monkeypatch.setattr(compile_cache, "directory", lambda: None)          # the cache off: no key
  assert stored_executables.key(("loop", 4, 256), (a,)) is None
