"""Start-up: the converted-weight cache (and how it survives damage), prefill and decode loop compiled apart,
and JAX's persistent compilation cache shared between processes (with the native CPU kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax import api
from specjax.models import buffers
from specjax.runtime import compile_cache
from specjax.checkpoints import converted, gguf_loader, load_model
from tests.helpers.compile_counter import count_compiles
from tests.helpers import CFG, random_hf_params, write_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gguf_file(tmp_path):
  return write_gguf(tmp_path / "tiny.gguf", CFG, random_hf_params(CFG, seed=11))


def _entry(cache: Path) -> Path:
  entries = [p for p in (cache / "converted").iterdir() if p.is_dir() and p.name != "sources"
             and not p.name.startswith(".")]
  assert len(entries) == 1, entries
  return entries[0]


def _same_params(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_converted_cache_round_trip(tmp_path, gguf_file, monkeypatch, capfd):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  first = load_model(gguf_file)
  assert "converting tiny.gguf" in capfd.readouterr().err
  entry = _entry(tmp_path / "cache")
  second = load_model(gguf_file)
  assert capfd.readouterr().err == ""                     # read from the cache: nothing to report
  _same_params(first.params, second.params)
  assert first.cfg == second.cfg
  t1, t2 = first.tokenizer, second.tokenizer
  for text in ["hello world", "the world<|im_end|>", "naïve ☃ 123"]:
    assert t1.encode(text) == t2.encode(text)
    assert t1.encode_chat(text) == t2.encode_chat(text)
  assert t1.eos_token_ids == t2.eos_token_ids and t1.bos_token_id == t2.bos_token_id
  # The data section starts 64-byte aligned, so the CPU backend can alias the memory map instead of copying.
  n, _ = converted._header_length(entry / converted.PARAMS_FILE)
  assert (8 + n) % 64 == 0


def test_weight_cache_can_be_turned_off(tmp_path, gguf_file, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("SPECJAX_WEIGHT_CACHE", "0")
  load_model(gguf_file)
  assert not (tmp_path / "cache" / "converted").exists()


def _truncate(entry):
  f = entry / converted.PARAMS_FILE
  f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_a_byte(entry):
  f = entry / converted.PARAMS_FILE
  data = bytearray(f.read_bytes())
  data[-100] ^= 0x5A
  f.write_bytes(bytes(data))


def _drop_manifest(entry):
  (entry / converted.MODEL_FILE).unlink()


def _garble_manifest(entry):
  (entry / converted.MODEL_FILE).write_text('{"manifest": {"layout_version": 1, "par')


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte, _drop_manifest, _garble_manifest],
                         ids=["truncated", "flipped-byte", "no-model-json", "garbled-model-json"])
def test_damaged_entry_is_reported_and_rebuilt(tmp_path, gguf_file, monkeypatch, capfd, damage):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  good = load_model(gguf_file)
  good_params = jax.tree_util.tree_map(np.array, good.params)   # a copy: the load maps the file we damage
  capfd.readouterr()
  damage(_entry(tmp_path / "cache"))
  again = load_model(gguf_file)
  lines = [l for l in capfd.readouterr().err.splitlines() if "unusable" in l]
  assert len(lines) == 1 and "rebuilding" in lines[0], lines
  _same_params(good_params, again.params)
  load_model(gguf_file)                                   # rebuilt whole: the next load is silent
  assert capfd.readouterr().err == ""


def test_interrupted_conversion_leaves_no_entry(tmp_path, gguf_file, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))

  pieces = gguf_loader.GGUFSource.pieces

  def killed(self, dtype, **kwargs):   # killed part-way through writing the tensors
    for i, piece in enumerate(pieces(self, dtype, **kwargs)):
      if i == 5:
        raise KeyboardInterrupt
      yield piece

  monkeypatch.setattr(gguf_loader.GGUFSource, "pieces", killed)
  with pytest.raises(KeyboardInterrupt):
    load_model(gguf_file)
  left = [p.name for p in (tmp_path / "cache" / "converted").iterdir() if p.name != "sources"]
  assert left == []


def test_a_second_conversion_keeps_the_entry_another_process_is_reading(tmp_path, gguf_file, monkeypatch):
  """Two processes of one run convert the same model at once: the one that finishes second must not delete
  the entry the first has already memory-mapped (it did: the first then failed on a missing
  params.safetensors, tests/parallel/test_multihost.py)."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  first = load_model(gguf_file)
  entry = _entry(tmp_path / "cache")
  inode = (entry / converted.PARAMS_FILE).stat().st_ino
  src = gguf_loader.open_gguf(gguf_file)
  converted.save_entry_streaming(entry, src, np.float32, {"path": str(gguf_file)})   # the late finisher
  assert (entry / converted.PARAMS_FILE).stat().st_ino == inode        # theirs is kept, not replaced
  assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".")] == []   # its own copy is gone
  _same_params(first.params, load_model(gguf_file).params)


def test_new_prompt_length_compiles_only_a_prefill(tmp_path, gguf_file, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  compile_cache.enable(False)             # count real compiles, not reads from the persistent cache
  try:
    m = api.load(str(gguf_file))
    short = "hello world"
    long = "the world hello world " * 12      # another prompt bucket (> 64 tokens)
    assert buffers.prompt_bucket(len(api.encode_prompts(m, [long])[0])) != buffers.prompt_bucket(
        len(api.encode_prompts(m, [short])[0]))
    first, _ = api.generate(m, [short], max_new_tokens=6, max_len=256)
    names: list = []
    with count_compiles(names):
      api.generate(m, [long], max_new_tokens=6, max_len=256)
    assert len(names) == 1 and "init" in names[0], names    # the prefill, and nothing else
    assert m.executables.count("loop") == 1
    with count_compiles() as n:             # both shapes now compiled: nothing more
      again, _ = api.generate(m, [short], max_new_tokens=6, max_len=256)
      api.generate(m, [long], max_new_tokens=9, max_len=256)
    assert n() == 0
    assert again[0].token_ids == first[0].token_ids
  finally:
    compile_cache.enable(True)


def _cli(*args, cache: Path, **env):
  e = {**os.environ, "SPECJAX_CACHE": str(cache), **env}
  return subprocess.run([sys.executable, "-m", "specjax.cli", *args], capture_output=True, text=True, cwd=ROOT,
                        env=e, timeout=600)


def test_second_process_compiles_nothing(tmp_path, gguf_file):
  """Two processes, one cache: the second reads every executable back (native CPU kernels included, so their
  FFI targets must be registered before the executables are loaded) and prints the same tokens."""
  cache = tmp_path / "cache"
  args = ("generate", "--model", str(gguf_file), "--prompt", "hello world", "--max-new-tokens", "8",
          "--max-len", "128", "--drafter", "ngram", "--k", "3", "--json")
  first = _cli(*args, cache=cache)
  assert first.returncode == 0, first.stderr
  second = _cli(*args, cache=cache)
  assert second.returncode == 0, second.stderr
  s1, s2 = json.loads(first.stdout)["stats"], json.loads(second.stdout)["stats"]
  assert s1["executables_compiled"] > 0
  assert s2["executables_compiled"] == 0 and s2["executables_from_cache"] > 0, s2
  assert json.loads(first.stdout)["outputs"] == json.loads(second.stdout)["outputs"]
  for key in ("load_s", "compile_s", "prefill_s", "decode_s"):
    assert s2[key] >= 0
  assert "converting" in first.stderr and "converting" not in second.stderr
  if jax.default_backend() == "cpu" and os.environ.get("SPECJAX_NATIVE", "1") != "0":
    kernels = Path(os.environ.get("SPECJAX_KERNEL_DIR") or cache / "kernels")   # tests share one build
    assert list(kernels.glob("libspecjax_cpu_*.so")), "the native kernels were not built"
  # Turned off: compiles again, writes nothing new.
  off = _cli(*args, "--no-compile-cache", cache=cache)
  assert off.returncode == 0, off.stderr
  s3 = json.loads(off.stdout)["stats"]
  assert s3["executables_from_cache"] == 0 and s3["executables_compiled"] > 0 and s3["compile_cache_dir"] is None


def test_cache_command_lists_and_clears(tmp_path, gguf_file):
  cache = tmp_path / "cache"
  assert _cli("tokenize", "--model", str(gguf_file), "--text", "hello", cache=cache).returncode == 0
  listed = json.loads(_cli("cache", "--json", cache=cache).stdout)
  parts = {p["part"]: p for p in listed["parts"]}
  assert parts["converted"]["bytes"] > 0 and parts["converted"]["entries"] >= 1
  cleared = _cli("cache", "--clear", "converted", "--json", cache=cache)
  assert cleared.returncode == 0, cleared.stderr
  parts = {p["part"]: p for p in json.loads(cleared.stdout)["parts"]}
  assert parts["converted"]["bytes"] == 0
  again = _cli("tokenize", "--model", str(gguf_file), "--text", "hello", cache=cache)
  assert again.returncode == 0 and "converting" in again.stderr      # rebuilt on the next load
