// The AVX2 + FMA attention's vector pieces (paged_attention_avx2.cpp): K/V elements loaded as float32 (float32,
// bfloat16, float16 bits, int8 rows with their scale), horizontal sums in one fixed order, the keys' scores and
// the values' weighted sums, for one query vector or for a run of query heads that read the same keys.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "avx2_math.h"
#include "bf16_avx2.h"
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace llmserve_cpu::attention_avx2 {

// Eight cached K/V elements as float32: loaded as they are, or widened from float16 (F16C).
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

template <typename KV>
constexpr bool kIsInt8 = std::is_same<KV, int8_t>::value;

// An int8 cache's chunk: for each of its n tokens, `heads` rows of d int8 each followed by its float32 scale ->
// float32 rows (value times scale) in buf [n, heads, d]; rows[c] then points at token c's.
inline void widen_int8_rows(const int8_t* const* src, int n, int heads, int d, float* buf, const float** rows) {
  for (int c = 0; c < n; ++c) {
    float* dst = buf + static_cast<int64_t>(c) * heads * d;
    rows[c] = dst;
    for (int h = 0; h < heads; ++h, dst += d) {
      const int8_t* x = src[c] + h * (d + 4);
      float scale;
      __builtin_memcpy(&scale, x + d, sizeof(scale));
      const __m256 sv = _mm256_set1_ps(scale);
      for (int i = 0; i < d; i += 8) {
        const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + i)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), sv));
      }
    }
  }
}
// bfloat16 (a bfloat16 model's cache) widens exactly: its bits are a float32's upper half.
inline __m256 load8(const c10::BFloat16* x) { return llmserve_cpu::bf16x8_load(x); }
#ifdef __F16C__
inline __m256 load8(const uint16_t* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
#endif

// [sum(a[0]), sum(a[1]), ..., sum(a[7])]
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// [sum(a[0]), .., sum(a[3])], each added up in the same order as hsum8's.
inline __m128 hsum4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// sum(v) in hsum8's order.
inline float hsum(__m256 v) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 a[4] = {v, zero, zero, zero};
  return _mm_cvtss_f32(hsum4(a));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// scores[c] = q . keys[c][off : off + d] for c < n -> their max; d a multiple of 8; KV: float or
// uint16_t (f16 bits).
template <int kD, typename KV>
inline float score_keys(const float* q, const KV* const* keys, int off, int n, int d_rt, float* scores) {
  const int d = kD > 0 ? kD : d_rt;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int c = 0;
  for (; c + 8 <= n; c += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(keys[c + j] + off + i), acc[j]);
    }
    const __m256 sums = hsum8(acc);
    _mm256_storeu_ps(scores + c, sums);
    vmax = _mm256_max_ps(vmax, sums);
  }
  float max = hmax(vmax);
  for (; c < n; ++c) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(keys[c] + off + i), acc);
    }
    scores[c] = hsum(acc);
    max = std::max(max, scores[c]);
  }
  return max;
}

// score_keys for kQ query vectors that read the same keys (query heads of one kv head, one token): query j at
// q + j * d, its scores at scores + j * kChunk, its max into maxes[j]. Each key's elements are loaded (and
// widened) once for all kQ, four keys a pass (4 * kQ accumulators); every score is added up in score_keys'
// order, so the results do not depend on how queries are grouped.
template <int kD, int kQ, typename KV>
inline void score_keys_shared(const float* q, const KV* const* keys, int off, int n, int d_rt, float* scores,
                              float* maxes) {
  const int d = kD > 0 ? kD : d_rt;
  __m128 vmax[kQ];
  for (int j = 0; j < kQ; ++j) vmax[j] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  int c = 0;
  for (; c + 4 <= n; c += 4) {
    __m256 acc[kQ][4];
    for (int j = 0; j < kQ; ++j)
      for (int t = 0; t < 4; ++t) acc[j][t] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      for (int t = 0; t < 4; ++t) {
        const __m256 kv = load8(keys[c + t] + off + i);
        for (int j = 0; j < kQ; ++j) acc[j][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i), kv, acc[j][t]);
      }
    }
    for (int j = 0; j < kQ; ++j) {
      const __m128 sums = hsum4(acc[j]);
      _mm_storeu_ps(scores + j * kChunk + c, sums);
      vmax[j] = _mm_max_ps(vmax[j], sums);
    }
  }
  for (int j = 0; j < kQ; ++j) {
    __m128 m = _mm_max_ps(vmax[j], _mm_movehl_ps(vmax[j], vmax[j]));
    maxes[j] = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  for (; c < n; ++c) {
    __m256 acc[kQ];
    for (int j = 0; j < kQ; ++j) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      const __m256 kv = load8(keys[c] + off + i);
      for (int j = 0; j < kQ; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i), kv, acc[j]);
    }
    for (int j = 0; j < kQ; ++j) {
      scores[j * kChunk + c] = hsum(acc[j]);
      maxes[j] = std::max(maxes[j], scores[j * kChunk + c]);
    }
  }
}

// scores[c] = exp(scores[c] - max) for c < n -> their sum.
inline float exp_shifted(float* scores, int n, float max) {
  const __m256 mv = _mm256_set1_ps(max);
  __m256 sum = _mm256_setzero_ps();
  int c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + c), mv));
    _mm256_storeu_ps(scores + c, e);
    sum = _mm256_add_ps(sum, e);
  }
  float s = hsum(sum);
  for (; c < n; ++c) {
    scores[c] = std::exp(scores[c] - max);
    s += scores[c];
  }
  return s;
}

// acc[0 : 8 * kVecs] += sum over c < n of p[c] * values[c][off : off + 8 * kVecs], acc held in registers.
template <int kVecs, typename KV>
inline void accumulate_span(float* acc, const float* p, const KV* const* values, int off, int n) {
  __m256 a[kVecs];
  for (int j = 0; j < kVecs; ++j) a[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int c = 0; c < n; ++c) {
    const __m256 pc = _mm256_set1_ps(p[c]);
    const KV* v = values[c] + off;
    for (int j = 0; j < kVecs; ++j) a[j] = _mm256_fmadd_ps(pc, load8(v + 8 * j), a[j]);
  }
  for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

// accumulate_span for kQ query vectors over the same values: query j's accumulators at acc + j * d, its weights at
// p + j * kChunk. Each value vector is loaded (and widened) once for all kQ; every lane adds up in key order, as
// accumulate_span does.
template <int kVecs, int kQ, typename KV>
inline void accumulate_span_shared(float* acc, int d, const float* p, const KV* const* values, int off, int n) {
  __m256 a[kQ][kVecs];
  for (int j = 0; j < kQ; ++j)
    for (int v = 0; v < kVecs; ++v) a[j][v] = _mm256_loadu_ps(acc + j * d + 8 * v);
  for (int c = 0; c < n; ++c) {
    const KV* x = values[c] + off;
    for (int v = 0; v < kVecs; ++v) {
      const __m256 xv = load8(x + 8 * v);
      for (int j = 0; j < kQ; ++j) a[j][v] = _mm256_fmadd_ps(_mm256_set1_ps(p[j * kChunk + c]), xv, a[j][v]);
    }
  }
  for (int j = 0; j < kQ; ++j)
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(acc + j * d + 8 * v, a[j][v]);
}

template <int kQ, typename KV>
inline void accumulate_shared(float* acc, const float* p, const KV* const* values, int off, int n, int d) {
  constexpr int kVecs = kQ == 2 ? 4 : 2;  // 8 accumulators, plus the value vectors and weights: 16 registers
  int i = 0;
  for (; i + 8 * kVecs <= d; i += 8 * kVecs) accumulate_span_shared<kVecs, kQ>(acc + i, d, p, values, off + i, n);
  for (; i < d; i += 8) accumulate_span_shared<1, kQ>(acc + i, d, p, values, off + i, n);
}

template <typename KV>
inline void accumulate(float* acc, const float* p, const KV* const* values, int off, int n, int d) {
  int i = 0;
  for (; i + 64 <= d; i += 64) accumulate_span<8>(acc + i, p, values, off + i, n);
  for (; i < d; i += 8) accumulate_span<1>(acc + i, p, values, off + i, n);
}

}  // namespace llmserve_cpu::attention_avx2

#endif
