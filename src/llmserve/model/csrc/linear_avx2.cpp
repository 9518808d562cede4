// float32 linear layers on CPU through AVX2 + FMA (JIT-built by llmserve/model/cpu_kernels.py).
//
//   pack_linear_weight  w [N, K] -> panels [P, K, 16], P = ceil(N / 16): 16 output columns a panel, one
//                       64-byte cache line per k, zero columns padding the last panel (done once, at load)
//   packed_linear       out [M, N] = x [M, K] @ w^T (+ bias [N])
//
// Threads take contiguous runs of (panel, 64-row block) units (panel_gemm.h), so each streams its own stretch
// of the packed weight. A unit walks K in chunks of 128: the panel's 8 KB chunk stays in L1 while every block of up to 6
// rows of x passes over it, 6 rows x 16 columns held in 12 ymm accumulators. At decode sizes (a few rows)
// the weights come from DRAM: past 6 rows the first row block of a panel prefetches the stream 256 k-rows
// (16 KB) ahead into L2, which overlaps the weights' stream with the FMAs instead of waiting for it; within one
// register block the hardware prefetchers keep up alone (panel_gemm.h).
//
// Every output element is one FMA chain over k in order (chunks accumulate through `out`): results do not
// depend on the number of rows, a row's position or the thread count.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "panel_blocks.h"
#include "panel_gemm.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;       // output columns a panel: two ymm registers
constexpr int64_t kChunk = 128;      // k-rows of a panel a row block passes over at a time (8 KB)
constexpr int64_t kPrefetchRows = 256;  // k-rows ahead the weight stream is prefetched
constexpr int kMaxRows = 6;  // rows of x a register block holds: 12 accumulators + 2 panel rows + 1 broadcast

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "pack_linear_weight: float32 [N, K] expected");
  const int64_t n = weight.size(0), k = weight.size(1), num_panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = weight.new_zeros({num_panels * kPanel, k});
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({num_panels, kPanel, k}).transpose(1, 2).contiguous();  // [P, K, 16]
}

using Gemm = llmserve_cpu::F32PanelGemm;

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr bool kHasAvx2 = true;

void run(const Gemm& g) {
  llmserve_cpu::run_f32_panel_gemm<kMaxRows, kChunk, kPrefetchRows>(
      g, [](auto rows, const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc, const float* bias,
            bool first, const float* pf) {
        llmserve_cpu::f32_block_avx2<decltype(rows)::value>(a, lda, b, kc, c, ldc, bias, first, pf);
      });
}

}  // namespace

#else
namespace {
constexpr bool kHasAvx2 = false;
void run(const Gemm&) {}
}  // namespace
#endif

namespace llmserve_cpu {

void packed_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasAvx2, "packed_linear: built without AVX2 + FMA");
  const Gemm g = llmserve_cpu::f32_panel_gemm("packed_linear", out, x, panels, bias);
  if (g.m > 0) run(g);
}

}  // namespace llmserve_cpu

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight);
  m.def("packed_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()", &llmserve_cpu::packed_linear);
}
