// A float32 Mixture-of-Experts layer on CPU in one call, for the decoder stack (csrc/decode_stack.cpp). It runs the
// Python block's ops (model/moe.py's SparseMoeBlock with model/moe_cpu.py's PackedExperts) in their order, so its
// outputs, and the load it records, are the Python path's bit for bit:
//   logits [T, E] = float(linear(double(x), double(router)))    moe.router_logits (batch-invariant)
//   ids [T, k]: each row's k largest logits, ties to the lower id  moe.route (a stable descending sort's first k)
//   weights [T, k] = softmax(logits) at ids [/ their sum]         moe.route (Qwen3-MoE's norm_topk_prob, Mixtral)
//   load[e] += the pairs routed to expert e                       moe_load.ExpertLoad.record
//   the (token, k) pairs sorted by expert, stable; their rows      moe.sort_pairs, PackedExperts.run_in_one_op
//   moe_experts -> out [T*k, H]; each token's k rows summed        csrc/moe_experts.cpp, then the sum over k
// The steps that round (the router's GEMM and its float rounding, softmax, the renormalising division, the sum over
// k) are the same ATen ops as in Python; choosing, counting, sorting and gathering are exact and done here.

#include <ATen/ATen.h>

#include "moe_layer.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace llmserve_cpu {

struct MoeLayer {
  at::Tensor router;         // [E, H] float64 (the float32 weight, converted once: the values F.linear is given)
  at::Tensor gate_up, down;  // [E, 2I/16, H, 16], [E, ceil(H/16), I, 16] float32 panels
  int64_t top_k;
  bool is_renormalized, use_avx512;
  at::Tensor load;  // [E] int64, added to
};

namespace {

// Whether a comes before b in torch.sort's descending order: larger, NaN above every number.
bool is_above(float a, float b) { return std::isnan(a) ? !std::isnan(b) : a > b; }

// ids [T*k]: each row of logits [T, E]'s k largest, in order, equal values to the lower expert id (what a stable
// descending sort puts first).
std::vector<int64_t> top_k_ids(const at::Tensor& logits, int64_t top_k) {
  const int64_t num_tokens = logits.size(0), num_experts = logits.size(1);
  const float* l = logits.data_ptr<float>();
  std::vector<int64_t> ids(num_tokens * top_k);
  std::vector<char> is_taken(num_experts);
  for (int64_t t = 0; t < num_tokens; ++t, l += num_experts) {
    std::fill(is_taken.begin(), is_taken.end(), 0);
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e)
        if (!is_taken[e] && (best < 0 || is_above(l[e], l[best]))) best = e;
      is_taken[best] = 1;
      ids[t * top_k + j] = best;
    }
  }
  return ids;
}

// weights [T, k] float32: softmax(logits) at ids, divided by their sum where the layer renormalises.
at::Tensor routing_weights(const MoeLayer& layer, const at::Tensor& logits, const std::vector<int64_t>& ids) {
  const int64_t num_tokens = logits.size(0), num_experts = logits.size(1), k = layer.top_k;
  const at::Tensor probs = at::softmax(logits, -1);  // [T, E]
  at::Tensor weights = at::empty({num_tokens, k}, logits.options());
  const float* p = probs.data_ptr<float>();
  float* w = weights.data_ptr<float>();
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t j = 0; j < k; ++j) w[t * k + j] = p[t * num_experts + ids[t * k + j]];
  return layer.is_renormalized ? weights / weights.sum(-1, /*keepdim=*/true) : weights;
}

}  // namespace

std::shared_ptr<const MoeLayer> make_moe_layer(const at::Tensor& router, at::Tensor gate_up, at::Tensor down,
                                               int64_t top_k, bool is_renormalized, bool use_avx512, at::Tensor load) {
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat, "MoeLayer: router must be float32 [E, H]");
  const int64_t num_experts = router.size(0), hidden = router.size(1);
  TORCH_CHECK(gate_up.dim() == 4 && down.dim() == 4 && gate_up.size(0) == num_experts &&
                  down.size(0) == num_experts && gate_up.size(2) == hidden && down.size(2) % 16 == 0 &&
                  gate_up.scalar_type() == at::kFloat && down.scalar_type() == at::kFloat,
              "MoeLayer: experts must be stacked float32 panels [E, 2I/16, H, 16] and [E, ceil(H/16), I, 16], "
              "I a multiple of 16");
  TORCH_CHECK(0 < top_k && top_k <= num_experts, "MoeLayer: top_k must be in 1..E");
  TORCH_CHECK(load.scalar_type() == at::kLong && load.dim() == 1 && load.size(0) == num_experts &&
                  load.is_contiguous(),
              "MoeLayer: load must be a contiguous int64 [E] tensor");
  return std::make_shared<const MoeLayer>(
      MoeLayer{router.to(at::kDouble).contiguous(), gate_up, down, top_k, is_renormalized, use_avx512, load});
}

void run_moe_layer(const MoeLayer& layer, const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == layer.router.size(1),
              "MoeLayer: x must be a contiguous float32 [T, H] tensor");
  const int64_t num_tokens = x.size(0), hidden = x.size(1), k = layer.top_k, num_experts = layer.router.size(0);
  const at::Tensor logits = at::linear(x.to(at::kDouble), layer.router).to(at::kFloat).contiguous();  // [T, E]
  const std::vector<int64_t> ids = top_k_ids(logits, k);  // [T*k]
  const at::Tensor weights = routing_weights(layer, logits, ids).contiguous();  // [T, k]
  // counts [E]; pairs [T*k] sorted by expert, stable (a counting sort: torch.sort(stable=True)'s order)
  at::Tensor counts = at::zeros({num_experts}, at::kLong), pairs = at::empty({num_tokens * k}, at::kLong);
  int64_t* count = counts.data_ptr<int64_t>();
  for (const int64_t e : ids) ++count[e];
  int64_t* load = layer.load.data_ptr<int64_t>();
  std::vector<int64_t> next(num_experts);
  for (int64_t e = 0, start = 0; e < num_experts; start += count[e], ++e) {
    load[e] += count[e];
    next[e] = start;
  }
  int64_t* pair = pairs.data_ptr<int64_t>();
  for (int64_t q = 0; q < num_tokens * k; ++q) pair[next[ids[q]]++] = q;
  at::Tensor rows = at::empty({num_tokens * k, hidden}, x.options());  // [P, H] each sorted pair's token's row
  const float* src = x.data_ptr<float>();
  float* dst = rows.data_ptr<float>();
  for (int64_t r = 0; r < num_tokens * k; ++r)
    std::memcpy(dst + r * hidden, src + pair[r] / k * hidden, hidden * sizeof(float));
  const at::Tensor weighted = at::empty({num_tokens * k, hidden}, x.options());  // [T*k, H]
  moe_experts(weighted, rows, counts, pairs, weights, layer.gate_up, layer.down, std::nullopt, std::nullopt,
              layer.use_avx512);
  at::sum_out(out, weighted.view({num_tokens, k, hidden}), {1});
}

}  // namespace llmserve_cpu
