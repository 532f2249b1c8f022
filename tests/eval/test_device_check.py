"""scripts/device_check.py, the one command for a lent accelerator, in its tiny mode on the CPU: the Pallas
kernel (interpret mode) against its reference, the verify-cost curve beside the cost model, greedy exactness
on the Pallas and XLA attention paths, and the random-weight n-gram timing, all in the JSON it writes."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import device_check  # noqa: E402


def test_the_device_check_runs_in_tiny_mode_and_writes_its_json(tmp_path, capsys):
  out = tmp_path / "check.json"
  assert device_check.main(["--tiny", "--out", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["backend"] == "cpu" and res["tiny"]
  kernels = res["kernels"]
  assert {r["dtype"] for r in kernels} == {"float32", "bfloat16"}
  for r in kernels:
    assert r["ok"] and r["max_abs_error"] <= device_check.TOLERANCE[r["dtype"]], r
    assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
  assert [r["rows"] for r in res["verify"]] == [1, 8]
  assert all(r["measured_ms"] > 0 and r["cost_model_ms"] > 0 for r in res["verify"])
  # the cost model prices more rows at least as high
  assert res["verify"][1]["cost_model_ms"] >= res["verify"][0]["cost_model_ms"]
  ex = res["exactness"]
  assert {r["path"] for r in ex} == {"pallas", "xla"}
  assert all(r["identical"] == r["sequences"] == 2 for r in ex), ex
  assert sum(r["accepted"] for r in ex) > 0           # drafts were accepted: the speculative path ran
  assert res["all_kernels_ok"] and res["all_exact"]
  assert res["speedups"]["weights"].startswith("random") and res["speedups"]["ngram_speedup"] > 0
  assert json.loads(capsys.readouterr().out)["all_exact"] is True


def test_a_kernel_that_disagrees_with_its_reference_is_reported(tmp_path, monkeypatch):
  """The check has power: a kernel off by a little fails the tolerance, and the command exits 1."""
  import importlib
  ta = importlib.import_module("specjax.kernels.pallas.tree_attention")
  real = ta.tree_attention
  monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: real(*a, **k) * 1.01)
  rows = device_check.check_kernels([(2, 4, 4, 2, 16, 64)], interpret=True, mask_kinds=("tree",))
  assert rows and not any(r["ok"] for r in rows if r["dtype"] == "float32")
