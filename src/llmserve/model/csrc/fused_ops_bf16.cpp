// The fused elementwise ops of csrc/fused_ops.cpp for a bfloat16 decoder layer: the same ops, each rounding to
// bfloat16 where transformers' chain of bf16 torch ops rounds (so greedy tokens follow transformers'):
//   rms_norm      out = bf16(w * bf16(x * r)), r from float32 sums            (x + residual rounded first)
//   silu_mul      out = bf16(bf16(silu(g)) * u)
//   rotary        x1' = bf16(bf16(x1 c) - bf16(x2 s)), x2' = bf16(bf16(x2 c) + bf16(x1 s)), c, s bf16
// fused_ops.cpp dispatches here on the tensors' dtype. silu comes from a table of its value at every bfloat16 (the
// same formula, evaluated once), and rotary and silu_mul run eight lanes at a time in AVX2 builds: the same bits.

#include "fused_ops_bf16.h"

#include "bf16_avx2.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>


namespace llmserve_cpu {
namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

inline float f(bf16 v) { return static_cast<float>(v); }

inline bf16 round(float v) { return bf16(v); }  // to nearest even, as torch rounds a float result

void norm_row(bf16* out, const bf16* x, const bf16* w, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += f(x[i]) * f(x[i]);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = round(f(w[i]) * f(round(f(x[i]) * r)));
}

// round(silu(g)) for each of the 65,536 bfloat16 g, by its bits (the scalar formula, once): a prompt's MLP looks up
// hundreds of thousands instead of an exp each, with the same bits. One spare entry: the AVX2 gather reads 32 bits.
const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> values(65537, 0);
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      const float g = f(bf16(static_cast<uint16_t>(bits), bf16::from_bits()));
      values[bits] = round(g / (1.f + std::exp(-g))).x;
    }
    return values;
  }();
  return table.data();
}

}  // namespace

void rms_norm_bf16(bf16* out, const bf16* x, const bf16* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(out + t * n, x + t * n, weight, n, eps);
  });
}

void add_rms_norm_bf16(bf16* x, bf16* residual, const bf16* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      bf16 *xr = x + t * n, *rr = residual + t * n;
      for (int64_t i = 0; i < n; ++i) rr[i] = round(f(xr[i]) + f(rr[i]));
      norm_row(xr, rr, weight, n, eps);
    }
  });
}

void silu_mul_bf16(bf16* out, const bf16* gate_up, int64_t rows, int64_t n) {
  const uint16_t* table = silu_table();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16 *g = gate_up + t * 2 * n, *u = g + n;
      bf16* o = out + t * n;
      int64_t i = 0;
#if defined(__AVX2__)
      for (; i + 8 <= n; i += 8) {  // table[g] gathered as 32-bit words from 16-bit steps: the low half is it
        const __m256i index = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)));
        const __m256 silu = bf16x8_widen(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), index, 2));
        bf16x8_store(o + i, _mm256_mul_ps(silu, bf16x8_load(u + i)));
      }
#endif
      for (; i < n; ++i) o[i] = round(f(bf16(table[g[i].x], bf16::from_bits())) * f(u[i]));
    }
  });
}

void rotary_bf16(bf16* base, const bf16* cos, const bf16* sin, int64_t rows, int64_t heads, int64_t half,
                 int64_t row_stride, int64_t head_stride) {
  at::parallel_for(0, rows, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16 *c = cos + t * half, *s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        bf16 *x1 = base + t * row_stride + h * head_stride, *x2 = x1 + half;
        int64_t i = 0;
#if defined(__AVX2__)
        for (; i + 8 <= half; i += 8) {
          const __m256 a = bf16x8_load(x1 + i), b = bf16x8_load(x2 + i), ci = bf16x8_load(c + i),
                       si = bf16x8_load(s + i);
          const __m256 a_c = bf16x8_round(_mm256_mul_ps(a, ci)), b_s = bf16x8_round(_mm256_mul_ps(b, si));
          const __m256 b_c = bf16x8_round(_mm256_mul_ps(b, ci)), a_s = bf16x8_round(_mm256_mul_ps(a, si));
          bf16x8_store(x1 + i, _mm256_sub_ps(a_c, b_s));
          bf16x8_store(x2 + i, _mm256_add_ps(b_c, a_s));
        }
#endif
        for (; i < half; ++i) {
          const float a = f(x1[i]), b = f(x2[i]), ci = f(c[i]), si = f(s[i]);
          x1[i] = round(f(round(a * ci)) - f(round(b * si)));
          x2[i] = round(f(round(b * ci)) + f(round(a * si)));
        }
      }
    }
  });
}

}  // namespace llmserve_cpu
