// A parallel loop over items [0, n) whose threads even out as they run: each of ATen's threads owns a contiguous
// stretch and takes it chunk by chunk from the front; a thread done with its own takes chunks from the back of the
// others'. With static halves (at::parallel_for) one of two threads waited for the other at the end of most
// linears of a one-row step, as the cores' read speeds differ from moment to moment (docs/benchmarks.md); here each
// thread still streams its own stretch in order, and only the last chunks move.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace llmserve_cpu {

namespace balanced_detail {

// A stretch's [front, back) in one word, so that its owner (front) and a thief (back) never take the same items.
struct alignas(64) Stretch {
  std::atomic<uint64_t> range{0};
  void reset(int64_t front, int64_t back) { range.store((uint64_t(front) << 32) | uint64_t(back)); }
};

// Up to `chunk` items from the front (the owner) or the back (a thief) -> [begin, end); false once empty.
inline bool take(Stretch& s, int64_t chunk, bool is_owner, int64_t& begin, int64_t& end) {
  uint64_t now = s.range.load(std::memory_order_relaxed);
  while (true) {
    const int64_t front = int64_t(now >> 32), back = int64_t(now & 0xffffffffu);
    if (front >= back) return false;
    const int64_t size = std::min(chunk, back - front);
    begin = is_owner ? front : back - size;
    end = begin + size;
    const uint64_t next = is_owner ? (uint64_t(end) << 32) | uint64_t(back) : (uint64_t(front) << 32) | uint64_t(begin);
    if (s.range.compare_exchange_weak(now, next, std::memory_order_acq_rel, std::memory_order_relaxed)) return true;
  }
}

}  // namespace balanced_detail

constexpr int64_t kMaxBalancedThreads = 256;
constexpr int64_t kBalancedChunkBytes = 128 << 10;  // weight bytes a chunk of a linear's work reads, about

// fn(begin, end) over [0, n) in chunks of at most `chunk` items, on ATen's threads (see the header); on one thread,
// or inside a parallel region, fn(0, n).
template <class Fn>
void balanced_parallel_for(int64_t n, int64_t chunk, const Fn& fn) {
  using balanced_detail::Stretch;
  if (n <= 0) return;
  TORCH_CHECK(n < (int64_t(1) << 32), "balanced_parallel_for: too many items");
  chunk = std::max<int64_t>(1, chunk);
  const int64_t num_threads =
      std::min({int64_t(at::get_num_threads()), (n + chunk - 1) / chunk, kMaxBalancedThreads});
  if (num_threads <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  // The threads' stretches only: an array of kMaxBalancedThreads would zero all of them (16 KB) at every call.
  const std::unique_ptr<Stretch[]> stretches(new Stretch[num_threads]);
  for (int64_t t = 0; t < num_threads; ++t) stretches[t].reset(n * t / num_threads, n * (t + 1) / num_threads);
  at::parallel_for(0, num_threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {  // one stretch a thread (all of them when ATen runs this serially)
      int64_t begin = 0, end = 0;
      while (balanced_detail::take(stretches[t], chunk, true, begin, end)) fn(begin, end);
      for (int64_t other = 1; other < num_threads; ++other)
        while (balanced_detail::take(stretches[(t + other) % num_threads], chunk, false, begin, end)) fn(begin, end);
    }
  });
}

}  // namespace llmserve_cpu
