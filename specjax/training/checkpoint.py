"""Training checkpoints (orbax-checkpoint): the train state as arrays, plus a JSON ``meta`` beside it.

Layout: ``<directory>/<step>/state`` (orbax's OCDBT array store) and ``<directory>/<step>/meta`` (JSON: what
the caller passed — e.g. the data position — plus ``step``, ``fingerprint`` and a CRC-32 of every array).

Atomicity: orbax writes a step into ``<step>.orbax-checkpoint-tmp-<n>`` and renames it to ``<step>`` only when
every item is written (on a local disk; on GCS a ``commit_success.txt`` marks it instead), and it lists only
finalized step directories, so a save killed half-way is never a complete checkpoint; leftover temporary
directories are removed the next time a ``Checkpointer`` opens the directory.  Saves are synchronous (async
checkpointing off, and ``wait_until_finished`` after each): once ``save`` returns the step is on disk, and a
SIGKILL right after cannot lose it.

The array store has no checksum of its own (a flipped bit in a data file restores silently different values),
so ``meta`` carries a CRC-32 per array, verified on restore.
"""
from __future__ import annotations

import gc
import json
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from specjax.errors import CheckpointError

META_CHECKSUMS = "array_crc32"


def _one_line(e: BaseException, limit: int = 200) -> str:
  text = str(e).strip().split("\n")[0].split(" See full TensorStore details")[0].strip() or type(e).__name__
  return text if len(text) <= limit else text[:limit] + "…"


def _collect_quietly() -> None:
  """A failed orbax read leaves sibling read coroutines that raise when collected ("Exception ignored in
  <coroutine ...>" tracebacks after our one-line error): collect them now, silently."""
  hook = sys.unraisablehook
  sys.unraisablehook = lambda _: None
  try:
    gc.collect()
  finally:
    sys.unraisablehook = hook


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def leaf_names(tree) -> dict[str, Any]:
  """{"params/w": leaf, ...} for every array leaf (dict keys, sequence indices and attribute names alike, so
  a namedtuple on one side and orbax's stored dict on the other give the same names)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def _crc32(x) -> int:
  a = np.ascontiguousarray(np.asarray(jax.device_get(x)))
  return zlib.crc32(a.view(np.uint8).reshape(-1).data) if a.size else 0


def _describe(fp: dict, keys) -> str:
  return ", ".join(f"{k}={fp.get(k, '<unset>')!r}" for k in keys)


class Checkpointer:
  """Saves every ``every`` steps (or when forced), keeps the last ``keep``; refuses checkpoints made for
  another configuration (``fingerprint``: a JSON dict, e.g. drafter kind, dims, target name)."""

  def __init__(self, directory: str | Path, *, every: int, keep: int, fingerprint: dict):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    if not isinstance(every, int) or every < 1:
      raise CheckpointError(f"checkpoint interval must be an integer >= 1, got {every!r}")
    if not isinstance(keep, int) or keep < 1:
      raise CheckpointError(f"checkpoints to keep must be an integer >= 1, got {keep!r}")
    try:
      self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"checkpoint fingerprint must be JSON-serialisable: {_one_line(e)}") from e
    self.directory = Path(directory).absolute()
    self.every = every
    self.keep = keep
    if self.directory.exists() and not self.directory.is_dir():
      raise CheckpointError(f"checkpoint directory {self.directory} is a file: use another --run-dir")
    # What a save killed half-way leaves behind, removed here and now: orbax's own cleanup
    # (cleanup_tmp_directories) may run on a background thread, after a resume has already listed the steps.
    if self.directory.is_dir():
      for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
        shutil.rmtree(tmp, ignore_errors=True)
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=keep, create=False, cleanup_tmp_directories=True,
        enable_async_checkpointing=False)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "meta"),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  # --- saving ---

  def should_save(self, step: int, force: bool = False) -> bool:
    return force or step % self.every == 0

  def save(self, step: int, train_state, meta: dict, force: bool = False) -> bool:
    """Save ``train_state`` (a pytree of arrays; PRNG keys as ``jax.random.key_data``) and ``meta`` (JSON) at
    ``step`` when it is a multiple of ``every`` or ``force``; returns whether it saved (a step already on disk
    is not saved again).  Returns once the checkpoint is complete on disk."""
    if not self.should_save(step, force):
      return False
    if step in self.all_steps():
      return False
    leaves = leaf_names(train_state)
    for name, leaf in leaves.items():
      if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
        raise CheckpointError(f"train state leaf {name!r} is a typed PRNG key: store jax.random.key_data(key)")
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"checkpoint meta must be JSON-serialisable: {_one_line(e)}") from e
    meta = dict(meta, step=step, fingerprint=self.fingerprint,
                **{META_CHECKSUMS: {name: _crc32(leaf) for name, leaf in leaves.items()}})
    self.directory.mkdir(parents=True, exist_ok=True)
    ocp = self._ocp
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                                  meta=ocp.args.JsonSave(meta)), force=True)
    self._mngr.wait_until_finished()
    return True

  # --- reading ---

  def all_steps(self) -> list[int]:
    """Complete checkpoints on disk, oldest first (re-read from the directory)."""
    self._mngr.reload()
    return sorted(self._mngr.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _step_dir(self, step: int) -> Path:
    return self.directory / str(step)

  def _damaged(self, step: int, what: str, e: BaseException | None = None) -> CheckpointError:
    earlier = [s for s in self.all_steps() if s < step]
    fix = (f"delete {self._step_dir(step)} to resume from step {earlier[-1]}" if earlier
           else "delete it and start again without resuming")
    detail = what
    if e is not None:   # orbax and tensorstore name whole paths: keep them relative to the step directory
      detail += ": " + _one_line(e).replace(f"{self._step_dir(step)}/", "").replace("local file ", "")
    return CheckpointError(f"checkpoint at {self._step_dir(step)} is damaged ({detail}): {fix}")

  def read_meta(self, step: int) -> dict:
    """The JSON meta of a complete checkpoint (fingerprint not checked)."""
    ocp = self._ocp
    try:
      meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean "cannot read it"
      raise self._damaged(step, "its meta cannot be read", e) from e
    if not isinstance(meta, dict) or "fingerprint" not in meta:
      raise self._damaged(step, "its meta has no fingerprint")
    return meta

  def check_fingerprint(self, step: int, meta: dict) -> None:
    saved = meta["fingerprint"]
    if saved == self.fingerprint:
      return
    keys = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
    raise CheckpointError(f"checkpoint at {self._step_dir(step)} was made for {_describe(saved, keys)}, this run is "
                          f"{_describe(self.fingerprint, keys)}: use another --run-dir or the matching config")

  def _stored(self, step: int) -> dict[str, tuple[tuple, np.dtype]]:
    """{leaf name: (shape, dtype)} as orbax recorded them."""
    try:
      tree = self._mngr.item_metadata(step)["state"].tree
      return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in leaf_names(tree).items()}
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean "cannot read it"
      raise self._damaged(step, "its array metadata cannot be read", e) from e

  def _check_structure(self, step: int, stored: dict, target) -> None:
    wanted = {name: tuple(x.shape) for name, x in leaf_names(target).items()}
    problems = [f"missing {n}" for n in sorted(set(wanted) - set(stored))]
    problems += [f"unexpected {n}" for n in sorted(set(stored) - set(wanted))]
    problems += [f"{n} is {stored[n][0]} on disk, {wanted[n]} here" for n in sorted(set(stored) & set(wanted))
                 if stored[n][0] != wanted[n]]
    if problems:
      shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
      raise CheckpointError(f"checkpoint at {self._step_dir(step)} does not fit this run's train state ({shown}): "
                            "use another --run-dir or the matching config")

  def restore(self, step: int | None = None, target=None) -> tuple[Any, dict]:
    """(train_state, meta) of ``step`` (default the latest), restored into the structure and dtypes of
    ``target`` (a pytree of arrays or ``jax.ShapeDtypeStruct``s, e.g. from ``jax.eval_shape``)."""
    steps = self.all_steps()
    if step is None:
      if not steps:
        where = ("holds no complete checkpoint" if self.directory.exists() else "does not exist")
        raise CheckpointError(f"cannot resume: {self.directory} {where}; start without resuming, or point "
                              "--run-dir at a run that saved a checkpoint")
      step = steps[-1]
    elif step not in steps:
      raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory} "
                            f"(complete: {steps or 'none'}): pick one of those")
    meta = self.read_meta(step)
    self.check_fingerprint(step, meta)
    stored = self._stored(step)
    if target is not None:
      self._check_structure(step, stored, target)
      target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
    ocp = self._ocp
    error = None
    try:
      state = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    except Exception as e:  # noqa: BLE001
      error = self._damaged(step, "its arrays cannot be read", e)
    if error is not None:
      _collect_quietly()
      raise error
    sums = meta.get(META_CHECKSUMS) or {}
    for name, leaf in leaf_names(state).items():
      # An array restored with a cast (target dtype != stored dtype) cannot be checked against the stored bytes.
      if name in sums and name in stored and stored[name][1] == np.dtype(leaf.dtype) and _crc32(leaf) != sums[name]:
        raise self._damaged(step, f"array {name} does not match its checksum")
    return state, meta

  def wait_until_finished(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
