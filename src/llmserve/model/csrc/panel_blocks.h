// The float32 panel GEMMs' register blocks (linear_avx2.cpp, linear_avx512.cpp, moe_experts.cpp): c[r, 0:16] (+)=
// a[r, 0:kc] @ b[0:kc, 0:16] for r < ROWS over one 16-column panel. `first` starts from the bias (or zero),
// otherwise from what c holds; pf, when set, is prefetched one line per k. Each output element is one FMA
// chain over k in order, in either ISA: the two give the same sums.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace llmserve_cpu {

constexpr int64_t kF32Panel = 16;  // output columns a panel

// Two ymm a row: 6 rows hold 12 accumulators + 2 panel rows + 1 broadcast.
template <int ROWS>
inline void f32_block_avx2(const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc,
                           const float* bias, bool first, const float* pf) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 2; ++j)
      acc[r][j] = !first ? _mm256_loadu_ps(c + r * ldc + 8 * j)
                  : bias ? _mm256_loadu_ps(bias + 8 * j)
                         : _mm256_setzero_ps();
  for (int i = 0; i < kc; ++i) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + i * kF32Panel), _MM_HINT_T1);
    __m256 bv[2];
    for (int j = 0; j < 2; ++j) bv[j] = _mm256_load_ps(b + i * kF32Panel + 8 * j);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + i);
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_fmadd_ps(av, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(c + r * ldc + 8 * j, acc[r][j]);
}

#if defined(__AVX512F__)
// One zmm a row.
template <int ROWS>
inline void f32_block_avx512(const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc,
                             const float* bias, bool first, const float* pf) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r)
    acc[r] = !first ? _mm512_loadu_ps(c + r * ldc) : bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int i = 0; i < kc; ++i) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + i * kF32Panel), _MM_HINT_T1);
    const __m512 bv = _mm512_load_ps(b + i * kF32Panel);
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + i]), bv, acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(c + r * ldc, acc[r]);
}
#endif

}  // namespace llmserve_cpu

#endif
