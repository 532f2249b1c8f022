// specjax CPU kernel: y[M, N] = x[M, D] . dequantize(w)[N, D]^T for a few rows M, with w kept compact.
//
// The same streaming design as cpu_matmul.cc (each weight row read once for all M rows of x, split over a
// few threads), but the weights arrive as bf16, int8 or int4 and are widened to fp32 in registers, 16 (or 8)
// columns at a time, just before their multiply-adds: a decode step then reads 2, 4 or ~7 times fewer bytes.
// The activations and the accumulation stay fp32.  Formats (quant.py):
//   bf16  bf16 [N, D] (read as its u16 bits)                         w = bits << 16
//   int8  s8  [N, D], scale f32 [N]                                   w = q * scale[n]
//   int4  u8  [N, D/2], scale f32 [N, D/G]; each 32-column block is 16 bytes, byte j holding column j in its
//         low nibble and column j + 16 in its high one                w = (nibble - 8) * scale[n, d / G]
// Every path dequantizes a weight exactly as the reference does (one fp32 multiply), then multiplies and adds:
// the result equals qmatmul_t_reference up to the order of the sums, and a row's bits do not depend on how
// many other rows are computed beside it.
//
// FFI targets "specjax_qmatmul_bf16", "specjax_qmatmul_int8", "specjax_qmatmul_int4" (cpu_qmatmul.py).
// Paths as in cpu_matmul.cc (isa.h): AVX-512F, AVX2+FMA, portable.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Kind { kBf16 = 0, kInt8 = 1, kInt4 = 2 };

struct QTask {
  const float* x;        // [rows, D]
  const uint8_t* w;      // the compact weight (see the formats above), as bytes
  const float* scale;    // int8 [N], int4 [N, D/G]; null for bf16
  float* y;              // [rows, N]
  const int64_t* row;    // [M]: the rows of x (and y) computed
  int64_t M, N, D, G;
  Kind kind;
};

// One weight, dequantized (the portable path and the tails).
inline float Weight(const QTask& t, int64_t n, int64_t d) {
  switch (t.kind) {
    case kBf16: {
      uint16_t h;
      std::memcpy(&h, t.w + 2 * (n * t.D + d), 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case kInt8:
      return static_cast<float>(static_cast<int8_t>(t.w[n * t.D + d])) * t.scale[n];
    default: {
      const uint8_t byte = t.w[n * (t.D / 2) + (d / 32) * 16 + (d & 15)];
      const int v = ((d & 16) ? (byte >> 4) : (byte & 15)) - 8;
      return static_cast<float>(v) * t.scale[n * (t.D / t.G) + d / t.G];
    }
  }
}

// Portable path: each weight row dequantized once into a scratch row, then against all M rows of x.
void RowBlockPortable(const QTask& t, int64_t n0, int64_t n1) {
  thread_local std::vector<float> scratch;
  scratch.resize(t.D);
  float* wr = scratch.data();
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t d = 0; d < t.D; ++d) wr[d] = Weight(t, n, d);
    for (int64_t m = 0; m < t.M; ++m) {
      const float* xr = t.x + t.row[m] * t.D;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t d = 0; d < t.D; ++d) a += wr[d] * xr[d];
      t.y[t.row[m] * t.N + n] = a;
    }
  }
}

#if SPECJAX_X86
// 16 weights of row n from column d (d a multiple of 16, d + 16 <= D), as fp32.
SPECJAX_TARGET_AVX512 inline __m512 Load16(const QTask& t, int64_t n, int64_t d) {
  switch (t.kind) {
    case kBf16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + 2 * (n * t.D + d)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case kInt8: {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w + n * t.D + d));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(t.scale[n]));
    }
    default: {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w + n * (t.D / 2) + (d / 32) * 16));
      __m512i v = _mm512_cvtepu8_epi32(b);
      v = (d & 16) ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
      v = _mm512_sub_epi32(v, _mm512_set1_epi32(8));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(t.scale[n * (t.D / t.G) + d / t.G]));
    }
  }
}

// The last D % 16 weights of row n (zeros past the end).
SPECJAX_TARGET_AVX512 inline __m512 LoadTail16(const QTask& t, int64_t n, int64_t d) {
  float lanes[16] = {};
  for (int64_t i = 0; d + i < t.D; ++i) lanes[i] = Weight(t, n, d + i);
  return _mm512_loadu_ps(lanes);
}

// 4 weight rows (dequantized once per 16 columns) against MB rows of x, as cpu_matmul.cc's Tile.
template <int MB>
SPECJAX_TARGET_AVX512 inline void Tile(const QTask& t, int64_t n, int64_t m0) {
  const int64_t D = t.D;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = t.x + t.row[m0 + i] * D;
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m512 w_0 = Load16(t, n, d), w_1 = Load16(t, n + 1, d);
    const __m512 w_2 = Load16(t, n + 2, d), w_3 = Load16(t, n + 3, d);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr[i] + d);
      acc[i][0] = _mm512_fmadd_ps(w_0, xv, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w_1, xv, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(w_2, xv, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(w_3, xv, acc[i][3]);
    }
  }
  if (d < D) {  // tail columns (bf16 and int8 only: int4 rows are whole blocks)
    const __mmask16 k = static_cast<__mmask16>((1u << (D - d)) - 1);
    const __m512 w_0 = LoadTail16(t, n, d), w_1 = LoadTail16(t, n + 1, d);
    const __m512 w_2 = LoadTail16(t, n + 2, d), w_3 = LoadTail16(t, n + 3, d);
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

SPECJAX_TARGET_AVX512 void RowBlockAvx512(const QTask& t, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 6 <= t.M; m += 6) Tile<6>(t, n, m);
    switch (t.M - m) {
      case 1: Tile<1>(t, n, m); break;
      case 2: Tile<2>(t, n, m); break;
      case 3: Tile<3>(t, n, m); break;
      case 4: Tile<4>(t, n, m); break;
      case 5: Tile<5>(t, n, m); break;
      default: break;
    }
  }
  if (n < n1) RowBlockPortable(t, n, n1);
}

// AVX2: 8 weights of row n from column d (d a multiple of 8, d + 8 <= D), as fp32.
SPECJAX_TARGET_AVX2 inline __m256 Load8(const QTask& t, int64_t n, int64_t d) {
  switch (t.kind) {
    case kBf16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w + 2 * (n * t.D + d)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case kInt8: {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t.w + n * t.D + d));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(t.scale[n]));
    }
    default: {
      const __m128i b = _mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(t.w + n * (t.D / 2) + (d / 32) * 16 + (d & 15)));
      __m256i v = _mm256_cvtepu8_epi32(b);
      v = (d & 16) ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
      v = _mm256_sub_epi32(v, _mm256_set1_epi32(8));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(t.scale[n * (t.D / t.G) + d / t.G]));
    }
  }
}

SPECJAX_TARGET_AVX2 inline float HorizontalSum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// 4 weight rows against MB <= 3 rows of x (16 ymm registers: 4*MB accumulators, MB rows of x, one weight
// vector), each weight vector dequantized once and fed to MB multiply-adds.
template <int MB>
SPECJAX_TARGET_AVX2 inline void Tile8(const QTask& t, int64_t n, int64_t m0) {
  const int64_t D = t.D;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = t.x + t.row[m0 + i] * D;
  __m256 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(xr[i] + d);
    for (int r = 0; r < 4; ++r) {
      const __m256 wv = Load8(t, n + r, d);
      for (int i = 0; i < MB; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  float tail[MB][4] = {};
  for (; d < D; ++d)   // at most 7 tail columns
    for (int r = 0; r < 4; ++r) {
      const float wv = Weight(t, n + r, d);
      for (int i = 0; i < MB; ++i) tail[i][r] = std::fma(wv, xr[i][d], tail[i][r]);
    }
  for (int i = 0; i < MB; ++i) {
    float* yr = t.y + t.row[m0 + i] * t.N + n;
    for (int r = 0; r < 4; ++r) yr[r] = HorizontalSum256(acc[i][r]) + tail[i][r];
  }
}

SPECJAX_TARGET_AVX2 void RowBlockAvx2(const QTask& t, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 3 <= t.M; m += 3) Tile8<3>(t, n, m);
    switch (t.M - m) {
      case 1: Tile8<1>(t, n, m); break;
      case 2: Tile8<2>(t, n, m); break;
      default: break;
    }
  }
  if (n < n1) RowBlockPortable(t, n, n1);
}
#endif

void RowBlock(const QTask& t, int64_t n0, int64_t n1) {
#if SPECJAX_X86
  switch (specjax::ActiveIsa()) {
    case specjax::kAvx512: return RowBlockAvx512(t, n0, n1);
    case specjax::kAvx2: return RowBlockAvx2(t, n0, n1);
    default: break;
  }
#endif
  RowBlockPortable(t, n0, n1);
}

// x [M, D] fp32, w (bytes of the compact weight, N rows), scale, rows [group, live...] -> y [M, N] fp32.
ffi::Error Run(const char* name, Kind kind, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const uint8_t* w,
               int64_t N, int64_t w_cols, const float* scale, int64_t scale_cols, ffi::Buffer<ffi::S32>& rows,
               ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  const int64_t n_rows = static_cast<int64_t>(rows.element_count());
  const int64_t D = xd.size() == 2 ? xd[1] : -1;
  const int64_t expected_cols = kind == kInt4 ? D / 2 : D;
  if (xd.size() != 2 || w_cols != expected_cols || n_rows < 2 || (kind == kInt4 && D % 32 != 0)) {
    return ffi::Error::InvalidArgument(std::string(name) + " expects x [M, D], w [N, D] (int4: [N, D/2], D a "
                                       "multiple of 32) and rows [group, live...]");
  }
  int64_t G = D;
  if (kind == kInt4) {
    if (scale_cols <= 0 || D % scale_cols != 0 || (D / scale_cols) % 32 != 0) {
      return ffi::Error::InvalidArgument(std::string(name) + ": scale must be [N, D/G], G a multiple of 32");
    }
    G = D / scale_cols;
  }
  specjax::LiveRows live;
  if (const char* bad = live.Collect(rows.typed_data(), n_rows, xd[0], N, y->typed_data())) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + bad);
  }
  QTask t{x.typed_data(), w, scale, y->typed_data(), live.rows(), live.count(), N, D, G, kind};
  if (t.M == 0) return ffi::Error::Success();
  specjax::RunRowBlocks(N, t.M * N * D, pool.num_threads(),
                        [&t](int64_t n0, int64_t n1) { RowBlock(t, n0, n1); });
  return ffi::Error::Success();
}

ffi::Error QMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("specjax_qmatmul_bf16 expects w [N, D]");
  return Run("specjax_qmatmul_bf16", kBf16, pool, x, reinterpret_cast<const uint8_t*>(w.typed_data()), wd[0],
             wd[1], nullptr, 0, rows, y);
}

ffi::Error QMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  if (wd.size() != 2 || static_cast<int64_t>(scale.element_count()) != wd[0]) {
    return ffi::Error::InvalidArgument("specjax_qmatmul_int8 expects w [N, D] and scale [N]");
  }
  return Run("specjax_qmatmul_int8", kInt8, pool, x, reinterpret_cast<const uint8_t*>(w.typed_data()), wd[0],
             wd[1], scale.typed_data(), 1, rows, y);
}

ffi::Error QMatmulInt4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  if (wd.size() != 2 || sd.size() != 2 || sd[0] != wd[0]) {
    return ffi::Error::InvalidArgument("specjax_qmatmul_int4 expects w [N, D/2] and scale [N, D/G]");
  }
  return Run("specjax_qmatmul_int4", kInt4, pool, x, w.typed_data(), wd[0], wd[1], scale.typed_data(), sd[1],
             rows, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQMatmulBf16, QMatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQMatmulInt8, QMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQMatmulInt4, QMatmulInt4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
