"""The distillation-losses recipe (`specjax train configs/distill_losses.gin`) end to end on a tiny model:
one feature drafter per loss on the same data, each trained and scored on held-out sequences, the table,
plot and summary written; a second run into the same directory is refused unless resumed."""
import csv
import json

import pytest

from specjax.errors import SpecjaxError
from specjax.training import recipes
from tests.helpers import CFG, random_hf_params, write_gguf


def test_distill_losses_trains_and_scores_one_drafter_per_loss(tmp_path):
  path = str(write_gguf(tmp_path / "tiny.gguf", CFG, random_hf_params(CFG, seed=3)))
  kw = dict(run_dir=str(tmp_path / "run"), model=path, data_dir=str(tmp_path / "data"), num_prompts=12,
            max_new_tokens=12, losses=("ce", "tvd"), eval_positions=2, steps=3, batch_size=2, seq_len=64,
            learning_rate=3e-3, warmup_steps=1, checkpoint_every=3, log_every=1, unroll=2, progress=False)
  res = recipes.distill_losses(**kw)
  rows = res["rows"]
  assert [r["loss"] for r in rows] == ["ce", "tvd"]
  for r in rows:
    assert r["final_loss"] > 0
    for i in (1, 2):
      assert 0 <= r[f"tvd_acc_{i}"] <= 1 and 0 <= r[f"greedy_{i}"] <= 1
  assert (tmp_path / "run" / "ce").is_dir() and (tmp_path / "run" / "tvd").is_dir()    # a run per loss
  run = tmp_path / "run"
  with open(run / "results.csv") as f:
    assert [r["loss"] for r in csv.DictReader(f)] == ["ce", "tvd"]
  assert (run / "losses.png").stat().st_size > 1000
  assert json.loads((run / "summary.json").read_text())["rows"] == rows
  with pytest.raises(SpecjaxError, match="--resume"):
    recipes.distill_losses(**kw)
