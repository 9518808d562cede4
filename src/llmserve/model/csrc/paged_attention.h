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

constexpr int kMaxQueryLen = 16;  // query tokens one work item attends (a longer row is split in tiles)
constexpr int kChunk = 32;  // keys scored, then softmaxed, then accumulated at a time

// One work item: query tokens q_begin .. q_begin + q_len - 1 of a row (a tile of at most kMaxQueryLen),
// for the kv heads kvh0 .. kvh0 + heads_per_item - 1.
struct WorkItem {
  int32_t row, kvh0, q_begin, q_len;
};

struct Params {
  const void* q;
  const void* kv;
  void* out;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* rows;
  const WorkItem* items;  // [num_items]
  int64_t q_stride_t, q_stride_h;
  int64_t bt_stride;
  int64_t kv_half;  // elements between the K and the V half of the cache
  int num_items, num_kv_heads, group, head_dim, block_size;
  int head_stride;  // cache elements from one kv head's row to the next: head_dim, or head_dim + 4 for an int8
                    // cache (each row ends in its float32 scale)
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

// What a work item attends: its first token in q, its query tokens, the keys its last query sees
// (0 .. seq_len - 1; query j sees 0 .. seq_len - q_len + j), its first kv head, its query heads
// (hg = heads_per_item * group) and its row's block table.
struct Item {
  int first_token, q_len, seq_len, kvh0, hg;
  const int32_t* table;
};

inline Item item_of(const Params& p, int index) {
  const WorkItem& w = p.items[index];
  const int start = p.query_start[w.row], row_q_len = p.query_start[w.row + 1] - start;
  return Item{start + w.q_begin, w.q_len, p.seq_lens[w.row] - row_q_len + w.q_begin + w.q_len, w.kvh0,
              p.heads_per_item * p.group, p.block_table + static_cast<int64_t>(w.row) * p.bt_stride};
}

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

// The cache element type under float32 q: float32, float16 (--kv-cache-dtype fp16), or int8 with a float32
// scale per token and kv head (--kv-cache-dtype int8: x = q * scale).
enum class KvType { kF32, kF16, kI8 };
// float32 rows with AVX2 + FMA (paged_attention_avx2.cpp) over such a cache (float16 read with F16C):
// false when not built with them or when head_dim is not a multiple of 8; the caller then runs the
// portable path (which reads no int8 cache).
bool attend_f32_avx2(const Params& p, int max_m, KvType kv);

}  // namespace llmserve_cpu
