// What the panel GEMMs share (linear_avx2.cpp and linear_avx512.cpp: float32, int8_linear_avx2.cpp: int8): the
// split of the work over threads, the dispatch to a register block of a given row count, and the float32 unit.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "balanced_for.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace llmserve_cpu {

constexpr int64_t kPanelRowBlock = 64;  // rows of x a work unit covers

// unit(p, row0, num_rows, prefetch) for every (panel p, 64-row block from row0) of an m-row product of panels of
// panel_bytes. Threads take contiguous runs of units, so each streams its own stretch of the packed weight, in
// chunks of about kBalancedChunkBytes that even the threads out (balanced_for.h); `prefetch` is set on a chunk's
// first unit and on a panel's first row block (which prefetch the stream, on into the next panel).
template <class Unit>
void for_each_panel_unit(int64_t num_panels, int64_t panel_bytes, int64_t m, Unit unit) {
  const int64_t num_row_blocks = (m + kPanelRowBlock - 1) / kPanelRowBlock;
  const int64_t chunk = kBalancedChunkBytes / std::max<int64_t>(1, panel_bytes);
  balanced_parallel_for(num_panels * num_row_blocks, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = u / num_row_blocks, row0 = (u % num_row_blocks) * kPanelRowBlock;
      unit(p, row0, std::min(kPanelRowBlock, m - row0), u == begin || row0 == 0);
    }
  });
}

// block(std::integral_constant<int, R>{}, r) for the register blocks of a unit's num_rows rows: R rows
// (1 .. kMaxRows) from row r, one inlined instance per row count. (Called through a table of function
// pointers, GCC kept the accumulators on the stack, much slower.)
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

// A float32 GEMM over 16-column panels: out [M, N] = x [M, K] @ w^T (+ bias [N]), panels [P, K, 16].
struct F32PanelGemm {
  const float* x;
  const float* panels;
  const float* bias;  // [N] or nullptr
  float* out;
  int64_t m, n, k, num_panels;
};

// One unit of an F32PanelGemm: panel p over rows [row0, row0 + num_rows), K in chunks of kChunk; a panel whose
// columns run past N goes through a 16-wide tile, then its valid columns are copied out. block(rows, a, lda, b,
// kc, c, ldc, bias, first, pf) is the ISA's register block (rows: std::integral_constant); with `prefetch` its
// first row block prefetches the stream kPrefetchRows k-rows ahead (on into the next panel near the end).
template <int kMaxRows, int64_t kChunk, int64_t kPrefetchRows, class Block>
void run_f32_panel_unit(const F32PanelGemm& g, int64_t p, int64_t row0, int64_t num_rows, bool prefetch, Block block) {
  constexpr int64_t kPanel = 16;
  const float* b = g.panels + p * g.k * kPanel;
  const int64_t num_elements = g.num_panels * g.k * kPanel;
  const int64_t num_cols = std::min(kPanel, g.n - p * kPanel);
  const bool is_full = num_cols == kPanel;
  alignas(64) float tile[kPanelRowBlock * kPanel];
  alignas(64) float bias_tile[kPanel] = {};  // the last panel's bias, zero-padded to 16 columns
  const float* bias = g.bias ? g.bias + p * kPanel : nullptr;
  if (bias && !is_full) {
    std::copy(bias, bias + num_cols, bias_tile);
    bias = bias_tile;
  }
  for (int64_t k0 = 0; k0 < g.k; k0 += kChunk) {
    const int kc = static_cast<int>(std::min(kChunk, g.k - k0));
    const int64_t pf_offset = (p * g.k + k0 + kPrefetchRows) * kPanel;
    const float* pf = prefetch && pf_offset + kc * kPanel <= num_elements ? g.panels + pf_offset : nullptr;
    for_each_row_block<kMaxRows>(num_rows, [&](auto rows, int64_t r) {
      float* c = is_full ? g.out + (row0 + r) * g.n + p * kPanel : tile + r * kPanel;
      block(rows, g.x + (row0 + r) * g.k + k0, g.k, b + k0 * kPanel, kc, c, is_full ? g.n : kPanel, bias, k0 == 0,
            r == 0 ? pf : nullptr);
    });
  }
  if (!is_full)
    for (int64_t r = 0; r < num_rows; ++r)
      std::copy(tile + r * kPanel, tile + r * kPanel + num_cols, g.out + (row0 + r) * g.n + p * kPanel);
}

// The F32PanelGemm of out = x @ panels^T (+ bias), every argument checked (errors name `op`).
inline F32PanelGemm f32_panel_gemm(const char* op, at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.size(2) == 16 && panels.is_contiguous(),
              op, ": panels must be a contiguous float32 [P, K, 16] tensor (pack_linear_weight)");
  const int64_t m = x.size(0), k = panels.size(1), n = out.size(1);
  TORCH_CHECK(k > 0, op, ": K must be positive");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == k && x.is_contiguous(),
              op, ": x must be a contiguous float32 [M, ", k, "] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == m && out.is_contiguous() &&
                  (n + 15) / 16 == panels.size(0),
              op, ": out must be a contiguous float32 [M, N] tensor with ceil(N / 16) == P");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                op, ": bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  return F32PanelGemm{x.data_ptr<float>(), panels.data_ptr<float>(), b, out.data_ptr<float>(), m, n, k, panels.size(0)};
}

// Every unit of an F32PanelGemm on ATen's threads (for_each_panel_unit). The weights' stream is prefetched in
// software only past one register block of rows: then each chunk is passed over more than once and the stream
// stalls without it; within one block the panels are read once, in order, and the hardware prefetchers keep up
// faster alone (on 2 MiB pages, model/huge_pages.py: docs/benchmarks.md).
template <int kMaxRows, int64_t kChunk, int64_t kPrefetchRows, class Block>
void run_f32_panel_gemm(const F32PanelGemm& g, Block block) {
  const bool can_prefetch = g.m > kMaxRows;
  for_each_panel_unit(g.num_panels, g.k * 64, g.m, [&](int64_t p, int64_t row0, int64_t num_rows, bool prefetch) {
    run_f32_panel_unit<kMaxRows, kChunk, kPrefetchRows>(g, p, row0, num_rows, prefetch && can_prefetch, block);
  });
}

}  // namespace llmserve_cpu
