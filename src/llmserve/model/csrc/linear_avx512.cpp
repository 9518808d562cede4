// Linear layers on AVX-512 CPUs (JIT-built by llmserve/model/cpu_kernels.py with -mavx512f ... where the CPU
// has them):
//
//   packed_linear_avx512  out [M, N] = x [M, K] @ w^T (+ bias [N]), float32, on linear_avx2.cpp's panels
//                         [P, K, 16]: the same schedule (panel_gemm.h), one zmm a row of a panel, up to 6 rows a
//                         register block. Every output element is one FMA chain over k in order, as in the AVX2
//                         kernel: results do not depend on the number of rows, nor on which of the two runs.
//   bf16_gemv             out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), bfloat16 in and out, M <= 8 (decode
//                         rows), float32 sums through AVX512-BF16's dot products (vdpbf16ps), on the plain
//                         row-major weight: threads take contiguous runs of output rows and stream those rows
//                         of w once, one after the other; a row's partial sums are added at the end (from 3 rows
//                         with a software prefetch ahead of the loads).
//
// Without AVX-512 (or AVX512-BF16) in the build the ops exist and refuse (`has_avx512_kernels` in Python says
// which are there).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "panel_blocks.h"
#include "panel_gemm.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kChunk = 128;         // k-rows of a panel a row block passes over at a time (8 KB)
constexpr int64_t kPrefetchRows = 256;  // k-rows ahead the weight stream is prefetched
constexpr int kMaxRows = 6;             // rows of x a register block holds (for_each_row_block's limit)
constexpr int64_t kGemvMinChunk = 8;    // output rows (of w) a chunk of a thread's work holds at least
constexpr int64_t kGemvPrefetch = 4096;  // elements of w ahead of the loads prefetched into L1 (8 KB; 2-16 KB
                                         // measured alike, none 20% slower: docs/benchmarks.md)
constexpr int64_t kMaxGemvM = llmserve_cpu::kBf16GemvMaxRows;
constexpr int kGemvPrefetchMinRows = 3;  // at 1-2 rows the hardware prefetchers stream w faster alone

using Gemm = llmserve_cpu::F32PanelGemm;

}  // namespace

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr bool kHasAvx512 = true;

void run(const Gemm& g) {
  llmserve_cpu::run_f32_panel_gemm<kMaxRows, kChunk, kPrefetchRows>(
      g, [](auto rows, const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc, const float* bias,
            bool first, const float* pf) {
        llmserve_cpu::f32_block_avx512<decltype(rows)::value>(a, lda, b, kc, c, ldc, bias, first, pf);
      });
}

}  // namespace
#else
namespace {
constexpr bool kHasAvx512 = false;
void run(const Gemm&) {}
}  // namespace
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

constexpr bool kHasBf16Dot = true;

struct Gemv {
  const uint16_t* x;     // [M, K] bfloat16 bits
  const uint16_t* w;     // [N, K]
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* out;         // [M, N]
  int64_t m, n, k;
};

inline float bf16_to_float(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

inline uint16_t float_to_bf16(float value) { return c10::BFloat16(value).x; }  // round to nearest even

// out[r, n] for r < M: the row of w streamed once, 64 k a step into two accumulators a row of x (even and odd
// 32-k halves, masked at the tail), one zmm of 16 pair sums each, added at the end. One row at a time keeps the
// weights one sequential stream (rows interleaved four at a time read ~35% slower from DRAM).
template <int M>
inline void gemv_row(const Gemv& g, int64_t n, bool can_prefetch) {
  __m512 acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* w = g.w + n * g.k;
  int64_t k0 = 0;
  for (; k0 + 64 <= g.k; k0 += 64) {
    if (can_prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k0 + kGemvPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + k0 + kGemvPrefetch + 32), _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k0), w1 = (__m512bh)_mm512_loadu_si512(w + k0 + 32);
    for (int r = 0; r < M; ++r) {
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_loadu_si512(g.x + r * g.k + k0), w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_loadu_si512(g.x + r * g.k + k0 + 32), w1);
    }
  }
  for (; k0 < g.k; k0 += 32) {  // the tail: under 64 k, masked
    const int64_t left = g.k - k0;
    const __mmask32 mask = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k0);
    for (int r = 0; r < M; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, g.x + r * g.k + k0), wv);
  }
  const float bias = g.bias ? bf16_to_float(g.bias[n]) : 0.0f;
  for (int r = 0; r < M; ++r)
    g.out[r * g.n + n] = float_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + bias);
}

template <int M>
void run_gemv_rows(const Gemv& g) {
  const bool can_prefetch = M >= kGemvPrefetchMinRows;
  const int64_t chunk = std::max<int64_t>(kGemvMinChunk, llmserve_cpu::kBalancedChunkBytes / (2 * g.k));
  llmserve_cpu::balanced_parallel_for(g.n, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) gemv_row<M>(g, n, can_prefetch);
  });
}

void run_gemv(const Gemv& g) {
  switch (g.m) {
    case 1: run_gemv_rows<1>(g); break;
    case 2: run_gemv_rows<2>(g); break;
    case 3: run_gemv_rows<3>(g); break;
    case 4: run_gemv_rows<4>(g); break;
    case 5: run_gemv_rows<5>(g); break;
    case 6: run_gemv_rows<6>(g); break;
    case 7: run_gemv_rows<7>(g); break;
    default: run_gemv_rows<8>(g); break;  // 16 accumulators and the two weight vectors: 18 of the 32 zmm
  }
}

}  // namespace
#else
namespace {
constexpr bool kHasBf16Dot = false;
struct Gemv {
  const uint16_t* x;
  const uint16_t* w;
  const uint16_t* bias;
  uint16_t* out;
  int64_t m, n, k;
};
void run_gemv(const Gemv&) {}
}  // namespace
#endif

namespace llmserve_cpu {

void packed_linear_avx512(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasAvx512, "packed_linear_avx512: built without AVX-512");
  const Gemm g = llmserve_cpu::f32_panel_gemm("packed_linear_avx512", out, x, panels, bias);
  if (g.m > 0) run(g);
}

void bf16_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasBf16Dot, "bf16_gemv: built without AVX512-BF16");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous() && k > 0,
              "bf16_gemv: weight must be a contiguous bfloat16 [N, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == k && x.is_contiguous() &&
                  m <= kMaxGemvM,
              "bf16_gemv: x must be a contiguous bfloat16 [M <= ", kMaxGemvM, ", ", k, "] tensor");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == m && out.size(1) == n &&
                  out.is_contiguous(),
              "bf16_gemv: out must be a contiguous bfloat16 [M, N] tensor");
  const uint16_t* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n && bias->is_contiguous(),
                "bf16_gemv: bias must be a contiguous bfloat16 [N] tensor");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  if (m == 0) return;
  run_gemv(Gemv{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                b, reinterpret_cast<uint16_t*>(out.data_ptr()), m, n, k});
}

bool has_avx512_linear() { return kHasAvx512; }

int64_t bf16_gemv_max_rows() { return kHasBf16Dot ? kMaxGemvM : 0; }

}  // namespace llmserve_cpu

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("packed_linear_avx512(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()", &llmserve_cpu::packed_linear_avx512);
  m.def("bf16_gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()", &llmserve_cpu::bf16_gemv);
  m.def("has_avx512_linear() -> bool", &llmserve_cpu::has_avx512_linear);
  m.def("bf16_gemv_max_rows() -> int", &llmserve_cpu::bf16_gemv_max_rows);
}
