import os

# Tests run on the CPU with deterministic, full-precision math.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The native CPU kernels wherever they apply, without the first-use measurement that may choose XLA for some
# weight sizes on some machines (specjax/kernels/autotune.py; tests/test_autotune.py covers it): the same
# executables, and the same counts of compiled executables, on every machine.
os.environ.setdefault("SPECJAX_NATIVE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
  """Drop every compiled executable after each test module.

  Each XLA:CPU executable keeps a few memory mappings for its JIT code (a decode loop with unrolled layers: about
  450), and jax's caches keep every executable alive.  A full run compiles a few hundred such loops, which
  passed the kernel's limit of 65,530 mappings per process (vm.max_map_count) late in the suite: XLA then
  aborted or crashed inside whatever compile or serialisation came next."""
  yield
  jax.clear_caches()
  gc.collect()
