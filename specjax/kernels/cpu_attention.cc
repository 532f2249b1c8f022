// specjax CPU kernel: attention of a few new query rows (a decode or verification step) over the KV cache.
//
//   out[b, t, h, :] = softmax_j(q[b, t, h] . k[layer, b, j, h / G] / sqrt(E)) . v[layer, b, j, h / G]
//
// over the slots j query t may see: every committed slot j < lengths[b], and the slots lengths[b] + u of the
// region after it (u < U) with mask[b, t, u].  The mask says it all: causal for plain decoding, a token tree's
// ancestor mask for verification, or the ancestors of a tree's frontier when a drafter extends a tree.  A
// layer with a sliding window also gives lo[b, t], the first slot query t sees: slots before it are neither
// read nor counted, so the work of a windowed layer does not grow with the context.
//
// Why: XLA:CPU has to read a fixed window of cache slots (the live part is data), transposes or copies it,
// and runs the small products and the softmax as separate passes; at a 700-token context that costs more
// than the layer's matmuls.  This kernel reads only each sequence's live slots, straight from the cache
// buffer [L, B, S, K, E] (no slice, no copy), with a vectorised exp, split over a few threads (parallel.h).
//
// Exposed as the XLA FFI target "specjax_attend_cache" (see cpu_attention.py, which holds the reference).
//
// Paths (isa.h picks one at run time from the CPU's features): AVX-512F and AVX2+FMA units for head sizes
// that are multiples of 16 / 8 floats, and a portable unit the compiler vectorises for the baseline.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"


namespace ffi = xla::ffi;

namespace {

struct Args {
  const float* q;        // [B, T, H, E]
  const float* k;        // [L, B, S, K, E]
  const float* v;        // [L, B, S, K, E]
  const int32_t* lengths;  // [B]
  const bool* mask;      // [B, T, U]
  const int32_t* lo;     // [B, T]: the first visible slot of each query (0 for a layer without a window)
  float* out;            // [B, T, H, E]
  int64_t layer, B, T, U, H, E, S, K, G;
  float scale;
};

// Slots are taken kChunk at a time (flash decoding): one unit of work is the G query heads of kv head kh at
// new position t of sequence b over one chunk of the slots it sees.  Each unit leaves partial results (per
// query head: the unnormalised weighted sum of value rows, the largest score and the sum of exp(score -
// largest)); a second pass combines a row's chunks.  So batch-1 decoding at a long context has many units for
// the threads, each slot is read once, and a chunk's K and V stay in cache for the G heads that share them.
//
// The chunks are fixed ranges of a row's *visible* slots, counted in order: committed slot j is visible slot
// j, and the region slots it sees (a tree row: its ancestors, not its siblings) follow the committed ones
// without gaps.  So a row's bits depend neither on the batch nor on the rows computed beside it, and a tree
// node gets the bits of the same token decoded on its own, whose ancestors lie in consecutive slots: its
// chunks hold the same terms, in the same places of the softmax's vector lanes and of the sum over value rows
// (what keeps greedy speculative decoding token-exact, with integer activations too, whose rounding turns a
// last-bit difference into a visible one).
constexpr int64_t kChunk = 256;

// What query t of sequence b sees, as visible slots v in [lo, nvis): v < rbase is buffer slot v (committed,
// from its window's start lo on); v >= rbase is the (v - rbase)-th region slot it sees (mask, at or after lo,
// inside the buffer).
struct RowSpan {
  int64_t ctx, lo, rbase, nvis;
  const bool* m;  // the row's mask over the region [U]
};

inline RowSpan Visible(const Args& a, int64_t b, int64_t t) {
  const int64_t ctx = std::min<int64_t>(a.lengths[b], a.S);
  const int64_t lo = std::max<int64_t>(a.lo[b * a.T + t], 0);
  const bool* m = a.mask + (b * a.T + t) * a.U;
  const int64_t rbase = std::max(lo, ctx);
  int64_t nvis = rbase;
  for (int64_t u = std::max<int64_t>(lo - ctx, 0); u < std::min(a.U, a.S - ctx); ++u) nvis += m[u];
  return {ctx, lo, rbase, nvis, m};
}

// The buffer slot of visible slot v (lo <= v < nvis).
inline int64_t SlotOfVisible(const Args& a, const RowSpan& r, int64_t v) {
  if (v < r.rbase) return v;
  int64_t rank = v - r.rbase;
  for (int64_t u = std::max<int64_t>(r.lo - r.ctx, 0);; ++u)
    if (r.m[u] && rank-- == 0) return r.ctx + u;
}

// Where one unit reads and writes, in view coordinates: slot i of the view is slot j0 + i of the buffer, j0
// the buffer slot of the chunk's first visible slot (or, in the chunk holding the query's window start, of
// that start); the view ends at the chunk's last visible slot, so it spans at most kChunk + U slots.
struct UnitView {
  int64_t ctx, last;            // committed slots of the view, and its slots [0, last)
  const float *kb, *vb, *qrow;  // key and value rows of this kv head (stride K*E), the first query row
  const bool* m;                // visibility of the view's new slots: slot i >= ctx is visible if m[i - ctx]
  float* part;                  // [G, E + 2] partial results
};

inline UnitView View(const Args& a, int64_t b, int64_t kh, int64_t t, int64_t E, int64_t chunk0, float* part) {
  const int64_t KE = a.K * E;
  const RowSpan r = Visible(a, b, t);
  const int64_t v0 = std::max(chunk0, r.lo), v1 = std::min(chunk0 + kChunk, r.nvis);
  const int64_t j0 = v1 > v0 ? SlotOfVisible(a, r, v0) : 0;
  const int64_t n = v1 > v0 ? SlotOfVisible(a, r, v1 - 1) + 1 - j0 : 0;
  const int64_t cache_row = (a.layer * a.B + b) * a.S * KE + kh * E + j0 * KE;
  const int64_t q_row = ((b * a.T + t) * a.H + kh * a.G) * E;
  const bool* m = r.m + std::max<int64_t>(j0 - r.ctx, 0);
  return {std::clamp<int64_t>(r.ctx - j0, 0, n), n, a.k + cache_row, a.v + cache_row, a.q + q_row, m, part};
}

// e^f for |f| <= ln2 / 2 by its Taylor series to degree 6, Horner order (highest coefficient first); shared by
// the scalar, AVX2 and AVX-512 exps below.
constexpr int kExpTerms = 7;
constexpr float kExpTaylor[kExpTerms] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f,
                                         1.0f};

// exp(x) for x <= 0 (scores minus their max), written so the compiler vectorises the loop calling it:
// 2^(x log2 e) = 2^n * 2^f with |f| <= 1/2, 2^f by its Taylor series to degree 6 (relative error < 2e-7).
#pragma omp declare simd
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.6931471805599453f;  // e^f with |f| <= ln2 / 2
  float p = kExpTaylor[0];
  for (int i = 1; i < kExpTerms; ++i) p = p * f + kExpTaylor[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// A tree's row sees some of the view's region slots and not others (its ancestors, not its siblings).  Its
// visible region scores are moved, in order, to the places right after the committed ones (the order of
// visible slots: see kChunk).  Returns how many places are taken; place i >= ctx holds view slot slot_of[i]
// (slot_of: at least kChunk entries, as a chunk holds at most kChunk visible slots).
inline int64_t CompactVisible(int64_t ctx, int64_t last, const bool* m, float* sg, int32_t* slot_of) {
  int64_t n = ctx;
  for (int64_t i = ctx; i < last; ++i) {
    if (!m[i - ctx]) continue;
    sg[n] = sg[i];
    slot_of[n++] = static_cast<int32_t>(i);
  }
  return n;
}

inline int64_t SlotOf(int64_t j, int64_t ctx, const int32_t* slot_of) { return j < ctx ? j : slot_of[j]; }

// One unit of work: the G query heads of kv head kh at new position t of sequence b, over the chunk of slots
// starting at j0.
void Unit(const Args& a, int64_t b, int64_t kh, int64_t t, int64_t j0, float* part, float* scores /* [G, kChunk + U] */) {
  const int64_t E = a.E, G = a.G, KE = a.K * E;
  const auto [ctx, last, kb, vb, qrow, m, pb] = View(a, b, kh, t, E, j0, part);

  // Scores, G query heads at a time per key row (the key row is loaded once for all of them).
  for (int64_t j = 0; j < last; ++j) {
    const float* kr = kb + j * KE;
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = qrow + g * E;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t e = 0; e < E; ++e) s += qr[e] * kr[e];
      scores[g * (kChunk + a.U) + j] = s * a.scale;
    }
  }
  int32_t slot_of[kChunk];
  int64_t n = last;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * (kChunk + a.U);
    n = CompactVisible(ctx, last, m, sg, slot_of);
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
    const bool none = mx == -INFINITY;  // nothing visible in this chunk: it contributes nothing
    if (none) mx = 0.f;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const float p = ExpNonPositive(sg[j] - mx);
      sg[j] = p;
      sum += p;
    }
    pb[g * (E + 2) + E] = none ? -INFINITY : mx;
    pb[g * (E + 2) + E + 1] = none ? 0.f : sum;
  }
  // Weighted sum of value rows (unnormalised), accumulated in the partial rows (they stay in L1).
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e = 0; e < E; ++e) pb[g * (E + 2) + e] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = vb + SlotOf(j, ctx, slot_of) * KE;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * (kChunk + a.U) + j];
      float* o = pb + g * (E + 2);
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) o[e] += p * vr[e];
    }
  }
}

#if SPECJAX_X86
// exp(x) for x <= 0, 16 lanes: 2^n * e^f with n = round(x log2 e), |f| <= ln2 / 2, e^f by Taylor to degree 6.
SPECJAX_TARGET_AVX512 inline __m512 Exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.6931471805599453f), x);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// The same unit for head sizes E = 16 * EC: each query row is held in EC registers, key and value rows are
// read in 16-float chunks (four key rows per pass), and the softmax runs 16 slots at a time.
template <int EC>
SPECJAX_TARGET_AVX512 void UnitAvx512(const Args& a, int64_t b, int64_t kh, int64_t t, int64_t j0, float* part,
                                      float* scores) {
  constexpr int64_t E = EC * 16;
  const int64_t G = a.G, KE = a.K * E;
  const auto [ctx, last, kb, vb, qrow, m, pb] = View(a, b, kh, t, E, j0, part);
  int32_t slot_of[kChunk];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores;
    __m512 qv[EC];
    for (int c = 0; c < EC; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(qrow + g * E + 16 * c), _mm512_set1_ps(a.scale));
    int64_t j = 0;
    for (; j + 4 <= last; j += 4) {
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
      const float* k0 = kb + j * KE;
      for (int c = 0; c < EC; ++c) {
        s0 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + 16 * c), s0);
        s1 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + KE + 16 * c), s1);
        s2 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + 2 * KE + 16 * c), s2);
        s3 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k0 + 3 * KE + 16 * c), s3);
      }
      sg[j] = _mm512_reduce_add_ps(s0);
      sg[j + 1] = _mm512_reduce_add_ps(s1);
      sg[j + 2] = _mm512_reduce_add_ps(s2);
      sg[j + 3] = _mm512_reduce_add_ps(s3);
    }
    for (; j < last; ++j) {
      __m512 s0 = _mm512_setzero_ps();
      for (int c = 0; c < EC; ++c) s0 = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kb + j * KE + 16 * c), s0);
      sg[j] = _mm512_reduce_add_ps(s0);
    }
    // Softmax over the visible slots (a tree row's moved together first: CompactVisible).
    const int64_t n = CompactVisible(ctx, last, m, sg, slot_of);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, sg + j));
    }
    float mxs = _mm512_reduce_max_ps(mx);
    const bool none = mxs == -INFINITY;
    if (none) mxs = 0.f;
    const __m512 mxv = _mm512_set1_ps(mxs);
    for (j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      _mm512_mask_storeu_ps(sg + j, k, Exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + j), mxv)));
    }
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(k, sg + j));
    }
    const float total = _mm512_reduce_add_ps(sum);
    // Weighted sum of value rows in EC registers.
    __m512 acc[EC];
    for (int c = 0; c < EC; ++c) acc[c] = _mm512_setzero_ps();
    for (j = 0; j < n; ++j) {
      const __m512 p = _mm512_set1_ps(sg[j]);
      const float* vr = vb + SlotOf(j, ctx, slot_of) * KE;
      for (int c = 0; c < EC; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), acc[c]);
    }
    float* pg = pb + g * (E + 2);
    for (int c = 0; c < EC; ++c) _mm512_storeu_ps(pg + 16 * c, acc[c]);
    pg[E] = none ? -INFINITY : mxs;
    pg[E + 1] = none ? 0.f : total;
  }
}

// exp(x) for x <= 0, 8 lanes (AVX2 has no scalef: 2^n is built in the exponent bits).
SPECJAX_TARGET_AVX2 inline __m256 Exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.6931471805599453f), x);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

SPECJAX_TARGET_AVX2 inline float Sum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

SPECJAX_TARGET_AVX2 inline float Max256(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// The AVX2 unit for head sizes E = 8 * EC: as UnitAvx512 with 8-float chunks; the softmax's vector loops
// stop at a multiple of 8 slots and finish the rest one at a time.
template <int EC>
SPECJAX_TARGET_AVX2 void UnitAvx2(const Args& a, int64_t b, int64_t kh, int64_t t, int64_t j0, float* part,
                                   float* scores) {
  constexpr int64_t E = EC * 8;
  const int64_t G = a.G, KE = a.K * E;
  const auto [ctx, last, kb, vb, qrow, m, pb] = View(a, b, kh, t, E, j0, part);
  int32_t slot_of[kChunk];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores;
    __m256 qv[EC];
    for (int c = 0; c < EC; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qrow + g * E + 8 * c), _mm256_set1_ps(a.scale));
    int64_t j = 0;
    for (; j + 2 <= last; j += 2) {   // two key rows per pass: 2 accumulators + EC query registers
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
      const float* k0 = kb + j * KE;
      for (int c = 0; c < EC; ++c) {
        s0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), s0);
        s1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + KE + 8 * c), s1);
      }
      sg[j] = Sum256(s0);
      sg[j + 1] = Sum256(s1);
    }
    for (; j < last; ++j) {
      __m256 s0 = _mm256_setzero_ps();
      for (int c = 0; c < EC; ++c) s0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kb + j * KE + 8 * c), s0);
      sg[j] = Sum256(s0);
    }
    const int64_t n = CompactVisible(ctx, last, m, sg, slot_of);   // a tree row's visible slots together
    const int64_t n8 = n & ~int64_t{7};
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (j = 0; j < n8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + j));
    float mxs = Max256(mx);
    for (j = n8; j < n; ++j) mxs = std::max(mxs, sg[j]);
    const bool none = mxs == -INFINITY;
    if (none) mxs = 0.f;
    const __m256 mxv = _mm256_set1_ps(mxs);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j < n8; j += 8) {
      const __m256 p = Exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mxv));
      _mm256_storeu_ps(sg + j, p);
      sum = _mm256_add_ps(sum, p);
    }
    float total = Sum256(sum);
    for (j = n8; j < n; ++j) {
      sg[j] = ExpNonPositive(sg[j] - mxs);
      total += sg[j];
    }
    __m256 acc[EC];
    for (int c = 0; c < EC; ++c) acc[c] = _mm256_setzero_ps();
    for (j = 0; j < n; ++j) {
      const __m256 p = _mm256_set1_ps(sg[j]);
      const float* vr = vb + SlotOf(j, ctx, slot_of) * KE;
      for (int c = 0; c < EC; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[c]);
    }
    float* pg = pb + g * (E + 2);
    for (int c = 0; c < EC; ++c) _mm256_storeu_ps(pg + 8 * c, acc[c]);
    pg[E] = none ? -INFINITY : mxs;
    pg[E + 1] = none ? 0.f : total;
  }
}
#endif

void RunUnit(const Args& a, int64_t b, int64_t kh, int64_t t, int64_t j0, float* part, float* scores) {
#if SPECJAX_X86
  const int32_t isa = specjax::ActiveIsa();
  if (isa == specjax::kAvx512) {
    switch (a.E) {
      case 16: return UnitAvx512<1>(a, b, kh, t, j0, part, scores);
      case 32: return UnitAvx512<2>(a, b, kh, t, j0, part, scores);
      case 64: return UnitAvx512<4>(a, b, kh, t, j0, part, scores);
      case 128: return UnitAvx512<8>(a, b, kh, t, j0, part, scores);
      default: break;
    }
  } else if (isa == specjax::kAvx2) {
    switch (a.E) {
      case 8: return UnitAvx2<1>(a, b, kh, t, j0, part, scores);
      case 16: return UnitAvx2<2>(a, b, kh, t, j0, part, scores);
      case 32: return UnitAvx2<4>(a, b, kh, t, j0, part, scores);
      case 64: return UnitAvx2<8>(a, b, kh, t, j0, part, scores);
      case 128: return UnitAvx2<16>(a, b, kh, t, j0, part, scores);
      default: break;
    }
  }
#endif
  Unit(a, b, kh, t, j0, part, scores);
}

// The second pass: a row's chunks combined, out = Σ_c e^(m_c - M) acc_c / Σ_c e^(m_c - M) sum_c (M the largest
// m_c).  With one chunk this is acc · (1 / sum) exactly, as a single pass would compute it.
void Combine(const Args& a, int64_t b, int64_t kh, int64_t t, const float* part /* [NC, G, E + 2] */) {
  const int64_t E = a.E, G = a.G, PE = E + 2;
  const RowSpan r = Visible(a, b, t);
  const int64_t nc = (r.nvis + kChunk - 1) / kChunk;
  const int64_t c0 = r.lo / kChunk;  // chunks wholly before the window were never computed
  float* orow = a.out + ((b * a.T + t) * a.H + kh * G) * E;
  for (int64_t g = 0; g < G; ++g) {
    float* o = orow + g * E;
    float mx = -INFINITY;
    for (int64_t c = c0; c < nc; ++c) {
      const float* pc = part + (c * G + g) * PE;
      if (pc[E + 1] > 0.f) mx = std::max(mx, pc[E]);
    }
    for (int64_t e = 0; e < E; ++e) o[e] = 0.f;
    if (mx == -INFINITY) continue;  // nothing visible: the row comes out zero
    float den = 0.f;
    for (int64_t c = c0; c < nc; ++c) {
      const float* pc = part + (c * G + g) * PE;
      if (!(pc[E + 1] > 0.f)) continue;
      const float w = std::exp(pc[E] - mx);
      den += w * pc[E + 1];
      for (int64_t e = 0; e < E; ++e) o[e] += w * pc[e];
    }
    const float inv = den > 0.f ? 1.0f / den : 0.f;
    for (int64_t e = 0; e < E; ++e) o[e] *= inv;
  }
}

ffi::Error AttendCache(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                       ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> live_rows, ffi::Buffer<ffi::S32> lo,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || v.dimensions() != kd || kd[1] != qd[0] || kd[4] != qd[3] ||
      qd[2] % kd[3] != 0 || lengths.element_count() != qd[0] || mask.dimensions().size() != 3 ||
      mask.dimensions()[0] != qd[0] || mask.dimensions()[1] != qd[1] ||
      (live_rows.element_count() != 1 && live_rows.element_count() != qd[0]) ||
      lo.element_count() != qd[0] * qd[1]) {
    return ffi::Error::InvalidArgument(
        "specjax_attend_cache expects q [B,T,H,E], k and v [L,B,S,K,E], lengths [B], mask [B,T,U], "
        "live [] or [B], lo [B,T]");
  }
  Args a;
  a.q = q.typed_data();
  a.k = k.typed_data();
  a.v = v.typed_data();
  a.lengths = lengths.typed_data();
  a.mask = mask.typed_data();
  a.lo = lo.typed_data();
  a.out = out->typed_data();
  a.B = qd[0], a.T = qd[1], a.U = mask.dimensions()[2], a.H = qd[2], a.E = qd[3];
  a.S = kd[2], a.K = kd[3], a.G = a.H / a.K;
  a.layer = layer.typed_data()[0];
  if (a.layer < 0 || a.layer >= kd[0]) return ffi::Error::InvalidArgument("layer index out of range");
  a.scale = 1.0f / std::sqrt(static_cast<float>(a.E));

  // Only the first live[b] new rows of sequence b matter (the rest are padded draft slots, or all of them for
  // a finished sequence or an empty serving slot): zero the others; they cost nothing.
  const int32_t* live_in = live_rows.typed_data();
  const bool per_seq = live_rows.element_count() != 1;
  std::vector<int64_t> live(a.B);
  int64_t max_live = 0, work = 0;  // work: roughly the multiply-adds, to decide whether threads are worth waking
  for (int64_t b = 0; b < a.B; ++b) {
    live[b] = std::clamp<int64_t>(live_in[per_seq ? b : 0], 0, a.T);
    max_live = std::max(max_live, live[b]);
    work += (std::min<int64_t>(a.lengths[b], a.S) + a.U) * live[b];
    std::fill(a.out + (b * a.T + live[b]) * a.H * a.E, a.out + (b + 1) * a.T * a.H * a.E, 0.0f);
  }
  if (max_live == 0) return ffi::Error::Success();
  work *= a.H * a.E * 2;
  const bool parallel = work >= (int64_t{1} << 17);
  const int64_t rows = a.B * a.K * max_live;           // (b, kv head, t), t fastest
  const int64_t NC = (a.S + kChunk - 1) / kChunk;        // chunks per row (at most S visible slots)
  const int64_t row_floats = NC * a.G * (a.E + 2);
  thread_local std::vector<float> partial;               // this call's [B, K, max_live, NC, G, E + 2]
  partial.resize(static_cast<size_t>(rows * row_floats));
  float* part = partial.data();
  // Units in the order (b, t, chunk, kv head): threads taking consecutive units read neighbouring parts of
  // the same cache rows [slot, K, E] at the same time.
  specjax::ParallelFor(pool.num_threads(), rows * NC, parallel, [&a, &live, max_live, NC, part, row_floats](int64_t u) {
    const int64_t kh = u % a.K, c = (u / a.K) % NC, w = u / (a.K * NC);
    const int64_t t = w % max_live, b = w / max_live;
    const int64_t r = (b * a.K + kh) * max_live + t;
    if (t >= live[b]) return;
    const RowSpan rs = Visible(a, b, t);
    if (c * kChunk >= rs.nvis || (c + 1) * kChunk <= rs.lo) return;
    thread_local std::vector<float> scores;
    scores.resize(static_cast<size_t>(a.G * (kChunk + a.U)));
    RunUnit(a, b, kh, t, c * kChunk, part + r * row_floats + c * a.G * (a.E + 2), scores.data());
  });
  specjax::ParallelFor(pool.num_threads(), rows, parallel, [&a, &live, max_live, part, row_floats](int64_t r) {
    const int64_t t = r % max_live, kh = (r / max_live) % a.K, b = r / (max_live * a.K);
    if (t < live[b]) Combine(a, b, kh, t, part + r * row_floats);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttendCache, AttendCache,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
