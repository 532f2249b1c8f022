"""scripts/ab_bench.py: two commits checked out side by side, runs alternated, the paired ratio computed, the
worktrees removed afterwards (the bench itself is replaced by a fake here: a real one takes minutes)."""
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
  spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "scripts" / "ab_bench.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _worktrees():
  return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout


@pytest.mark.skipif(subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=ROOT, capture_output=True).returncode != 0,
                    reason="needs a git checkout with history")
def test_alternates_the_two_commits_and_pairs_the_rounds(monkeypatch, tmp_path, capsys):
  ab = _load()
  calls = []
  speed = {"base": iter([10.0, 20.0, 10.0]), "head": iter([12.0, 22.0, 13.0])}

  def fake_bench(tree, args):
    side = tree.name
    assert (tree / "specjax" / "__init__.py").is_file()        # a real checkout of that commit
    calls.append(side)
    if len(calls) <= 2:                                        # the warm-up runs
      return {"ar_tokens_per_s": 1.0, "_wall_s": 0.0}
    return {"ar_tokens_per_s": next(speed[side]), "roofline_fraction": 0.5, "read_bandwidth_gbs": 30.0,
            "_wall_s": 1.0, "machine": {"kernel_path": "native-test"}}

  monkeypatch.setattr(ab, "run_bench", fake_bench)
  before = _worktrees()
  out = tmp_path / "ab.json"
  assert ab.main(["--base", "HEAD~1", "--rounds", "3", "--out", str(out), "--", "--limit", "2", "--json"]) == 0
  assert calls == ["base", "head", "base", "head", "head", "base", "base", "head"]
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["head_over_base_per_round"] == pytest.approx([1.2, 1.1, 1.3])
  assert summary["head_over_base_median"] == pytest.approx(1.2)
  assert summary["bench_args"] == ["--limit", "2"]                # --json is the script's own
  assert json.loads(out.read_text())["summary"] == summary
  assert _worktrees() == before                                  # the temporary checkouts are gone


def test_needs_the_separator_and_reads_the_last_json_line():
  ab = _load()
  assert ab.main(["--base", "HEAD"]) == 2
  assert ab._last_json('[specjax] loading\n{"ar_tokens_per_s": 3.5}\n') == {"ar_tokens_per_s": 3.5}
  with pytest.raises(RuntimeError, match="no JSON"):
    ab._last_json("nothing here\n")
