// Shared by the paged-attention translation units (see paged_attention.cpp for the kernel's contract).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace llmserve_cpu {

constexpr int kMaxQueryLen = 16;
constexpr int kChunk = 32;  // keys scored, then softmaxed, then accumulated at a time

struct Params {
  const void* q;
  const void* kv;
  void* out;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* rows;
  int64_t q_stride_t, q_stride_h;
  int64_t bt_stride;
  int64_t kv_half;  // elements between the K and the V half of the cache
  int num_items, num_kv_heads, group, head_dim, block_size;
  int heads_per_item;  // kv heads one work item attends together (all of them when rows are plenty)
  float scale;
};

struct Scratch {
  std::vector<float> q, acc, scores, kbuf, vbuf, max, sum;
  std::vector<int> valid;
  Scratch(int m, int d, int heads)
      : q(m * d), acc(m * d), scores(m * kChunk), kbuf(kChunk * heads * d), vbuf(kChunk * heads * d), max(m),
        sum(m), valid(m) {}
};

// Runs attend(p, item, scratch) for every work item on OpenMP threads (as many as ATen's pool, one
// Scratch each; one thread when already inside a parallel region), items handed out one at a time.
template <class Attend>
void for_each_item(const Params& p, int max_m, Attend attend) {
  int num_threads = std::max(1, std::min<int>(at::get_num_threads(), p.num_items));
  if (at::in_parallel_region()) num_threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
#endif
  {
    Scratch w(max_m, p.head_dim, p.heads_per_item);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int item = 0; item < p.num_items; ++item) attend(p, item, w);
  }
}

// float32 rows with AVX2 + FMA (paged_attention_avx2.cpp) over a float32 cache, or a float16 one
// (kv_is_f16, read with F16C): false when not built with them or when head_dim is not a multiple of 8;
// the caller then runs the portable path.
bool attend_f32_avx2(const Params& p, int max_m, bool kv_is_f16);

}  // namespace llmserve_cpu
