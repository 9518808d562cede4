// What the AVX2 panel GEMMs share (linear_avx2.cpp: float32, int8_linear_avx2.cpp: int8): the split of the
// work over threads and the dispatch to a register block of a given row count.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace llmserve_cpu {

constexpr int64_t kPanelRowBlock = 64;  // rows of x a work unit covers
constexpr int kPanelMaxRows = 6;        // rows of x a register block holds

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

// block(std::integral_constant<int, R>{}) with R = rows (1 .. kPanelMaxRows): one inlined instance per row
// count. (Called through a table of function pointers, GCC kept the accumulators on the stack: 2.5x slower.)
template <class Block>
inline void with_rows(int rows, Block block) {
  switch (rows) {
    case 1: return block(std::integral_constant<int, 1>{});
    case 2: return block(std::integral_constant<int, 2>{});
    case 3: return block(std::integral_constant<int, 3>{});
    case 4: return block(std::integral_constant<int, 4>{});
    case 5: return block(std::integral_constant<int, 5>{});
    default: return block(std::integral_constant<int, kPanelMaxRows>{});
  }
}

}  // namespace llmserve_cpu
