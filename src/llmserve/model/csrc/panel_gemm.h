// What the AVX2 panel GEMMs share (linear_avx2.cpp: float32, int8_linear_avx2.cpp: int8): the split of the
// work over threads and the dispatch to a register block of a given row count.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace llmserve_cpu {

constexpr int64_t kPanelRowBlock = 64;  // rows of x a work unit covers

// unit(p, row0, num_rows, prefetch) for every (panel p, 64-row block from row0) of an m-row product. Threads
// take contiguous runs of units, so each streams its own stretch of the packed weight; `prefetch` is set on a
// thread's first unit and on a panel's first row block (which prefetch the stream, on into the next panel).
template <class Unit>
void for_each_panel_unit(int64_t num_panels, int64_t m, Unit unit) {
  const int64_t num_row_blocks = (m + kPanelRowBlock - 1) / kPanelRowBlock;
  at::parallel_for(0, num_panels * num_row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = u / num_row_blocks, row0 = (u % num_row_blocks) * kPanelRowBlock;
      unit(p, row0, std::min(kPanelRowBlock, m - row0), u == begin || row0 == 0);
    }
  });
}

// block(std::integral_constant<int, R>{}, r) for the register blocks of a unit's num_rows rows: R rows
// (1 .. kMaxRows) from row r, one inlined instance per row count. (Called through a table of function
// pointers, GCC kept the accumulators on the stack: 2.5x slower.)
template <int kMaxRows, class Block>
inline void for_each_row_block(int64_t num_rows, Block block) {
  static_assert(1 <= kMaxRows && kMaxRows <= 6, "register blocks of 1 to 6 rows");
  for (int64_t r = 0; r < num_rows; r += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, num_rows - r)) {
      case 1: block(std::integral_constant<int, 1>{}, r); break;
      case 2: block(std::integral_constant<int, std::min(2, kMaxRows)>{}, r); break;
      case 3: block(std::integral_constant<int, std::min(3, kMaxRows)>{}, r); break;
      case 4: block(std::integral_constant<int, std::min(4, kMaxRows)>{}, r); break;
      case 5: block(std::integral_constant<int, std::min(5, kMaxRows)>{}, r); break;
      default: block(std::integral_constant<int, kMaxRows>{}, r); break;
    }
  }
}

}  // namespace llmserve_cpu
