// Test builds only (SPECJAX_EMULATE_SIMD, set by native.py under SPECJAX_EMULATE_SIMD=1): every AVX2 and AVX-512
// intrinsic the kernels use comes from SIMDe's portable C instead of the compiler's, so the vector paths run,
// slowly, on any x86-64 CPU, and the AVX-512 code is tested on machines without AVX-512.
//
// Where SIMDe differs from the hardware, this file puts the hardware's behaviour back, so that an emulated path
// computes the hardware's bits (tests/test_cpu_isa_emulated.py checks that against the real AVX2 path):
// masked loads and stores touch only the lanes in the mask (SIMDe's read and write all 16; the kernels rely on
// the hardware not touching the others at the ends of rows and buffers), multiply-adds round once, and
// _mm512_reduce_add_ps (which SIMDe lacks) adds in GCC's order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace specjax::emulated {

inline simde__m512 MaskLoad(simde__m512 src, uint16_t k, const void* p) {
  float lanes[16];
  simde_mm512_storeu_ps(lanes, src);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(&lanes[i], static_cast<const float*>(p) + i, sizeof(float));
  return simde_mm512_loadu_ps(lanes);
}

inline void MaskStore(void* p, uint16_t k, simde__m512 a) {
  float lanes[16];
  simde_mm512_storeu_ps(lanes, a);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<float*>(p) + i, &lanes[i], sizeof(float));
}

// SIMDe has no _mm512_reduce_add_ps: this one adds in the order GCC's does (the upper half onto the lower,
// 16 -> 8 -> 4 lanes, then lanes {0,1} + {2,3}, then the last two), so an emulated sum has the hardware's bits.
inline float ReduceAdd(simde__m512 a) {
  float v[16];
  simde_mm512_storeu_ps(v, a);
  for (int i = 0; i < 8; ++i) v[i] += v[i + 8];
  for (int i = 0; i < 4; ++i) v[i] += v[i + 4];
  return (v[0] + v[2]) + (v[1] + v[3]);
}

// SIMDe's multiply-adds round twice (a product, then a sum) where the hardware's FMA rounds once: these round
// once, lane by lane, as the hardware does.
template <typename V>
inline V FusedMulAdd(V a, V b, V c, bool negate_product) {
  constexpr int n = sizeof(V) / sizeof(float);
  float x[n], y[n], z[n];
  std::memcpy(x, &a, sizeof(V));
  std::memcpy(y, &b, sizeof(V));
  std::memcpy(z, &c, sizeof(V));
  for (int i = 0; i < n; ++i) x[i] = std::fma(negate_product ? -x[i] : x[i], y[i], z[i]);
  std::memcpy(&a, x, sizeof(V));
  return a;
}

}  // namespace specjax::emulated
#define _mm512_reduce_add_ps(a) specjax::emulated::ReduceAdd(a)
#undef _mm512_fmadd_ps
#undef _mm512_fnmadd_ps
#undef _mm256_fmadd_ps
#undef _mm256_fnmadd_ps
#define _mm512_fmadd_ps(a, b, c) specjax::emulated::FusedMulAdd((a), (b), (c), false)
#define _mm512_fnmadd_ps(a, b, c) specjax::emulated::FusedMulAdd((a), (b), (c), true)
#define _mm256_fmadd_ps(a, b, c) specjax::emulated::FusedMulAdd((a), (b), (c), false)
#define _mm256_fnmadd_ps(a, b, c) specjax::emulated::FusedMulAdd((a), (b), (c), true)
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#ifndef _MM_FROUND_TO_NEAREST_INT
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#endif
#undef _mm512_mask_loadu_ps
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_loadu_ps(src, k, p) specjax::emulated::MaskLoad((src), (k), (p))
#define _mm512_maskz_loadu_ps(k, p) specjax::emulated::MaskLoad(simde_mm512_setzero_ps(), (k), (p))
#define _mm512_mask_storeu_ps(p, k, a) specjax::emulated::MaskStore((p), (k), (a))
