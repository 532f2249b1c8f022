// specjax CPU kernel: y[M, N] = x[M, D] . w[N, D]^T for a few rows M (decode and verification steps).
//
// Why: a decode step is a chain of matrix-vector products that must stream every weight from DRAM once.
// XLA:CPU reaches about 2/3 of the machine's read bandwidth on them and switches to a packing GEMM as soon as
// M > 1, which makes verifying k drafted tokens cost almost twice a plain step.  This kernel streams each
// weight row once for all M rows (the rows of x stay in L1/L2), split over a few threads (parallel.h).
//
// Exposed to JAX as the XLA FFI target "specjax_matmul_t" (see cpu_matmul.py, which also holds the
// reference implementation and builds this file with the system C++ compiler on first use).
//
// Paths (isa.h picks one at run time from the CPU's features): AVX-512F (16-wide tiles), AVX2+FMA (8-wide
// tiles), and a portable loop the compiler vectorises for the baseline.  Each equals matmul_t_reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"


namespace ffi = xla::ffi;

namespace {

struct Task {
  const float* x;         // [rows, D]
  const float* w;         // [N, D]
  float* y;               // [rows, N]
  const int64_t* row;     // [M]: the rows of x (and y) computed — all of them, or only the live ones
  int64_t M, N, D;
};

// Portable path: rows [n0, n1) of w against all M rows of x, four weight rows at a time.
void RowBlockPortable(const Task& t, int64_t n0, int64_t n1) {
  const int64_t D = t.D, M = t.M, N = t.N;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* w0 = t.w + (n + 0) * D;
    const float* w1 = t.w + (n + 1) * D;
    const float* w2 = t.w + (n + 2) * D;
    const float* w3 = t.w + (n + 3) * D;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = t.x + t.row[m] * D;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t d = 0; d < D; ++d) {
        const float xv = xr[d];
        a0 += w0[d] * xv;
        a1 += w1[d] * xv;
        a2 += w2[d] * xv;
        a3 += w3[d] * xv;
      }
      float* yr = t.y + t.row[m] * N + n;
      yr[0] = a0;
      yr[1] = a1;
      yr[2] = a2;
      yr[3] = a3;
    }
  }
  for (; n < n1; ++n) {
    const float* wr = t.w + n * D;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = t.x + t.row[m] * D;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t d = 0; d < D; ++d) a += wr[d] * xr[d];
      t.y[t.row[m] * N + n] = a;
    }
  }
}

#if SPECJAX_X86
// A tile: 4 weight rows (loaded once per 16 columns) against MB rows of x held in 4*MB accumulators, while
// prefetching the next tile's rows so the memory stream keeps going during the arithmetic.
template <int MB>
SPECJAX_TARGET_AVX512 inline void Tile(const Task& t, const float* w0, int64_t n, int64_t m0, bool prefetch) {
  const int64_t D = t.D;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = t.x + t.row[m0 + i] * D;
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    if (prefetch) {
      const char* p = reinterpret_cast<const char*>(w0 + 4 * D + d);
      _mm_prefetch(p, _MM_HINT_T0);
      _mm_prefetch(p + 4 * D, _MM_HINT_T0);
      _mm_prefetch(p + 8 * D, _MM_HINT_T0);
      _mm_prefetch(p + 12 * D, _MM_HINT_T0);
    }
    const __m512 w_0 = _mm512_loadu_ps(w0 + d), w_1 = _mm512_loadu_ps(w0 + D + d);
    const __m512 w_2 = _mm512_loadu_ps(w0 + 2 * D + d), w_3 = _mm512_loadu_ps(w0 + 3 * D + d);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr[i] + d);
      acc[i][0] = _mm512_fmadd_ps(w_0, xv, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w_1, xv, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(w_2, xv, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(w_3, xv, acc[i][3]);
    }
  }
  if (d < D) {  // tail columns: masked loads read zeros past the end
    const __mmask16 k = static_cast<__mmask16>((1u << (D - d)) - 1);
    const __m512 w_0 = _mm512_maskz_loadu_ps(k, w0 + d), w_1 = _mm512_maskz_loadu_ps(k, w0 + D + d);
    const __m512 w_2 = _mm512_maskz_loadu_ps(k, w0 + 2 * D + d), w_3 = _mm512_maskz_loadu_ps(k, w0 + 3 * D + d);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(k, xr[i] + d);
      acc[i][0] = _mm512_fmadd_ps(w_0, xv, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w_1, xv, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(w_2, xv, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(w_3, xv, acc[i][3]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float* yr = t.y + t.row[m0 + i] * t.N + n;
    for (int r = 0; r < 4; ++r) yr[r] = _mm512_reduce_add_ps(acc[i][r]);
  }
}

SPECJAX_TARGET_AVX512 void RowBlockAvx512(const Task& t, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* w0 = t.w + n * t.D;
    const bool prefetch = n + 8 <= n1;
    int64_t m = 0;
    for (; m + 6 <= t.M; m += 6) Tile<6>(t, w0, n, m, prefetch);
    switch (t.M - m) {
      case 1: Tile<1>(t, w0, n, m, prefetch); break;
      case 2: Tile<2>(t, w0, n, m, prefetch); break;
      case 3: Tile<3>(t, w0, n, m, prefetch); break;
      case 4: Tile<4>(t, w0, n, m, prefetch); break;
      case 5: Tile<5>(t, w0, n, m, prefetch); break;
      default: break;
    }
  }
  if (n < n1) RowBlockPortable(t, n, n1);
}

// AVX2: the same tile, 8 columns at a time.  16 ymm registers hold 4*MB accumulators, MB rows of x and one
// weight row, so MB <= 3; the weight rows are loaded one at a time and each feeds MB multiply-adds.
SPECJAX_TARGET_AVX2 inline float HorizontalSum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

template <int MB>
SPECJAX_TARGET_AVX2 inline void Tile8(const Task& t, const float* w0, int64_t n, int64_t m0, bool prefetch) {
  const int64_t D = t.D;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = t.x + t.row[m0 + i] * D;
  __m256 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    if (prefetch && (d & 15) == 0) {   // one prefetch per 64-byte line of each of the next tile's rows
      const char* p = reinterpret_cast<const char*>(w0 + 4 * D + d);
      _mm_prefetch(p, _MM_HINT_T0);
      _mm_prefetch(p + 4 * D, _MM_HINT_T0);
      _mm_prefetch(p + 8 * D, _MM_HINT_T0);
      _mm_prefetch(p + 12 * D, _MM_HINT_T0);
    }
    __m256 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(xr[i] + d);
    for (int r = 0; r < 4; ++r) {
      const __m256 wv = _mm256_loadu_ps(w0 + r * D + d);
      for (int i = 0; i < MB; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  float tail[MB][4] = {};
  for (; d < D; ++d)   // at most 7 tail columns
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < MB; ++i) tail[i][r] = std::fma(w0[r * D + d], xr[i][d], tail[i][r]);
  for (int i = 0; i < MB; ++i) {
    float* yr = t.y + t.row[m0 + i] * t.N + n;
    for (int r = 0; r < 4; ++r) yr[r] = HorizontalSum256(acc[i][r]) + tail[i][r];
  }
}

// AVX2 with at most 3 rows of x (a decode step, a short verification): one weight row at a time, so each
// thread reads a single sequential stream, prefetched 512 bytes ahead.  On a 2-core Zen 3 (no AVX-512) this
// streamed the real model's matrices ~8% faster than four interleaved row streams (Tile8) at M = 1 and ~4% at
// M = 3; with more rows of x the tile's reuse of each loaded weight vector wins.
template <int MB>
SPECJAX_TARGET_AVX2 inline void RowSeq8(const Task& t, int64_t n) {
  // The same arithmetic as Tile8 (one 8-lane accumulator per row pair, the same tail, the same final sum), so
  // a row of y has the same bits whichever path and however many rows of x computed it.
  constexpr int64_t kAhead = 512 / sizeof(float);
  const int64_t D = t.D;
  const float* w = t.w + n * D;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = t.x + t.row[i] * D;
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    if ((d & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + d + kAhead), _MM_HINT_T0);
    const __m256 wv = _mm256_loadu_ps(w + d);
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[i] + d), acc[i]);
  }
  float tail[MB] = {};
  for (; d < D; ++d)   // at most 7 tail columns
    for (int i = 0; i < MB; ++i) tail[i] = std::fma(w[d], xr[i][d], tail[i]);   // as Tile8: explicit fma
  for (int i = 0; i < MB; ++i) t.y[t.row[i] * t.N + n] = HorizontalSum256(acc[i]) + tail[i];
}

SPECJAX_TARGET_AVX2 void RowBlockAvx2(const Task& t, int64_t n0, int64_t n1) {
  if (t.M <= 3) {   // rows past the last whole group of 4 go to the portable loop, as with Tile8
    const int64_t n_end = n0 + (n1 - n0) / 4 * 4;
    for (int64_t n = n0; n < n_end; ++n) {
      switch (t.M) {
        case 1: RowSeq8<1>(t, n); break;
        case 2: RowSeq8<2>(t, n); break;
        default: RowSeq8<3>(t, n); break;
      }
    }
    if (n_end < n1) RowBlockPortable(t, n_end, n1);
    return;
  }
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* w0 = t.w + n * t.D;
    const bool prefetch = n + 8 <= n1;
    int64_t m = 0;
    for (; m + 3 <= t.M; m += 3) Tile8<3>(t, w0, n, m, prefetch);
    switch (t.M - m) {
      case 1: Tile8<1>(t, w0, n, m, prefetch); break;
      case 2: Tile8<2>(t, w0, n, m, prefetch); break;
      default: break;
    }
  }
  if (n < n1) RowBlockPortable(t, n, n1);
}
#endif

void RowBlock(const Task& t, int64_t n0, int64_t n1) {
#if SPECJAX_X86
  switch (specjax::ActiveIsa()) {
    case specjax::kAvx512: return RowBlockAvx512(t, n0, n1);
    case specjax::kAvx2: return RowBlockAvx2(t, n0, n1);
    default: break;
  }
#endif
  RowBlockPortable(t, n0, n1);
}

// The rows of x that matter come from `rows` (rows.h: draft slots nobody proposed this step, a finished
// sequence, an empty serving slot are set to zero in y and cost nothing); the rows of w are split over the
// caller and the helper threads (rows.h).
ffi::Error MatmulT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  const int64_t n_rows = static_cast<int64_t>(rows.element_count());
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || n_rows < 2) {
    return ffi::Error::InvalidArgument(
        "specjax_matmul_t expects x [M, D], w [N, D] and rows [group, live...]");
  }
  const int64_t N = wd[0], D = xd[1];
  specjax::LiveRows live;
  if (const char* bad = live.Collect(rows.typed_data(), n_rows, xd[0], N, y->typed_data())) {
    return ffi::Error::InvalidArgument(std::string("specjax_matmul_t: ") + bad);
  }
  Task t{x.typed_data(), w.typed_data(), y->typed_data(), live.rows(), live.count(), N, D};
  if (t.M == 0) return ffi::Error::Success();
  specjax::RunRowBlocks(N, t.M * N * D, pool.num_threads(),
                        [&t](int64_t n0, int64_t n1) { RowBlock(t, n0, n1); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulT, MatmulT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The path in use, forcing one (never above what the CPU has), and what the CPU has (see isa.h).
extern "C" int32_t SpecjaxKernelIsa() { return specjax::ActiveIsa(); }

extern "C" int32_t SpecjaxSetIsa(int32_t isa) {
  const int32_t best = specjax::DetectIsa();
  specjax::ActiveIsaSlot().store(std::clamp<int32_t>(isa, specjax::kPortable, best));
  return specjax::ActiveIsa();
}

// How many threads the native kernels use from now on (the caller plus helpers; <= 0: all of them).
extern "C" int64_t SpecjaxSetThreads(int64_t threads) {
  specjax::SpinPool::HelperLimit().store(threads <= 0 ? -1 : threads - 1);
  return threads;
}

extern "C" int32_t SpecjaxDetectedIsa(int32_t pretend_no_features) {
  specjax::PretendNoFeatures().store(pretend_no_features);
  return specjax::DetectIsa();
}
