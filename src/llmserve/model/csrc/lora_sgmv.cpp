// The LoRA products of one projection for every adapter token of a step, in one call (JIT-built by
// llmserve/model/lora_cpu.py): out[t] += (x[t] @ A[s]^T) @ B[s]^T for each token t with slot s.
//
//   out            [T, O]  float32 or bfloat16 (x alike), rows may be strided; columns: sub-projection j at
//                          its offset
//   x              [T, I]  rows may be strided
//   a              [S, n_sub * R, I]   A per slot, stacked over sub-projections (R rows each); out's dtype
//                          (bs alike), or bfloat16 slots for float32 rows (csrc/lora_sgmv_mixed.cpp)
//   bs[j]          [S, R, O_j]         B^T per slot and sub-projection (scale folded in)
//   token_indices  [N] int64  the adapter tokens, grouped by slot (model/lora_layers.py's LoRAStep)
//   token_slots    [N] int64  their slots
//   ranks          [S, n_sub] int32    each slot's rank per sub-projection (0: no LoRA there)
//
// Tokens of one slot go in tiles of up to kTile (lora_sgmv.h): each row of A is read once for the tile
// (shrink), and each row of B^T once for the tile against a register block of each token's output row
// (expand). Rows past a slot's rank are skipped. The tiles are split over torch's intra-op threads, as the base
// projection beside them is. This file: float32 and the op; csrc/lora_sgmv_bf16.cpp: bfloat16.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "lora_sgmv.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_AVX2 1
#endif

namespace {

using llmserve_lora::Problem;

#ifdef LORA_AVX2
using llmserve_lora::hsum;
#endif

// h[t] = dot(xs[t], arow) for the tile's n tokens
template <int64_t N>
void dots(const float* const* xs, const float* arow, int64_t len, float* h) {
  int64_t i = 0;
  float acc[N] = {};
#ifdef LORA_AVX2
  __m256 v[N];
  for (int64_t t = 0; t < N; ++t) v[t] = _mm256_setzero_ps();
  for (; i + 8 <= len; i += 8) {
    const __m256 va = _mm256_loadu_ps(arow + i);
    for (int64_t t = 0; t < N; ++t) v[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + i), va, v[t]);
  }
  for (int64_t t = 0; t < N; ++t) acc[t] = hsum(v[t]);
#endif
  for (; i < len; ++i)
    for (int64_t t = 0; t < N; ++t) acc[t] += xs[t][i] * arow[i];
  for (int64_t t = 0; t < N; ++t) h[t] = acc[t];
}

void dots_any(const float* const* xs, int64_t n, const float* arow, int64_t len, float* h) {
  llmserve_lora::with_tile_rows(n, [&](auto m) { dots<decltype(m)::value>(xs, arow, len, h); });
}

// for each of the tile's N tokens t: orows[t][0:len] += sum_r hs[t][r] * bt[r * len : r * len + len]
// (a block of 16 output columns of every token in registers, each row of B^T loaded once for all of them)
template <int64_t N>
void expand_rows(float* const* orows, const float* const* hs, const float* bt, int64_t rank, int64_t len) {
  int64_t o = 0;
#ifdef LORA_AVX2
  for (; o + 16 <= len; o += 16) {
    __m256 c[N][2];
    for (int64_t t = 0; t < N; ++t) {
      c[t][0] = _mm256_loadu_ps(orows[t] + o);
      c[t][1] = _mm256_loadu_ps(orows[t] + o + 8);
    }
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 b0 = _mm256_loadu_ps(bt + r * len + o), b1 = _mm256_loadu_ps(bt + r * len + o + 8);
      for (int64_t t = 0; t < N; ++t) {
        const __m256 hr = _mm256_broadcast_ss(hs[t] + r);
        c[t][0] = _mm256_fmadd_ps(hr, b0, c[t][0]);
        c[t][1] = _mm256_fmadd_ps(hr, b1, c[t][1]);
      }
    }
    for (int64_t t = 0; t < N; ++t) {
      _mm256_storeu_ps(orows[t] + o, c[t][0]);
      _mm256_storeu_ps(orows[t] + o + 8, c[t][1]);
    }
  }
#endif
  for (; o < len; ++o)
    for (int64_t t = 0; t < N; ++t) {
      float c = orows[t][o];
      for (int64_t r = 0; r < rank; ++r) c += hs[t][r] * bt[r * len + o];
      orows[t][o] = c;
    }
}

void expand_any(float* const* orows, const float* const* hs, int64_t n, const float* bt, int64_t rank, int64_t len) {
  llmserve_lora::with_tile_rows(n, [&](auto m) { expand_rows<decltype(m)::value>(orows, hs, bt, rank, len); });
}

struct F32Ops {
  using T = float;
  using W = float;
  static void dots(const float* const* xs, int64_t n, const float* arow, int64_t len, float* h) {
    dots_any(xs, n, arow, len, h);
  }
  static void expand(float* const* orows, const float* const* hs, int64_t n, const float* bt, int64_t rank,
                     int64_t len) {
    expand_any(orows, hs, n, bt, rank, len);
  }
};

// the rows' dtype and the slots': float32 or bfloat16 alike, or float32 rows with bfloat16 slots
bool is_supported(at::ScalarType rows, at::ScalarType slots) {
  return (rows == at::kFloat || rows == at::kBFloat16) && (slots == rows || slots == at::kBFloat16);
}

void check_rows(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.stride(1) == 1, what,
              ": expected a [rows, cols] tensor of out's dtype with contiguous rows");
}

// The checked shapes and pointers of one call (x of out's dtype, bs of a's; see is_supported).
Problem problem_of(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, at::TensorList bs,
                   const at::Tensor& token_indices, const at::Tensor& token_slots, const at::Tensor& ranks) {
  const at::ScalarType dtype = out.scalar_type(), slot_dtype = a.scalar_type();
  TORCH_CHECK(is_supported(dtype, slot_dtype), "out, a: float32 or bfloat16 alike, or float32 out with bfloat16 a");
  check_rows(out, dtype, "out");
  check_rows(x, dtype, "x");
  Problem p;
  p.num_sub = static_cast<int64_t>(bs.size());
  TORCH_CHECK(p.num_sub > 0 && a.dim() == 3 && a.is_contiguous(), "a: [S, K, I]");
  p.num_slots = a.size(0), p.k_rows = a.size(1), p.in = a.size(2), p.max_rank = p.k_rows / p.num_sub;
  TORCH_CHECK(x.size(1) == p.in && x.size(0) == out.size(0) && p.k_rows == p.num_sub * p.max_rank,
              "x, a: shapes differ");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.size(0) == p.num_slots &&
                  ranks.size(1) == p.num_sub, "ranks: int32 [S, n_sub]");
  p.offsets.assign(p.num_sub + 1, 0);
  for (int64_t j = 0; j < p.num_sub; ++j) {
    TORCH_CHECK(bs[j].scalar_type() == slot_dtype && bs[j].is_contiguous() && bs[j].dim() == 3 &&
                    bs[j].size(0) == p.num_slots && bs[j].size(1) == p.max_rank, "bs: [S, R, O_j] each");
    p.offsets[j + 1] = p.offsets[j] + bs[j].size(2);
  }
  TORCH_CHECK(p.offsets[p.num_sub] == out.size(1), "out: columns differ from the sub-projections' sum");
  TORCH_CHECK(token_indices.scalar_type() == at::kLong && token_slots.scalar_type() == at::kLong &&
                  token_indices.is_contiguous() && token_slots.is_contiguous() &&
                  token_indices.numel() == token_slots.numel(), "token_indices, token_slots: int64 [N]");
  p.num_tokens = token_indices.numel(), p.num_rows = x.size(0);
  p.x_stride = x.stride(0), p.out_stride = out.stride(0);
  p.idx = token_indices.data_ptr<int64_t>();
  p.slots = token_slots.data_ptr<int64_t>();
  p.rank_of = ranks.data_ptr<int32_t>();
  for (int64_t i = 0; i < ranks.numel(); ++i)
    TORCH_CHECK(p.rank_of[i] >= 0 && p.rank_of[i] <= p.max_rank, "ranks: over R");
  return p;
}

template <class T>
std::vector<const T*> b_pointers(at::TensorList bs) {
  std::vector<const T*> bts;
  for (const auto& b : bs) bts.push_back(static_cast<const T*>(b.data_ptr()));
  return bts;
}

void lora_sgmv(at::Tensor out, const at::Tensor& x, const at::Tensor& a, at::TensorList bs,
               const at::Tensor& token_indices, const at::Tensor& token_slots, const at::Tensor& ranks) {
  const Problem p = problem_of(out, x, a, bs, token_indices, token_slots, ranks);
  if (out.scalar_type() == at::kFloat && a.scalar_type() == at::kBFloat16) {
    llmserve_lora::run_tiles_f32_bf16(p, out.data_ptr<float>(), x.data_ptr<float>(),
                                      static_cast<const uint16_t*>(a.data_ptr()), b_pointers<uint16_t>(bs));
    return;
  }
  if (out.scalar_type() == at::kFloat) {
    llmserve_lora::run_tiles<F32Ops>(p, out.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(),
                                     b_pointers<float>(bs));
    return;
  }
  llmserve_lora::run_tiles_bf16(p, static_cast<uint16_t*>(out.data_ptr()), static_cast<const uint16_t*>(x.data_ptr()),
                                static_cast<const uint16_t*>(a.data_ptr()), b_pointers<uint16_t>(bs));
}

}  // namespace

TORCH_LIBRARY(llmserve_lora, m) {
  m.def("lora_sgmv(Tensor(a!) out, Tensor x, Tensor a, Tensor[] bs, Tensor token_indices, Tensor token_slots, "
        "Tensor ranks) -> ()", &lora_sgmv);
}
