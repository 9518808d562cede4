// Fused paged attention on CPU (JIT-built by llmserve/model/cpu_kernels.py): decode rows, chunks over a
// cached prefix and whole prompts alike.
//
// For each work item (a row's tile of at most 16 query tokens, for one kv head or all), in parallel: its
// q query tokens times the G query heads of a kv head (M = q * G query vectors) read the keys they see
// once, straight from the paged cache through the block table, with an online softmax in float32.
// Query j of a row of q tokens over s keys sees keys 0..s-q+j (causal), or with a sliding window W only
// s-q+j-W+1..s-q+j (keys before an item's first query's window are never read; blocks wholly before it are
// never touched). Sinks [H] add exp(sink - max) to each head's denominator. No K/V copy is made; float32
// reads in place, bfloat16/float16 are converted one key chunk at a time. The cache shares q's dtype,
// or is float16 under float32 q and out (--kv-cache-dtype fp16 of a float32 model), or int8 under float32
// q and out (--kv-cache-dtype int8; AVX2 builds only): then its last dim is D + 4, each kv head's row of D
// values followed by the float32 scale they were quantized with.
//
// kv_cache [2, N, block_size, Hkv, D] contiguous; q [T, H, D] (last dim contiguous);
// out [T, H, D] contiguous, written only at the tokens of `rows`; block_table [B, W] int32 (row
// stride free, last dim contiguous); seq_lens [B] int32; query_start [B + 1] int32; rows [R] int32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using llmserve_cpu::kChunk;
using llmserve_cpu::kMaxQueryLen;
using llmserve_cpu::Item;
using llmserve_cpu::item_of;
using llmserve_cpu::Params;
using llmserve_cpu::WorkItem;
using llmserve_cpu::Scratch;
using llmserve_cpu::visible_in_chunk;

template <typename T>
inline const float* as_f32(const T* src, float* buf, int n) {
  for (int i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_f32<float>(const float* src, float*, int) { return src; }

template <typename T>
inline float to_f32(T x) { return static_cast<float>(x); }
template <typename T>
inline T from_f32(float x) { return static_cast<T>(x); }

// kD > 0: head_dim known at compile time (lets the compiler unroll and keep vectors in registers).
template <int kD>
inline float dot(const float* __restrict a, const float* __restrict b, int d) {
  const int n = kD > 0 ? kD : d;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Four dots at once: four independent accumulation chains hide the FMA latency.
template <int kD>
inline void dot4(const float* __restrict a, const float* __restrict b0, const float* __restrict b1,
                 const float* __restrict b2, const float* __restrict b3, int d, float* out) {
  const int n = kD > 0 ? kD : d;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int i = 0; i < n; ++i) {
    s0 += a[i] * b0[i];
    s1 += a[i] * b1[i];
    s2 += a[i] * b2[i];
    s3 += a[i] * b3[i];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// y += a0 x0 + a1 x1 + a2 x2 + a3 x3: one load/store of y per four rows.
template <int kD>
inline void axpy4(float* __restrict y, const float* a, const float* __restrict x0, const float* __restrict x1,
                  const float* __restrict x2, const float* __restrict x3, int d) {
  const int n = kD > 0 ? kD : d;
  const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a0 * x0[i] + a1 * x1[i] + a2 * x2[i] + a3 * x3[i];
}

template <int kD>
inline void axpy(float* __restrict y, float a, const float* __restrict x, int d) {
  const int n = kD > 0 ? kD : d;
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

template <int kD>
inline void scale_inplace(float* __restrict y, float a, int d) {
  const int n = kD > 0 ? kD : d;
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] *= a;
}

template <typename T>
inline void prefetch_token(const T* k, const T* v, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k) + b, 0, 1);
    __builtin_prefetch(reinterpret_cast<const char*>(v) + b, 0, 1);
  }
}

// T: q and out; KV: the cache (T, or c10::Half under float q).
template <typename T, typename KV, int kD>
void attend_item(const Params& p, int item, Scratch& w) {
  const int d = kD > 0 ? kD : p.head_dim;
  const Item it = item_of(p, item);
  const int kvh0 = it.kvh0, first_token = it.first_token, q_len = it.q_len;
  const int g = p.group;
  const int hg = it.hg;  // query heads of the item: kvh0 * g .. kvh0 * g + hg - 1
  const int m_count = q_len * hg;  // query vector m: token m / hg, head kvh0 * g + m % hg, kv head .. / g
  const int span = p.heads_per_item * d;  // the item's contiguous part of one token's K (or V)
  const T* q = static_cast<const T*>(p.q);
  const KV* kcache = static_cast<const KV*>(p.kv);
  const KV* vcache = kcache + p.kv_half;
  const int32_t* table = it.table;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * d;
  const int64_t block_stride = token_stride * p.block_size;

  for (int m = 0; m < m_count; ++m) {
    const T* src = q + (first_token + m / hg) * p.q_stride_t + (kvh0 * g + m % hg) * p.q_stride_h;
    float* dst = w.q.data() + m * d;
    for (int i = 0; i < d; ++i) dst[i] = to_f32(src[i]) * p.scale;
    std::fill(w.acc.data() + m * d, w.acc.data() + (m + 1) * d, 0.f);
    w.max[m] = -std::numeric_limits<float>::infinity();
    w.sum[m] = 0.f;
  }
  auto token_offset = [&](int t) {
    return static_cast<int64_t>(table[t / p.block_size]) * block_stride + (t % p.block_size) * token_stride +
           static_cast<int64_t>(kvh0) * d;
  };
  const float* kp[kChunk];  // the chunk's keys (values): span floats each, kv head kvh0 first
  const float* vp[kChunk];
  for (int c0 = it.first_key; c0 < it.key_end; c0 += kChunk) {
    const int cn = std::min(kChunk, it.key_end - c0);
    for (int c = 0; c < cn; ++c) {
      const int64_t off = token_offset(c0 + c);
      kp[c] = as_f32<KV>(kcache + off, w.kbuf.data() + c * span, span);
      vp[c] = as_f32<KV>(vcache + off, w.vbuf.data() + c * span, span);
    }
    for (int t = c0 + kChunk; t < std::min(it.key_end, c0 + 2 * kChunk); ++t) {  // the next chunk, while computing
      const int64_t off = token_offset(t);
      prefetch_token(kcache + off, vcache + off, static_cast<int64_t>(span) * sizeof(KV));
    }
    for (int m = 0; m < m_count; ++m) {
      visible_in_chunk(p, it, m, c0, cn, w);  // keys f .. f + nv - 1 of the chunk
      const int nv = w.valid[m];
      if (nv <= 0) continue;
      const float* qm = w.q.data() + m * d;
      const float* const* kpm = kp + w.first[m];
      const int head_off = (m % hg) / g * d;
      float* sc = w.scores.data() + m * kChunk;
      float cmax = -std::numeric_limits<float>::infinity();
      int c = 0;
      for (; c + 4 <= nv; c += 4) {
        dot4<kD>(qm, kpm[c] + head_off, kpm[c + 1] + head_off, kpm[c + 2] + head_off, kpm[c + 3] + head_off, d, sc + c);
      }
      for (; c < nv; ++c) sc[c] = dot<kD>(qm, kpm[c] + head_off, d);
      for (c = 0; c < nv; ++c) cmax = std::max(cmax, sc[c]);
      const float new_max = std::max(w.max[m], cmax);
      if (new_max > w.max[m]) {
        const float corr = std::exp(w.max[m] - new_max);  // 0 on the first chunk
        w.sum[m] *= corr;
        scale_inplace<kD>(w.acc.data() + m * d, corr, d);
        w.max[m] = new_max;
      }
      float s = 0.f;
      for (c = 0; c < nv; ++c) {
        sc[c] = std::exp(sc[c] - new_max);
        s += sc[c];
      }
      w.sum[m] += s;
    }
    for (int m = 0; m < m_count; ++m) {
      float* am = w.acc.data() + m * d;
      const float* sc = w.scores.data() + m * kChunk;
      const int head_off = (m % hg) / g * d;
      const int nv = w.valid[m];
      const float* const* vpm = vp + w.first[m];
      int c = 0;
      for (; c + 4 <= nv; c += 4) {
        axpy4<kD>(am, sc + c, vpm[c] + head_off, vpm[c + 1] + head_off, vpm[c + 2] + head_off, vpm[c + 3] + head_off,
                  d);
      }
      for (; c < nv; ++c) axpy<kD>(am, sc[c], vpm[c] + head_off, d);
    }
  }
  if (llmserve_cpu::stash_split(it, w, d)) return;
  T* out = static_cast<T*>(p.out);
  const int num_heads = p.num_kv_heads * g;
  for (int m = 0; m < m_count; ++m) {
    T* dst = out + (static_cast<int64_t>(first_token + m / hg) * num_heads + kvh0 * g + m % hg) * d;
    const float inv = 1.f / llmserve_cpu::denominator(p, w, m, kvh0 * g + m % hg);
    const float* am = w.acc.data() + m * d;
    for (int i = 0; i < d; ++i) dst[i] = from_f32<T>(am[i] * inv);
  }
}

template <typename T, typename KV = T>
void dispatch_dim(const Params& p, int max_m) {
  switch (p.head_dim) {
    case 64: return llmserve_cpu::for_each_item(p, max_m, attend_item<T, KV, 64>);
    case 128: return llmserve_cpu::for_each_item(p, max_m, attend_item<T, KV, 128>);
    default: return llmserve_cpu::for_each_item(p, max_m, attend_item<T, KV, 0>);
  }
}

// The step's work items: row by row, tile by tile, kv head group by group; items that attend more
// (prompt tiles late in a long row) first when any row has more than one query token, so that the
// dynamic schedule does not end on one long item.
std::vector<WorkItem> work_items(const Params& p, int64_t num_rows, int num_tiles, bool has_long_rows) {
  const int num_groups = p.num_kv_heads / p.heads_per_item;
  std::vector<WorkItem> items;
  items.reserve(static_cast<size_t>(num_tiles) * num_groups);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int row = p.rows[r], q_len = p.query_start[row + 1] - p.query_start[row];
    for (int q0 = 0; q0 < q_len; q0 += kMaxQueryLen) {
      for (int h = 0; h < num_groups; ++h) {
        items.push_back(WorkItem{row, h * p.heads_per_item, q0, std::min(kMaxQueryLen, q_len - q0)});
      }
    }
  }
  if (has_long_rows) {
    auto work = [&](const WorkItem& w) {  // query tokens times the keys the item reads
      const int row_q_len = p.query_start[w.row + 1] - p.query_start[w.row];
      const int seq_len = p.seq_lens[w.row] - row_q_len + w.q_begin + w.q_len;
      return static_cast<int64_t>(w.q_len) * (seq_len - llmserve_cpu::first_visible(p, seq_len - w.q_len));
    };
    std::stable_sort(items.begin(), items.end(),
                     [&](const WorkItem& a, const WorkItem& b) { return work(a) > work(b); });
  }
  return items;
}

// Every work item through the kernel for q's dtype and the cache's.
void attend(const Params& p, int max_m, at::ScalarType q_type, bool kv_is_f16_of_f32, bool kv_is_i8) {
  if (kv_is_i8) {
    TORCH_CHECK(llmserve_cpu::attend_f32_avx2(p, max_m, llmserve_cpu::KvType::kI8),
                "paged_attention: an int8 cache needs the AVX2 build and head_dim % 8 == 0");
    return;
  }
  if (kv_is_f16_of_f32) {
    if (llmserve_cpu::attend_f32_avx2(p, max_m, llmserve_cpu::KvType::kF16)) return;
    return dispatch_dim<float, c10::Half>(p, max_m);
  }
  switch (q_type) {
    case at::kFloat:
      if (llmserve_cpu::attend_f32_avx2(p, max_m, llmserve_cpu::KvType::kF32)) return;
      return dispatch_dim<float>(p, max_m);
    case at::kBFloat16:
      if (llmserve_cpu::attend_f32_avx2(p, max_m, llmserve_cpu::KvType::kBF16)) return;
      return dispatch_dim<c10::BFloat16>(p, max_m);
    case at::kHalf: return dispatch_dim<c10::Half>(p, max_m);
    default: TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace

namespace llmserve_cpu {

// Whether kv_cache[0] is contiguous, from its strides (kv_cache[0] itself would be a view: autograd metadata of the
// cache, at every layer of a decode step).
static bool is_contiguous_half(const at::Tensor& kv_cache) {
  int64_t expected = 1;
  for (int64_t dim = kv_cache.dim() - 1; dim >= 1; --dim) {
    if (kv_cache.size(dim) != 1 && kv_cache.stride(dim) != expected) return false;
    expected *= kv_cache.size(dim);
  }
  return true;
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& rows,
                     double scale, int64_t window, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  // stride(0) == 0: the K and V halves are the same memory (MLA's latents: values = the keys' first features)
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && is_contiguous_half(kv_cache) &&
              (kv_cache.stride(0) == 0 || kv_cache.is_contiguous()),
              "paged_attention: kv_cache must be a contiguous [2, N, bs, Hkv, D] (or one half seen twice)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with contiguous D");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "paged_attention: out must be contiguous like q");
  const bool is_f32_q = q.scalar_type() == at::kFloat;
  const bool kv_is_f16_of_f32 = is_f32_q && kv_cache.scalar_type() == at::kHalf;
  const bool kv_is_i8 = is_f32_q && kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK((q.scalar_type() == kv_cache.scalar_type() || kv_is_f16_of_f32 || kv_is_i8) && out.scalar_type() == q.scalar_type(),
              "paged_attention: q, out and kv_cache must share a dtype (or float32 q/out over a float16 or int8 cache)");
  for (const at::Tensor* t : {&block_table, &seq_lens, &query_start, &rows}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(), "paged_attention: int32 CPU metadata");
  }
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1, "paged_attention: block_table [B, W]");
  TORCH_CHECK(seq_lens.is_contiguous() && query_start.is_contiguous() && rows.is_contiguous(),
              "paged_attention: contiguous seq_lens, query_start, rows");
  const int num_kv_heads = kv_cache.size(3);
  const int head_stride = kv_cache.size(4), head_dim = kv_is_i8 ? head_stride - 4 : head_stride;
  TORCH_CHECK(q.size(2) == head_dim && q.size(1) % num_kv_heads == 0, "paged_attention: q heads/head_dim mismatch");
  TORCH_CHECK(window >= 0 && window <= std::numeric_limits<int>::max(), "paged_attention: window must be >= 0");
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->device().is_cpu() && sinks->is_contiguous() &&
                sinks->dim() == 1 && sinks->size(0) == q.size(1), "paged_attention: sinks must be float32 [H]");
  }
  Params p;
  p.q = q.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.out = out.data_ptr();
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start = query_start.data_ptr<int32_t>();
  p.rows = rows.data_ptr<int32_t>();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.bt_stride = block_table.stride(0);
  p.kv_half = kv_cache.stride(0);
  p.num_kv_heads = num_kv_heads;
  p.group = q.size(1) / num_kv_heads;
  p.head_dim = head_dim;
  p.head_stride = head_stride;
  p.block_size = kv_cache.size(2);
  p.scale = static_cast<float>(scale);
  p.window = static_cast<int>(window);
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  if (rows.numel() == 0) return;
  // Validate what the kernel will index (O(rows + blocks read), cheap next to the attention itself).
  const int64_t num_rows = seq_lens.numel(), num_tokens = q.size(0), num_blocks = kv_cache.size(1);
  TORCH_CHECK(query_start.numel() == num_rows + 1 && block_table.size(0) == num_rows, "paged_attention: B mismatch");
  int num_tiles = 0, max_tile = 1;
  for (int64_t r = 0; r < rows.numel(); ++r) {
    const int row = p.rows[r];
    TORCH_CHECK(row >= 0 && row < num_rows, "paged_attention: row index out of range");
    const int start = p.query_start[row], q_len = p.query_start[row + 1] - start, seq_len = p.seq_lens[row];
    TORCH_CHECK(q_len >= 1 && start >= 0 && start + q_len <= num_tokens,
                "paged_attention: query_len must be >= 1 and within q");
    TORCH_CHECK(seq_len >= q_len && (seq_len + p.block_size - 1) / p.block_size <= block_table.size(1),
                "paged_attention: seq_len shorter than query_len or past the block table");
    const int32_t* table = p.block_table + row * p.bt_stride;
    for (int b = llmserve_cpu::first_visible(p, seq_len - q_len) / p.block_size;
         b < (seq_len + p.block_size - 1) / p.block_size; ++b) {  // the blocks it reads
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "paged_attention: block id out of range");
    }
    num_tiles += (q_len + kMaxQueryLen - 1) / kMaxQueryLen;
    max_tile = std::max(max_tile, std::min(q_len, kMaxQueryLen));
  }
  // All kv heads of a tile in one item (each token's K/V read as one contiguous span); when tiles are too few
  // for the threads, long ones split over their keys, else one kv head per item.
  const int num_threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  p.heads_per_item = num_kv_heads;
  std::vector<WorkItem> items = work_items(p, rows.numel(), num_tiles, max_tile > 1);
  const std::vector<llmserve_cpu::SplitGroup> splits = llmserve_cpu::split_items(p, items, num_threads);
  if (splits.empty() && num_tiles < 4 * num_threads) {
    p.heads_per_item = 1;
    items = work_items(p, rows.numel(), num_tiles, max_tile > 1);
  }
  const int max_m = max_tile * p.group * p.heads_per_item;
  // every slot a merge reads is written by its split first (stash_split), so the buffer is not zeroed
  const size_t num_partial_floats = splits.empty() ? 0 : static_cast<size_t>(items.size()) * max_m * (head_dim + 2);
  const std::unique_ptr<float[]> partials(num_partial_floats > 0 ? new float[num_partial_floats] : nullptr);
  p.partials = partials.get();
  p.partial_stride = max_m * (head_dim + 2);
  p.items = items.data();
  p.num_items = static_cast<int>(items.size());
  attend(p, max_m, q.scalar_type(), kv_is_f16_of_f32, kv_is_i8);
  llmserve_cpu::merge_splits(p, splits, q.scalar_type());
}

}  // namespace llmserve_cpu

TORCH_LIBRARY(llmserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor query_start, Tensor rows, float scale, int window=0, Tensor? sinks=None) -> ()",
        &llmserve_cpu::paged_attention);
}
