// Eight bfloat16 at a time in AVX2 registers, for the kernels that read or write bfloat16 (fused_ops_bf16.cpp,
// paged_attention_avx2.cpp, lora_sgmv_bf16.cpp, lora_sgmv_mixed.cpp): widening is exact (a bfloat16's bits are a
// float32's upper half); narrowing rounds to nearest even as c10::BFloat16 does (NaN to 0x7FC0), so vector and
// scalar code give the same bits.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

namespace llmserve_cpu {

// The bfloat16 bits in the low 16 bits of eight 32-bit lanes -> eight float32 (the lanes' high bits are dropped).
inline __m256 bf16x8_widen(__m256i lanes) { return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16)); }

// Eight bfloat16 at p -> eight float32.
inline __m256 bf16x8_load(const void* p) {
  return bf16x8_widen(_mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
}

// Eight float32 -> their bfloat16 bits (to nearest even; NaN to 0x7FC0), one in each 32-bit lane.
inline __m256i bf16x8_round_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
}

// Eight float32 rounded to bfloat16, as float32: what widening the rounded value gives.
inline __m256 bf16x8_round(__m256 v) { return bf16x8_widen(bf16x8_round_bits(v)); }

// Eight float32 rounded to bfloat16, stored at p.
inline void bf16x8_store(void* p, __m256 v) {
  const __m256i packed = _mm256_packus_epi32(bf16x8_round_bits(v), _mm256_setzero_si256());  // per 128-bit lane
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0b11011000);  // the lanes' low halves side by side
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
}

}  // namespace llmserve_cpu

#endif
