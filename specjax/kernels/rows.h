// What the few-row matmul kernels (cpu_matmul.cc, cpu_qmatmul.cc) share: which rows of x are live, and how
// the rows of w are split over threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"

namespace specjax {

// rows = [group, live] or [group, live_0, ..., live_{all/group - 1}]: x's `all` rows come in groups of `group`
// (a sequence's new tokens) of which only the first `live` (one count for all groups, or one per group)
// matter.  Collects the live ones and zeroes the others' outputs (y [all, N]); they cost nothing more.
class LiveRows {
 public:
  // Returns nullptr, or what is wrong with `rows`.
  const char* Collect(const int32_t* rd, int64_t n_rows, int64_t all, int64_t N, float* y) {
    const int64_t group = std::max<int64_t>(rd[0], 1);
    const int64_t groups = (all + group - 1) / group;
    if (n_rows != 2 && n_rows != 1 + groups) return "rows must hold one live count, or one per group";
    row_ = store_;
    if (all > kStore) {
      heap_.resize(all);
      row_ = heap_.data();
    }
    count_ = 0;
    for (int64_t r = 0; r < all; ++r) {
      const int64_t live = std::clamp<int64_t>(n_rows == 2 ? rd[1] : rd[1 + r / group], 0, group);
      if (r % group < live) {
        row_[count_++] = r;
      } else {
        std::fill_n(y + r * N, N, 0.0f);
      }
    }
    return nullptr;
  }
  const int64_t* rows() const { return row_; }
  int64_t count() const { return count_; }

 private:
  static constexpr int64_t kStore = 64;
  int64_t store_[kStore];
  std::vector<int64_t> heap_;
  int64_t* row_ = store_;
  int64_t count_ = 0;
};

// Rows of w are split into 4 blocks per thread (a multiple of 4 rows, at least 8), taken in turn by the caller
// and the helper threads (see parallel.h: they stay awake between the back-to-back kernels of a step, so no
// call waits for a wake-up).  Few long blocks keep each thread on one sequential stream for longer: on a
// 2-core Zen 3 this streamed the real model's matrices ~5% faster than blocks of 64 rows, at 1 and 5 rows;
// four per thread still lets a thread that started late catch up.  Block bounds are multiples of 4, so
// which rows take the tile loops (and so a row's bits) does not depend on the thread count.
// `work` = M * N * D: below 2^16 multiply-adds one thread does it all.
template <typename BlockFn>
void RunRowBlocks(int64_t N, int64_t work, int64_t threads, const BlockFn& block_fn) {
  if (work < (int64_t{1} << 16)) {
    block_fn(0, N);
    return;
  }
  constexpr int64_t kBlocksPerThread = 4;
  const int64_t parts = kBlocksPerThread * std::max<int64_t>(threads, 1);
  const int64_t block = std::max<int64_t>(8, ((N + parts - 1) / parts + 3) / 4 * 4);
  const int64_t blocks = (N + block - 1) / block;
  ParallelFor(threads, blocks, true, [&block_fn, block, N](int64_t i) {
    block_fn(i * block, std::min(N, (i + 1) * block));
  });
}

// The live rows of x in tiles of 4, then the 1-3 left: tile(std::integral_constant<int, MB>{}, m0) for each
// (the kernels' register tiles take MB as a template argument).
template <typename TileFn>
inline void ForRowTiles(int64_t M, const TileFn& tile) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, m);
  switch (M - m) {
    case 1: tile(std::integral_constant<int, 1>{}, m); break;
    case 2: tile(std::integral_constant<int, 2>{}, m); break;
    case 3: tile(std::integral_constant<int, 3>{}, m); break;
    default: break;
  }
}

}  // namespace specjax
