"""The roofline and batch-sweep experiments end to end on a tiny model (their real runs, on SmolLM2, are in
docs/BENCHMARKS.md): every grid point measured and priced, the plots written; the sweep's crossover rows,
one row per (rate, policy) with every request served, and the summary comparing goodput with fixed k."""
import pytest

from tests.helpers import CFG, random_hf_params, write_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
  return str(write_gguf(tmp_path_factory.mktemp("exp") / "tiny.gguf", CFG, random_hf_params(CFG, seed=3)))


def test_roofline_measures_and_prices_every_point(tiny_path, tmp_path):
  from experiments import roofline
  res = roofline.roofline(tiny_path, batches=(1, 4), rows=(1, 8), context=16, repeats=2, device="h200",
                          log=lambda *_: None)
  rows = res["rows"]
  assert [(r["B"], r["T"]) for r in rows] == [(1, 1), (1, 8), (4, 1), (4, 8)]
  for r in rows:
    assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["bound"] in ("compute", "memory", "floor")
    assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
    assert r["rows"] == r["B"] * r["T"]
  by = {(r["B"], r["T"]): r["predicted_ms"] for r in rows}
  assert by[(4, 8)] >= by[(4, 1)] >= by[(1, 1)]             # more rows never cost less in the model
  assert res["median_abs_error"] <= res["max_abs_error"]
  roofline.plot(res, tmp_path)
  assert any(p.suffix == ".png" and p.stat().st_size > 1000 for p in tmp_path.iterdir())


def test_batch_sweep_crossover_and_policies_under_load(tiny_path, tmp_path):
  from experiments import batch_sweep
  policies = ("never", "always", "off-above", "adaptive", "goodput")
  res = batch_sweep.batch_sweep(tiny_path, prompts="specjax-prompts", categories=["summarization"], k=2,
                                buckets=(0, 2), slots=2, batches=(1,), rates=(50.0,), requests=4,
                                max_new_tokens=6, policies=policies, max_batch=1, device="h200",
                                crossover_requests=2, log=lambda *_: None)
  assert len(res["crossover_rows"]) == 1 and res["crossover_batch_measured"] in (None, 1)
  assert len(res["acceptance_by_position"]) == 2
  rows = res["rows"]
  assert [(r["rate"], r["policy"]) for r in rows] == [(rate, p) for rate in (50.0,) for p in policies]
  assert all(r["served"] == 4 and r["tokens_per_s"] > 0 for r in rows)
  never = [r for r in rows if r["policy"] == "never"]
  always = [r for r in rows if r["policy"] == "always"]
  assert all(r["mean_k"] == 0 for r in never) and all(r["mean_k"] > 0 for r in always)
  assert set(res["summary"]) == {"50.0"}
  for s in res["summary"].values():
    assert s["goodput_vs_best_fixed"] > 0 and s["goodput_beats_both"] == (s["goodput_vs_best_fixed"] > 1)
  batch_sweep.plot(res, tmp_path)
  assert any(p.suffix == ".png" for p in tmp_path.iterdir())
