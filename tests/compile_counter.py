"""Count XLA compilations (backend compiles) inside a block, via jax.monitoring."""
import contextlib

import jax

_COUNT = [0]
_REGISTERED = [False]


def _listener(event: str, duration: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COUNT[0] += 1


@contextlib.contextmanager
def count_compiles():
  """Yields a callable returning how many backend compilations happened since entering."""
  if not _REGISTERED[0]:
    jax.monitoring.register_event_duration_secs_listener(_listener)
    _REGISTERED[0] = True
  start = _COUNT[0]
  yield lambda: _COUNT[0] - start
