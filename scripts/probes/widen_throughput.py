"""The arithmetic ceiling of the AVX-512 int4 kernel on this CPU, measured in registers (no memory traffic).

  python scripts/probes/widen_throughput.py

Compiles and runs a small C++ loop (needs a C++ compiler and AVX-512F): 512-bit multiply-adds a second on
one core, and the int4 path's work per 16 weights a second (shift + ``vpermps`` table lookup + multiply-add,
as ``cpu_qmatmul.cc``'s Nibble512) beside the alternative tried and dropped (mask + unsigned conversion +
multiply-add).  Ten independent chains each, so latency does not bound them.  Times two cores and sixteen
weights per operation gives the G weights/s a one-row int4 matmul could reach if nothing but that arithmetic
cost anything; docs/benchmarks-log.md ("Quantized weights") sets it beside the kernel's measured rates.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#define R(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
__attribute__((target("avx512f,avx512bw"))) int main() {
  const __m512 m = _mm512_set1_ps(0.9999999f), b = _mm512_set1_ps(1e-7f);
  const int64_t n = 200000000;
#define D(i) __m512 a##i = _mm512_set1_ps(1.0f + i);
  R(D)
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n; ++k) {
#define F(i) a##i = _mm512_fmadd_ps(a##i, m, b);
    R(F)
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float r = 0;
#define S(i) r += _mm512_reduce_add_ps(a##i);
  R(S)
  printf("fma %.3f\n", n * 10 / s / 1e9);
  __m512i v = _mm512_set1_epi32(0x12345678);
  const __m512 tab = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n / 4; ++k) {
    v = _mm512_add_epi32(v, _mm512_set1_epi32(1));
#define P(i) a##i = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 3 * i), tab), m, a##i);
    R(P)
  }
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  R(S)
  printf("shift_permute_fma %.3f\n", n / 4 * 10 / s / 1e9);
  t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n / 4; ++k) {
    v = _mm512_add_epi32(v, _mm512_set1_epi32(1));
#define C(i) a##i = _mm512_fmadd_ps(_mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15 << (3 * i)))), m, a##i);
    R(C)
  }
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  R(S)
  printf("mask_convert_fma %.3f\n", n / 4 * 10 / s / 1e9);
  return r == 12345.0f;   // keeps the chains live
}
"""


def main() -> int:
  cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if cxx is None:
    print("no C++ compiler on PATH", file=sys.stderr)
    return 1
  with tempfile.TemporaryDirectory() as d:
    src, exe = Path(d) / "widen.cc", Path(d) / "widen"
    src.write_text(SOURCE)
    subprocess.run([cxx, "-O2", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
  if "fma" not in out.stdout:
    print(f"the probe did not run (an AVX-512F CPU is needed): {out.stderr.strip()}", file=sys.stderr)
    return 1
  rates = {k: float(v) for k, v in (line.split() for line in out.stdout.split("\n") if line.strip())}
  print(f"512-bit multiply-adds, one core:          {rates['fma']:.2f} G/s")
  for name in ("shift_permute_fma", "mask_convert_fma"):
    g = rates[name]
    print(f"{name:24s} per 16 weights, one core: {g:.2f} G/s -> {2 * 16 * g:.0f} G weights/s on two cores")
  return 0


if __name__ == "__main__":
  sys.exit(main())
