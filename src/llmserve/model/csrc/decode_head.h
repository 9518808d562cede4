// A CPU decode step's prologue and epilogue for the decoder stack (csrc/decode_stack.cpp, `DecodeStack::step`):
// the embedding lookup and the rotary cos/sin before the layers, the final norm and the sampled rows' logits after
// them. The same values as the Python model (model/llama.py, model/layers.py): the same bits. Between two weight
// streams every ATen op runs with cold caches (tens of microseconds each, whatever its size), so the common case
// uses none but the allocations: embedding rows copied, cos/sin rows read from a table the Python rotary computed
// at load (model/cpu_decode_head.py), bfloat16 logits widened in a loop.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace llmserve_cpu {

struct DecodeHead {
  at::Tensor embedding;       // [vocab, hidden]: nn.Embedding's table
  at::Tensor inv_freq;        // [D/2] float32: the rotary's inverse frequencies
  double rotary_scaling = 1;  // yarn's mscale (longrope's factor) on cos and sin; 1: none
  at::Tensor cos_table, sin_table;  // [P, D/2] in the model's dtype: RotaryEmbedding.cos_sin of positions 0..P-1
  at::Tensor final_norm;      // [hidden]
  double final_eps = 0;
  at::Tensor head_weight;     // the logits' linear in the stack's kind: panels [P, hidden, 16] or [vocab, hidden]
  int64_t vocab_size = 0;
};

// ids [T] int64 -> [T, hidden] rows of the table (what nn.Embedding's lookup gives)
inline at::Tensor embed_rows(const DecodeHead& head, const at::Tensor& ids) {
  const int64_t num_rows = ids.numel(), vocab = head.embedding.size(0), hidden = head.embedding.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "DecodeStack: input ids must be a contiguous int64 [T] tensor");
  const at::Tensor out = at::empty({num_rows, hidden}, head.embedding.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const size_t row_bytes = hidden * head.embedding.element_size();
  const char* table = static_cast<const char*>(head.embedding.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < num_rows; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < vocab, "DecodeStack: input id ", id[t], " out of range [0, ", vocab, ")");
    std::memcpy(dst + t * row_bytes, table + id[t] * row_bytes, row_bytes);
  }
  return out;
}

// positions [T] int64 -> cos, sin [T, 1, D/2] in dtype (RotaryEmbedding.cos_sin): from the tables where every
// position is in them, else computed as cos_sin computes them
inline std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const DecodeHead& head, const at::Tensor& positions,
                                                        at::ScalarType dtype) {
  const int64_t num_rows = positions.numel(), half = head.inv_freq.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  bool is_in_table = head.cos_table.defined() && head.cos_table.scalar_type() == dtype && positions.is_contiguous();
  for (int64_t t = 0; is_in_table && t < num_rows; ++t) is_in_table = pos[t] >= 0 && pos[t] < head.cos_table.size(0);
  if (is_in_table) {
    const at::Tensor cos = at::empty({num_rows, 1, half}, head.cos_table.options());
    const at::Tensor sin = at::empty({num_rows, 1, half}, head.cos_table.options());
    const size_t row_bytes = half * head.cos_table.element_size();
    for (int64_t t = 0; t < num_rows; ++t) {
      std::memcpy(static_cast<char*>(cos.data_ptr()) + t * row_bytes,
                  static_cast<const char*>(head.cos_table.data_ptr()) + pos[t] * row_bytes, row_bytes);
      std::memcpy(static_cast<char*>(sin.data_ptr()) + t * row_bytes,
                  static_cast<const char*>(head.sin_table.data_ptr()) + pos[t] * row_bytes, row_bytes);
    }
    return {cos, sin};
  }
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * head.inv_freq.unsqueeze(0);  // [T, D/2]
  at::Tensor cos = freqs.cos(), sin = freqs.sin();
  if (head.rotary_scaling != 1.0) {
    cos = cos * head.rotary_scaling;
    sin = sin * head.rotary_scaling;
  }
  return {cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)};
}

// h [T, hidden] -> its rows at logits_indices [N] (index_select), h itself when those are 0..T-1 in order
inline at::Tensor rows_at(const at::Tensor& h, const at::Tensor& logits_indices) {
  bool is_all = logits_indices.numel() == h.size(0) && logits_indices.scalar_type() == at::kLong &&
                logits_indices.is_contiguous();
  const int64_t* index = is_all ? logits_indices.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; is_all && i < h.size(0); ++i) is_all = index[i] == i;
  return is_all ? h : h.index_select(0, logits_indices);
}

// logits [N, vocab] -> float32 (bfloat16 widened exactly, as .to(float32) does; float32 as it is)
inline at::Tensor as_float(const at::Tensor& logits) {
  if (logits.scalar_type() != at::kBFloat16 || !logits.is_contiguous()) return logits.to(at::kFloat);
  const at::Tensor out = at::empty(logits.sizes(), logits.options().dtype(at::kFloat));
  const uint16_t* src = static_cast<const uint16_t*>(logits.data_ptr());
  uint32_t* dst = static_cast<uint32_t*>(out.data_ptr());
  const int64_t n = logits.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint32_t>(src[i]) << 16;  // a bfloat16 is a float's top half
  return out;
}

}  // namespace llmserve_cpu
