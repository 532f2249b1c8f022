// ParallelFor over XLA's intra-op thread pool, safe when the pool is busy.
//
// The calling thread works through the units itself, and helper tasks scheduled on the pool join in when
// they get a thread.  The caller waits only for units a helper has already started (which are running), never
// for a helper to be scheduled: XLA may run several custom calls at once on the same pool, and waiting for a
// task queued behind a busy pool would deadlock.  Late helpers find no work left and return; the shared state
// they touch is reference-counted.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace specjax {

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t units, int64_t helpers,
                        std::function<void(int64_t unit)> fn) {
  struct State {
    std::function<void(int64_t)> fn;
    int64_t units;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
  };
  auto st = std::make_shared<State>();
  st->fn = std::move(fn);
  st->units = units;
  auto work = [](State& s) {
    for (int64_t u = s.next.fetch_add(1); u < s.units; u = s.next.fetch_add(1)) {
      s.fn(u);
      s.finished.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t i = 0; i < helpers && i + 1 < units; ++i) pool.Schedule([st, work] { work(*st); });
  work(*st);
  while (st->finished.load(std::memory_order_acquire) != units) std::this_thread::yield();
}

}  // namespace specjax
