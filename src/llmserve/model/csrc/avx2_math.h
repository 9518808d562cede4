// Vector math shared by the AVX2 + FMA kernels (paged_attention_avx2.cpp, fused_ops.cpp, moe_experts.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace llmserve_cpu {

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial; < 2 ulp).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38: stays a normal float
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

}  // namespace llmserve_cpu

#endif

namespace llmserve_cpu {

// out[i] = g[i] / (1 + exp(-g[i])) * u[i]
inline void silu_mul_row(float* __restrict out, const float* __restrict g, const float* __restrict u, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // exp(-|g|), never overflows
    const __m256 is_neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, is_neg), _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

}  // namespace llmserve_cpu
