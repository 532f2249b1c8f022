"""Several processes (hosts) as one JAX program: ``jax.distributed.initialize``, wired to flags and environment.

Every process runs the same command; after ``initialize`` ``jax.devices()`` lists the devices of all of them,
a mesh (``sharding.make_mesh``) spans them, and each jitted step runs SPMD on every process at once.  Where
the three values come from, first found wins:

  1. flags: ``--coordinator HOST:PORT --num-processes N --process-id I``;
  2. the environment: ``SPECJAX_COORDINATOR``, ``SPECJAX_NUM_PROCESSES``, ``SPECJAX_PROCESS_ID``;
  3. ``--distributed`` alone (or ``SPECJAX_DISTRIBUTED=1``): jax's own cluster detection, which reads what
     SLURM, Open MPI, Kubernetes (JobSet) and Cloud TPU set for each process.

With none of them the run is single-process and nothing happens.  On CPU processes (tests, a laptop with
several processes) the cross-process collectives go over gloo.  Host-side results come back with
``to_host``, which gathers the pieces other processes hold; ``is_main`` says which process prints.
"""
from __future__ import annotations

import os

import numpy as np

from specjax.errors import SpecjaxError
from specjax.settings import environment

ENV_COORDINATOR = "SPECJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SPECJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPECJAX_PROCESS_ID"
ENV_AUTO = "SPECJAX_DISTRIBUTED"

_STARTED = False


def settings(coordinator=None, num_processes=None, process_id=None, auto=False, environ=None) -> dict | None:
  """The initialize arguments from flags, then the environment; None for a single-process run."""
  env = environment() if environ is None else environ

  def pick(flag, name, cast):
    if flag is not None:
      return flag
    raw = env.get(name)
    if raw in (None, ""):
      return None
    try:
      return cast(raw)
    except ValueError:
      raise SpecjaxError(f"${name}={raw!r} is not a valid {cast.__name__}") from None

  coord = pick(coordinator, ENV_COORDINATOR, str)
  n = pick(num_processes, ENV_NUM_PROCESSES, int)
  pid = pick(process_id, ENV_PROCESS_ID, int)
  auto = auto or env.get(ENV_AUTO, "") not in ("", "0")
  given = [v is not None for v in (coord, n, pid)]
  if not any(given):
    return {} if auto else None
  if not all(given):
    missing = [f for f, g in zip(("--coordinator", "--num-processes", "--process-id"), given) if not g]
    raise SpecjaxError(f"a multi-process run needs --coordinator, --num-processes and --process-id (or their "
                       f"SPECJAX_* variables): {', '.join(missing)} missing (or pass --distributed alone to let "
                       "jax read them from the cluster launcher)")
  if ":" not in coord:
    raise SpecjaxError(f"--coordinator {coord!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
  if n < 1 or not 0 <= pid < n:
    raise SpecjaxError(f"--process-id {pid} must be in 0..{n - 1} for --num-processes {n}")
  return {"coordinator_address": coord, "num_processes": n, "process_id": pid}


def initialize(coordinator=None, num_processes=None, process_id=None, auto=False, log=None) -> bool:
  """Join the multi-process run these settings describe (once per process); False if single-process.
  Must run before anything touches a device."""
  global _STARTED
  kw = settings(coordinator, num_processes, process_id, auto)
  if kw is None or _STARTED:
    return _STARTED
  import jax
  _native_stdout_to_stderr()
  jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU devices only; GPUs use NCCL
  try:
    jax.distributed.initialize(**kw)
  except (ValueError, RuntimeError) as e:
    raise SpecjaxError(f"jax.distributed.initialize failed ({e}); check --coordinator (reachable from every "
                       "process, the same on all), --num-processes and a distinct --process-id each") from e
  _STARTED = True
  if log:
    log(f"[specjax] process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local "
        f"of {jax.device_count()} devices")
  return True


def _native_stdout_to_stderr() -> None:
  """Native libraries (gloo) print connection chatter to file descriptor 1; a command's stdout carries its one
  JSON result.  Point fd 1 at stderr and give Python's ``sys.stdout`` a private copy of the real stdout."""
  import sys
  sys.stdout.flush()
  real = os.dup(1)
  os.dup2(2, 1)
  sys.stdout = os.fdopen(real, "w", buffering=1)


def is_main() -> bool:
  """Process 0 (or the only one): the one that prints results and writes files."""
  if not _STARTED:
    return True
  import jax
  return jax.process_index() == 0


def to_host(x) -> np.ndarray:
  """A jax array as one numpy array on this host, gathering the shards other processes hold."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
