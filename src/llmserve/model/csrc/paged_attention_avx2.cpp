// float32 paged attention with AVX2 + FMA intrinsics: CPU decode's hot path (contract: paged_attention.cpp), also
// for bfloat16 q, out and cache (a bfloat16 model's decode rows: widened exactly, computed in float32).
//
// Same work items, chunks, windows, sinks and online softmax as the portable path; four differences. Keys are scored
// eight at a time (eight independent FMA chains, then one horizontal-add tree for the eight sums) instead
// of one dot product and its horizontal sum per key. The query heads of one kv head (GQA's group, one token)
// read each key and value once for up to three of them (`score_run`, `accumulate_run`), adding up every sum in
// the same order as one query alone, so grouping changes no bits. The softmax's exponentials are a vectorised
// polynomial (Cephes' expf: < 2 ulp on the inputs here, which are <= 0). Each query's output accumulates
// in registers over a chunk of values. K/V are read in place from the paged cache: float32 as they are,
// float16 (--kv-cache-dtype fp16) widened eight at a time with F16C; int8 (--kv-cache-dtype int8) rows are
// widened and scaled once a chunk into float32 buffers that every query vector of the item then reads. All
// arithmetic is float32, so an f16 cache gives the same result as an f32 cache holding the same
// (f16-rounded) values, and an int8 one as an f32 cache holding its dequantized values.

#include "attention_avx2.h"
#include "avx2_math.h"
#include "paged_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

using llmserve_cpu::Item;
using llmserve_cpu::item_of;
using llmserve_cpu::kChunk;
using llmserve_cpu::Params;
using llmserve_cpu::Scratch;
using llmserve_cpu::exp_nonpositive;
using namespace llmserve_cpu::attention_avx2;

constexpr int kPrefetchAhead = kChunk;  // keys: prefetch the next chunk while computing this one

// Query vector m's online softmax over one chunk whose nv scores (max cmax) are in its scores row:
// rescale what it holds to the new max, exponentiate the chunk's scores in place, add up their sum.
inline void fold_chunk(Scratch& w, int m, int d, int nv, float cmax) {
  const float new_max = std::max(w.max[m], cmax);
  if (new_max > w.max[m]) {
    const float corr = std::exp(w.max[m] - new_max);  // 0 on the first chunk
    w.sum[m] *= corr;
    float* am = w.acc.data() + m * d;
    for (int i = 0; i < d; ++i) am[i] *= corr;
    w.max[m] = new_max;
  }
  w.sum[m] += exp_shifted(w.scores.data() + m * kChunk, nv, new_max);
}

// The run of query vectors from m that read the same keys: the rest of m's kv head's query heads (of m's token),
// at most 3 at a time (score_keys_shared's registers; 4 go as 2 + 2).
inline int run_length(int m, int group) {
  const int rest = group - m % group;
  return rest == 4 ? 2 : std::min(3, rest);
}

// Score and softmax-fold query vectors m .. m + nq - 1 (a run) over one chunk's valid[m] visible keys.
template <int kD, typename KV>
inline void score_run(Scratch& w, int m, int nq, int d, int head_off, const KV* const* kp) {
  const int nv = w.valid[m];
  const float* q = w.q.data() + m * d;
  float* scores = w.scores.data() + m * kChunk;
  float maxes[3];
  switch (nq) {
    case 1: maxes[0] = score_keys<kD>(q, kp, head_off, nv, d, scores); break;
    case 2: score_keys_shared<kD, 2>(q, kp, head_off, nv, d, scores, maxes); break;
    default: score_keys_shared<kD, 3>(q, kp, head_off, nv, d, scores, maxes);
  }
  for (int j = 0; j < nq; ++j) fold_chunk(w, m + j, d, nv, maxes[j]);
}

// Add a run's chunk of values, weighted by its softmaxed scores, to its accumulators.
template <typename KV>
inline void accumulate_run(Scratch& w, int m, int nq, int d, int head_off, const KV* const* vp) {
  float* acc = w.acc.data() + m * d;
  const float* weights = w.scores.data() + m * kChunk;
  switch (nq) {
    case 1: accumulate(acc, weights, vp, head_off, w.valid[m], d); break;
    case 2: accumulate_shared<2>(acc, weights, vp, head_off, w.valid[m], d); break;
    default: accumulate_shared<3>(acc, weights, vp, head_off, w.valid[m], d);
  }
}

// Query vector m of an item: token m / hg, head kvh0 * g + m % hg; its kv head is kvh0 + (m % hg) / g.
// Q: q's and out's dtype, float32 or bfloat16.
template <typename Q>
void load_queries(const Params& p, const Item& it, Scratch& w, int d) {
  const Q* q = static_cast<const Q*>(p.q);
  for (int m = 0; m < it.q_len * it.hg; ++m) {
    const Q* src = q + (it.first_token + m / it.hg) * p.q_stride_t + (it.kvh0 * p.group + m % it.hg) * p.q_stride_h;
    for (int i = 0; i < d; ++i) w.q[m * d + i] = static_cast<float>(src[i]) * p.scale;
    std::fill(w.acc.data() + m * d, w.acc.data() + (m + 1) * d, 0.f);
    w.max[m] = -std::numeric_limits<float>::infinity();
    w.sum[m] = 0.f;
  }
}

template <typename Q>
void store_outputs(const Params& p, const Item& it, const Scratch& w, int d) {
  if (llmserve_cpu::stash_split(it, w, d)) return;
  Q* out = static_cast<Q*>(p.out);
  const int num_heads = p.num_kv_heads * p.group;
  for (int m = 0; m < it.q_len * it.hg; ++m) {
    const int head = it.kvh0 * p.group + m % it.hg;
    Q* dst = out + (static_cast<int64_t>(it.first_token + m / it.hg) * num_heads + head) * d;
    const float inv = 1.f / llmserve_cpu::denominator(p, w, m, head);
    for (int i = 0; i < d; ++i) dst[i] = static_cast<Q>(w.acc[m * d + i] * inv);
  }
}

template <int kD, typename KV, typename Q>
void attend_item(const Params& p, int item_index, Scratch& w) {
  const int d = kD > 0 ? kD : p.head_dim;
  const Item it = item_of(p, item_index);
  const KV* kcache = static_cast<const KV*>(p.kv);
  const KV* vcache = kcache + p.kv_half;
  const int hs = p.head_stride;  // d, or d + 4 for an int8 cache (its scale)
  const int span_bytes = p.heads_per_item * hs * static_cast<int>(sizeof(KV));  // the item's part of a token's K
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * hs;
  // a power-of-two block size (the usual 16) divides by shifting: two divisions a token cost as much as
  // a fifth of the chunk's arithmetic
  const bool is_pow2 = (p.block_size & (p.block_size - 1)) == 0;
  const int shift = __builtin_ctz(static_cast<unsigned>(p.block_size));
  const int64_t block_stride = token_stride * p.block_size;
  auto token_offset = [&](int t) {
    const int block = is_pow2 ? t >> shift : t / p.block_size, slot = t - block * p.block_size;
    return static_cast<int64_t>(it.table[block]) * block_stride + slot * token_stride + static_cast<int64_t>(it.kvh0) * hs;
  };
  const int m_count = it.q_len * it.hg;
  const KV* kp[kChunk];
  const KV* vp[kChunk];
  const float* kf[kChunk];  // an int8 cache: the chunk's rows widened (widen_int8_rows)
  const float* vf[kChunk];
  // The next chunk's K/V are prefetched a few tokens at a time between the queries' work: issued all at
  // once, hundreds of prefetches stall on the fill buffers instead of overlapping the arithmetic.
  int next_t = 0, next_end = 0;
  auto prefetch_tokens = [&](int n) {
    for (const int stop = std::min(next_end, next_t + n); next_t < stop; ++next_t) {
      const int64_t off = token_offset(next_t);
      for (int b = 0; b < span_bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kcache + off) + b, 0, 1);
        __builtin_prefetch(reinterpret_cast<const char*>(vcache + off) + b, 0, 1);
      }
    }
  };
  const int tokens_per_slice = (kPrefetchAhead + 2 * m_count - 1) / (2 * m_count);  // 2 * m_count slices a chunk
  // The first chunk's K/V all at once, before the queries load: no chunk before it hides them, and read on demand
  // they came in at the memory's latency (a decode step's KV is cold after the weights' stream).
  next_t = it.first_key;
  next_end = std::min(it.key_end, it.first_key + kChunk);
  prefetch_tokens(kChunk);
  load_queries<Q>(p, it, w, d);
  for (int c0 = it.first_key; c0 < it.key_end; c0 += kChunk) {  // keys outside: out of every window, or a split's
    const int cn = std::min(kChunk, it.key_end - c0);
    for (int c = 0; c < cn; ++c) {
      const int64_t off = token_offset(c0 + c);
      kp[c] = kcache + off;
      vp[c] = vcache + off;
    }
    next_t = c0 + kPrefetchAhead;
    next_end = std::min(it.key_end, c0 + kPrefetchAhead + kChunk);
    if constexpr (kIsInt8<KV>) {  // widened once, then read by every query vector as a float32 cache
      widen_int8_rows(kp, cn, p.heads_per_item, d, w.kbuf.data(), kf);
      if (p.kv_half == 0) std::copy(kf, kf + cn, vf);  // K and V one memory (MLA's latents): widened once
      else widen_int8_rows(vp, cn, p.heads_per_item, d, w.vbuf.data(), vf);
    }
    // Query vectors in runs that read the same keys (score_run): keys query m sees in the chunk are
    // first[m] .. first[m] + valid[m] - 1, the same for the whole run.
    for (int m = 0; m < m_count;) {
      const int nq = run_length(m, p.group);
      for (int j = m; j < m + nq; ++j) llmserve_cpu::visible_in_chunk(p, it, j, c0, cn, w);
      if (w.valid[m] > 0) {
        if constexpr (kIsInt8<KV>) score_run<kD, float>(w, m, nq, d, (m % it.hg) / p.group * d, kf + w.first[m]);
        else score_run<kD, KV>(w, m, nq, d, (m % it.hg) / p.group * hs, kp + w.first[m]);
      }
      prefetch_tokens(tokens_per_slice * nq);
      m += nq;
    }
    for (int m = 0; m < m_count;) {
      const int nq = run_length(m, p.group);
      if (w.valid[m] > 0) {
        if constexpr (kIsInt8<KV>) accumulate_run(w, m, nq, d, (m % it.hg) / p.group * d, vf + w.first[m]);
        else accumulate_run(w, m, nq, d, (m % it.hg) / p.group * hs, vp + w.first[m]);
      }
      prefetch_tokens(tokens_per_slice * nq);
      m += nq;
    }
  }
  store_outputs<Q>(p, it, w, d);
}

template <typename KV, typename Q = float>
void dispatch_dim(const Params& p, int max_m) {
  switch (p.head_dim) {
    case 64: return llmserve_cpu::for_each_item(p, max_m, attend_item<64, KV, Q>);
    case 128: return llmserve_cpu::for_each_item(p, max_m, attend_item<128, KV, Q>);
    default: return llmserve_cpu::for_each_item(p, max_m, attend_item<0, KV, Q>);
  }
}

}  // namespace

namespace llmserve_cpu {

bool attend_f32_avx2(const Params& p, int max_m, KvType kv) {
  if (p.head_dim % 8 != 0) return false;
  if (kv == KvType::kF32) {
    dispatch_dim<float>(p, max_m);
    return true;
  }
  if (kv == KvType::kI8) {
    dispatch_dim<int8_t>(p, max_m);
    return true;
  }
  if (kv == KvType::kBF16) {
    dispatch_dim<c10::BFloat16, c10::BFloat16>(p, max_m);
    return true;
  }
#ifdef __F16C__
  dispatch_dim<uint16_t>(p, max_m);
  return true;
#else
  return false;  // no F16C at build time: the portable path widens the f16 cache
#endif
}

}  // namespace llmserve_cpu

#else  // no AVX2 + FMA at build time: the portable path serves float32 too

namespace llmserve_cpu {
bool attend_f32_avx2(const Params&, int, KvType) { return false; }
}  // namespace llmserve_cpu

#endif
