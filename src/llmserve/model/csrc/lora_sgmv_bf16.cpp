// The LoRA kernel for bfloat16 tensors (csrc/lora_sgmv.cpp's op calls it for bfloat16 `out`): the same tiles
// (lora_sgmv.h), float32 sums, and one rounding into each output element, as PEFT computes an adapter on a
// bfloat16 base model (its adapter weights upcast to float32: x @ A^T @ B^T * scale in float32, added to the
// bfloat16 base output, rounded once).
//
//   shrink  h[t] = dot(x[t], A row): AVX512-BF16's dot products (vdpbf16ps, 32 pairs an instruction) where the
//           build has them, else AVX2 FMAs on bfloat16 widened to float32 (a shift), else scalar
//   expand  out[t] = bf16(sum_r h[t][r] * B^T[r] + out[t]): AVX2 FMAs on B^T widened to float32, h float32
//           (vdpbf16ps would round h to bfloat16 first), rounded to nearest even by integer arithmetic, so the
//           bits do not depend on which of the builds ran the expand

#include <c10/util/BFloat16.h>

#include "bf16_avx2.h"
#include "lora_sgmv.h"

#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_BF16_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LORA_BF16_DOT 1
#endif

namespace {

inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline uint16_t to_bf16(float value) { return c10::BFloat16(value).x; }  // to nearest even; NaN stays NaN

#ifdef LORA_BF16_AVX2
inline __m256 load8(const uint16_t* p) { return llmserve_cpu::bf16x8_load(p); }
inline void store8(uint16_t* p, __m256 v) { llmserve_cpu::bf16x8_store(p, v); }  // to nearest even (c10's rounding)

using llmserve_lora::hsum;
#endif

// h[t] = dot(xs[t], arow) in float32 for the tile's N tokens
template <int64_t N>
void dots(const uint16_t* const* xs, const uint16_t* arow, int64_t len, float* h) {
  int64_t i = 0;
  float acc[N] = {};
#if defined(LORA_BF16_DOT)
  __m512 v[N];
  for (int64_t t = 0; t < N; ++t) v[t] = _mm512_setzero_ps();
  for (; i + 32 <= len; i += 32) {
    const __m512bh va = (__m512bh)_mm512_loadu_si512(arow + i);
    for (int64_t t = 0; t < N; ++t) v[t] = _mm512_dpbf16_ps(v[t], (__m512bh)_mm512_loadu_si512(xs[t] + i), va);
  }
  if (i < len) {  // the tail: under 32, masked (zeros add nothing)
    const __mmask32 mask = (__mmask32(1) << (len - i)) - 1;
    const __m512bh va = (__m512bh)_mm512_maskz_loadu_epi16(mask, arow + i);
    for (int64_t t = 0; t < N; ++t)
      v[t] = _mm512_dpbf16_ps(v[t], (__m512bh)_mm512_maskz_loadu_epi16(mask, xs[t] + i), va);
    i = len;
  }
  for (int64_t t = 0; t < N; ++t) acc[t] = _mm512_reduce_add_ps(v[t]);
#elif defined(LORA_BF16_AVX2)
  __m256 v[N];
  for (int64_t t = 0; t < N; ++t) v[t] = _mm256_setzero_ps();
  for (; i + 8 <= len; i += 8) {
    const __m256 va = load8(arow + i);
    for (int64_t t = 0; t < N; ++t) v[t] = _mm256_fmadd_ps(load8(xs[t] + i), va, v[t]);
  }
  for (int64_t t = 0; t < N; ++t) acc[t] = hsum(v[t]);
#endif
  for (; i < len; ++i)
    for (int64_t t = 0; t < N; ++t) acc[t] += to_float(xs[t][i]) * to_float(arow[i]);
  for (int64_t t = 0; t < N; ++t) h[t] = acc[t];
}

// for each of the tile's N tokens t: orows[t][0:len] = bf16(sum_r hs[t][r] * bt[r * len + o] + orows[t][o])
// (16 output columns of every token in registers, each row of B^T loaded once for all of them)
template <int64_t N>
void expand_rows(uint16_t* const* orows, const float* const* hs, const uint16_t* bt, int64_t rank, int64_t len) {
  int64_t o = 0;
#ifdef LORA_BF16_AVX2
  for (; o + 16 <= len; o += 16) {
    __m256 c[N][2];
    for (int64_t t = 0; t < N; ++t) c[t][0] = c[t][1] = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 b0 = load8(bt + r * len + o), b1 = load8(bt + r * len + o + 8);
      for (int64_t t = 0; t < N; ++t) {
        const __m256 hr = _mm256_broadcast_ss(hs[t] + r);
        c[t][0] = _mm256_fmadd_ps(hr, b0, c[t][0]);
        c[t][1] = _mm256_fmadd_ps(hr, b1, c[t][1]);
      }
    }
    for (int64_t t = 0; t < N; ++t) {
      store8(orows[t] + o, _mm256_add_ps(c[t][0], load8(orows[t] + o)));
      store8(orows[t] + o + 8, _mm256_add_ps(c[t][1], load8(orows[t] + o + 8)));
    }
  }
#endif
  for (; o < len; ++o)
    for (int64_t t = 0; t < N; ++t) {
      float c = 0.0f;
      for (int64_t r = 0; r < rank; ++r) c = std::fma(hs[t][r], to_float(bt[r * len + o]), c);
      orows[t][o] = to_bf16(c + to_float(orows[t][o]));
    }
}

struct Bf16Ops {
  using T = uint16_t;
  using W = uint16_t;
  static void dots(const uint16_t* const* xs, int64_t n, const uint16_t* arow, int64_t len, float* h) {
    llmserve_lora::with_tile_rows(n, [&](auto m) { ::dots<decltype(m)::value>(xs, arow, len, h); });
  }
  static void expand(uint16_t* const* orows, const float* const* hs, int64_t n, const uint16_t* bt, int64_t rank,
                     int64_t len) {
    llmserve_lora::with_tile_rows(n, [&](auto m) { expand_rows<decltype(m)::value>(orows, hs, bt, rank, len); });
  }
};

}  // namespace

namespace llmserve_lora {

void run_tiles_bf16(const Problem& p, uint16_t* out, const uint16_t* x, const uint16_t* a,
                    const std::vector<const uint16_t*>& bts) {
  run_tiles<Bf16Ops>(p, out, x, a, bts);
}

}  // namespace llmserve_lora
