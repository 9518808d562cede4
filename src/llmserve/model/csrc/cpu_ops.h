// The C++ entry points of the CPU ops that csrc/decode_stack.cpp calls directly (each is also registered under
// torch.ops.llmserve_cpu, where cpu_kernels.py documents it): called from C++ they skip the dispatcher and the
// Python wrappers.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace llmserve_cpu {

constexpr int64_t kBf16GemvMaxRows = 8;  // rows of x bf16_gemv takes (a few decode rows, or a verification's k + 1)

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_mul(at::Tensor out, const at::Tensor& gate_up);
void rotary(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin);
void write_kv(at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k, const at::Tensor& v);
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& rows,
                     double scale, int64_t window, const std::optional<at::Tensor>& sinks);
void packed_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels,
                   const c10::optional<at::Tensor>& bias);
void packed_linear_avx512(at::Tensor out, const at::Tensor& x, const at::Tensor& panels,
                          const c10::optional<at::Tensor>& bias);
void bf16_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

}  // namespace llmserve_cpu
