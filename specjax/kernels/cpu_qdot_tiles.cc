// specjax CPU kernel: cpu_qdot.cc's integer-dot product for weights repacked at load into 16-row tiles.
//
// In rows, each weight row's 64 bytes fill one vector and a 32-column block's sum ends up spread over lanes
// that must be added across (cpu_qdot.cc): every (weight row, x row) pair pays a conversion, a scaling and a
// horizontal sum, so 8 rows of x cost about 3x one.  In tiles, lane l of a vector holds 4 consecutive bytes of
// weight row 16 t + l, so one vpdpbusd adds 4 products to each of 16 outputs, the x operand is 4 bytes of x
// broadcast from memory, and a block's 16 sums are ready in 16 lanes: nothing is added across lanes and the
// float work is one conversion, one multiply and one fma per 16 outputs.  One tile's block (512 bytes int8,
// 256 int4) is loaded once and serves up to 8 rows of x from registers.
//
// The layout (qformat.tile_rows, the same byte permutation for both kinds): the row layout's bytes [N, Db] in
// units of 4 bytes, [N/16, 16, Db/4, 4] -> [N/16, Db/4, 16, 4]; scale and offset [N, D/G] ->
// [N/16, D/G, 16].  int8 unit j of block b holds columns 32 b + 4 j .. + 3; int4 unit j (of 4) holds columns
// 32 b + 4 j .. + 3 in its low nibbles and 32 b + 16 + 4 j .. + 3 in its high ones.
//
// The arithmetic is that of cpu_qdot.cc's portable path, lane by lane in the same order: integer block sums are
// exact, and each output runs the same float operations (p = isum(b); acc = fma(p * sx, sw, acc), or with
// coarser x scales part = fma(p, sw, part) and acc = fma(part, sx, acc); then + the int4 offset term summed
// over groups left to right).  So every path here gives the bits of the portable path in rows, whatever the
// number of rows in the call: plain decoding and verification agree.
//
// Unsigned and signed operands: vpdpbusd and vpmaddubsw multiply unsigned bytes by signed ones.  VNNI: int8
// weights with their top bit flipped (w + 128) and int4 nibbles (0..15) as they are, the sums starting from
// -128 (int8) or -8 (int4, the centring) x the block's sum of x.  AVX2: int4 likewise; int8 as |w| with x
// taking w's sign (vpsignb), so vpmaddubsw's 16-bit pair sums stay below 2^15.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "isa.h"
#include "qdot_task.h"

namespace specjax::qdot {
namespace {

#ifndef SPECJAX_QDOT_AHEAD
#define SPECJAX_QDOT_AHEAD 4096
#endif
constexpr int64_t kAhead = SPECJAX_QDOT_AHEAD;   // bytes the VNNI loop prefetches ahead of its reads

inline int64_t RowBytes(const DotTask& t) { return t.kind == kInt8 ? t.D : t.D / 2; }

// ----------------------------------------------------------------------------------------------------------
// Portable: one output at a time, reading the tiled bytes in column order.

inline int32_t TiledBlockSum(const DotTask& t, const uint8_t* wt, int64_t lane, const int8_t* xq, int64_t b) {
  int32_t s = 0;
  if (t.kind == kInt8) {
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t k = 0; k < 4; ++k)
        s += static_cast<int8_t>(wt[(8 * b + j) * 64 + 4 * lane + k]) * xq[32 * b + 4 * j + k];
  } else {
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t k = 0; k < 4; ++k) {
        const uint8_t byte = wt[(4 * b + j) * 64 + 4 * lane + k];
        s += ((byte & 15) - 8) * xq[32 * b + 4 * j + k] + ((byte >> 4) - 8) * xq[32 * b + 16 + 4 * j + k];
      }
  }
  return s;
}

void TilePortable(const DotTask& t, int64_t tile) {
  const int64_t blocks = t.D / 32, per = t.XB / 32, groups = t.D / t.G;
  const uint8_t* wt = t.w + tile * 16 * RowBytes(t);
  const float* st = t.scale + tile * 16 * groups;
  for (int64_t m = 0; m < t.M; ++m) {
    const int8_t* xq = t.qx + m * t.Dp;
    for (int64_t lane = 0; lane < 16; ++lane) {
      float acc = 0.f;
      for (int64_t a = 0; a < blocks; a += per) {
        float part = 0.f;
        for (int64_t b = a; b < std::min(blocks, a + per); ++b) {
          const float sw = st[(b * 32 / t.G) * 16 + lane];
          const float p = static_cast<float>(TiledBlockSum(t, wt, lane, xq, b));
          part = per == 1 ? p * t.sx[m * blocks + b] : std::fma(p, sw, part);
          if (per == 1) acc = std::fma(part, sw, acc);
        }
        if (per > 1) acc = std::fma(part, t.sx[m * blocks + a], acc);
      }
      float off = 0.f;
      if (t.kind == kInt4) {
        const float* ot = t.offset + tile * 16 * groups;
        for (int64_t g = 0; g < groups; ++g)
          off = std::fma(std::fma(st[g * 16 + lane], 8.0f, ot[g * 16 + lane]), t.xsum[m * groups + g], off);
      }
      t.y[t.row[m] * t.N + 16 * tile + lane] = acc + off;
    }
  }
}

#if SPECJAX_X86
// ----------------------------------------------------------------------------------------------------------
// AVX-512 VNNI: the 16 lanes of a tile at once, up to 8 rows of x per pass.

template <Kind KIND, int MB>
SPECJAX_TARGET_AVX512VNNI void TileVnni(const DotTask& t, int64_t tile, int64_t m0) {
  const int64_t blocks = t.D / 32, per = t.XB / 32, groups = t.D / t.G;
  constexpr int64_t kBlockBytes = KIND == kInt8 ? 512 : 256;
  constexpr int32_t kStart = KIND == kInt8 ? -128 : -8;
  const uint8_t* wt = t.w + tile * 16 * RowBytes(t);
  const float* st = t.scale + tile * 16 * groups;
  const int gshift = t.G == 64 ? 1 : 0;
  const int32_t* xq[MB];
  const float* sx[MB];
  const int32_t* bs[MB];
  __m512 acc[MB], part[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    xq[i] = reinterpret_cast<const int32_t*>(t.qx + (m0 + i) * t.Dp);
    sx[i] = t.sx + (m0 + i) * blocks;
    bs[i] = t.bsum + (m0 + i) * blocks;
    acc[i] = part[i] = _mm512_setzero_ps();
  }
  for (int64_t a = 0; a < blocks; a += per) {
    const int64_t end = std::min(blocks, a + per);
    for (int64_t b = a; b < end; ++b) {
      const uint8_t* p = wt + b * kBlockBytes;
#pragma GCC unroll 8
      for (int64_t j = 0; j < kBlockBytes; j += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + j), _MM_HINT_T0);
      if constexpr (KIND == kInt4)   // the offsets the tile's last step reads (a stream of their own)
        _mm_prefetch(reinterpret_cast<const char*>(t.offset + tile * 16 * groups + (b >> gshift) * 16), _MM_HINT_T0);
      // Each row's sum in two chains (C = 2) when few rows leave the dot-product unit waiting on one chain's
      // latency; the chains are added in integers, exactly.
      constexpr int C = MB <= 2 ? 2 : 1;
      __m512i s[C][MB];
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        s[0][i] = _mm512_set1_epi32(kStart * bs[i][b]);
        if constexpr (C == 2) s[C - 1][i] = _mm512_setzero_si512();
      }
      if constexpr (KIND == kInt8) {
        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * j), flip);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i)
            s[j % C][i] = _mm512_dpbusd_epi32(s[j % C][i], w, _mm512_set1_epi32(xq[i][8 * b + j]));
        }
      } else {
        const __m512i mask = _mm512_set1_epi8(15);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(p + 64 * j);
          const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            s[0][i] = _mm512_dpbusd_epi32(s[0][i], lo, _mm512_set1_epi32(xq[i][8 * b + j]));
            s[C - 1][i] = _mm512_dpbusd_epi32(s[C - 1][i], hi, _mm512_set1_epi32(xq[i][8 * b + 4 + j]));
          }
        }
      }
      if constexpr (C == 2) {
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) s[0][i] = _mm512_add_epi32(s[0][i], s[1][i]);
      }
      const __m512 sw = _mm512_loadu_ps(st + (b >> gshift) * 16);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const __m512 pf = _mm512_cvtepi32_ps(s[0][i]);
        if (per == 1) {
          acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(pf, _mm512_set1_ps(sx[i][b])), sw, acc[i]);
        } else {
          part[i] = _mm512_fmadd_ps(pf, sw, part[i]);
        }
      }
    }
    if (per > 1) {
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        acc[i] = _mm512_fmadd_ps(part[i], _mm512_set1_ps(sx[i][a]), acc[i]);
        part[i] = _mm512_setzero_ps();
      }
    }
  }
  if constexpr (KIND == kInt4) {   // + sum_g (offset + 8 scale) x xsum, left to right (part[] is free again)
    const float* ot = t.offset + tile * 16 * groups;
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 o = _mm512_fmadd_ps(_mm512_loadu_ps(st + g * 16), eight, _mm512_loadu_ps(ot + g * 16));
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i)
        part[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(t.xsum[(m0 + i) * groups + g]), part[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
    _mm512_storeu_ps(t.y + t.row[m0 + i] * t.N + 16 * tile, KIND == kInt4 ? _mm512_add_ps(acc[i], part[i]) : acc[i]);
}

// ----------------------------------------------------------------------------------------------------------
// AVX2: lanes 0-7 of the tile, then lanes 8-15 (each unit's first and second 32 bytes), up to 4 rows per pass.

template <Kind KIND, int MB>
SPECJAX_TARGET_AVX2 void TileAvx2(const DotTask& t, int64_t tile, int64_t m0) {
  const int64_t blocks = t.D / 32, per = t.XB / 32, groups = t.D / t.G;
  constexpr int64_t kBlockBytes = KIND == kInt8 ? 512 : 256;
  const uint8_t* wt = t.w + tile * 16 * RowBytes(t);
  const float* st = t.scale + tile * 16 * groups;
  const int gshift = t.G == 64 ? 1 : 0;
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(15);
  for (int64_t h = 0; h < 2; ++h) {
    const int32_t* xq[MB];
    const float* sx[MB];
    __m256 acc[MB], part[MB];
    for (int i = 0; i < MB; ++i) {
      xq[i] = reinterpret_cast<const int32_t*>(t.qx + (m0 + i) * t.Dp);
      sx[i] = t.sx + (m0 + i) * blocks;
      acc[i] = part[i] = _mm256_setzero_ps();
    }
    for (int64_t a = 0; a < blocks; a += per) {
      const int64_t end = std::min(blocks, a + per);
      for (int64_t b = a; b < end; ++b) {
        const uint8_t* p = wt + b * kBlockBytes + 32 * h;
        if (h == 0)
          for (int64_t j = 0; j < kBlockBytes; j += 64) _mm_prefetch(reinterpret_cast<const char*>(p + 4096 + j), _MM_HINT_T0);
        __m256i s[MB];
        for (int i = 0; i < MB; ++i)   // int4: the centring, -8 x the block's sum of x
          s[i] = _mm256_set1_epi32(KIND == kInt4 ? -8 * t.bsum[(m0 + i) * blocks + b] : 0);
        if constexpr (KIND == kInt8) {
          for (int j = 0; j < 8; ++j) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
            const __m256i mag = _mm256_abs_epi8(raw);
            for (int i = 0; i < MB; ++i) {
              const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xq[i][8 * b + j]), raw);
              s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), ones));
            }
          }
        } else {
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
            const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for (int i = 0; i < MB; ++i) {
              const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[i][8 * b + j]));
              const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[i][8 * b + 4 + j]));
              s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones));
            }
          }
        }
        const __m256 sw = _mm256_loadu_ps(st + (b >> gshift) * 16 + 8 * h);
        for (int i = 0; i < MB; ++i) {
          const __m256 pf = _mm256_cvtepi32_ps(s[i]);
          if (per == 1) {
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(pf, _mm256_set1_ps(sx[i][b])), sw, acc[i]);
          } else {
            part[i] = _mm256_fmadd_ps(pf, sw, part[i]);
          }
        }
      }
      if (per > 1) {
        for (int i = 0; i < MB; ++i) {
          acc[i] = _mm256_fmadd_ps(part[i], _mm256_set1_ps(sx[i][a]), acc[i]);
          part[i] = _mm256_setzero_ps();
        }
      }
    }
    if constexpr (KIND == kInt4) {
      const float* ot = t.offset + tile * 16 * groups + 8 * h;
      const __m256 eight = _mm256_set1_ps(8.0f);
      for (int64_t g = 0; g < groups; ++g) {
        const __m256 o = _mm256_fmadd_ps(_mm256_loadu_ps(st + g * 16 + 8 * h), eight, _mm256_loadu_ps(ot + g * 16));
        for (int i = 0; i < MB; ++i)
          part[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(t.xsum[(m0 + i) * groups + g]), part[i]);
      }
    }
    for (int i = 0; i < MB; ++i)
      _mm256_storeu_ps(t.y + t.row[m0 + i] * t.N + 16 * tile + 8 * h,
                       KIND == kInt4 ? _mm256_add_ps(acc[i], part[i]) : acc[i]);
  }
}

// The live rows in passes of up to MAX rows, the last with what is left: fn(std::integral_constant<int, MB>{},
// m0) for each.  (Even passes, 9 rows as 5 + 4, measured slower than 8 + 1 on the 1.5B's matrices: 115 against
// 106 ms at int8, 93 against 86 at int4, Xeon 167.)
template <int MAX, typename Fn, int... I>
inline void ForPasses(int64_t M, const Fn& fn, std::integer_sequence<int, I...>) {
  int64_t m = 0;
  for (; m + MAX <= M; m += MAX) fn(std::integral_constant<int, MAX>{}, m);
  const int64_t left = M - m;
  ((left == I + 1 ? (fn(std::integral_constant<int, I + 1>{}, m), 0) : 0), ...);
}
#endif

}  // namespace

void RowBlockTiles(const DotTask& t, int32_t path, int64_t t0, int64_t t1) {
#if SPECJAX_X86
  // Each tile in passes of up to MAX rows; kernel(mb, tile, m0) runs one pass of mb rows.
  const auto each_tile = [&](auto max, const auto& kernel) {
    constexpr int MAX = decltype(max)::value;
    for (int64_t tile = t0; tile < t1; ++tile)
      ForPasses<MAX>(t.M, [&](auto mb, int64_t m) { kernel(mb, tile, m); }, std::make_integer_sequence<int, MAX - 1>{});
  };
  if (path == kPathVnni)
    return each_tile(std::integral_constant<int, 8>{}, [&](auto mb, int64_t tile, int64_t m) {
      if (t.kind == kInt8) TileVnni<kInt8, decltype(mb)::value>(t, tile, m);
      else TileVnni<kInt4, decltype(mb)::value>(t, tile, m);
    });
  if (path == kPathAvx2)
    return each_tile(std::integral_constant<int, 4>{}, [&](auto mb, int64_t tile, int64_t m) {
      if (t.kind == kInt8) TileAvx2<kInt8, decltype(mb)::value>(t, tile, m);
      else TileAvx2<kInt4, decltype(mb)::value>(t, tile, m);
    });
#endif
  for (int64_t tile = t0; tile < t1; ++tile) TilePortable(t, tile);
}

}  // namespace specjax::qdot
