// specjax CPU kernel: y[M, N] = x[M, D] . dequantize(w)[N, D]^T for int8 and int4 weights on integer dot
// products, for a few rows M (a decode step, a verification).
//
// cpu_qmatmul.cc widens every weight to fp32 and multiplies in fp32: the widening is paid once per call, but
// each row of x then costs one fp32 multiply-add per weight, so verifying 8 rows costs far more than decoding
// one.  Here each live row of x is quantized to int8 once per call, and each 32-column block of products is
// summed exactly in int32 by integer instructions (AVX2: vpmaddubsw + vpmaddwd, 32 products per row in two
// instructions; AVX-512 VNNI: vpdpbusd, 64 in one), then scaled once per block.  The weight block is unpacked
// once and serves every row.  (llama.cpp multiplies its quantized weights the same way.)
//
// The numbers (x's quantization block is 32 columns; its scale block, XB, is 32 or 256 columns):
//   qx[m, d]  = nearbyint(x[m, d] * (127 / amax)),  amax = max |x[m, .]| over d's 32-column block
//   isum(b)   = sum over block b of qw[n, d] * qx[m, d]    (int8: the signed byte; int4: the nibble - 8)
//   y[m, n]   = sum_a sum_{b in a} isum(b) * (amax(b) / 127) * scale[n, g(b)]    computed as below
//             + sum_g (offset[n, g] + 8 scale[n, g]) * xsum[m, g]    (int4: xsum = x's own fp32 sum over g)
// int4 nibbles are centred (nibble - 8), the 8 moved into the exact fp32 term: x's rounding error then meets
// weights of about half the magnitude (on SmolLM2-135M perplexity rose 1.4% over fp32 activations with the
// nibbles as stored).
// With XB = 32 each block keeps its own x scale: part = isum(b) * sx(b); y += part * scale.  With XB = 256
// one x scale (the largest of its 8 blocks' amax) serves 8 blocks, so x is quantized more coarsely but the
// x scale is applied once per 8 blocks.  The XLA reference (cpu_qdot.py) computes the same integers.
//
// Row-invariant: a row's quantization depends on that row alone, integer sums are exact, and each (weight row,
// x row) pair runs the same float operations in the same order whatever else the call computes, so a
// verification row has the bits of a decode row.
//
// FFI targets "specjax_qdot_int8" and "specjax_qdot_int4" (cpu_qdot.py): the int8 and int4 formats of
// cpu_qmatmul.cc, with attributes xblock (32 to 256) and tiled: weights repacked into 16-row tiles, which
// cpu_qdot_tiles.cc multiplies (faster at every row count; a model with integer activations loads its weights
// so), the row layout here serving the weights that cannot be tiled (N not a multiple of 16).  Paths: AVX-512
// VNNI, AVX2, portable (isa.h); SpecjaxQDotPath() says which one the active instruction set takes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "qdot_task.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::qdot::DotTask;
using specjax::qdot::Kind;
using specjax::qdot::kInt8;
using specjax::qdot::kInt4;
using specjax::qdot::kPathPortable;
using specjax::qdot::kPathAvx2;
using specjax::qdot::kPathVnni;

inline int64_t Blocks(const DotTask& t) { return t.D / 32; }

// Quantizes the live rows of x into the task's buffers (on the caller's thread: M x D values, small beside the
// weights).  Scalar C++ (the compiler vectorises it): every path sees the same integers.
struct Quantized {
  std::vector<int8_t> qx;
  std::vector<float> sx, sxv, xsum;
  std::vector<int32_t> corr, bsum;
};

void QuantizeRows(const float* x, DotTask& t, bool vnni, bool tiled, Quantized& q) {
  const int64_t D = t.D, Dp = (D + 63) / 64 * 64, blocks = D / 32, per = t.XB / 32;
  t.Dp = Dp;
  q.qx.assign(t.M * Dp, 0);
  q.sx.resize(t.M * blocks);
  for (int64_t m = 0; m < t.M; ++m) {
    const float* xr = x + t.row[m] * D;
    int8_t* out = q.qx.data() + m * Dp;
    for (int64_t a = 0; a < blocks; a += per) {
      const int64_t d0 = a * 32, d1 = std::min(D, d0 + t.XB);
      float amax = 0.f;
      for (int64_t d = d0; d < d1; ++d) amax = std::max(amax, std::fabs(xr[d]));
      const float inv = amax > 0.f ? 127.0f / amax : 0.f, sx = amax / 127.0f;
      for (int64_t d = d0; d < d1; ++d) out[d] = static_cast<int8_t>(std::nearbyint(xr[d] * inv));
      for (int64_t b = a; b < std::min(blocks, a + per); ++b) q.sx[m * blocks + b] = sx;
    }
  }
  t.qx = q.qx.data();
  t.sx = q.sx.data();
  if (t.kind == kInt4) {   // x's exact sums over the weight groups, left to right
    const int64_t groups = D / t.G;
    q.xsum.resize(t.M * groups);
    for (int64_t m = 0; m < t.M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t d = g * t.G; d < (g + 1) * t.G; ++d) s += x[t.row[m] * D + d];
        q.xsum[m * groups + g] = s;
      }
    t.xsum = q.xsum.data();
  }
  if (tiled) {   // each 32-column block's sum of qx (the tiled kernels need nothing else)
    q.bsum.resize(t.M * blocks);
    for (int64_t m = 0; m < t.M; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t s = 0;
        for (int64_t d = 32 * b; d < 32 * b + 32; ++d) s += q.qx[m * Dp + d];
        q.bsum[m * blocks + b] = s;
      }
    t.bsum = q.bsum.data();
    return;
  }
  if (vnni && t.XB == 32) {
    const int64_t steps = Dp / 64;
    q.sxv.assign(t.M * steps * 16, 0.f);
    for (int64_t m = 0; m < t.M; ++m)
      for (int64_t b = 0; b < blocks; ++b)
        std::fill_n(q.sxv.data() + (m * steps + b / 2) * 16 + (b % 2) * 8, 8, q.sx[m * blocks + b]);
    t.sxv = q.sxv.data();
  }
  if (t.kind == kInt4 || vnni) {
    const int32_t c = t.kind == kInt4 ? 8 : 128;
    q.corr.resize(t.M * Dp / 4);
    for (int64_t i = 0; i < t.M * Dp / 4; ++i) {
      const int8_t* p = q.qx.data() + 4 * i;
      q.corr[i] = -c * (p[0] + p[1] + p[2] + p[3]);
    }
    t.corr = q.corr.data();
  }
}

// ----------------------------------------------------------------------------------------------------------
// Portable path: one (weight row, x row) pair at a time, in the order the formula above reads.

inline int32_t BlockSum(const DotTask& t, const uint8_t* wr, const int8_t* xq, int64_t b) {
  int32_t s = 0;
  if (t.kind == kInt8) {
    for (int64_t j = 0; j < 32; ++j) s += static_cast<int8_t>(wr[b * 32 + j]) * xq[b * 32 + j];
  } else {
    for (int64_t j = 0; j < 16; ++j) {
      const uint8_t byte = wr[b * 16 + j];
      s += ((byte & 15) - 8) * xq[b * 32 + j] + ((byte >> 4) - 8) * xq[b * 32 + j + 16];
    }
  }
  return s;
}

inline float OffsetTerm(const DotTask& t, int64_t n, int64_t m) {
  if (t.kind != kInt4) return 0.f;
  const int64_t groups = t.D / t.G;
  float s = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const float off = std::fma(t.scale[n * groups + g], 8.0f, t.offset[n * groups + g]);
    s = std::fma(off, t.xsum[m * groups + g], s);
  }
  return s;
}

void RowBlockPortable(const DotTask& t, int64_t n0, int64_t n1) {
  const int64_t blocks = Blocks(t), per = t.XB / 32, groups = t.D / t.G;
  const int64_t row_bytes = t.kind == kInt8 ? t.D : t.D / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = t.w + n * row_bytes;
    for (int64_t m = 0; m < t.M; ++m) {
      const int8_t* xq = t.qx + m * t.Dp;
      float acc = 0.f;
      for (int64_t a = 0; a < blocks; a += per) {
        float part = 0.f;
        for (int64_t b = a; b < std::min(blocks, a + per); ++b) {
          const float sw = t.scale[n * groups + b * 32 / t.G];
          const float p = static_cast<float>(BlockSum(t, wr, xq, b));
          part = per == 1 ? p * t.sx[m * blocks + b] : std::fma(p, sw, part);
          if (per == 1) acc = std::fma(part, sw, acc);
        }
        if (per > 1) acc = std::fma(part, t.sx[m * blocks + a], acc);
      }
      t.y[t.row[m] * t.N + n] = acc + OffsetTerm(t, n, m);
    }
  }
}

#if SPECJAX_X86
// ----------------------------------------------------------------------------------------------------------
// AVX2: one 32-column block per step.  int4: the block's 16 bytes become 32 nibbles in column order (low
// nibbles, then high), the unsigned operand of vpmaddubsw, and each int32 lane of 4 products adds -8 x its 4
// values of x (the centring); int8: |w| is the unsigned operand and x takes w's sign (vpsignb).  vpmaddwd
// against ones sums pairs of the 16-bit products into 8 int32 lanes (no overflow:
// 2 x 128 x 127 < 2^15), converted once per block.

SPECJAX_TARGET_AVX2 inline float HorizontalSum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// sum_g (offset[g] + 8 scale[g]) * xsum[g] over a row's groups, 8 lanes then the rest, in a fixed order.
SPECJAX_TARGET_AVX2 inline float OffsetTerm256(const float* off, const float* sw, const float* xs, int64_t groups) {
  __m256 v = _mm256_setzero_ps();
  const __m256 eight = _mm256_set1_ps(8.0f);
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 o = _mm256_fmadd_ps(_mm256_loadu_ps(sw + g), eight, _mm256_loadu_ps(off + g));
    v = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + g), v);
  }
  float s = HorizontalSum256(v);
  for (; g < groups; ++g) s = std::fma(std::fma(sw[g], 8.0f, off[g]), xs[g], s);
  return s;
}

template <Kind KIND, int MB>
SPECJAX_TARGET_AVX2 void Dot256(const DotTask& t, int64_t n, int64_t m0) {
  const int64_t blocks = Blocks(t), per = t.XB / 32, groups = t.D / t.G;
  const uint8_t* wr = t.w + n * (KIND == kInt8 ? t.D : t.D / 2);
  const float* sw = t.scale + n * groups;
  const int8_t* xq[MB];
  const float* sx[MB];
  const int32_t* cr[MB];
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) {
    xq[i] = t.qx + (m0 + i) * t.Dp;
    sx[i] = t.sx + (m0 + i) * blocks;
    cr[i] = KIND == kInt4 ? t.corr + (m0 + i) * (t.Dp / 4) : nullptr;
    acc[i] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const int gshift = t.G == 64 ? 1 : 0;   // 32-column blocks per weight group: 1 or 2 (a shift, not a division)
  for (int64_t a = 0; a < blocks; a += per) {
    __m256 part[MB];
    for (int i = 0; i < MB; ++i) part[i] = _mm256_setzero_ps();
    const int64_t end = std::min(blocks, a + per);
    for (int64_t b = a; b < end; ++b) {
      __m256i wv, raw;
      _mm_prefetch(reinterpret_cast<const char*>(wr + (KIND == kInt8 ? 32 : 16) * b + 1024), _MM_HINT_T0);
      if constexpr (KIND == kInt4) {
        const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16 * b));
        wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), _mm256_set1_epi8(15));
        raw = wv;
      } else {
        raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32 * b));
        wv = _mm256_abs_epi8(raw);
      }
      const __m256 s = _mm256_broadcast_ss(sw + (b >> gshift));
      for (int i = 0; i < MB; ++i) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + 32 * b));
        if constexpr (KIND == kInt8) xv = _mm256_sign_epi8(xv, raw);
        __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
        if constexpr (KIND == kInt4)   // the centring: 8 x the lane's 4 values of x off
          isum = _mm256_add_epi32(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr[i] + 8 * b)));
        const __m256 p = _mm256_cvtepi32_ps(isum);
        if (per == 1) {
          acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(p, _mm256_broadcast_ss(sx[i] + b)), s, acc[i]);
        } else {
          part[i] = _mm256_fmadd_ps(p, s, part[i]);
        }
      }
    }
    if (per > 1)
      for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(part[i], _mm256_broadcast_ss(sx[i] + a), acc[i]);
  }
  for (int i = 0; i < MB; ++i) {
    const float off = KIND == kInt4 ? OffsetTerm256(t.offset + n * groups, sw, t.xsum + (m0 + i) * groups, groups)
                                    : 0.f;
    t.y[t.row[m0 + i] * t.N + n] = HorizontalSum256(acc[i]) + off;
  }
}

template <Kind KIND>
SPECJAX_TARGET_AVX2 void RowBlockAvx2(const DotTask& t, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    specjax::ForRowTiles(t.M, [&](auto mb, int64_t m) { Dot256<KIND, decltype(mb)::value>(t, n, m); });
}

// ----------------------------------------------------------------------------------------------------------
// AVX-512 VNNI: two blocks (64 columns) per step, lanes 0-7 block 2c and 8-15 block 2c + 1.  vpdpbusd takes
// the weight as its unsigned operand: int4 nibbles as they are (the accumulator starting from -8 x the sums of x
// it meets: the centring), int8 bytes with their top bit flipped (w + 128, starting from -128 x those sums).  A
// last half step (D / 32 odd) reads 32 columns, the rest zero (x is zero-padded to Dp).

SPECJAX_TARGET_AVX512VNNI inline __m512i WeightStep512(const DotTask& t, const uint8_t* wr, int64_t c, bool half) {
  if (t.kind == kInt4) {
    const __m256i v = half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 32 * c)))
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32 * c));
    const __m256i mask = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);   // lo.0 lo.1 hi.0 hi.1
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));                // lo.0 hi.0 lo.1 hi.1
  }
  const __m512i v =
      half ? _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 64 * c)), 0)
           : _mm512_loadu_si512(wr + 64 * c);
  return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
}

SPECJAX_TARGET_AVX512VNNI inline float OffsetTerm512(const float* off, const float* sw, const float* xs,
                                                      int64_t groups) {
  __m512 v = _mm512_setzero_ps();
  const __m512 eight = _mm512_set1_ps(8.0f);
  int64_t g = 0;
  for (; g + 16 <= groups; g += 16) {
    const __m512 o = _mm512_fmadd_ps(_mm512_loadu_ps(sw + g), eight, _mm512_loadu_ps(off + g));
    v = _mm512_fmadd_ps(o, _mm512_loadu_ps(xs + g), v);
  }
  float s = _mm512_reduce_add_ps(v);
  for (; g < groups; ++g) s = std::fma(std::fma(sw[g], 8.0f, off[g]), xs[g], s);
  return s;
}

template <Kind KIND, int MB>
SPECJAX_TARGET_AVX512VNNI void Dot512(const DotTask& t, int64_t n, int64_t m0) {
  const int64_t blocks = Blocks(t), steps = t.Dp / 64, per_steps = t.XB / 64, groups = t.D / t.G;
  const uint8_t* wr = t.w + n * (KIND == kInt8 ? t.D : t.D / 2);
  const float* sw = t.scale + n * groups;
  const int8_t* xq[MB];
  __m512 acc[MB], part[MB];
  for (int i = 0; i < MB; ++i) {
    xq[i] = t.qx + (m0 + i) * t.Dp;
    acc[i] = part[i] = _mm512_setzero_ps();
  }
  const __mmask16 upper = 0xFF00;
  const int gshift = t.G == 64 ? 1 : 0;                  // 32-column blocks per weight group: 1 or 2
  const int64_t span = per_steps > 0 ? per_steps : steps;  // the steps under one x scale (XB = 32: inside)
  for (int64_t a = 0; a < steps; a += span) {            // nested, not a modulo per step (it cost 2x here)
    const int64_t end = std::min(steps, a + span);
    for (int64_t c = a; c < end; ++c) {
      const bool half = 2 * c + 1 >= blocks;
      _mm_prefetch(reinterpret_cast<const char*>(wr + (KIND == kInt8 ? 64 : 32) * c + 1024), _MM_HINT_T0);
      const __m512i wv = WeightStep512(t, wr, c, half);
      const float s0 = sw[(2 * c) >> gshift], s1 = half ? 0.f : sw[(2 * c + 1) >> gshift];
      const __m512 s = _mm512_mask_blend_ps(upper, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
      for (int i = 0; i < MB; ++i) {
        const __m512i start = _mm512_loadu_si512(t.corr + (m0 + i) * (t.Dp / 4) + 16 * c);
        const __m512i xv = _mm512_loadu_si512(xq[i] + 64 * c);
        const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, wv, xv));
        if (per_steps == 0) {   // XB = 32: each block's own x scale
          const __m512 sxv = _mm512_loadu_ps(t.sxv + ((m0 + i) * steps + c) * 16);
          acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(p, sxv), s, acc[i]);
        } else {
          part[i] = _mm512_fmadd_ps(p, s, part[i]);
        }
      }
    }
    if (per_steps > 0) {
      for (int i = 0; i < MB; ++i) {   // the scale block's x scale (that of its first 32-column block)
        acc[i] = _mm512_fmadd_ps(part[i], _mm512_set1_ps(t.sx[(m0 + i) * blocks + 2 * a]), acc[i]);
        part[i] = _mm512_setzero_ps();
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    const float off = KIND == kInt4 ? OffsetTerm512(t.offset + n * groups, sw, t.xsum + (m0 + i) * groups, groups)
                                    : 0.f;
    t.y[t.row[m0 + i] * t.N + n] = _mm512_reduce_add_ps(acc[i]) + off;
  }
}

template <Kind KIND>
SPECJAX_TARGET_AVX512VNNI void RowBlockVnni(const DotTask& t, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    specjax::ForRowTiles(t.M, [&](auto mb, int64_t m) { Dot512<KIND, decltype(mb)::value>(t, n, m); });
}
#endif

int32_t ActivePath() {
#if SPECJAX_X86
  const int32_t isa = specjax::ActiveIsa();
  if (isa == specjax::kAvx512 && specjax::HasAvx512Vnni()) return kPathVnni;
  if (isa >= specjax::kAvx2) return kPathAvx2;
#endif
  return kPathPortable;
}

void RowBlock(const DotTask& t, int32_t path, int64_t n0, int64_t n1) {
#if SPECJAX_X86
  if (path == kPathVnni) return t.kind == kInt8 ? RowBlockVnni<kInt8>(t, n0, n1) : RowBlockVnni<kInt4>(t, n0, n1);
  if (path == kPathAvx2) return t.kind == kInt8 ? RowBlockAvx2<kInt8>(t, n0, n1) : RowBlockAvx2<kInt4>(t, n0, n1);
#endif
  RowBlockPortable(t, n0, n1);
}

ffi::Error Run(const char* name, Kind kind, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const uint8_t* w,
               int64_t N, int64_t w_cols, const float* scale, const float* offset, int64_t scale_cols,
               ffi::Buffer<ffi::S32>& rows, int64_t xblock, bool tiled, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  const int64_t n_rows = static_cast<int64_t>(rows.element_count());
  const int64_t D = xd.size() == 2 ? xd[1] : -1;
  if (xd.size() != 2 || D % 32 != 0 || w_cols != (kind == kInt4 ? D / 2 : D) || n_rows < 2) {
    return ffi::Error::InvalidArgument(std::string(name) + " expects x [M, D] (D a multiple of 32), w [N, D] "
                                       "(int4: [N, D/2]) and rows [group, live...]");
  }
  const int64_t G = scale_cols > 0 && D % scale_cols == 0 ? D / scale_cols : 0;
  if (G != 32 && G != 64)
    return ffi::Error::InvalidArgument(std::string(name) + ": scale must be [N, D/G], G 32 or 64");
  if (xblock != 32 && xblock != 64 && xblock != 128 && xblock != 256)
    return ffi::Error::InvalidArgument(std::string(name) + ": xblock must be 32, 64, 128 or 256");
  if (tiled && N % 16 != 0)
    return ffi::Error::InvalidArgument(std::string(name) + ": a tiled weight needs N a multiple of 16");
  specjax::LiveRows live;
  if (const char* bad = live.Collect(rows.typed_data(), n_rows, xd[0], N, y->typed_data())) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + bad);
  }
  DotTask t{w, scale, offset, y->typed_data(), live.rows(), live.count(), N, D, G, xblock, kind};
  if (t.M == 0) return ffi::Error::Success();
  const int32_t path = ActivePath();
  thread_local Quantized q;
  QuantizeRows(x.typed_data(), t, path == kPathVnni, tiled, q);
  if (tiled) {   // in units of 16-row tiles (cpu_qdot_tiles.cc)
    specjax::RunRowBlocks(N / 16, t.M * N * D / 4, pool.num_threads(), [&t, path](int64_t t0, int64_t t1) {
      specjax::qdot::RowBlockTiles(t, path, t0, t1);
    });
    return ffi::Error::Success();
  }
  specjax::RunRowBlocks(N, t.M * N * D / 4, pool.num_threads(),
                        [&t, path](int64_t n0, int64_t n1) { RowBlock(t, path, n0, n1); });
  return ffi::Error::Success();
}

ffi::Error QDotInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> rows, int64_t xblock, bool tiled,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  if (wd.size() != 2 || sd.size() != 2 || sd[0] != wd[0]) {
    return ffi::Error::InvalidArgument("specjax_qdot_int8 expects w [N, D] and scale [N, D/G]");
  }
  return Run("specjax_qdot_int8", kInt8, pool, x, reinterpret_cast<const uint8_t*>(w.typed_data()), wd[0], wd[1],
             scale.typed_data(), nullptr, sd[1], rows, xblock, tiled, y);
}

ffi::Error QDotInt4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> rows,
                    int64_t xblock, bool tiled, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  auto od = offset.dimensions();
  if (wd.size() != 2 || sd.size() != 2 || sd[0] != wd[0] || od.size() != 2 || od[0] != sd[0] || od[1] != sd[1]) {
    return ffi::Error::InvalidArgument("specjax_qdot_int4 expects w [N, D/2], scale and offset [N, D/G]");
  }
  return Run("specjax_qdot_int4", kInt4, pool, x, w.typed_data(), wd[0], wd[1], scale.typed_data(),
             offset.typed_data(), sd[1], rows, xblock, tiled, y);
}

}  // namespace

// The integer-dot path the active instruction set takes: 0 portable, 1 AVX2, 2 AVX-512 VNNI.
extern "C" int32_t SpecjaxQDotPath() { return ActivePath(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQDotInt8, QDotInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("xblock")
                                  .Attr<bool>("tiled")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQDotInt4, QDotInt4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("xblock")
                                  .Attr<bool>("tiled")
                                  .Ret<ffi::Buffer<ffi::F32>>());
