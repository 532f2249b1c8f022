// Which instruction set the native kernels use: chosen at run time from what the running CPU has.
//
// The library is built for the baseline of its architecture (no -march=native), and each fast path is a
// function compiled for its own target (`SPECJAX_TARGET_AVX512`, `SPECJAX_TARGET_AVX2`).  Only the path the
// CPU supports is ever called, so a library built on one machine and loaded on another (a shared cache, a
// container moved between hosts) runs the best path that machine has instead of faulting on an instruction it
// lacks.
//
//   SpecjaxKernelIsa()      the path in use: 0 portable (compiler-vectorised loops), 1 AVX2+FMA, 2 AVX-512F+BW
//   SpecjaxSetIsa(i)        use path i if the CPU supports it, else the best one below it; returns the path
//                           now in use (tests force each path in turn; SPECJAX_CPU_ISA does it from Python)
//   SpecjaxDetectedIsa(f)   what the CPU supports; f = 1 pretends it supports nothing beyond the baseline
//                           (the test of a library meeting a CPU without its instructions)
//   HasAvx512Vnni()         one extension more, which the integer-dot kernel's AVX-512 path needs (cpu_qdot.cc)
//
// Test builds with SPECJAX_EMULATE_SIMD defined take every vector intrinsic from simd_emulation.h instead of
// the compiler's, so every path runs on any x86-64 CPU.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#define SPECJAX_X86 1
#if defined(SPECJAX_EMULATE_SIMD)
#include "simd_emulation.h"
#define SPECJAX_TARGET_AVX512
#define SPECJAX_TARGET_AVX512VNNI
#define SPECJAX_TARGET_AVX2
#else
#include <immintrin.h>
#define SPECJAX_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define SPECJAX_TARGET_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
#define SPECJAX_TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif
#else
#define SPECJAX_X86 0
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
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

// Whether the CPU has AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products summed into 16 int32 lanes per instruction),
// which the integer-dot kernel (cpu_qdot.cc) uses on the AVX-512 path; without it that path takes AVX2's.
inline bool HasAvx512Vnni() {
#if SPECJAX_X86
  if (PretendNoFeatures().load()) return false;
#if defined(SPECJAX_EMULATE_SIMD)
  return true;
#else
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
#endif
#else
  return false;
#endif
}

inline std::atomic<int32_t>& ActiveIsaSlot() {
  static std::atomic<int32_t> active{DetectIsa()};
  return active;
}

inline int32_t ActiveIsa() { return ActiveIsaSlot().load(std::memory_order_relaxed); }

}  // namespace specjax
