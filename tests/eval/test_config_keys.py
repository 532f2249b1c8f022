"""Every config in configs/ runs at tiny size and writes the JSON keys it wrote before the redesign
(tests/data/config_keys.json, recorded by ``python -m tests.helpers.config_keys --code <worktree of 64e1003>``; a
config added later is recorded at the commit that added it).  A key that disappears breaks researchers' scripts; a
new key is allowed but must be recorded as an addition (``python -m tests.helpers.config_keys --add --only NAME``
on the current checkout)."""
import json
from pathlib import Path

import pytest

from tests.helpers import config_keys as ck

CONFIGS = sorted(p.stem for p in (ck.ROOT / "configs").glob("*.gin"))
TABLE = json.loads(ck.FIXTURE.read_text())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  return ck.make_inputs(tmp_path_factory.mktemp("config_inputs"))


def test_every_config_has_tiny_bindings_and_a_recorded_shape():
  assert set(CONFIGS) == set(ck.TINY) == set(TABLE), "add the new config to tests/helpers/config_keys.py and record it"


def test_key_paths_catch_a_dropped_or_renamed_key():
  before = ck.key_paths({"rows": [{"speedup": 1.0, "tau": 2.0}], "machine": {"cpu": "x"},
                         "by_rows": {"1": 2.0, "4": 3.0}})
  assert before == {"/rows", "/rows[]/speedup", "/rows[]/tau", "/machine", "/by_rows"}
  after = ck.key_paths({"rows": [{"speedup": 1.0, "mean_accepted": 2.0}], "machine": {}, "by_rows": {"2": 1.0}})
  assert before - after == {"/rows[]/tau"}


@pytest.mark.parametrize("name", [c for c in CONFIGS if c not in ck.MESHED])
def test_config_at_tiny_size_keeps_its_json_keys(name, inputs, tmp_path):
  result = ck.run_in_process(name, inputs, tmp_path)
  keys = ck.key_paths(result)
  recorded = set(TABLE[name]["keys"])
  assert not recorded - keys, f"{name}: keys gone since {TABLE[name]['recorded_at']}: {sorted(recorded - keys)}"
  new = keys - recorded - set(TABLE[name].get("added", {}))
  assert not new, (f"{name}: new keys, record them (python -m tests.helpers.config_keys --add --only {name}): "
                  f"{sorted(new)}")
  out = tmp_path / f"{name}-out"
  assert (out / "config.gin").is_file()
  if name not in ck.TRAINING:                      # a run directory: the resolved config, the table, the plots
    assert (out / "results.csv").is_file() and any(p.suffix == ".png" for p in out.iterdir())
    assert result["machine"]["kernel_path"]
  assert ck.TINY[name][-1].split(" = ")[0] in (out / "config.gin").read_text()   # the bindings took


@pytest.mark.parametrize("name", ck.MESHED)
def test_meshed_config_at_tiny_size_keeps_its_json_keys(name, inputs, tmp_path):
  """The mesh config in its own process with two host devices (a 1x2 mesh)."""
  keys = ck.key_paths(ck.run_in_subprocess(name, inputs, tmp_path))
  recorded, added = set(TABLE[name]["keys"]), set(TABLE[name].get("added", {}))
  assert recorded <= keys <= recorded | added, sorted(keys ^ recorded)
  assert Path(tmp_path / f"{name}-out" / "results.json").is_file()
