// The LoRA kernel's step (csrc/lora_sgmv.cpp: float32; csrc/lora_sgmv_bf16.cpp: bfloat16; csrc/lora_sgmv_mixed.cpp:
// float32 rows with bfloat16 adapter slots): the tiles of one slot's tokens, shared by all three. `Ops` gives the
// rows' element type T, the slots' W and the two inner products:
//   Ops::dots(xs, n, arow, len, h)             h[t] = dot(xs[t], arow) in float32 for the tile's n tokens
//   Ops::expand(orows, hs, n, bt, rank, len)   orows[t][o] += sum_r hs[t][r] * bt[r * len + o]
// The shrunk features h stay float32 between the two (one rounding, into the output).

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace llmserve_lora {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {  // the sum of a register's 8 floats
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int64_t kTile = 4;

// f(std::integral_constant<int, m>) with m = n for n of 1 to 3, else 4 (kTile): a tile's row count as a
// compile-time constant for each dtype's dots and expand templates.
template <class F>
inline void with_tile_rows(int64_t n, F&& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

struct Problem {
  int64_t num_slots, k_rows, in, max_rank, num_sub;  // a: [S, K = n_sub * R, I]
  int64_t num_tokens, num_rows, x_stride, out_stride;
  const int64_t* idx;        // [N] adapter tokens, grouped by slot
  const int64_t* slots;      // [N]
  const int32_t* rank_of;    // [S, n_sub]
  std::vector<int64_t> offsets;  // [n_sub + 1] each sub-projection's first output column
};

// The first token of each tile: runs of one slot's tokens, at most kTile long; ends with num_tokens.
inline std::vector<int64_t> tile_starts(const Problem& p) {
  std::vector<int64_t> starts;
  for (int64_t start = 0; start < p.num_tokens;) {
    const int64_t slot = p.slots[start];
    TORCH_CHECK(slot >= 0 && slot < p.num_slots, "token slot out of range");
    int64_t end = start + 1;
    while (end < p.num_tokens && p.slots[end] == slot && end - start < kTile) ++end;
    starts.push_back(start);
    start = end;
  }
  starts.push_back(p.num_tokens);
  return starts;
}

// One tile: its n tokens' shrink into h [kTile, K] (float32), then the expand into their output rows.
template <class Ops>
void run_tile(const Problem& p, int64_t start, int64_t n, typename Ops::T* out, const typename Ops::T* x,
              const typename Ops::W* a, const std::vector<const typename Ops::W*>& bts, float* h) {
  using T = typename Ops::T;
  const int64_t slot = p.slots[start];
  float column[kTile];
  const T* xs[kTile];
  for (int64_t t = 0; t < n; ++t) xs[t] = x + p.idx[start + t] * p.x_stride;
  for (int64_t j = 0; j < p.num_sub; ++j) {
    const int64_t rank = p.rank_of[slot * p.num_sub + j];
    for (int64_t r = 0; r < rank; ++r) {
      const int64_t k = j * p.max_rank + r;
      Ops::dots(xs, n, a + (slot * p.k_rows + k) * p.in, p.in, column);
      for (int64_t t = 0; t < n; ++t) h[t * p.k_rows + k] = column[t];
    }
  }
  for (int64_t j = 0; j < p.num_sub; ++j) {
    const int64_t rank = p.rank_of[slot * p.num_sub + j], len = p.offsets[j + 1] - p.offsets[j];
    if (rank == 0) continue;
    T* orows[kTile];
    const float* hs[kTile];
    for (int64_t t = 0; t < n; ++t) {
      orows[t] = out + p.idx[start + t] * p.out_stride + p.offsets[j];
      hs[t] = h + t * p.k_rows + j * p.max_rank;
    }
    Ops::expand(orows, hs, n, bts[j] + slot * p.max_rank * len, rank, len);
  }
}

// Every tile, split over torch's intra-op threads (a token is in one tile, so no two threads write one
// output row): the base projection beside it runs on all of them, and a one-thread LoRA would add its whole
// time to the step's wall time.
template <class Ops>
void run_tiles(const Problem& p, typename Ops::T* out, const typename Ops::T* x, const typename Ops::W* a,
               const std::vector<const typename Ops::W*>& bts) {
  for (int64_t i = 0; i < p.num_tokens; ++i)
    TORCH_CHECK(p.idx[i] >= 0 && p.idx[i] < p.num_rows, "token index out of range");
  const std::vector<int64_t> starts = tile_starts(p);
  const int64_t num_tiles = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kTile * p.k_rows);  // [tile, K] the tile's shrunk features
    for (int64_t i = begin; i < end; ++i)
      run_tile<Ops>(p, starts[i], starts[i + 1] - starts[i], out, x, a, bts, h.data());
  });
}

// bfloat16 (csrc/lora_sgmv_bf16.cpp): the same step on bfloat16 tensors (bits), float32 sums, one rounding
// into each output element.
void run_tiles_bf16(const Problem& p, uint16_t* out, const uint16_t* x, const uint16_t* a,
                    const std::vector<const uint16_t*>& bts);

// float32 rows, bfloat16 slots (csrc/lora_sgmv_mixed.cpp; --lora-dtype bfloat16 on a float32 model): the slots
// widened to float32 as they are read (exact), float32 sums into the float32 output.
void run_tiles_f32_bf16(const Problem& p, float* out, const float* x, const uint16_t* a,
                        const std::vector<const uint16_t*>& bts);

}  // namespace llmserve_lora
