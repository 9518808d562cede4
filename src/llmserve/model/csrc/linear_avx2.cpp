// float32 linear layers on CPU through AVX2 + FMA (JIT-built by llmserve/model/cpu_kernels.py).
//
//   pack_linear_weight  w [N, K] -> panels [P, K, 16], P = ceil(N / 16): 16 output columns a panel, one
//                       64-byte cache line per k, zero columns padding the last panel (done once, at load)
//   packed_linear       out [M, N] = x [M, K] @ w^T (+ bias [N])
//
// Threads take contiguous runs of (panel, 64-row block) units (panel_gemm.h), so each streams its own stretch
// of the packed weight. A unit walks K in chunks of 128: the panel's 8 KB chunk stays in L1 while every block of up to 6
// rows of x passes over it, 6 rows x 16 columns held in 12 ymm accumulators. At decode sizes (a few rows)
// the weights come from DRAM, so the first row block of a panel prefetches the stream 256 k-rows (16 KB)
// ahead into L2, which overlaps the weights' stream with the FMAs instead of waiting for it.
//
// Every output element is one FMA chain over k in order (chunks accumulate through `out`): results do not
// depend on the number of rows, a row's position or the thread count.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "panel_gemm.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;       // output columns a panel: two ymm registers
constexpr int64_t kChunk = 128;      // k-rows of a panel a row block passes over at a time (8 KB)
constexpr int64_t kRowBlock = llmserve_cpu::kPanelRowBlock;  // rows of x a work unit covers
constexpr int64_t kPrefetchRows = 256;  // k-rows ahead the weight stream is prefetched
constexpr int kMaxRows = 6;  // rows of x a register block holds: 12 accumulators + 2 panel rows + 1 broadcast

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "pack_linear_weight: float32 [N, K] expected");
  const int64_t n = weight.size(0), k = weight.size(1), num_panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = weight.new_zeros({num_panels * kPanel, k});
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({num_panels, kPanel, k}).transpose(1, 2).contiguous();  // [P, K, 16]
}

struct Gemm {
  const float* x;        // [M, K]
  const float* panels;   // [P, K, 16]
  const float* bias;     // [N] or nullptr
  float* out;            // [M, N]
  int64_t m, n, k, num_panels;
};

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr bool kHasAvx2 = true;

// c[r, 0:16] (+)= a[r, 0:kc] @ b[0:kc, 0:16] for r < ROWS; `first` starts from the bias (or zero),
// otherwise from what c holds. pf, when set, is prefetched one line per k.
template <int ROWS>
inline void block(const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc, const float* bias,
                  bool first, const float* pf) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = !first ? _mm256_loadu_ps(c + r * ldc + 8 * j) : bias ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
  for (int i = 0; i < kc; ++i) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + i * kPanel), _MM_HINT_T1);
    __m256 bv[2];
    for (int j = 0; j < 2; ++j) bv[j] = _mm256_load_ps(b + i * kPanel + 8 * j);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + i);
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_fmadd_ps(av, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(c + r * ldc + 8 * j, acc[r][j]);
}

// One unit: panel p over rows [row0, row0 + num_rows). A panel whose columns run past N goes through a
// 16-wide tile, then its valid columns are copied out.
void run_unit(const Gemm& g, int64_t p, int64_t row0, int64_t num_rows, bool prefetch) {
  const float* b = g.panels + p * g.k * kPanel;
  const int64_t num_elements = g.num_panels * g.k * kPanel;
  const int64_t num_cols = std::min(kPanel, g.n - p * kPanel);
  const bool is_full = num_cols == kPanel;
  alignas(32) float tile[kRowBlock * kPanel];
  alignas(32) float bias_tile[kPanel] = {};  // the last panel's bias, zero-padded to 16 columns
  const float* bias = g.bias ? g.bias + p * kPanel : nullptr;
  if (bias && !is_full) {
    std::copy(bias, bias + num_cols, bias_tile);
    bias = bias_tile;
  }
  for (int64_t k0 = 0; k0 < g.k; k0 += kChunk) {
    const int kc = static_cast<int>(std::min(kChunk, g.k - k0));
    const int64_t pf_offset = (p * g.k + k0 + kPrefetchRows) * kPanel;  // into the next panel near the end
    const float* pf = prefetch && pf_offset + kc * kPanel <= num_elements ? g.panels + pf_offset : nullptr;
    llmserve_cpu::for_each_row_block<kMaxRows>(num_rows, [&](auto rows, int64_t r) {
      float* c = is_full ? g.out + (row0 + r) * g.n + p * kPanel : tile + r * kPanel;
      block<decltype(rows)::value>(g.x + (row0 + r) * g.k + k0, g.k, b + k0 * kPanel, kc, c, is_full ? g.n : kPanel,
                                   bias, k0 == 0, r == 0 ? pf : nullptr);
    });
  }
  if (!is_full)
    for (int64_t r = 0; r < num_rows; ++r)
      std::copy(tile + r * kPanel, tile + r * kPanel + num_cols, g.out + (row0 + r) * g.n + p * kPanel);
}

void run(const Gemm& g) {
  llmserve_cpu::for_each_panel_unit(g.num_panels, g.m, [&](int64_t p, int64_t row0, int64_t num_rows, bool prefetch) {
    run_unit(g, p, row0, num_rows, prefetch);
  });
}

}  // namespace

#else
namespace {
constexpr bool kHasAvx2 = false;
void run(const Gemm&) {}
}  // namespace
#endif

namespace {

void packed_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasAvx2, "packed_linear: built without AVX2 + FMA");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "packed_linear: panels must be a contiguous float32 [P, K, 16] tensor (pack_linear_weight)");
  const int64_t m = x.size(0), k = panels.size(1), n = out.size(1);
  TORCH_CHECK(k > 0, "packed_linear: K must be positive");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == k && x.is_contiguous(),
              "packed_linear: x must be a contiguous float32 [M, ", k, "] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == m && out.is_contiguous() &&
                  (n + kPanel - 1) / kPanel == panels.size(0),
              "packed_linear: out must be a contiguous float32 [M, N] tensor with ceil(N / 16) == P");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "packed_linear: bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  if (m == 0) return;
  run(Gemm{x.data_ptr<float>(), panels.data_ptr<float>(), b, out.data_ptr<float>(), m, n, k, panels.size(0)});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight);
  m.def("packed_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()", &packed_linear);
}
