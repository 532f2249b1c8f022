"""The AVX-512 (and AVX2) paths on a CPU without them: the kernels built with SPECJAX_EMULATE_SIMD=1 take their
vector intrinsics from SIMDe's portable C (isa.h), so every path's tests run on any x86-64 machine.

Two checks, each in a subprocess (a process loads one kernel library):
1. the per-path tests of test_cpu_isa.py, the per-path live-row test and the quantized kernels' per-path tests
   (test_quant.py; test_qdot.py, whose AVX-512 path is VNNI's) pass with every path emulated -- on a CPU that
   lacks a path (on one with every path, those tests ran each path natively, and check 2 shows the emulation
   computes the same bits: 73 s saved);
2. the emulation computes the hardware's bits: each path this CPU really has gives the same outputs, bit for
   bit, emulated and native (AVX2 on an AVX2 machine; AVX2 and AVX-512 on an AVX-512 one).  The emulated
   `_mm512_reduce_add_ps` adds in GCC's order (isa.h); a library built by another compiler may differ there.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specjax.kernels import native

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set paths only"),
    pytest.mark.skipif(not native.available(), reason="native CPU kernels not built here"),
]
pytest.importorskip("simde_py", reason="SIMDe's headers (pip install simde-py: part of the [test] extra)")


def _emulated_env():
  env = dict(os.environ, SPECJAX_EMULATE_SIMD="1", SPECJAX_NATIVE="1", JAX_PLATFORMS="cpu")
  env.pop("SPECJAX_CPU_ISA", None)
  return env


def test_every_path_passes_its_tests_under_emulation():
  if native.detected_isa() == native.ISAS[-1]:
    pytest.skip("this CPU runs every path natively (test_cpu_isa.py, test_quant.py); the emulation's bits are "
                "checked against them in test_emulation_gives_the_hardware_bits")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
       "tests/kernels/test_cpu_isa.py", "tests/kernels/test_cpu_matmul.py::test_live_rows_per_group",
       "tests/kernels/test_quant.py::test_kernel_equals_reference",
       "tests/kernels/test_quant.py::test_kernel_live_rows_and_row_bits",
       "tests/kernels/test_qdot.py::test_each_path_equals_the_integer_reference",
       "tests/kernels/test_qdot.py::test_a_row_has_the_same_bits_however_many_rows",
       "tests/kernels/test_qdot.py::test_tiled_weights_give_the_portable_row_bits"],
      cwd=ROOT, env=_emulated_env(), capture_output=True, text=True, timeout=900)
  tail = proc.stdout[-3000:] + proc.stderr[-2000:]
  assert proc.returncode == 0, tail
  assert "skipped" not in proc.stdout.splitlines()[-1], f"a path was skipped under emulation:\n{tail}"


def test_emulation_gives_the_hardware_bits(tmp_path):
  from tests.helpers import isa_outputs
  here = isa_outputs.outputs()
  out = tmp_path / "emulated.npz"
  proc = subprocess.run([sys.executable, "-m", "tests.helpers.isa_outputs", str(out)], cwd=ROOT, env=_emulated_env(),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  emulated = dict(np.load(out))
  assert any(key.startswith("avx512/") for key in emulated), "the emulating build did not run the AVX-512 path"
  compared = [key for key in here if key.split("/")[0] != "portable"]
  for key in compared:
    np.testing.assert_array_equal(emulated[key], here[key], err_msg=f"{key}: emulated vs this CPU")
  if native.detected_isa() == "portable":
    pytest.skip("this CPU has no vector path to compare the emulation with")
