// A CPU decode step's prologue and epilogue for the decoder stack (csrc/decode_stack.cpp, `DecodeStack::step`):
// the embedding lookup and the rotary cos/sin before the layers, the final norm and the sampled rows' logits after
// them. The same ATen ops as the Python model (model/llama.py, model/layers.py) in the same order: the same bits.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace llmserve_cpu {

struct DecodeHead {
  at::Tensor embedding;       // [vocab, hidden]: nn.Embedding's table
  at::Tensor inv_freq;        // [D/2] float32: the rotary's inverse frequencies
  double rotary_scaling = 1;  // yarn's mscale (longrope's factor) on cos and sin; 1: none
  at::Tensor final_norm;      // [hidden]
  double final_eps = 0;
  at::Tensor head_weight;     // the logits' linear in the stack's kind: panels [P, hidden, 16] or [vocab, hidden]
  int64_t vocab_size = 0;
};

// ids [T] int64 -> [T, hidden] rows of the table (nn.Embedding's at::embedding)
inline at::Tensor embed_rows(const DecodeHead& head, const at::Tensor& ids) {
  return at::embedding(head.embedding, ids);
}

// positions [T] int64 -> cos, sin [T, 1, D/2] in dtype (RotaryEmbedding.cos_sin)
inline std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const DecodeHead& head, const at::Tensor& positions,
                                                        at::ScalarType dtype) {
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * head.inv_freq.unsqueeze(0);  // [T, D/2]
  at::Tensor cos = freqs.cos(), sin = freqs.sin();
  if (head.rotary_scaling != 1.0) {
    cos = cos * head.rotary_scaling;
    sin = sin * head.rotary_scaling;
  }
  return {cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)};
}

}  // namespace llmserve_cpu
