// Few rows over long contexts, in the paged-attention kernel (contract: paged_attention.cpp): a decode step of
// one row attended per kv head is 3 work items for SmolLM2-135M, so on 2 threads one thread attends two heads
// while the other waits. Instead each (tile, all kv heads) item is cut into splits over its keys (flash-decoding;
// each token's K/V still read as one contiguous span): every split keeps its queries' unnormalised
// accumulators, max and sum (stash_split), and merge_splits combines them by their maxima (log-sum-exp).

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace llmserve_cpu {

namespace {

constexpr int kMinSplitKeys = 64;  // keys a split reads at least: its start and merge cost far less than that

// The keys a work item reads: from its first query's first visible key to its last query's position.
std::pair<int, int> key_range(const Params& p, const WorkItem& w) {
  const int row_q_len = p.query_start[w.row + 1] - p.query_start[w.row];
  const int seq_len = p.seq_lens[w.row] - row_q_len + w.q_begin + w.q_len;
  return {first_visible(p, seq_len - w.q_len), seq_len};
}

// Keys a split reads: the items' keys over twice the threads (two splits a thread let the dynamic schedule even
// out a late thread), in whole groups of 8 (the scoring width), at least kMinSplitKeys.
int split_length(const Params& p, const std::vector<WorkItem>& items, int num_threads) {
  int64_t total = 0;
  for (const WorkItem& w : items) {
    const auto [first, end] = key_range(p, w);
    total += end - first;
  }
  const int64_t length = (total + 2 * num_threads - 1) / (2 * num_threads);
  return static_cast<int>(std::max<int64_t>(kMinSplitKeys, (length + 7) / 8 * 8));
}

template <typename T>
void merge_into(const Params& p, const SplitGroup& s, int d) {
  const WorkItem& w = s.item;
  const int hg = p.heads_per_item * p.group, num_heads = p.num_kv_heads * p.group;
  const int first_token = p.query_start[w.row] + w.q_begin;
  T* out = static_cast<T*>(p.out);
  std::vector<float> acc(d);
  for (int m = 0; m < w.q_len * hg; ++m) {
    auto slot = [&](int i) { return p.partials + static_cast<int64_t>(s.first_partial + i) * p.partial_stride + m * (d + 2); };
    float max = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < s.num_splits; ++i) max = std::max(max, slot(i)[d]);
    float sum = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int i = 0; i < s.num_splits; ++i) {
      const float* x = slot(i);
      if (x[d + 1] == 0.f) continue;  // the split held none of this query's keys (max -inf)
      const float c = std::exp(x[d] - max);
      sum += c * x[d + 1];
      for (int j = 0; j < d; ++j) acc[j] += c * x[j];
    }
    const int head = w.kvh0 * p.group + m % hg;
    if (p.sinks != nullptr) sum += std::exp(p.sinks[head] - max);
    T* dst = out + (static_cast<int64_t>(first_token + m / hg) * num_heads + head) * d;
    const float inv = 1.f / sum;
    for (int j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[j] * inv);
  }
}

}  // namespace

std::vector<SplitGroup> split_items(const Params& p, std::vector<WorkItem>& items, int num_threads) {
  std::vector<SplitGroup> groups;
  if (num_threads <= 1 || static_cast<int>(items.size()) >= 4 * num_threads) return groups;
  const int length = split_length(p, items, num_threads);
  std::vector<WorkItem> result;
  int num_partials = 0;
  for (const WorkItem& w : items) {
    const auto [first, end] = key_range(p, w);
    const int n = (end - first + length - 1) / length;
    if (n <= 1) {
      result.push_back(w);
      continue;
    }
    const int piece = ((end - first + n - 1) / n + 7) / 8 * 8;  // n about equal splits
    const int count = (end - first + piece - 1) / piece;
    groups.push_back(SplitGroup{w, num_partials, count});
    for (int i = 0; i < count; ++i) {
      WorkItem split = w;
      split.key_begin = first + i * piece;
      split.key_end = std::min(end, first + (i + 1) * piece);
      split.partial = num_partials++;
      result.push_back(split);
    }
  }
  if (!groups.empty()) items.swap(result);
  return groups;
}

void merge_splits(const Params& p, const std::vector<SplitGroup>& groups, at::ScalarType out_type) {
  for (const SplitGroup& s : groups) {
    switch (out_type) {
      case at::kBFloat16: merge_into<c10::BFloat16>(p, s, p.head_dim); break;
      case at::kHalf: merge_into<c10::Half>(p, s, p.head_dim); break;
      default: merge_into<float>(p, s, p.head_dim);
    }
  }
}

}  // namespace llmserve_cpu
