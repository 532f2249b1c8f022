"""The training loop on a tiny linear regression: it learns, it survives SIGKILL and resumes exactly, and a bad
run directory (no checkpoint, damaged, another config) is one clear error."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.training import checkpoint, loop, optim

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
"""Linear regression trained by specjax.training (written by tests/training/test_training_loop.py)."""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

jax.config.update("jax_default_matmul_precision", "highest")

from specjax.training import checkpoint, loop, optim  # noqa: E402

D = 4
BATCH = 8


class Batcher:
  """Seeded shuffles of a fixed data set; the position (epoch, index) fixes every later batch."""

  def __init__(self, seed=0, n=64):
    rng = np.random.default_rng(seed)
    self.x = rng.normal(size=(n, D)).astype(np.float32)
    self.y = (self.x @ np.arange(1, D + 1) + 0.5 + 0.01 * rng.normal(size=n)).astype(np.float32)
    self.seed, self.n = seed, n
    self.epoch, self.index = 0, 0

  def next(self):
    if self.index + BATCH > self.n:
      self.epoch, self.index = self.epoch + 1, 0
    idx = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)[self.index:self.index + BATCH]
    self.index += BATCH
    return {"x": self.x[idx], "y": self.y[idx]}

  def position(self):
    return {"epoch": self.epoch, "index": self.index}

  def seek(self, position):
    self.epoch, self.index = position["epoch"], position["index"]


def build(total, lr=0.5):
  tx = optim.make_optimizer(learning_rate=lr, total_steps=total, warmup_steps=5, weight_decay=0.01)
  schedule = optim.make_schedule(learning_rate=lr, total_steps=total, warmup_steps=5)

  def init():
    params = {"w": jnp.zeros((D,)), "b": jnp.zeros(())}
    return loop.make_train_state(params, tx.init(params), jax.random.PRNGKey(0))

  @jax.jit
  def step_fn(state, batch):
    key, noise_key = jax.random.split(state["key"])
    noise = 1e-3 * jax.random.normal(noise_key, batch["y"].shape)      # uses the key: resume must restore it

    def loss_fn(p):
      return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"] - noise) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    step = state["step"] + 1
    new = dict(state, params=optax.apply_updates(state["params"], updates), opt_state=opt_state, step=step,
               key=key)
    return new, {"loss": loss, "lr": schedule(step), "grad_norm": optax.tree.norm(grads)}

  return init, step_fn


def main(run_dir, *, total=40, every=10, resume=False, stall_after=None, fingerprint=None, log_every=1):
  init, step_fn = build(total)
  ck = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), every=every, keep=3,
                               fingerprint=fingerprint or {"drafter": "linear", "dim": D})
  batcher = Batcher()
  state = init()
  if resume:
    state, start = loop.resume(ck, jax.eval_shape(init), batcher)
    print(f"resumed at step {start}", file=sys.stderr, flush=True)
  fn = step_fn
  if stall_after is not None:
    def fn(state, batch):               # hang in the step after ``stall_after``: the test kills us there
      out = step_fn(state, batch)
      if int(out[0]["step"]) > stall_after:
        time.sleep(600)
      return out
  state = loop.train(fn, state, batcher, total_steps=total, run_dir=run_dir, checkpointer=ck,
                     log_every=log_every, tokens_per_batch=BATCH, progress=False)
  ck.close()
  np.save(os.path.join(run_dir, "final_w.npy"), np.asarray(state["params"]["w"]))
  return state


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("run_dir")
  ap.add_argument("--resume", action="store_true")
  ap.add_argument("--stall-after", type=int)
  a = ap.parse_args()
  main(a.run_dir, resume=a.resume, stall_after=a.stall_after)
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory):
  path = tmp_path_factory.mktemp("script") / "train_linear.py"
  path.write_text(SCRIPT)
  spec = importlib.util.spec_from_file_location("train_linear", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  mod.PATH = path
  return mod


def _records(run_dir):
  return loop.read_metrics(Path(run_dir) / loop.METRICS)


def _losses(run_dir):
  return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def test_loss_decreases_and_files_are_well_formed(script, tmp_path):
  script.main(str(tmp_path), total=50, every=25, log_every=5)
  recs = _records(tmp_path)
  assert [r["step"] for r in recs] == list(range(5, 51, 5))
  for r in recs:
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "steps_per_s", "elapsed_s", "time"} <= set(r)
    assert all(isinstance(v, (int, float)) and np.isfinite(v) for v in r.values())
  lines = (tmp_path / loop.METRICS).read_text().splitlines()
  assert len(lines) == len(recs) and all(json.loads(line)["step"] for line in lines)
  assert recs[-1]["loss"] < 0.05 * recs[0]["loss"]
  # the schedule: peak at the end of warm-up, end_lr_ratio · peak at the last step
  assert recs[0]["lr"] == pytest.approx(0.5, rel=1e-6)
  assert recs[-1]["lr"] == pytest.approx(0.05, rel=1e-5)
  png = (tmp_path / loop.LOSS_PLOT).read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  import matplotlib.image
  img = matplotlib.image.imread(tmp_path / loop.LOSS_PLOT)
  assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
  assert checkpoint.Checkpointer(tmp_path / "checkpoints", every=25, keep=3,
                                 fingerprint={"drafter": "linear", "dim": 4}).all_steps() == [25, 50]


def test_kill_and_resume_matches_uninterrupted_run(script, tmp_path):
  ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
  ref_state = script.main(str(ref_dir))
  ref = _losses(ref_dir)
  assert sorted(ref) == list(range(1, 41))

  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, str(script.PATH), str(run_dir)]
  # Killed while inside step 25: after the step-20 checkpoint, with lines 21..24 already in metrics.jsonl.
  proc = subprocess.Popen(cmd + ["--stall-after", "24"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.time() + 120
  try:
    while time.time() < deadline and proc.poll() is None and max(_losses(run_dir), default=0) < 24:
      time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert max(_losses(run_dir)) == 24
  ck = checkpoint.Checkpointer(run_dir / "checkpoints", every=10, keep=3, fingerprint={"drafter": "linear", "dim": 4})
  assert ck.latest_step() == 20          # the kill came after step 20's checkpoint, before step 30's

  out = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=180)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed at step 20" in out.stderr
  recs = _records(run_dir)
  assert [r["step"] for r in recs] == list(range(1, 41))       # lines 21..24 of the killed run dropped
  got = _losses(run_dir)
  for step in range(1, 41):
    assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step
  np.testing.assert_allclose(np.load(run_dir / "final_w.npy"), np.asarray(ref_state["params"]["w"]),
                             rtol=1e-6, atol=1e-6)
  assert recs[-1]["elapsed_s"] >= recs[19]["elapsed_s"]       # wall time continues across the resume
  assert ck.all_steps() == [20, 30, 40]
  assert (run_dir / loop.LOSS_PLOT).exists()


def _fp(**kw):
  return {"drafter": "linear", "dim": 4, **kw}


def _state(n=4096):
  return {"w": jnp.arange(n, dtype=jnp.float32) / 7, "step": jnp.int32(0),
          "key": jax.random.key_data(jax.random.PRNGKey(3))}


def _save_steps(directory, steps, n=4096):
  ck = checkpoint.Checkpointer(directory, every=5, keep=5, fingerprint=_fp())
  for s in steps:
    assert ck.save(s, dict(_state(n), step=jnp.int32(s)), {"data": {"i": s}})
  return ck


def test_checkpointer_roundtrip_interval_and_keep(tmp_path):
  ck = checkpoint.Checkpointer(tmp_path / "ck", every=5, keep=2, fingerprint=_fp(layers=(1, 2)))
  assert ck.latest_step() is None and not (tmp_path / "ck").exists()
  state = _state(16)
  assert not ck.save(3, state, {})
  assert ck.save(3, state, {}, force=True)
  assert ck.save(5, state, {"data": {"i": 5}})
  assert not ck.save(5, state, {}, force=True)         # already on disk
  assert ck.save(10, state, {})
  assert ck.all_steps() == [5, 10]                     # keep=2
  abstract = jax.eval_shape(lambda: dict(state, w=state["w"].astype(jnp.bfloat16)))
  restored, meta = checkpoint.Checkpointer(tmp_path / "ck", every=5, keep=2,
                                           fingerprint=_fp(layers=[1, 2])).restore(5, target=abstract)
  assert restored["w"].dtype == jnp.bfloat16 and restored["key"].dtype == jnp.uint32
  np.testing.assert_array_equal(restored["key"], state["key"])
  assert meta["step"] == 5 and meta["data"] == {"i": 5} and meta["fingerprint"] == _fp(layers=[1, 2])
  with pytest.raises(SpecjaxError, match="typed PRNG key"):
    ck.save(15, dict(state, key=jax.random.key(0)), {})
  with pytest.raises(SpecjaxError, match="JSON"):
    ck.save(15, state, {"x": object()})


def test_incomplete_save_is_ignored(tmp_path):
  _save_steps(tmp_path, [5])
  partial = tmp_path / "10.orbax-checkpoint-tmp-1234"       # what a save killed half-way leaves behind
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "_METADATA").write_text("{")
  ck = checkpoint.Checkpointer(tmp_path, every=5, keep=5, fingerprint=_fp())
  assert ck.latest_step() == 5
  assert not partial.exists()                               # cleaned up when the directory is opened


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
  (tmp_path / "ck").mkdir()
  (tmp_path / "ck" / "10.orbax-checkpoint-tmp-99").mkdir()
  ck = checkpoint.Checkpointer(tmp_path / "ck", every=5, keep=2, fingerprint=_fp())
  with pytest.raises(SpecjaxError, match=r"ck holds no complete checkpoint; start without resuming"):
    loop.resume(ck, jax.eval_shape(_state), None)
  assert loop.resume(ck, jax.eval_shape(_state), None, required=False) is None
  missing = checkpoint.Checkpointer(tmp_path / "nope", every=5, keep=2, fingerprint=_fp())
  with pytest.raises(SpecjaxError, match="nope does not exist"):
    missing.restore(target=jax.eval_shape(_state))


def test_fingerprint_and_structure_mismatch(tmp_path):
  _save_steps(tmp_path, [5])
  other = checkpoint.Checkpointer(tmp_path, every=5, keep=5, fingerprint=_fp(dim=8))
  with pytest.raises(SpecjaxError) as e:
    other.restore(target=jax.eval_shape(_state))
  msg = str(e.value)
  assert "\n" not in msg
  assert msg == (f"checkpoint at {tmp_path / '5'} was made for dim=4, this run is dim=8: "
                 "use another --run-dir or the matching config")
  same = checkpoint.Checkpointer(tmp_path, every=5, keep=5, fingerprint=_fp())
  with pytest.raises(SpecjaxError, match=r"does not fit this run's train state \(w is \(4096,\) on disk, \(10,\) "):
    same.restore(target=jax.eval_shape(lambda: _state(10)))
  with pytest.raises(SpecjaxError, match="missing extra"):
    same.restore(target=jax.eval_shape(lambda: dict(_state(), extra=jnp.zeros(2))))


def _damage(path: Path, how: str):
  if how == "delete":
    path.unlink()
  elif how == "truncate":
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  else:                                                     # flip one bit in the middle
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x10
    path.write_bytes(bytes(b))


def _largest_data_file(step_dir: Path) -> Path:
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("target,how", [
    ("meta/metadata", "delete"), ("meta/metadata", "truncate"), ("state/_METADATA", "truncate"),
    ("state/manifest.ocdbt", "truncate"), ("data", "flip"), ("data", "truncate")])
def test_damaged_checkpoint_is_a_clear_error(tmp_path, target, how):
  _save_steps(tmp_path, [5, 10])
  path = _largest_data_file(tmp_path / "10") if target == "data" else tmp_path / "10" / target
  _damage(path, how)
  ck = checkpoint.Checkpointer(tmp_path, every=5, keep=5, fingerprint=_fp())
  assert ck.latest_step() == 10
  with pytest.raises(SpecjaxError) as e:
    ck.restore(target=jax.eval_shape(_state))
  msg = str(e.value)
  print(msg)
  assert "\n" not in msg and len(msg) < 300 + 2 * len(str(tmp_path))
  assert msg.startswith(f"checkpoint at {tmp_path / '10'} is damaged (")
  assert msg.endswith(f"delete {tmp_path / '10'} to resume from step 5")
  restored, meta = ck.restore(5, target=jax.eval_shape(_state))   # the earlier one is intact
  np.testing.assert_array_equal(restored["w"], _state()["w"])


def test_fresh_run_refuses_a_directory_with_checkpoints(script, tmp_path):
  script.main(str(tmp_path), total=10, every=5, log_every=5)
  with pytest.raises(SpecjaxError, match="already holds checkpoints up to step 10 but this run starts at step 0"):
    script.main(str(tmp_path), total=20, every=5)


def test_resume_at_the_end_and_extend(script, tmp_path):
  script.main(str(tmp_path), total=10, every=5, log_every=5)
  init, step_fn = script.build(20)
  ck = checkpoint.Checkpointer(tmp_path / "checkpoints", every=5, keep=5, fingerprint=_fp())
  batcher = script.Batcher()
  state, start = loop.resume(ck, jax.eval_shape(init), batcher)
  assert start == 10 and batcher.position() == {"epoch": 1, "index": 16}
  state = loop.train(step_fn, state, batcher, total_steps=12, run_dir=tmp_path, checkpointer=ck, log_every=1,
                     progress=False, eval_fn=lambda s: {"loss": jnp.sum(s["params"]["w"])}, eval_every=2,
                     extra_meta={"note": "extended"})
  assert int(state["step"]) == 12
  recs = _records(tmp_path)
  assert [r["step"] for r in recs] == [5, 10, 11, 12, 12]
  assert "eval_loss" in recs[-1] and "loss" in recs[-2]
  assert ck.restore()[1]["note"] == "extended"


def test_optimizer_schedule_and_validation():
  kw = dict(learning_rate=1.0, total_steps=10, warmup_steps=4)
  assert optim.learning_rate_at(1, **kw) == pytest.approx(0.25)
  assert optim.learning_rate_at(4, **kw) == pytest.approx(1.0)
  assert optim.learning_rate_at(10, **kw) == pytest.approx(0.1)
  tx = optim.make_optimizer(**kw, clip_norm=0.5)
  params = {"w": jnp.zeros(3)}
  updates, _ = tx.update({"w": jnp.array([30.0, 40.0, 0.0])}, tx.init(params), params)
  # clipped to norm 0.5, then Adam's first step is ±lr·1 per coordinate, lr = schedule(1) = 0.25
  np.testing.assert_allclose(updates["w"], [-0.25, -0.25, 0.0], atol=1e-6)
  for bad in (dict(total_steps=0, warmup_steps=0), dict(total_steps=10, warmup_steps=10),
              dict(total_steps=10, warmup_steps=-1)):
    with pytest.raises(SpecjaxError):
      optim.make_optimizer(learning_rate=1e-3, **bad)
  with pytest.raises(SpecjaxError, match="learning_rate"):
    optim.make_optimizer(learning_rate=0.0, total_steps=10, warmup_steps=1)
