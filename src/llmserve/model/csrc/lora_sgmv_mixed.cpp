// The LoRA kernel for float32 rows with bfloat16 adapter slots (--lora-dtype bfloat16 on a float32 model;
// csrc/lora_sgmv.cpp's op calls it when `out` is float32 and the slots bfloat16): the same tiles (lora_sgmv.h),
// each slot element widened to float32 as it is read (a shift: exact), float32 FMAs and sums, as the float32
// kernel on slots that hold the bfloat16 values. Half the slot bytes a step: the products read every resident
// adapter's A and B once a step, so on CPU they cost about their bytes.

#include "bf16_avx2.h"
#include "lora_sgmv.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_MIXED_AVX2 1
#endif

namespace {

inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

#ifdef LORA_MIXED_AVX2
inline __m256 load8(const uint16_t* p) { return llmserve_cpu::bf16x8_load(p); }

using llmserve_lora::hsum;
#endif

// h[t] = dot(xs[t], arow) for the tile's N tokens
template <int64_t N>
void dots(const float* const* xs, const uint16_t* arow, int64_t len, float* h) {
  int64_t i = 0;
  float acc[N] = {};
#ifdef LORA_MIXED_AVX2
  __m256 v[N];
  for (int64_t t = 0; t < N; ++t) v[t] = _mm256_setzero_ps();
  for (; i + 8 <= len; i += 8) {
    const __m256 va = load8(arow + i);
    for (int64_t t = 0; t < N; ++t) v[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + i), va, v[t]);
  }
  for (int64_t t = 0; t < N; ++t) acc[t] = hsum(v[t]);
#endif
  for (; i < len; ++i)
    for (int64_t t = 0; t < N; ++t) acc[t] += xs[t][i] * to_float(arow[i]);
  for (int64_t t = 0; t < N; ++t) h[t] = acc[t];
}

// for each of the tile's N tokens t: orows[t][0:len] += sum_r hs[t][r] * bt[r * len : r * len + len]
template <int64_t N>
void expand_rows(float* const* orows, const float* const* hs, const uint16_t* bt, int64_t rank, int64_t len) {
  int64_t o = 0;
#ifdef LORA_MIXED_AVX2
  for (; o + 16 <= len; o += 16) {
    __m256 c[N][2];
    for (int64_t t = 0; t < N; ++t) {
      c[t][0] = _mm256_loadu_ps(orows[t] + o);
      c[t][1] = _mm256_loadu_ps(orows[t] + o + 8);
    }
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 b0 = load8(bt + r * len + o), b1 = load8(bt + r * len + o + 8);
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
      for (int64_t r = 0; r < rank; ++r) c += hs[t][r] * to_float(bt[r * len + o]);
      orows[t][o] = c;
    }
}

struct F32Bf16Ops {
  using T = float;
  using W = uint16_t;
  static void dots(const float* const* xs, int64_t n, const uint16_t* arow, int64_t len, float* h) {
    llmserve_lora::with_tile_rows(n, [&](auto m) { ::dots<decltype(m)::value>(xs, arow, len, h); });
  }
  static void expand(float* const* orows, const float* const* hs, int64_t n, const uint16_t* bt, int64_t rank,
                     int64_t len) {
    llmserve_lora::with_tile_rows(n, [&](auto m) { expand_rows<decltype(m)::value>(orows, hs, bt, rank, len); });
  }
};

}  // namespace

namespace llmserve_lora {

void run_tiles_f32_bf16(const Problem& p, float* out, const float* x, const uint16_t* a,
                        const std::vector<const uint16_t*>& bts) {
  run_tiles<F32Bf16Ops>(p, out, x, a, bts);
}

}  // namespace llmserve_lora
