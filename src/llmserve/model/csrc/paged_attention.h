// Shared by the paged-attention translation units (see paged_attention.cpp for the kernel's contract).
#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace llmserve_cpu {

constexpr int kMaxQueryLen = 16;  // query tokens one work item attends (a longer row is split in tiles)
constexpr int kChunk = 32;  // keys scored, then softmaxed, then accumulated at a time

// One work item: query tokens q_begin .. q_begin + q_len - 1 of a row (a tile of at most kMaxQueryLen),
// for the kv heads kvh0 .. kvh0 + heads_per_item - 1, over the keys key_begin .. key_end - 1 only (of those
// its queries see). partial >= 0: the item is one split of a (tile, kv heads) whose keys several items share
// (few rows, long contexts: every thread gets work); it leaves its unnormalised output, max and sum in
// partial slot `partial` for merge_splits, instead of writing out.
struct WorkItem {
  int32_t row, kvh0, q_begin, q_len;
  int32_t key_begin = 0, key_end = std::numeric_limits<int32_t>::max(), partial = -1;
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
  int window;  // > 0: a query at position p sees keys p - window + 1 .. p only (sliding window); 0: all
  const float* sinks;  // [H] float32: one logit per query head added to the softmax denominator; or nullptr
  float* partials;  // split items' slots: each max_m query vectors of (head_dim accumulators, max, sum)
  int partial_stride;  // floats a slot: max_m * (head_dim + 2)
  float scale;
};

// A thread's working memory for items of up to m query vectors of d features over `heads` kv heads. Kept by each
// thread from call to call (`fit` grows it), so a decode step's layers allocate and clear none; every field is
// written before it is read.
struct Scratch {
  std::vector<float> q, acc, scores, kbuf, vbuf, max, sum;
  std::vector<int> first, valid;  // per query vector, in the current chunk: its first visible key, their count
  void fit(int m, int d, int heads) {
    grow(q, m * d);
    grow(acc, m * d);
    grow(scores, m * kChunk);
    grow(kbuf, kChunk * heads * d);
    grow(vbuf, kChunk * heads * d);
    grow(max, m);
    grow(sum, m);
    grow(first, m);
    grow(valid, m);
  }
  template <typename T>
  static void grow(std::vector<T>& field, int size) {
    if (static_cast<int>(field.size()) < size) field.resize(size);
  }
};

// The first key a query at position pos sees: pos - window + 1 under a sliding window, else 0.
inline int first_visible(const Params& p, int pos) { return p.window > 0 ? std::max(0, pos - p.window + 1) : 0; }

// What a work item attends: its first token in q, its query tokens, the keys its last query sees
// (.. seq_len - 1; query j sees .. seq_len - q_len + j), the keys it reads, first_key .. key_end - 1 (keys
// before first_key are out of every query's window or another split's; from key_end on, another split's),
// its first kv head, its query heads (hg = heads_per_item * group), its row's block table and its partial
// slot (nullptr: it writes out).
struct Item {
  int first_token, q_len, seq_len, first_key, key_end, kvh0, hg;
  const int32_t* table;
  float* partial;
};

inline Item item_of(const Params& p, int index) {
  const WorkItem& w = p.items[index];
  const int start = p.query_start[w.row], row_q_len = p.query_start[w.row + 1] - start;
  const int seq_len = p.seq_lens[w.row] - row_q_len + w.q_begin + w.q_len;
  float* partial = w.partial < 0 ? nullptr : p.partials + static_cast<int64_t>(w.partial) * p.partial_stride;
  return Item{start + w.q_begin, w.q_len, seq_len, std::max<int>(first_visible(p, seq_len - w.q_len), w.key_begin),
              std::min<int>(seq_len, w.key_end), w.kvh0, p.heads_per_item * p.group,
              p.block_table + static_cast<int64_t>(w.row) * p.bt_stride, partial};
}

// The keys query vector m of an item sees in the chunk c0 .. c0 + cn - 1, counted from c0: w.first[m] and
// w.valid[m] of them (none when valid <= 0).
inline void visible_in_chunk(const Params& p, const Item& it, int m, int c0, int cn, Scratch& w) {
  const int pos = it.seq_len - it.q_len + m / it.hg;
  w.first[m] = std::max(0, first_visible(p, pos) - c0);
  w.valid[m] = std::min(cn, pos - c0 + 1) - w.first[m];
}

// The softmax denominator of query vector m (query head `head`): its sum, plus exp(sink) when heads have sinks.
inline float denominator(const Params& p, const Scratch& w, int m, int head) {
  return p.sinks == nullptr ? w.sum[m] : w.sum[m] + std::exp(p.sinks[head] - w.max[m]);
}

// A split item's result: each query vector's accumulators (not yet divided by the sum), max and sum, into its
// partial slot -> true; false for an item that writes out itself.
inline bool stash_split(const Item& it, const Scratch& w, int d) {
  if (it.partial == nullptr) return false;
  for (int m = 0; m < it.q_len * it.hg; ++m) {
    float* slot = it.partial + static_cast<int64_t>(m) * (d + 2);
    std::copy(w.acc.data() + m * d, w.acc.data() + (m + 1) * d, slot);
    slot[d] = w.max[m];
    slot[d + 1] = w.sum[m];
  }
  return true;
}

// Runs attend(p, item, scratch) for every work item on OpenMP threads (as many as ATen's pool, each with its
// Scratch; one thread when already inside a parallel region), items handed out one at a time.
template <class Attend>
void for_each_item(const Params& p, int max_m, Attend attend) {
  int num_threads = std::max(1, std::min<int>(at::get_num_threads(), p.num_items));
  if (at::in_parallel_region()) num_threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
#endif
  {
    static thread_local Scratch w;
    w.fit(max_m, p.head_dim, p.heads_per_item);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int item = 0; item < p.num_items; ++item) attend(p, item, w);
  }
}

// A work item cut into num_splits items over its keys, whose partial slots are first_partial ..
// first_partial + num_splits - 1 (paged_attention_split.cpp).
struct SplitGroup {
  WorkItem item;
  int first_partial, num_splits;
};
// Cuts the items into splits over their keys when they are too few for num_threads (a decode step of one or two
// rows), in place -> the groups to merge (none: nothing was cut). Needs p's rows' metadata and heads_per_item.
std::vector<SplitGroup> split_items(const Params& p, std::vector<WorkItem>& items, int num_threads);
// Each group's splits -> its queries' outputs in p.out (of dtype out_type), sinks included.
void merge_splits(const Params& p, const std::vector<SplitGroup>& groups, at::ScalarType out_type);

// The cache element type under float32 q: float32, float16 (--kv-cache-dtype fp16), or int8 with a float32
// scale per token and kv head (--kv-cache-dtype int8: x = q * scale).
enum class KvType { kF32, kF16, kI8, kBF16 };  // kBF16: q, out and cache all bfloat16
// float32 rows with AVX2 + FMA (paged_attention_avx2.cpp) over such a cache (float16 read with F16C):
// false when not built with them or when head_dim is not a multiple of 8; the caller then runs the
// portable path (which reads no int8 cache).
bool attend_f32_avx2(const Params& p, int max_m, KvType kv);

}  // namespace llmserve_cpu
