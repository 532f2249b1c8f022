// specjax CPU kernel: y[M, N] = x[M, D] . dequantize(w)[N, D]^T for a few rows M, with w kept compact.
//
// The same streaming design as cpu_matmul.cc (each weight row read once for all M rows of x, split over a
// few threads), but the weights arrive as bf16, int8 or int4 and are widened to fp32 in registers just before
// their multiply-adds: a decode step then reads 2, ~3.8 or ~6 times fewer bytes.  The activations and the
// accumulation stay fp32.  Formats (quant.py; G, the group along the input, is 32 or 64):
//   bf16  bf16 [N, D] (read as its u16 bits)                          w = bits << 16
//   int8  s8  [N, D], scale f32 [N, D/G]                              w = q * scale[n, d / G]
//   int4  u8  [N, D/2], scale and offset f32 [N, D/G]; each 32-column block is 16 bytes, byte j holding column j
//         in its low nibble and column j + 16 in its high one        w = nibble * scale[n, d/G] + offset[n, d/G]
// (int4 is GGUF's Q4_1 layout, so Q4_0, Q4_1 and Q4_K blocks map onto it exactly.)  The vector paths sum each
// chunk's products of raw integers and x, then scale the sum (and add offset x the chunk's sum of x): the same
// value as qmatmul_t_reference (dequantize, then multiply) up to the order of the sums, and a row's bits do
// not depend on how many other rows are computed beside it.
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
  const float* scale;    // int8, int4 [N, D/G]; null for bf16
  const float* offset;   // int4 [N, D/G]; null otherwise
  float* y;              // [rows, N]
  const int64_t* row;    // [M]: the rows of x (and y) computed
  int64_t M, N, D, G;
  Kind kind;
  const float* xp = nullptr;   // [M, Dc]: the live rows of x, permuted to the vector paths' chunk order
  int64_t Dc = 0;              // columns in whole chunks (the rest, a tail, read x itself)
  int64_t lanes = 0;           // the vector path xp was built for: 16 (AVX-512), 8 (AVX2), 0 (portable)
};

// The vector paths read one vector of weight bytes (4L bytes, L lanes of 32 bits) per chunk and widen it with
// shifts and masks only (no shuffles): a lane's 32 bits hold 2 bf16, 4 int8 or 8 int4 weights, and sub-vector
// k of the chunk takes the k-th of each lane.  x is permuted once per call to match: chunk position k*L + i
// holds the column that lane i's k-th weight multiplies.  Chunk widths: bf16 2L, int8 4L, int4 8L columns.
inline int64_t ChunkWidth(Kind kind, int64_t L) { return kind == kBf16 ? 2 * L : kind == kInt8 ? 4 * L : 8 * L; }

// Floats per chunk in the permuted x: its columns, and for int4 one more vector, lane i's sum of x over its 8
// columns (what the chunk's offsets multiply).
inline int64_t ChunkStride(Kind kind, int64_t L) { return ChunkWidth(kind, L) + (kind == kInt4 ? L : 0); }

inline int64_t ChunkColumn(Kind kind, int64_t L, int64_t p) {
  const int64_t k = p / L, i = p % L;
  switch (kind) {
    case kBf16: return 2 * i + k;                         // k = 0: the low (even) bf16, 1: the high (odd)
    case kInt8: return 4 * i + k;                         // k = byte
    default:    // k = nibble: byte k / 2 of the lane, low or high half; lane i's bytes start at 4i
      return 32 * (i / 4) + 4 * (i % 4) + k / 2 + 16 * (k % 2);
  }
}

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
      return static_cast<float>(static_cast<int8_t>(t.w[n * t.D + d])) * t.scale[n * (t.D / t.G) + d / t.G];
    default: {
      const uint8_t byte = t.w[n * (t.D / 2) + (d / 32) * 16 + (d & 15)];
      const int v = (d & 16) ? (byte >> 4) : (byte & 15);
      const int64_t g = n * (t.D / t.G) + d / t.G;
      return static_cast<float>(v) * t.scale[g] + t.offset[g];
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
// 16 weights of row n from column d (d a multiple of 16, d + 16 <= D), as fp32 (the tails past the chunks).
SPECJAX_TARGET_AVX512 inline __m512 Load16(const QTask& t, int64_t n, int64_t d) {
  switch (t.kind) {
    case kBf16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + 2 * (n * t.D + d)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case kInt8: {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w + n * t.D + d));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(b))),
                           _mm512_set1_ps(t.scale[n * (t.D / t.G) + d / t.G]));
    }
    default: {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w + n * (t.D / 2) + (d / 32) * 16));
      __m512i v = _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(b));   // (two steps: SIMDe lacks the one)
      v = (d & 16) ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
      const int64_t g = n * (t.D / t.G) + d / t.G;
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(t.scale[g]), _mm512_set1_ps(t.offset[g]));
    }
  }
}

// The last D % 16 weights of row n (zeros past the end).
SPECJAX_TARGET_AVX512 inline __m512 LoadTail16(const QTask& t, int64_t n, int64_t d) {
  float lanes[16] = {};
  for (int64_t i = 0; d + i < t.D; ++i) lanes[i] = Weight(t, n, d + i);
  return _mm512_loadu_ps(lanes);
}

// Nibble K of every lane as a float: the lane's low 4 bits index a table of 0..15 (vpermps reads only those),
// so one shift and one permute per 16 weights.
template <int K>
SPECJAX_TARGET_AVX512 inline __m512 Nibble512(__m512i v) {
  const __m512i shifted = K == 0 ? v : _mm512_srli_epi32(v, 4 * K);
  const __m512 table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_permutexvar_ps(shifted, table);   // the low 4 bits of each lane index the table
}

// Byte K of every lane moved to the lane's top byte, the rest zero: as an int32, q * 2^24 for the signed byte
// q, which converts to float exactly (8 significant bits).  The permuted x of an int8 call carries the 2^-24
// (Run), so each product is q * x exactly as the reference rounds it.  One byte shuffle per 16 weights; two
// shifts (both on one port on Intel cores) did the same before.
template <int K>
SPECJAX_TARGET_AVX512 inline __m512i ByteOnTop512(__m512i v) {
  if constexpr (K == 3) {
    return _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFF000000u)));
  } else {
    const __m512i pick = _mm512_set1_epi32(static_cast<int>(0x80808080u & ~0xFF000000u) |
                                           static_cast<int>(static_cast<uint32_t>(K) << 24));
    // pshufb indexes within each 128-bit lane: the dword at bytes 4j..4j+3 takes byte 4j + K
    const __m512i lane_base = _mm512_set_epi32(0x0C000000, 0x08000000, 0x04000000, 0, 0x0C000000, 0x08000000,
                                               0x04000000, 0, 0x0C000000, 0x08000000, 0x04000000, 0, 0x0C000000,
                                               0x08000000, 0x04000000, 0);
    return _mm512_shuffle_epi8(v, _mm512_add_epi32(pick, lane_base));
  }
}

// The per-lane vector of a chunk's group values (scales or offsets) from p, the chunk's first group.
SPECJAX_TARGET_AVX512 inline __m512 GroupVector512(__m512i idx, int64_t per_chunk, const float* p) {
  const __m128 s4 = per_chunk == 4 ? _mm_loadu_ps(p)
                    : per_chunk == 2 ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)))
                                     : _mm_set1_ps(*p);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s4));
}

// NR rows of w from n against MB <= 4 live rows of x from m0.  Per chunk, each weight vector is loaded once
// and widened with shifts and masks; each sub-vector of x, loaded once, feeds NR * MB multiply-adds.  int8 and
// int4: a chunk's sums of integer weight x x are scaled by their groups' scales (int8: lanes 8h..8h+7 hold
// columns 32h..32h+31; int4: lanes 4b..4b+3 hold block b), and int4 adds offset x the lanes' sums of x.  Each
// (weight row, x row) pair has its own accumulator and the same sequence of operations whatever NR and MB: a
// row's bits do not depend on the others.
template <Kind KIND, int NR, int MB>
SPECJAX_TARGET_AVX512 void Tile512(const QTask& t, int64_t n, int64_t m0) {
  constexpr int64_t L = 16;
  const int64_t W = ChunkWidth(KIND, L);
  const int64_t row_bytes = KIND == kBf16 ? 2 * t.D : KIND == kInt8 ? t.D : t.D / 2;
  const uint8_t* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = t.w + (n + r) * row_bytes;
  const int64_t S = ChunkStride(KIND, L);
  const float* xp[MB];
  for (int i = 0; i < MB; ++i) xp[i] = t.xp + (m0 + i) * (t.Dc / W) * S;
  __m512 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t chunks = t.Dc / W;
  const int64_t groups = t.D / t.G;
  if constexpr (KIND != kBf16) {   // the group values (their own streams) of the rows 4 tiles ahead
    for (int r = 0; r < NR; ++r) {
      const int64_t ahead = (n + r + 4 * NR) * groups;
      for (int64_t b = 0; b < groups * 4; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(t.scale + ahead) + b, _MM_HINT_T0);
        if constexpr (KIND == kInt4) _mm_prefetch(reinterpret_cast<const char*>(t.offset + ahead) + b, _MM_HINT_T0);
      }
    }
  }
  // which of the chunk's group scales each lane takes: the chunk spans W / G groups (int8 W = 64, int4 128)
  const int64_t per_chunk = W / t.G;
  const __m512i scale_idx = per_chunk == 4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                            : per_chunk == 2 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                             : _mm512_setzero_si512();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i v[NR];
    // prefetch into L1 one row's stream 1 KB ahead, or the next tile's rows, and into L2 16 KB ahead (on Zen 4
    // the L2 stream took the 1.5B's 112 layer matrices at one row from 69 to 53 ms at int8, 50 to 47 at int4)
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[r] + (NR == 1 ? 1024 : NR * row_bytes) + c * 4 * L),
                   _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wr[r] + 16384 + c * 4 * L), _MM_HINT_T1);
      v[r] = _mm512_loadu_si512(wr[r] + c * 4 * L);
    }
    const int64_t o = c * S;
    if constexpr (KIND == kBf16) {
      __m512 even[NR], odd[NR];
      for (int r = 0; r < NR; ++r) {
        even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v[r], 16));
        odd[r] = _mm512_castsi512_ps(_mm512_and_si512(v[r], _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      }
      for (int i = 0; i < MB; ++i) {
        const __m512 x0 = _mm512_loadu_ps(xp[i] + o), x1 = _mm512_loadu_ps(xp[i] + o + L);
        for (int r = 0; r < NR; ++r) {
          acc[r][i] = _mm512_fmadd_ps(even[r], x0, acc[r][i]);
          acc[r][i] = _mm512_fmadd_ps(odd[r], x1, acc[r][i]);
        }
      }
    } else if constexpr (KIND == kInt8) {
      __m512 part[NR][MB];
#define SPECJAX_BYTE(K)                                                                              \
      {                                                                                              \
        __m512 q[NR];                                                                                \
        for (int r = 0; r < NR; ++r) q[r] = _mm512_cvtepi32_ps(ByteOnTop512<K>(v[r]));               \
        for (int i = 0; i < MB; ++i) {                                                               \
          const __m512 xk = _mm512_loadu_ps(xp[i] + o + K * L);                                      \
          for (int r = 0; r < NR; ++r)                                                               \
            part[r][i] = K == 0 ? _mm512_mul_ps(q[r], xk) : _mm512_fmadd_ps(q[r], xk, part[r][i]);   \
        }                                                                                            \
      }
      SPECJAX_BYTE(0) SPECJAX_BYTE(1) SPECJAX_BYTE(2) SPECJAX_BYTE(3)
#undef SPECJAX_BYTE
      for (int r = 0; r < NR; ++r) {
        const __m512 scale = GroupVector512(scale_idx, per_chunk, t.scale + (n + r) * groups + c * per_chunk);
        for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_fmadd_ps(part[r][i], scale, acc[r][i]);
      }
    } else {
      __m512 part[NR][MB];
      {
        __m512 nk[NR];
        for (int r = 0; r < NR; ++r) nk[r] = Nibble512<0>(v[r]);
        for (int i = 0; i < MB; ++i) {
          const __m512 xk = _mm512_loadu_ps(xp[i] + o);
          for (int r = 0; r < NR; ++r) part[r][i] = _mm512_mul_ps(nk[r], xk);
        }
      }
#define SPECJAX_NIBBLE(K)                                                                      \
      {                                                                                        \
        __m512 nk[NR];                                                                         \
        for (int r = 0; r < NR; ++r) nk[r] = Nibble512<K>(v[r]);                               \
        for (int i = 0; i < MB; ++i) {                                                         \
          const __m512 xk = _mm512_loadu_ps(xp[i] + o + K * L);                                \
          for (int r = 0; r < NR; ++r) part[r][i] = _mm512_fmadd_ps(nk[r], xk, part[r][i]);   \
        }                                                                                      \
      }
      SPECJAX_NIBBLE(1) SPECJAX_NIBBLE(2) SPECJAX_NIBBLE(3) SPECJAX_NIBBLE(4)
      SPECJAX_NIBBLE(5) SPECJAX_NIBBLE(6) SPECJAX_NIBBLE(7)
#undef SPECJAX_NIBBLE
      for (int r = 0; r < NR; ++r) {
        const __m512 scale = GroupVector512(scale_idx, per_chunk, t.scale + (n + r) * groups + c * per_chunk);
        const __m512 offset = GroupVector512(scale_idx, per_chunk, t.offset + (n + r) * groups + c * per_chunk);
        for (int i = 0; i < MB; ++i) {
          acc[r][i] = _mm512_fmadd_ps(part[r][i], scale, acc[r][i]);
          acc[r][i] = _mm512_fmadd_ps(_mm512_loadu_ps(xp[i] + o + 8 * L), offset, acc[r][i]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r) {   // the tail past the whole chunks: dequantized 16 at a time, against x itself
    for (int i = 0; i < MB; ++i) {
      const float* xr = t.x + t.row[m0 + i] * t.D;
      __m512 tail = _mm512_setzero_ps();
      int64_t d = t.Dc;
      for (; d + 16 <= t.D; d += 16) tail = _mm512_fmadd_ps(Load16(t, n + r, d), _mm512_loadu_ps(xr + d), tail);
      if (d < t.D) {
        const __mmask16 k = static_cast<__mmask16>((1u << (t.D - d)) - 1);
        tail = _mm512_fmadd_ps(LoadTail16(t, n + r, d), _mm512_maskz_loadu_ps(k, xr + d), tail);
      }
      t.y[t.row[m0 + i] * t.N + n + r] = _mm512_reduce_add_ps(acc[r][i]) + _mm512_reduce_add_ps(tail);
    }
  }
}

template <Kind KIND, int NR>
SPECJAX_TARGET_AVX512 void RowsAvx512(const QTask& t, int64_t n) {
  specjax::ForRowTiles(t.M, [&](auto mb, int64_t m) { Tile512<KIND, NR, decltype(mb)::value>(t, n, m); });
}

// One or two rows of x (decoding) over a short input: one weight row at a time, a single sequential stream per
// thread.  More rows (verification), or an input whose permuted x outgrows L1 (D > 4096: the 1.5B's w_down
// reads 35 KB of x per weight row): weight rows in groups of 4 (int4: 2, whose partial sums need registers
// too), so each load of x serves several of them; the rest one by one.  (Same bits either way: see Tile512.)
// Measured on Zen 4 (min of 30 calls, one row): groups of 4 cut w_down [1536, 8960] from 1.38 to 0.54 ms
// (bf16), 0.79 to 0.38 (int8), 0.64 to 0.34 (int4), and slowed [17920, 1536] by 10-60%.
// On an Intel Xeon (family 6 model 167, AVX-512, 2 cores; python scripts/probes/bench_qmatmul.py, the 1.5B's 112
// layer matrices at one row) three changes took int8 from 97 to 70 ms and int4 from 76 to 53 ms: software
// prefetch of the weight rows and of the group values' streams (int8 14 -> 20, int4 22 -> 26 G weights/s on
// w_gate_up), int4 nibbles turned into floats by a table lookup (vpermps) instead of two operations and a
// subtraction (int4 18 -> 22), and int8 bytes moved by a byte shuffle instead of two shifts (int8 at 4 rows
// 8 -> 13 G weights/s: the shifts and conversions all queued on one port there).
template <Kind KIND>
SPECJAX_TARGET_AVX512 void RowBlockAvx512(const QTask& t, int64_t n0, int64_t n1) {
  constexpr int NR = KIND == kInt4 ? 2 : 4;
  int64_t n = n0;
  if (t.M > 2 || t.D > 4096)
    for (; n + NR <= n1; n += NR) RowsAvx512<KIND, NR>(t, n);
  for (; n < n1; ++n) RowsAvx512<KIND, 1>(t, n);
}

// AVX2: 8 weights of row n from column d (d a multiple of 8, d + 8 <= D), as fp32 (the tails).
SPECJAX_TARGET_AVX2 inline __m256 Load8(const QTask& t, int64_t n, int64_t d) {
  switch (t.kind) {
    case kBf16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w + 2 * (n * t.D + d)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case kInt8: {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t.w + n * t.D + d));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(t.scale[n * (t.D / t.G) + d / t.G]));
    }
    default: {
      const __m128i b = _mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(t.w + n * (t.D / 2) + (d / 32) * 16 + (d & 15)));
      __m256i v = _mm256_cvtepu8_epi32(b);
      v = (d & 16) ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
      const int64_t g = n * (t.D / t.G) + d / t.G;
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(t.scale[g]), _mm256_set1_ps(t.offset[g]));
    }
  }
}

SPECJAX_TARGET_AVX2 inline float HorizontalSum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

template <int K>
SPECJAX_TARGET_AVX2 inline __m256 Nibble256(__m256i v) {
  const __m256i shifted = K == 0 ? v : _mm256_srli_epi32(v, 4 * K);
  const __m256i bits = _mm256_or_si256(_mm256_and_si256(shifted, _mm256_set1_epi32(15)),
                                       _mm256_set1_epi32(0x4B000000));
  return _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(8388608.0f));
}

// As Row512, 8 lanes: chunks of 16 (bf16), 32 (int8) or 64 (int4: two blocks, lanes 4b..4b+3 block b).
template <Kind KIND, int MB>
SPECJAX_TARGET_AVX2 void Row256(const QTask& t, int64_t n, int64_t m0) {
  constexpr int64_t L = 8;
  const int64_t W = ChunkWidth(KIND, L);
  const int64_t row_bytes = KIND == kBf16 ? 2 * t.D : KIND == kInt8 ? t.D : t.D / 2;
  const uint8_t* wr = t.w + n * row_bytes;
  const int64_t S = ChunkStride(KIND, L);
  const float* xp[MB];
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) {
    xp[i] = t.xp + (m0 + i) * (t.Dc / W) * S;
    xr[i] = t.x + t.row[m0 + i] * t.D;
  }
  __m256 acc[MB], tail[MB];
  for (int i = 0; i < MB; ++i) acc[i] = tail[i] = _mm256_setzero_ps();
  const int64_t chunks = t.Dc / W;
  const int64_t groups = t.D / t.G;
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + c * 4 * L));
    const int64_t o = c * S;
    if constexpr (KIND == kBf16) {
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
      for (int i = 0; i < MB; ++i) {   // each chunk summed apart, then added: no long chain across chunks
        const auto p = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xp[i] + o + L), _mm256_mul_ps(even, _mm256_loadu_ps(xp[i] + o)));
        acc[i] = _mm256_add_ps(acc[i], p);
      }
    } else if constexpr (KIND == kInt8) {
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
      const __m256 q2 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
      const __m256 q3 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
      const __m256 scale = _mm256_set1_ps(t.scale[n * groups + c * W / t.G]);   // a chunk lies in one group
      for (int i = 0; i < MB; ++i) {
        const auto a = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp[i] + o + L), _mm256_mul_ps(q0, _mm256_loadu_ps(xp[i] + o)));
        const auto b = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xp[i] + o + 3 * L), _mm256_mul_ps(q2, _mm256_loadu_ps(xp[i] + o + 2 * L)));
        acc[i] = _mm256_fmadd_ps(_mm256_add_ps(a, b), scale, acc[i]);
      }
    } else {
      const int64_t g0 = n * groups + (t.G == 32 ? 2 * c : c), g1 = t.G == 32 ? g0 + 1 : g0;   // block 0, 1
      const __m256 scale = _mm256_set_m128(_mm_set1_ps(t.scale[g1]), _mm_set1_ps(t.scale[g0]));
      const __m256 offset = _mm256_set_m128(_mm_set1_ps(t.offset[g1]), _mm_set1_ps(t.offset[g0]));
      // four short chains of two nibbles each, summed as a tree, then scaled into the row's sum
      const __m256 n0 = Nibble256<0>(v), n1 = Nibble256<1>(v), n2 = Nibble256<2>(v), n3 = Nibble256<3>(v);
      const __m256 n4 = Nibble256<4>(v), n5 = Nibble256<5>(v), n6 = Nibble256<6>(v), n7 = Nibble256<7>(v);
      for (int i = 0; i < MB; ++i) {
        const float* xo = xp[i] + o;
        const __m256 a0 = _mm256_fmadd_ps(n1, _mm256_loadu_ps(xo + L), _mm256_mul_ps(n0, _mm256_loadu_ps(xo)));
        const __m256 a1 = _mm256_fmadd_ps(n3, _mm256_loadu_ps(xo + 3 * L), _mm256_mul_ps(n2, _mm256_loadu_ps(xo + 2 * L)));
        const __m256 a2 = _mm256_fmadd_ps(n5, _mm256_loadu_ps(xo + 5 * L), _mm256_mul_ps(n4, _mm256_loadu_ps(xo + 4 * L)));
        const __m256 a3 = _mm256_fmadd_ps(n7, _mm256_loadu_ps(xo + 7 * L), _mm256_mul_ps(n6, _mm256_loadu_ps(xo + 6 * L)));
        acc[i] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), scale, acc[i]);
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xo + 8 * L), offset, acc[i]);
      }
    }
  }
  int64_t d = t.Dc;
  for (; d + 8 <= t.D; d += 8) {
    const __m256 w = Load8(t, n, d);
    for (int i = 0; i < MB; ++i) tail[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr[i] + d), tail[i]);
  }
  float rest[MB] = {};
  for (; d < t.D; ++d) {   // at most 7 columns
    const float w = Weight(t, n, d);
    for (int i = 0; i < MB; ++i) rest[i] = std::fma(w, xr[i][d], rest[i]);
  }
  for (int i = 0; i < MB; ++i) {
    t.y[t.row[m0 + i] * t.N + n] = HorizontalSum256(acc[i]) + (HorizontalSum256(tail[i]) + rest[i]);
  }
}

template <Kind KIND>
SPECJAX_TARGET_AVX2 void RowBlockAvx2(const QTask& t, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    specjax::ForRowTiles(t.M, [&](auto mb, int64_t m) { Row256<KIND, decltype(mb)::value>(t, n, m); });
}
#endif

int64_t VectorLanes() {
#if SPECJAX_X86
  switch (specjax::ActiveIsa()) {
    case specjax::kAvx512: return 16;
    case specjax::kAvx2: return 8;
    default: break;
  }
#endif
  return 0;
}

void RowBlock(const QTask& t, int64_t n0, int64_t n1) {
#if SPECJAX_X86
  const int64_t lanes = t.xp == nullptr ? 0 : t.lanes;
  if (lanes == 16) {
    switch (t.kind) {
      case kBf16: return RowBlockAvx512<kBf16>(t, n0, n1);
      case kInt8: return RowBlockAvx512<kInt8>(t, n0, n1);
      default: return RowBlockAvx512<kInt4>(t, n0, n1);
    }
  }
  if (lanes == 8) {
    switch (t.kind) {
      case kBf16: return RowBlockAvx2<kBf16>(t, n0, n1);
      case kInt8: return RowBlockAvx2<kInt8>(t, n0, n1);
      default: return RowBlockAvx2<kInt4>(t, n0, n1);
    }
  }
#endif
  RowBlockPortable(t, n0, n1);
}

// x [M, D] fp32, w (bytes of the compact weight, N rows), scale, rows [group, live...] -> y [M, N] fp32.
ffi::Error Run(const char* name, Kind kind, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const uint8_t* w,
               int64_t N, int64_t w_cols, const float* scale, const float* offset, int64_t scale_cols,
               ffi::Buffer<ffi::S32>& rows, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  const int64_t n_rows = static_cast<int64_t>(rows.element_count());
  const int64_t D = xd.size() == 2 ? xd[1] : -1;
  const int64_t expected_cols = kind == kInt4 ? D / 2 : D;
  if (xd.size() != 2 || w_cols != expected_cols || n_rows < 2 || (kind == kInt4 && D % 32 != 0)) {
    return ffi::Error::InvalidArgument(std::string(name) + " expects x [M, D], w [N, D] (int4: [N, D/2], D a "
                                       "multiple of 32) and rows [group, live...]");
  }
  int64_t G = D;
  if (kind != kBf16) {
    G = scale_cols > 0 && D % scale_cols == 0 ? D / scale_cols : 0;
    if (G != 32 && G != 64) {
      return ffi::Error::InvalidArgument(std::string(name) + ": scale must be [N, D/G] with G 32 or 64");
    }
  }
  specjax::LiveRows live;
  if (const char* bad = live.Collect(rows.typed_data(), n_rows, xd[0], N, y->typed_data())) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + bad);
  }
  QTask t{x.typed_data(), w, scale, offset, y->typed_data(), live.rows(), live.count(), N, D, G, kind};
  if (t.M == 0) return ffi::Error::Success();
  // The vector paths' permuted copy of the live rows of x (M x Dc floats: small beside the weights).
  thread_local std::vector<float> xp;
  const int64_t lanes = VectorLanes();
  if (lanes > 0) {
    const int64_t width = ChunkWidth(kind, lanes), stride = ChunkStride(kind, lanes);
    t.Dc = D / width * width;
    const int64_t chunks = t.Dc / width;
    // AVX-512 int8: ByteOnTop512's bytes come as q * 2^24, so x carries the 2^-24 (exact: a power of two)
    const float x_scale = kind == kInt8 && lanes == 16 ? 0x1p-24f : 1.0f;
    xp.resize(std::max<int64_t>(1, t.M * chunks * stride));
    // the chunk's column order, once per call: ChunkColumn's divisions for every element of x cost a decode step
    // of the 1.5B at int4 about 1 ms, on one thread while the other waited
    int32_t columns[8 * 16];
    for (int64_t p = 0; p < width; ++p) columns[p] = static_cast<int32_t>(ChunkColumn(kind, lanes, p));
    for (int64_t m = 0; m < t.M; ++m) {
      const float* xr = t.x + t.row[m] * D;
      for (int64_t c = 0; c < chunks; ++c) {
        float* out = xp.data() + (m * chunks + c) * stride;
        for (int64_t p = 0; p < width; ++p) out[p] = xr[c * width + columns[p]] * x_scale;
        for (int64_t i = 0; kind == kInt4 && i < lanes; ++i) {   // each lane's sum of x (its 8 nibbles' columns)
          float sum = 0.f;
          for (int64_t k = 0; k < 8; ++k) sum += out[k * lanes + i];
          out[width + i] = sum;
        }
      }
    }
    t.xp = xp.data();
    t.lanes = lanes;
  }
  specjax::RunRowBlocks(N, t.M * N * D, pool.num_threads(),
                        [&t](int64_t n0, int64_t n1) { RowBlock(t, n0, n1); });
  return ffi::Error::Success();
}

ffi::Error QMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("specjax_qmatmul_bf16 expects w [N, D]");
  return Run("specjax_qmatmul_bf16", kBf16, pool, x, reinterpret_cast<const uint8_t*>(w.typed_data()), wd[0],
             wd[1], nullptr, nullptr, 0, rows, y);
}

ffi::Error QMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  if (wd.size() != 2 || sd.size() != 2 || sd[0] != wd[0]) {
    return ffi::Error::InvalidArgument("specjax_qmatmul_int8 expects w [N, D] and scale [N, D/G]");
  }
  return Run("specjax_qmatmul_int8", kInt8, pool, x, reinterpret_cast<const uint8_t*>(w.typed_data()), wd[0],
             wd[1], scale.typed_data(), nullptr, sd[1], rows, y);
}

ffi::Error QMatmulInt4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> rows,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  auto od = offset.dimensions();
  if (wd.size() != 2 || sd.size() != 2 || sd[0] != wd[0] || od.size() != 2 || od[0] != sd[0] || od[1] != sd[1]) {
    return ffi::Error::InvalidArgument("specjax_qmatmul_int4 expects w [N, D/2], scale and offset [N, D/G]");
  }
  return Run("specjax_qmatmul_int4", kInt4, pool, x, w.typed_data(), wd[0], wd[1], scale.typed_data(),
             offset.typed_data(), sd[1], rows, y);
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
