import os

# Tests run on the CPU with deterministic, full-precision math.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The native CPU kernels wherever they apply, without the first-use measurement that may choose XLA for some
# weight sizes on some machines (specjax/measure/kernel_paths.py; tests/kernels/test_kernel_choices.py covers it):
# the same executables, and the same counts of compiled executables, on every machine.
os.environ.setdefault("SPECJAX_NATIVE", "1")
# bench's read-bandwidth probe (before and after every run it times) on 16 MiB, not 1 GiB: the tests read its
# keys, never its value, and the 1 GiB probe was about 3 s a call, two calls a bench run, in every process.
os.environ.setdefault("SPECJAX_PROBE_MB", "16")
# fp32 activations beside quantized weights unless a test asks for integer ones: the default differs by CPU
# (int8 where the integer-dot kernel has VNNI, dispatch.default_activations), and the suite should run the same
# executables on every machine; test_qdot.py and the real-model tests run the integer paths by name, and one
# test checks the default itself.  (With the CPU's default on this Xeon the cold suite took 18:25, not ~14.)
os.environ.setdefault("SPECJAX_ACTIVATIONS", "fp32")

# One build of the native kernels for the whole run: tests that start a process on a fresh SPECJAX_CACHE (an
# empty cache is their subject) would otherwise each compile the kernels again, ~13 s of a core apiece.
if "SPECJAX_KERNEL_DIR" not in os.environ:
  from specjax import settings as _settings
  os.environ["SPECJAX_KERNEL_DIR"] = str(_settings.cache_root() / "kernels")

# Tests compile several hundred small programs from an empty cache in CI, and compiling was half of a cold
# run's time.  At these sizes XLA:CPU's code quality buys nothing (the heavy matmuls and attention are the
# native kernels or Eigen, built optimised either way), so the suite asks for cheap compiles: no LLVM backend
# optimisation (about a third of each compile), the classic elemental emitters instead of the MLIR fusion
# emitters (a further ~40% of the backend compile on Xeon 167), one codegen split and no expensive LLVM passes.
# The same HLO; only the generated machine code differs (results agree to rounding).  Subprocesses inherit these
# (tests append their own flags, e.g. a host device count).
_CHEAP_COMPILES = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                   "--xla_cpu_parallel_codegen_split_count=1 --xla_llvm_disable_expensive_passes=true")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _CHEAP_COMPILES).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run, on from the start (the run's SPECJAX_CACHE, which
# `api.load` switches on anyway): a program one test file or worker compiled is read back by the next instead
# of compiled again (modules drop their in-memory executables, below).  SPECJAX_COMPILE_CACHE=0 turns it off.
from specjax.runtime import compile_cache as _compile_cache  # noqa: E402

_compile_cache.enable()

import gc  # noqa: E402

import pytest  # noqa: E402

# The helpers' own asserts (tests/helpers/) are reported like a test's.
pytest.register_assert_rewrite("tests.helpers")


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


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  """A tiny random GGUF checkpoint (``helpers.CFG``) written once per test module: its path."""
  from tests.helpers import CFG, random_hf_params, write_gguf
  return str(write_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", CFG, random_hf_params(CFG, seed=3)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """The same tiny checkpoint (written again, in a directory of its own) loaded by ``api.load``, once per test
  module: test_serving.py, test_suffix.py (a test file with a ``tiny`` of its own uses that one)."""
  from specjax import api
  from tests.helpers import CFG, random_hf_params, write_gguf
  path = write_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf", CFG, random_hf_params(CFG, seed=3))
  return api.load(str(path))
