"""Would Intel AMX tiles speed up the int4 matmul at one row?  A self-contained probe (tried, not adopted).

  python scripts/probes/amx_int4_probe.py [N D ...]      # default: the 1.5B's w_qkv, w_gate_up and w_down shapes

Compiles and runs a C++ probe (needs a C++ compiler, Linux, and a CPU with AMX-TILE + AMX-INT8, i.e. an Intel
Xeon from Sapphire Rapids on; elsewhere it says so and exits).  One thread, one row of x, random int4 weights
in the kernels' Q4_1 layout (cpu_qmatmul.cc), checked against a float64 reference.

The method: x split per 32-column block into four signed 8-bit limbs on a power-of-two scale (exact to about
2^-28 of the block's largest |x|: the activations stay fp32-accurate); the stored int4 bytes p = lo + 16 hi
go into the tile unit as they are, with (p & 0xF0) as a second tile, since
sum lo x[j] + hi x[j+16] = sum p x[j] + (p & 0xF0) (x[j+16]/16 - x[j]); a block-diagonal tile of x's limbs
separates four blocks (each with its own scale) and four limbs in one TDPBUSD, whose 16 int32 lanes per weight
row are then scaled and summed in fp32.  Per 16 weight rows x 128 columns: 4 tile loads, 2 TDPBUSD, 1 tile
store, and ~150 vector micro-ops (the masked copy, the scales, the limb factors).

It prints the probe's G weights/s, and the cost of the tile operations alone; docs/benchmarks-log.md ("Quantized
weights": AMX) sets them beside the AVX-512 kernel's.  Measured on an Intel Xeon family 6 model 207: the tile
operations alone took ~80% of the probe's time, and a full path built on this design came out level with the
AVX-512 kernel at one row, so the kernels do not use AMX.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

struct TileCfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

struct Limbs { std::vector<int8_t> b1, b2; std::vector<float> f, xsum; };

// x's limbs per 4-block set: B tiles [16 k-rows][16 columns x 4 bytes], column 4q + l = limb l of block q
static Limbs Split(const float* x, int64_t D) {
  const int64_t G = D / 32;
  Limbs p;
  p.b1.assign((G + 3) / 4 * 1024, 0); p.b2.assign((G + 3) / 4 * 1024, 0);
  p.f.assign((G + 3) / 4 * 16, 0.f); p.xsum.assign(G, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    double a[16], b[16], mx = 0;
    for (int j = 0; j < 16; ++j) {
      a[j] = x[32 * g + j];
      b[j] = (double)x[32 * g + 16 + j] / 16.0 - (double)x[32 * g + j];
      mx = std::fmax(mx, std::fmax(std::fabs(a[j]), std::fabs(b[j])));
    }
    float s = 0;
    for (int j = 0; j < 32; ++j) s += x[32 * g + j];
    p.xsum[g] = s;
    int e = 0;
    if (mx > 0) std::frexp(mx / 127.0, &e);
    for (int j = 0; j < 16; ++j) {
      for (int which = 0; which < 2; ++which) {
        double r = which ? b[j] : a[j];
        int8_t* dst = (which ? p.b2.data() : p.b1.data()) + (g / 4) * 1024;
        for (int l = 0; l < 4; ++l) {
          const double unit = std::ldexp(1.0, e - 7 * l), q = std::nearbyint(r / unit);
          r -= q * unit;
          const int k = 16 * (g % 4) + j;
          dst[(k / 4) * 64 + 4 * (4 * (g % 4) + l) + (k % 4)] = (int8_t)q;
        }
      }
    }
    for (int l = 0; l < 4; ++l) p.f[g * 4 + l] = (float)std::ldexp(1.0, e - 7 * l);
  }
  return p;
}

static bool g_tiles_only = false;

__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))
static void Rows(const uint8_t* w, const float* scale, const float* offset, int64_t N, int64_t D, const Limbs& p, float* y) {
  const int64_t G = D / 32, rb = D / 2;
  TileCfg cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 5; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }   // C, A1, A2, B1, B2
  _tile_loadconfig(&cfg);
  alignas(64) uint8_t a2[16 * 64];
  alignas(64) int32_t P[16 * 16];
  const __m512i hi = _mm512_set1_epi8((char)0xF0);
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t n0 = 0; n0 + 16 <= N; n0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      if (!g_tiles_only)
        for (int i = 0; i < 16; ++i)
          _mm512_store_si512(a2 + 64 * i, _mm512_and_si512(_mm512_loadu_si512(w + (n0 + i) * rb + g0 * 16), hi));
      _tile_zero(0);
      _tile_loadd(1, w + n0 * rb + g0 * 16, rb);
      _tile_loadd(2, a2, 64);
      _tile_loadd(3, p.b1.data() + g0 / 4 * 1024, 64);
      _tile_loadd(4, p.b2.data() + g0 / 4 * 1024, 64);
      _tile_dpbusd(0, 1, 3);
      _tile_dpbusd(0, 2, 4);
      _tile_stored(0, P, 64);
      if (g_tiles_only) continue;
      const __m512 f4 = _mm512_loadu_ps(p.f.data() + g0 * 4);
      for (int i = 0; i < 16; ++i) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(P + 16 * i)), f4);
        const __m512 s = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(scale + (n0 + i) * G + g0)));
        acc[i] = _mm512_fmadd_ps(t, s, acc[i]);
      }
    }
    for (int i = 0; i < 16; ++i) {
      float o = 0;
      for (int64_t g = 0; g < G; ++g) o += offset[(n0 + i) * G + g] * p.xsum[g];
      y[n0 + i] = _mm512_reduce_add_ps(acc[i]) + o;
    }
  }
  _tile_release();
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    printf("no AMX here (the OS did not grant the tile state)\n");
    return 2;
  }
  for (int a = 1; a + 1 < argc; a += 2) {
    const int64_t N = atoll(argv[a]), D = atoll(argv[a + 1]);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<uint8_t> w(N * D / 2);
    for (auto& b : w) b = rng() & 255;
    std::vector<float> sc(N * D / 32), of(N * D / 32), x(D), y(N);
    for (auto& s : sc) s = 1e-3f * (1 + (rng() % 1000) / 1000.f);
    for (auto& s : of) s = -8e-3f * (1 + (rng() % 1000) / 1000.f);
    for (auto& v : x) v = nd(rng);
    const Limbs p = Split(x.data(), D);
    g_tiles_only = false;
    Rows(w.data(), sc.data(), of.data(), N, D, p, y.data());
    double err = 0, mag = 0;
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0;
      for (int64_t d = 0; d < D; ++d) {
        const uint8_t b = w[n * (D / 2) + (d / 32) * 16 + (d & 15)];
        const int v = (d & 16) ? (b >> 4) : (b & 15);
        ref += (double)(v * sc[n * (D / 32) + d / 32] + of[n * (D / 32) + d / 32]) * x[d];
      }
      err = std::fmax(err, std::fabs(y[n] - ref));
      mag = std::fmax(mag, std::fabs(ref));
    }
    double best[2] = {1e9, 1e9};
    for (int r = 0; r < 30; ++r) {
      for (int only = 0; only < 2; ++only) {
        g_tiles_only = only;
        const auto t0 = std::chrono::steady_clock::now();
        Rows(w.data(), sc.data(), of.data(), N, D, p, y.data());
        best[only] = std::fmin(best[only], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    printf("N=%ld D=%ld: max error %.2g of max |y|; probe %.3f ms = %.1f G weights/s on one core; "
           "the tile operations alone (with the first touch of the weight rows) %.3f ms (%.1f ns per 16 rows x 128 columns)\n",
           N, D, err / mag, best[0] * 1e3, N * D / best[0] / 1e9, best[1] * 1e3, best[1] / (N / 16 * (D / 128)) * 1e9);
  }
}
"""

DEFAULT_SHAPES = [(2048, 1536), (17920, 1536), (1536, 8960)]


def main() -> None:
  args = [int(a) for a in sys.argv[1:]]
  shapes = list(zip(args[::2], args[1::2])) if args else DEFAULT_SHAPES
  cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if cxx is None:
    raise SystemExit("no C++ compiler found")
  with tempfile.TemporaryDirectory() as tmp:
    src, exe = Path(tmp) / "probe.cc", Path(tmp) / "probe"
    src.write_text(SOURCE)
    subprocess.run([cxx, "-O3", "-std=c++20", str(src), "-o", str(exe)], check=True)
    proc = subprocess.run([str(exe), *[str(v) for s in shapes for v in s]], capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode != 0:
      sys.exit(proc.returncode)


if __name__ == "__main__":
  main()
