"""Fixtures several test files of this folder share (a test file's own fixture of the same name wins)."""
import pytest

from specjax.kernels import native


@pytest.fixture
def restore_isa():
  """The detected instruction-set path again after a test that forced one: test_quant.py, test_qdot.py
  (test_cpu_isa.py has its own, which also ends a pretended CPU)."""
  yield
  if native.available():
    native.set_isa(native.detected_isa())
