"""The ``specjax`` command line: a thin layer over ``specjax.api`` (gin is applied here, nowhere else).

Every measuring command takes ``--json`` and then prints exactly one JSON object on stdout; progress and logs
go to stderr.  Bad input prints one line ``specjax: error: ...`` and exits with status 2.  Each command group
(``decoding``, ``experiments``, ``machine``, ``serving``, ``cache``) registers its own parsers and commands;
``common`` holds the flags and checks they share.
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading

from specjax import settings
from specjax.cli import cache, common, decoding, experiments, flags, serving
from specjax.cli import costs as machine

GROUPS = (decoding, experiments, machine, serving, cache)


def build_parser() -> argparse.ArgumentParser:
  """The parser of every command; each parsed namespace carries its command's function as ``run``."""
  parser = flags.Parser(prog="specjax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  for group in GROUPS:
    for name, fn in group.register(sub).items():
      sub.choices[name].set_defaults(run=fn)
  return parser


def _error(line: str) -> None:
  """The one error line, in a single write (helper threads may log at the same moment)."""
  sys.stderr.write(line + "\n")
  sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
  """Run one command: ``argv`` (default: this process's command line, ``sys.argv[1:]``); returns the exit
  status.  Called without ``argv`` (the ``specjax`` script, ``python -m specjax``) it ends the process itself
  once the command is done (``_exit``)."""
  args = build_parser().parse_args(argv)
  rc = _run(args)
  if argv is None and not getattr(args, "coordinator", None):
    _exit(rc)
  return rc


def _exit(rc: int) -> None:
  """End the process now with status ``rc``, skipping only the interpreter's teardown (freeing every module
  and object, the XLA client and the executables one by one: ~0.3 s after a generate): the output is
  flushed and every ``atexit`` handler runs as in a normal exit (logging, jax's own clean-up, finalizers).
  Returns without ending anything while another thread runs (a normal exit waits for it) or if the output
  cannot be flushed (a closed pipe: Python reports it as usual)."""
  if not isinstance(rc, int) or threading.active_count() > 1:
    return
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except (OSError, ValueError):
    return
  atexit._run_exitfuncs()
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except (OSError, ValueError):
    pass
  os._exit(rc)


def _run(args) -> int:
  from specjax.errors import SpecjaxError
  try:
    if hasattr(args, "coordinator"):       # before anything touches a device
      from specjax.parallel import distributed
      distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed,
                             log=common.log)
    return args.run(args)
  except SpecjaxError as e:
    # one line: gin appends "In call to configurable ..." to errors raised inside a bound function
    _error(f"specjax: error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
    return 2
  except KeyboardInterrupt:
    _error("specjax: interrupted")
    return 130
  except (OSError, MemoryError) as e:
    _error(f"specjax: error: {type(e).__name__}: {e}")
    return 2
  except Exception as e:  # noqa: BLE001 -- keep the one-line contract; SPECJAX_DEBUG=1 shows the traceback
    if settings.debug():
      raise
    _error(f"specjax: error: unexpected {type(e).__name__}: {e} (set SPECJAX_DEBUG=1 for a traceback)")
    return 1
