"""Count XLA compilations (backend compiles) inside a block, via ``jax.monitoring``: what an experiment reports
as "compiles after warm-up" (a served trace must compile nothing once warm) and what the tests assert."""
from __future__ import annotations

import contextlib

import jax

_NAMES: list[str] = []
_REGISTERED = [False]


def _listener(event: str, duration: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _NAMES.append(str(kwargs.get("fun_name", "?")))


@contextlib.contextmanager
def count_compiles(names: list | None = None):
  """Yields a callable returning how many backend compilations happened since entering; if ``names`` is
  given, the compiled functions' names are appended to it on exit."""
  if not _REGISTERED[0]:
    jax.monitoring.register_event_duration_secs_listener(_listener)
    _REGISTERED[0] = True
  start = len(_NAMES)
  try:
    yield lambda: len(_NAMES) - start
  finally:
    if names is not None:
      names.extend(_NAMES[start:])
