// int8 linear layers (W8A8 dynamic) on CPUs without VNNI, through AVX2 (JIT-built by
// llmserve/model/cpu_kernels.py).
//
//   pack_int8_weight  q [N, K] int8 -> panels [P, K2, 32] int8, P = ceil(N / 16), K2 = ceil(K / 2): per pair of
//                     k, 16 output columns x 2 k (column-major within the pair), zeros padding N and K (at load)
//   int8_linear       out [M, N] = ((x_q @ q^T) * x_scale[m]) * w_scale[n] (+ bias[n]), where x [M, K] float32
//                     is quantized per row here, as model/quant/linear.py's torch path does it: scale =
//                     max(max|x| / 127, 1e-12), x_q = round-half-even(x / scale)
//
// Why: without VNNI, oneDNN's s8 GEMM (what torch._int_mm runs) multiplies with vpmaddubsw, whose int16 pair
// sums saturate: its results are off by up to tens of thousands (docs/benchmarks.md). Here x_q and
// the weights are widened to int16 and multiplied with vpmaddwd: each int32 lane gains x[k] w[k] +
// x[k+1] w[k+1] (<= 2 * 127 * 127), exactly, so the int32 sums are exact for any K up to 133,000.
//
// The schedule is csrc/linear_avx2.cpp's (panel_gemm.h): threads take contiguous runs of (panel, 64-row
// block) units; a unit walks K in chunks of 128 pairs (a 4 KB panel chunk stays in L1) with 4 rows x 16
// columns in 8 ymm accumulators, partial sums kept in an int32 tile; the first row block of a panel
// prefetches the weight stream ahead into L2. Integer sums are exact, so a row's output never depends on its
// batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "panel_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;          // output columns a panel
constexpr int64_t kPairBytes = 2 * kPanel;  // one pair of k of a panel: 32 int8
constexpr int64_t kChunkPairs = 128;    // pairs of k a row block passes over at a time (4 KB of panel)
constexpr int64_t kRowBlock = llmserve_cpu::kPanelRowBlock;  // rows of x a work unit covers
constexpr int64_t kPrefetchPairs = 512;  // pairs of k ahead the weight stream is prefetched (16 KB)
constexpr int kMaxRows = 4;  // rows of x a register block holds: with 6 (plus a madd's temporary) GCC spilled
                             // accumulators to the stack (slower at 16-64 rows)

at::Tensor pack_int8_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "pack_int8_weight: int8 [N, K] expected");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t num_panels = (n + kPanel - 1) / kPanel, num_pairs = (k + 1) / 2;
  at::Tensor padded = weight.new_zeros({num_panels * kPanel, 2 * num_pairs});
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [P, 16, K2, 2] -> [P, K2, 16, 2]: within a pair, column j's two k are bytes 2j, 2j + 1
  return padded.view({num_panels, kPanel, num_pairs, 2}).permute({0, 2, 1, 3}).contiguous().view(
      {num_panels, num_pairs, kPairBytes});
}

struct Int8Gemm {
  const int16_t* xq;     // [M, 2 * K2] x quantized, widened, zero-padded to whole pairs
  const float* x_scale;  // [M]
  const int8_t* panels;  // [P, K2, 32]
  const float* w_scale;  // [N]
  const float* bias;     // [N] or nullptr
  float* out;            // [M, N]
  int64_t m, n, num_pairs, num_panels;
};

}  // namespace

#if defined(__AVX2__)
#include <immintrin.h>

namespace {

constexpr bool kHasAvx2 = true;

// Row r of x [M, K] float32 -> xq[r, :] (int16, padded to 2 * K2 with zeros) and its scale.
void quantize_row(const float* x, int64_t k, int64_t padded_k, int16_t* xq, float* scale_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float absmax = 0.0f;
  for (float v : lanes) absmax = std::max(absmax, v);
  for (; i < k; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float scale = std::max(absmax / 127.0f, 1e-12f);
  *scale_out = scale;
  const __m256 vscale = _mm256_set1_ps(scale);
  i = 0;
  for (; i + 16 <= k; i += 16) {  // x / scale, rounded half to even, packed to int16 in order
    const __m256i lo = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vscale),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8), vscale),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
  }
  for (; i < k; ++i) xq[i] = static_cast<int16_t>(std::nearbyint(x[i] / scale));
  for (; i < padded_k; ++i) xq[i] = 0;
}

// acc[r, 0:16] (+)= xq[r, 0:2 kc] @ panel[0:kc pairs] for r < ROWS, in the int32 tile c (row stride 16);
// `first` starts from zero. pf, when set, is prefetched one 32-byte pair per step (a line every other).
template <int ROWS>
inline void block(const int16_t* a, int64_t lda, const int8_t* b, int kc, int32_t* c, bool first, const int8_t* pf) {
  __m256i acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = first ? _mm256_setzero_si256() : _mm256_load_si256(reinterpret_cast<const __m256i*>(c + r * kPanel + 8 * j));
  for (int i = 0; i < kc; ++i) {
    if (pf && (i & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + i * kPairBytes), _MM_HINT_T1);
    __m256i bv[2];  // columns 0-7 and 8-15, each lane one column's (w[k], w[k + 1]) as int16
    for (int j = 0; j < 2; ++j)
      bv[j] = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(b + i * kPairBytes + 16 * j)));
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;  // (x[k], x[k + 1]) as two int16
      __builtin_memcpy(&pair, a + r * lda + 2 * i, sizeof(pair));
      const __m256i av = _mm256_set1_epi32(pair);
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(av, bv[j]));
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 2; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(c + r * kPanel + 8 * j), acc[r][j]);
}

// The int32 sums of a unit's rows -> out: (acc * x_scale[row]) * w_scale[col] (+ bias[col]), valid columns only.
void write_out(const Int8Gemm& g, int64_t p, int64_t row0, int64_t num_rows, const int32_t* tile) {
  const int64_t col0 = p * kPanel, num_cols = std::min(kPanel, g.n - col0);
  for (int64_t r = 0; r < num_rows; ++r) {
    const float xs = g.x_scale[row0 + r];
    float* o = g.out + (row0 + r) * g.n + col0;
    for (int64_t j = 0; j < num_cols; ++j) {
      const float y = static_cast<float>(tile[r * kPanel + j]) * xs * g.w_scale[col0 + j];
      o[j] = g.bias ? y + g.bias[col0 + j] : y;
    }
  }
}

void run_unit(const Int8Gemm& g, int64_t p, int64_t row0, int64_t num_rows, bool prefetch) {
  const int8_t* b = g.panels + p * g.num_pairs * kPairBytes;
  const int64_t num_bytes = g.num_panels * g.num_pairs * kPairBytes;
  const int64_t lda = 2 * g.num_pairs;
  alignas(32) int32_t tile[kRowBlock * kPanel];
  for (int64_t k0 = 0; k0 < g.num_pairs; k0 += kChunkPairs) {
    const int kc = static_cast<int>(std::min(kChunkPairs, g.num_pairs - k0));
    const int64_t pf_offset = (p * g.num_pairs + k0 + kPrefetchPairs) * kPairBytes;  // into the next panel near the end
    const int8_t* pf = prefetch && pf_offset + kc * kPairBytes <= num_bytes ? g.panels + pf_offset : nullptr;
    llmserve_cpu::for_each_row_block<kMaxRows>(num_rows, [&](auto rows, int64_t r) {
      block<decltype(rows)::value>(g.xq + (row0 + r) * lda + 2 * k0, lda, b + k0 * kPairBytes, kc, tile + r * kPanel,
                                   k0 == 0, r == 0 ? pf : nullptr);
    });
  }
  write_out(g, p, row0, num_rows, tile);
}

void run(const Int8Gemm& g) {
  llmserve_cpu::for_each_panel_unit(g.num_panels, g.num_pairs * 32, g.m, [&](int64_t p, int64_t row0, int64_t num_rows, bool prefetch) {
    run_unit(g, p, row0, num_rows, prefetch);
  });
}

}  // namespace

#else
namespace {
constexpr bool kHasAvx2 = false;
void quantize_row(const float*, int64_t, int64_t, int16_t*, float*) {}
void run(const Int8Gemm&) {}
}  // namespace
#endif

namespace {

void int8_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const at::Tensor& w_scale,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasAvx2, "int8_linear: built without AVX2");
  TORCH_CHECK(panels.scalar_type() == at::kChar && panels.dim() == 3 && panels.size(2) == kPairBytes &&
                  panels.is_contiguous(),
              "int8_linear: panels must be a contiguous int8 [P, K2, 32] tensor (pack_int8_weight)");
  const int64_t m = x.size(0), k = x.size(1), num_pairs = panels.size(1), n = out.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && k > 0 && (k + 1) / 2 == num_pairs,
              "int8_linear: x must be a contiguous float32 [M, K] tensor with ceil(K / 2) == K2");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == m && out.is_contiguous() &&
                  (n + kPanel - 1) / kPanel == panels.size(0),
              "int8_linear: out must be a contiguous float32 [M, N] tensor with ceil(N / 16) == P");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == n && w_scale.is_contiguous(),
              "int8_linear: w_scale must be a contiguous float32 [N] tensor");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "int8_linear: bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  if (m == 0) return;
  at::Tensor xq = at::empty({m, 2 * num_pairs}, x.options().dtype(at::kShort));
  at::Tensor x_scale = at::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  int16_t* xqp = xq.data_ptr<int16_t>();
  float* xsp = x_scale.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, k, 2 * num_pairs, xqp + r * 2 * num_pairs, xsp + r);
  });
  run(Int8Gemm{xqp, xsp, panels.data_ptr<int8_t>(), w_scale.data_ptr<float>(), b, out.data_ptr<float>(), m, n,
               num_pairs, panels.size(0)});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("pack_int8_weight(Tensor weight) -> Tensor", &pack_int8_weight);
  m.def("int8_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor w_scale, Tensor? bias) -> ()", &int8_linear);
}
