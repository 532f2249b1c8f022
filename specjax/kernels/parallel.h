// ParallelFor for the native kernels: the calling thread plus a few helper threads that stay awake briefly.
//
// Why not XLA's intra-op pool: a decode step calls ~150 short kernels (≈ 0.1–0.3 ms each) back to back, and
// a pool task has to wake a sleeping worker every time.  On a 2-core VM that wake-up took ~50–70 µs per call
// (measured: 90 chained 3072×576 matmuls cost 31 ms through XLA's pool against 25 ms with workers already
// running), i.e. a fifth of the step.  Here the helpers spin for a short while after each job (by default
// 2 ms, SPECJAX_SPIN_US), so the next kernel of the same step finds them running; then they sleep, so an
// idle process costs nothing.
//
// Safety: the caller works through the units itself and waits only for units a helper has already claimed
// (which are running), never for a helper to arrive.  One job runs on the helpers at a time; a call made
// while they are busy (XLA may run two custom calls at once) runs on its caller alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>   // SSE2, the x86-64 baseline (not immintrin.h: isa.h decides how vector types come in)
#define SPECJAX_PAUSE() _mm_pause()
#else
#define SPECJAX_PAUSE() std::this_thread::yield()
#endif

namespace specjax {

class SpinPool {
 public:
  // helpers: extra threads beside the caller (fixed by the first call: the number of cores minus one).
  static SpinPool& Get(int64_t helpers) {
    static SpinPool* pool = new SpinPool(helpers);  // never destroyed: helpers may outlive static teardown
    return *pool;
  }

  int64_t helpers() const { return static_cast<int64_t>(threads_.size()); }

  // At most `n` helpers join a job from now on (n < 0: all of them).  A machine with many cores may stream a
  // decode step's weights fastest with fewer than all of them; the measured choice is set here (kernels/choices.py).
  static std::atomic<int64_t>& HelperLimit() {
    static std::atomic<int64_t> limit{-1};
    return limit;
  }

  // Runs fn(0) ... fn(units - 1), each exactly once, on the caller and (if `use_helpers`) the helpers.
  void Run(int64_t units, bool use_helpers, const std::function<void(int64_t)>& fn) {
    if (units <= 1 || !use_helpers || threads_.empty() || busy_.exchange(true)) {
      for (int64_t u = 0; u < units; ++u) fn(u);
      return;
    }
    // Odd generation: no helper may join while the job is being set up; wait for stragglers of the last job.
    generation_.fetch_add(1);
    while (active_.load() != 0) SPECJAX_PAUSE();
    fn_ = &fn;
    units_ = units;
    next_.store(0);
    finished_.store(0);
    generation_.fetch_add(1);  // even: the job is open
    generation_.notify_all();
    Work();
    while (finished_.load() != units) SPECJAX_PAUSE();
    generation_.fetch_add(1);  // odd again: closed (late helpers find nothing to do)
    while (active_.load() != 0) SPECJAX_PAUSE();
    generation_.fetch_add(1);
    busy_.store(false);
  }

 private:
  explicit SpinPool(int64_t helpers) {
    const char* env = std::getenv("SPECJAX_SPIN_US");
    spin_us_ = env ? std::atoll(env) : 2000;
    for (int64_t i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { HelperLoop(i); });
    for (auto& t : threads_) t.detach();
  }

  void Work() {
    for (int64_t u = next_.fetch_add(1); u < units_; u = next_.fetch_add(1)) {
      (*fn_)(u);
      finished_.fetch_add(1);
    }
  }

  void HelperLoop(int64_t index) {
    uint64_t seen = generation_.load();
    for (;;) {
      uint64_t g = generation_.load();
      auto start = std::chrono::steady_clock::now();
      for (int spins = 0; g == seen || (g & 1); g = generation_.load()) {
        if (++spins % 256 != 0) {
          SPECJAX_PAUSE();
        } else if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
          generation_.wait(g);  // sleep until the generation changes
          start = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      const int64_t limit = HelperLimit().load(std::memory_order_relaxed);
      if (limit >= 0 && index >= limit) continue;   // not one of the helpers in use
      active_.fetch_add(1);
      if (generation_.load() == g) Work();
      active_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  int64_t spin_us_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> finished_{0};
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t units_ = 0;
};

// Runs fn over [0, units) on the caller, and on the helpers when `parallel`.  `threads` is the machine's
// parallelism (XLA's intra-op pool size), used by the first call to size the helper set.
inline void ParallelFor(int64_t threads, int64_t units, bool parallel, const std::function<void(int64_t)>& fn) {
  SpinPool::Get(std::max<int64_t>(threads - 1, 0)).Run(units, parallel, fn);
}

}  // namespace specjax
