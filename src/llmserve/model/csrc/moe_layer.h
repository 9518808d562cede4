// A float32 Mixture-of-Experts layer on CPU as one C++ call (csrc/moe_layer.cpp), for csrc/decode_stack.cpp, and the
// experts' op it runs (csrc/moe_experts.cpp; also registered as torch.ops.llmserve_cpu.moe_experts).
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>

namespace llmserve_cpu {

// out [T*k, H] row q = weights[q] * (expert of pair q)(rows' row of q), for pairs sorted by expert (cpu_kernels.py
// documents it).
void moe_experts(at::Tensor out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& pairs,
                 const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                 const std::optional<at::Tensor>& gate_up_bias, const std::optional<at::Tensor>& down_bias,
                 bool use_avx512);

struct MoeLayer;  // the router, the stacked expert panels, the routing settings and the layer's load counts

// router [E, H] float32; gate_up [E, 2I/16, H, 16] and down [E, ceil(H/16), I, 16] stacked float32 panels;
// load [E] int64, to which every run adds the tokens routed to each expert.
std::shared_ptr<const MoeLayer> make_moe_layer(const at::Tensor& router, at::Tensor gate_up, at::Tensor down,
                                               int64_t top_k, bool is_renormalized, bool use_avx512, at::Tensor load);

// x [T, H] float32 contiguous -> the layer's output [T, H], written into out.
void run_moe_layer(const MoeLayer& layer, const at::Tensor& x, at::Tensor out);

}  // namespace llmserve_cpu
