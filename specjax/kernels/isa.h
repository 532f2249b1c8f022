// Which instruction set the native kernels use: chosen at run time from what the running CPU has.
//
// The library is built for the baseline of its architecture (no -march=native), and each fast path is a
// function compiled for its own target (`SPECJAX_TARGET_AVX512`, `SPECJAX_TARGET_AVX2`).  Only the path the
// CPU supports is ever called, so a library built on one machine and loaded on another (a shared cache, a
// container moved between hosts) runs the best path that machine has instead of faulting on an instruction it
// lacks.
//
//   SpecjaxKernelIsa()      the path in use: 0 portable (compiler-vectorised loops), 1 AVX2+FMA, 2 AVX-512F
//   SpecjaxSetIsa(i)        use path i if the CPU supports it, else the best one below it; returns the path
//                           now in use (tests force each path in turn; SPECJAX_CPU_ISA does it from Python)
//   SpecjaxDetectedIsa(f)   what the CPU supports; f = 1 pretends it supports nothing beyond the baseline
//                           (the test of a library meeting a CPU without its instructions)
//
// Test builds with SPECJAX_EMULATE_SIMD defined (native.py does this under SPECJAX_EMULATE_SIMD=1) take every
// AVX2 and AVX-512 intrinsic from SIMDe's portable implementations instead of the compiler's: the vector
// paths then run, slowly, on any x86-64 CPU, so the AVX-512 code is tested on machines without AVX-512.  The
// masked loads and stores are replaced by lane-exact ones (SIMDe's read and write all 16 lanes; the hardware
// touches only the lanes in the mask, and the kernels rely on that at the ends of rows and buffers).
#pragma once

#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define SPECJAX_X86 1
#if defined(SPECJAX_EMULATE_SIMD)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define SPECJAX_TARGET_AVX512
#define SPECJAX_TARGET_AVX2
#else
#include <immintrin.h>
#define SPECJAX_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define SPECJAX_TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif
#else
#define SPECJAX_X86 0
#endif

#if SPECJAX_X86 && defined(SPECJAX_EMULATE_SIMD)
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
#endif

namespace specjax {

enum Isa : int32_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline std::atomic<int32_t>& PretendNoFeatures() {
  static std::atomic<int32_t> pretend{0};
  return pretend;
}

inline int32_t DetectIsa() {
#if SPECJAX_X86
  if (PretendNoFeatures().load()) return kPortable;
#if defined(SPECJAX_EMULATE_SIMD)
  return kAvx512;   // every path is plain C++ in an emulating build
#endif
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

inline std::atomic<int32_t>& ActiveIsaSlot() {
  static std::atomic<int32_t> active{DetectIsa()};
  return active;
}

inline int32_t ActiveIsa() { return ActiveIsaSlot().load(std::memory_order_relaxed); }

}  // namespace specjax
