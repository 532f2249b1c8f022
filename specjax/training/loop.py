"""The generic training loop: jitted steps, logging, checkpoints, exact resume.

Conventions:
  * ``train_state`` is a dict pytree of arrays holding the completed-step count as ``train_state["step"]``
    (scalar int32) next to whatever else the step needs (params, optimizer state, a PRNG key stored as
    ``jax.random.key_data``).  ``step_fn(train_state, batch) -> (train_state, metrics)`` is jitted by the
    caller and must add 1 to ``step``; ``metrics`` is a dict of scalars (a ``loss``, and ``lr`` if the step
    logs ``optim.make_schedule(...)(step)``).
  * ``batcher`` has ``next() -> batch``, ``position() -> dict`` (JSON) and ``seek(position)``; the batch of a
    step depends only on the position before it, so a run resumed from a checkpoint sees the same batches.
  * A checkpoint at step s holds the train state after s steps and, in its meta, ``data``: the batcher's
    position after the batch of step s was consumed.  ``resume`` restores both; ``train`` then continues at
    step s + 1 and drops any lines past s from ``metrics.jsonl`` (written after that checkpoint, before a kill).

Files in ``run_dir``: ``metrics.jsonl`` (one JSON line per log step: step, every metric as a float,
``tokens_per_s`` when ``tokens_per_batch`` is given, ``steps_per_s``, ``elapsed_s`` (training wall time, across
resumes) and ``time``; eval lines carry ``eval_*`` metrics) and ``loss.png`` (loss-like metrics against step,
redrawn at every checkpoint and at the end).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax.runtime import compile_cache
from specjax.parallel import distributed
from specjax import progress as progress_lib
from specjax.errors import SpecjaxError
from specjax.training.checkpoint import Checkpointer
from specjax.training.jsonl import read_records

METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"
DATA_KEY = "data"          # meta key of the batcher position


class Batcher(Protocol):
  def next(self) -> Any: ...
  def position(self) -> dict: ...
  def seek(self, position: dict) -> None: ...


def make_train_state(params, opt_state, key: jax.Array | None = None, **extra) -> dict:
  """{"params", "opt_state", "step" (int32 0), "key" (raw uint32 key data, if given), **extra}."""
  state = {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32), **extra}
  if key is not None:
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.key_data(key)
    state["key"] = key
  return state


def _state_step(train_state) -> int:
  try:
    return int(jax.device_get(train_state["step"]))
  except (KeyError, TypeError, IndexError) as e:
    raise SpecjaxError("train_state must be a dict with a scalar 'step' (completed steps): "
                       "build it with training.loop.make_train_state") from e


def resume(checkpointer: Checkpointer, abstract_state, batcher: Batcher, *,
           required: bool = True) -> tuple[Any, int] | None:
  """Restore the latest checkpoint into ``abstract_state``'s structure and dtypes, seek ``batcher`` to the
  saved data position; returns (train_state, step).  With ``required=False`` and no checkpoint: None."""
  if not required and checkpointer.latest_step() is None:
    return None
  state, meta = checkpointer.restore(None, target=abstract_state)
  step = int(meta["step"])
  if DATA_KEY not in meta:
    raise SpecjaxError(f"checkpoint at {checkpointer.directory / str(step)} has no data position "
                       f"(meta '{DATA_KEY}'): it was not written by training.loop; use another --run-dir")
  if _state_step(state) != step:
    raise SpecjaxError(f"checkpoint at {checkpointer.directory / str(step)} holds a train state at step "
                       f"{_state_step(state)}, not {step}: use another --run-dir")
  batcher.seek(meta[DATA_KEY])
  return state, step


# --- metrics file ---

def read_metrics(path: str | Path) -> list[dict]:
  """The records of a metrics.jsonl (a last line cut by a kill is ignored)."""
  def check(rec):
    if not isinstance(rec.get("step"), int):
      raise ValueError("needs an integer 'step'")
  return read_records(path, check, "delete that line")


def _truncate_metrics(path: Path, last_step: int) -> list[dict]:
  """Keep the records at or before ``last_step`` (rewritten atomically); returns them."""
  if not path.exists():
    return []
  kept = [r for r in read_metrics(path) if r["step"] <= last_step]
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in kept)
  os.replace(tmp, path)
  return kept


_LOSS_WORDS = {"loss", "kl", "fkl", "rkl", "jsd", "tvd", "ce", "nll", "l1", "mse", "huber", "xent"}


def _loss_like(key: str) -> bool:
  words = re.split(r"[^a-z0-9]+", key.lower())
  return "loss" in key.lower() or any(w in _LOSS_WORDS for w in words)


def plot_losses(metrics_path: str | Path, out_path: str | Path) -> Path | None:
  """Loss-like metrics of a metrics.jsonl against step (log y when all positive), written atomically; None
  when there is nothing to plot."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_metrics(metrics_path)
  series: dict[str, tuple[list, list]] = {}
  for r in records:
    for k, v in r.items():
      if k != "step" and _loss_like(k) and isinstance(v, (int, float)) and math.isfinite(v):
        xs, ys = series.setdefault(k, ([], []))
        xs.append(r["step"])
        ys.append(v)
  if not series:
    return None
  fig = Figure(figsize=(7, 4.2), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for k in sorted(series):
    xs, ys = series[k]
    ax.plot(xs, ys, label=k, marker="o" if len(xs) < 3 else None, linewidth=1.2)
  if all(y > 0 for _, ys in series.values() for y in ys):
    ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  out_path = Path(out_path)
  tmp = out_path.with_name(out_path.name + ".tmp.png")
  fig.savefig(tmp)
  os.replace(tmp, out_path)
  return out_path


class _MetricsWriter:
  def __init__(self, path: Path):
    self.path = path
    self.f = open(path, "a", encoding="utf-8")

  def write(self, record: dict) -> None:
    self.f.write(json.dumps(record) + "\n")     # one write per line, then flush: a kill cuts at most one line
    self.f.flush()

  def close(self) -> None:
    self.f.close()


def _scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
  out = {}
  for k, v in jax.device_get(metrics).items():
    a = np.asarray(v)
    if a.size != 1:
      raise SpecjaxError(f"metric {k!r} has shape {a.shape}: step and eval functions must return scalars")
    out[prefix + str(k)] = float(a.reshape(()))
  return out


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """When ``train`` logs, evaluates and stops, and what it adds to each record and checkpoint."""
  total_steps: int
  log_every: int
  eval_every: int
  eval_fn: Callable | None
  tokens_per_batch: int | None
  extra_meta: dict | None

  def check(self) -> None:
    if not isinstance(self.total_steps, int) or self.total_steps < 1:
      raise SpecjaxError(f"total_steps must be an integer >= 1, got {self.total_steps!r}")
    if not isinstance(self.log_every, int) or self.log_every < 1:
      raise SpecjaxError(f"log_every must be an integer >= 1, got {self.log_every!r}")
    if self.eval_every < 0 or (self.eval_every and self.eval_fn is None):
      raise SpecjaxError("eval_every needs an eval_fn (and must be >= 0)")


class _RunLog:
  """One ``train`` call's records: the metrics file (cut back to the starting step), the training wall time
  across resumes, the throughput mark and the progress line."""

  def __init__(self, run_dir: Path, start: int):
    self.run_dir = run_dir
    self.start = start
    self.metrics_path = run_dir / METRICS
    self.main = distributed.is_main()        # several processes: one writes the metrics and the plot
    kept = _truncate_metrics(self.metrics_path, start) if self.main else []
    self.elapsed0 = max((r.get("elapsed_s", 0.0) for r in kept), default=0.0)
    self.writer = _MetricsWriter(self.metrics_path if self.main else Path(os.devnull))
    self.t_start = time.perf_counter()
    self.mark_t, self.mark_step = self.t_start, start
    self.info = "loss ?"

  def elapsed(self) -> float:
    return self.elapsed0 + time.perf_counter() - self.t_start

  def mark(self, step: int, now: float | None = None) -> None:
    """Throughput is measured from here (after compilation, an eval or a checkpoint)."""
    self.mark_t, self.mark_step = time.perf_counter() if now is None else now, step

  def log(self, step: int, metrics: dict, tokens_per_batch: int | None) -> None:
    record = {"step": step, **_scalars(metrics)}
    now = time.perf_counter()
    if step > self.mark_step:
      steps_per_s = (step - self.mark_step) / max(now - self.mark_t, 1e-9)
      record["steps_per_s"] = steps_per_s
      if tokens_per_batch:
        record["tokens_per_s"] = steps_per_s * tokens_per_batch
    self.mark(step, now)
    record["elapsed_s"] = self.elapsed()
    record["time"] = time.time()
    self.writer.write(record)
    self.info = " ".join(f"{k} {record[k]:.4g}" for k in ("loss", "lr") if k in record)
    if "tokens_per_s" in record:
      self.info += f" {record['tokens_per_s']:,.0f} tok/s"

  def log_eval(self, step: int, eval_metrics: dict) -> None:
    self.writer.write({"step": step, **_scalars(eval_metrics, prefix="eval_"), "elapsed_s": self.elapsed(),
                       "time": time.time()})
    self.mark(step)       # throughput counts training steps only

  def plot(self) -> None:
    if self.main:
      plot_losses(self.metrics_path, self.run_dir / LOSS_PLOT)

  def close(self) -> None:
    self.writer.close()


def _start_step(train_state, total_steps: int, checkpointer: Checkpointer | None) -> int:
  """The train state's completed steps, checked against ``total_steps`` and the checkpoints already there."""
  start = _state_step(train_state)
  if start > total_steps:
    raise SpecjaxError(f"the train state is already at step {start}, past total_steps={total_steps}: "
                       "raise --steps or use another --run-dir")
  if checkpointer is not None:
    latest = checkpointer.latest_step()
    if latest is not None and latest > start:
      raise SpecjaxError(f"{checkpointer.directory} already holds checkpoints up to step {latest} but this run "
                         f"starts at step {start}: resume from it or use another --run-dir")
  return start


def _record_step(run: _RunLog, sched: _Schedule, step: int, train_state, metrics: dict) -> None:
  """After step ``step``: the throughput mark past the first (compiling) step, the log line, the eval."""
  last = step == sched.total_steps
  if step == run.start + 1 and not last:
    # The first step includes compilation: throughput is measured from its end.
    jax.block_until_ready(metrics)
    run.mark(step)
  if step % sched.log_every == 0 or last:
    run.log(step, metrics, sched.tokens_per_batch)
  if sched.eval_every and step % sched.eval_every == 0:
    run.log_eval(step, sched.eval_fn(train_state))


def _save(checkpointer: Checkpointer, run: _RunLog, sched: _Schedule, step: int, train_state,
          batcher: Batcher) -> None:
  """The checkpoint of step ``step`` (meta: ``extra_meta``, the batcher position, ``elapsed_s``), the plot."""
  if _state_step(train_state) != step:
    raise SpecjaxError(f"after step {step} the train state says step {_state_step(train_state)}: "
                       "step_fn must add 1 to train_state['step']")
  meta = {**(sched.extra_meta or {}), DATA_KEY: batcher.position(), "elapsed_s": run.elapsed()}
  checkpointer.save(step, train_state, meta, force=step == sched.total_steps)
  run.plot()
  run.mark(step)


def _step_loop(step_fn: Callable, train_state, batcher: Batcher, checkpointer: Checkpointer | None,
               sched: _Schedule, run: _RunLog, progress: bool):
  """Steps ``run.start`` + 1 … ``total_steps`` under a progress bar; returns the last train state."""
  with progress_lib.progress(progress) as bar:
    task = bar.add_task("train", total=sched.total_steps, completed=run.start, info=run.info)
    for step in range(run.start + 1, sched.total_steps + 1):
      batch = batcher.next()
      train_state, metrics = step_fn(train_state, batch)
      _record_step(run, sched, step, train_state, metrics)
      bar.update(task, completed=step, info=run.info)
      if checkpointer is not None and checkpointer.should_save(step, force=step == sched.total_steps):
        _save(checkpointer, run, sched, step, train_state, batcher)
  return train_state


def train(step_fn: Callable, train_state, batcher: Batcher, *, total_steps: int, run_dir: str | Path,
          checkpointer: Checkpointer | None, log_every: int = 10, tokens_per_batch: int | None = None,
          progress: bool = True, eval_fn: Callable | None = None, eval_every: int = 0,
          extra_meta: dict | None = None):
  """Run ``step_fn`` from ``train_state["step"]`` + 1 to ``total_steps``; returns the final train state.

  Logs every ``log_every`` steps and at the last; ``eval_fn(train_state) -> dict of scalars`` every
  ``eval_every`` steps (0: never); checkpoints when ``checkpointer`` says so and at the last step (meta:
  ``extra_meta`` + the batcher position + ``elapsed_s``).
  """
  sched = _Schedule(total_steps=total_steps, log_every=log_every, eval_every=eval_every, eval_fn=eval_fn,
                    tokens_per_batch=tokens_per_batch, extra_meta=extra_meta)
  sched.check()
  start = _start_step(train_state, total_steps, checkpointer)
  run_dir = Path(run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  compile_cache.enable()     # a resumed run reads its training step back instead of compiling it again
  run = _RunLog(run_dir, start)
  try:
    train_state = _step_loop(step_fn, train_state, batcher, checkpointer, sched, run, progress)
  finally:
    run.close()
  if checkpointer is not None:
    checkpointer.wait_until_finished()
  run.plot()
  return train_state
