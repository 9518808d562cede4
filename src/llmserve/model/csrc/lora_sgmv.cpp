// The LoRA products of one projection for every adapter token of a step, in one call (JIT-built by
// llmserve/model/lora_cpu.py): out[t] += (x[t] @ A[s]^T) @ B[s]^T for each token t with slot s.
//
//   out            [T, O]  float32, rows may be strided; columns: sub-projection j at its offset
//   x              [T, I]  float32, rows may be strided
//   a              [S, n_sub * R, I]   A per slot, stacked over sub-projections (R rows each)
//   bs[j]          [S, R, O_j]         B^T per slot and sub-projection (scale folded in)
//   token_indices  [N] int64  the adapter tokens, grouped by slot (model/lora_layers.py's LoRAStep)
//   token_slots    [N] int64  their slots
//   ranks          [S, n_sub] int32    each slot's rank per sub-projection (0: no LoRA there)
//
// Tokens of one slot go in tiles of up to kTile: each row of A is read once for the tile (shrink), and each
// row of B^T once for the tile against a register block of each token's output row (expand). Rows past a
// slot's rank are skipped. One thread: a decode step's products are a few microseconds each, less than waking others.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_AVX2 1
#endif

namespace {

constexpr int64_t kTile = 4;

#ifdef LORA_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
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
  switch (n) {
    case 1: dots<1>(xs, arow, len, h); break;
    case 2: dots<2>(xs, arow, len, h); break;
    case 3: dots<3>(xs, arow, len, h); break;
    default: dots<4>(xs, arow, len, h); break;
  }
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
  switch (n) {
    case 1: expand_rows<1>(orows, hs, bt, rank, len); break;
    case 2: expand_rows<2>(orows, hs, bt, rank, len); break;
    case 3: expand_rows<3>(orows, hs, bt, rank, len); break;
    default: expand_rows<4>(orows, hs, bt, rank, len); break;
  }
}

void check_float_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, what,
              ": expected a float32 [rows, cols] tensor with contiguous rows");
}

void lora_sgmv(at::Tensor out, const at::Tensor& x, const at::Tensor& a, at::TensorList bs,
               const at::Tensor& token_indices, const at::Tensor& token_slots, const at::Tensor& ranks) {
  check_float_rows(out, "out");
  check_float_rows(x, "x");
  const int64_t num_sub = static_cast<int64_t>(bs.size());
  TORCH_CHECK(num_sub > 0 && a.scalar_type() == at::kFloat && a.dim() == 3 && a.is_contiguous(),
              "a: float32 [S, K, I]");
  const int64_t num_slots = a.size(0), k_rows = a.size(1), in = a.size(2), max_rank = k_rows / num_sub;
  TORCH_CHECK(x.size(1) == in && x.size(0) == out.size(0) && k_rows == num_sub * max_rank, "x, a: shapes differ");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.size(0) == num_slots &&
                  ranks.size(1) == num_sub, "ranks: int32 [S, n_sub]");
  std::vector<int64_t> offsets(num_sub + 1, 0);
  for (int64_t j = 0; j < num_sub; ++j) {
    TORCH_CHECK(bs[j].scalar_type() == at::kFloat && bs[j].is_contiguous() && bs[j].dim() == 3 &&
                    bs[j].size(0) == num_slots && bs[j].size(1) == max_rank, "bs: float32 [S, R, O_j] each");
    offsets[j + 1] = offsets[j] + bs[j].size(2);
  }
  TORCH_CHECK(offsets[num_sub] == out.size(1), "out: columns differ from the sub-projections' sum");
  TORCH_CHECK(token_indices.scalar_type() == at::kLong && token_slots.scalar_type() == at::kLong &&
                  token_indices.is_contiguous() && token_slots.is_contiguous() &&
                  token_indices.numel() == token_slots.numel(), "token_indices, token_slots: int64 [N]");
  const int64_t num_tokens = token_indices.numel(), num_rows = x.size(0);
  const int64_t* idx = token_indices.data_ptr<int64_t>();
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int32_t* rank_of = ranks.data_ptr<int32_t>();
  for (int64_t i = 0; i < ranks.numel(); ++i) TORCH_CHECK(rank_of[i] >= 0 && rank_of[i] <= max_rank, "ranks: over R");
  const float* a_data = a.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float* x_data = x.data_ptr<float>();
  std::vector<float> h(kTile * k_rows);  // [tile, K] the tile's shrunk features
  std::vector<float> column(kTile);
  const float* xs[kTile];
  for (int64_t start = 0; start < num_tokens;) {
    const int64_t slot = slots[start];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "token slot out of range");
    int64_t end = start + 1;
    while (end < num_tokens && slots[end] == slot && end - start < kTile) ++end;
    const int64_t n = end - start;
    for (int64_t t = 0; t < n; ++t) {
      TORCH_CHECK(idx[start + t] >= 0 && idx[start + t] < num_rows, "token index out of range");
      xs[t] = x_data + idx[start + t] * x.stride(0);
    }
    for (int64_t j = 0; j < num_sub; ++j) {
      const int64_t rank = rank_of[slot * num_sub + j];
      for (int64_t r = 0; r < rank; ++r) {
        const int64_t k = j * max_rank + r;
        dots_any(xs, n, a_data + (slot * k_rows + k) * in, in, column.data());
        for (int64_t t = 0; t < n; ++t) h[t * k_rows + k] = column[t];
      }
    }
    for (int64_t j = 0; j < num_sub; ++j) {
      const int64_t rank = rank_of[slot * num_sub + j], len = offsets[j + 1] - offsets[j];
      if (rank == 0) continue;
      const float* bt = bs[j].data_ptr<float>() + slot * max_rank * len;
      float* orows[kTile];
      const float* hs[kTile];
      for (int64_t t = 0; t < n; ++t) {
        orows[t] = out_data + idx[start + t] * out.stride(0) + offsets[j];
        hs[t] = h.data() + t * k_rows + j * max_rank;
      }
      expand_any(orows, hs, n, bt, rank, len);
    }
    start = end;
  }
}

}  // namespace

TORCH_LIBRARY(llmserve_lora, m) {
  m.def("lora_sgmv(Tensor(a!) out, Tensor x, Tensor a, Tensor[] bs, Tensor token_indices, Tensor token_slots, "
        "Tensor ranks) -> ()", &lora_sgmv);
}
