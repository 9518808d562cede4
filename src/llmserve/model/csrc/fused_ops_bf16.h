// bfloat16 rows of the fused elementwise ops (csrc/fused_ops_bf16.cpp); contiguous rows unless strides are given.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace llmserve_cpu {

void rms_norm_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* weight, int64_t rows, int64_t n,
                   float eps);
void add_rms_norm_bf16(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* weight, int64_t rows,
                       int64_t n, float eps);
void silu_mul_bf16(c10::BFloat16* out, const c10::BFloat16* gate_up, int64_t rows, int64_t n);
void rotary_bf16(c10::BFloat16* base, const c10::BFloat16* cos, const c10::BFloat16* sin, int64_t rows, int64_t heads,
                 int64_t half, int64_t row_stride, int64_t head_stride);

}  // namespace llmserve_cpu
