// Every decoder layer of a CPU decode step in one call (JIT-built by llmserve/model/cpu_kernels.py).
//
// From Python, a dense Llama-family layer on decode rows is ten ops, each behind a module call, a wrapper and the
// dispatcher: at one row that is a third of a bfloat16 step. DecodeStack holds the layers' weights (given once, at
// load: model/cpu_decode_stack.py) and runs all layers of a step through the same kernels, in the same order, on
// the same inputs, so its outputs are the Python path's bit for bit:
//   layer 0: residual = x; h = rms_norm(x)            later layers: residual += h; h = rms_norm(residual)
//   qkv = linear(h); [q, k = per-head rms_norm(q, k)]; rotary(q, k); write_kv(k, v); o = paged_attention(q);
//   h = linear(o)
//   residual += h; h = rms_norm(residual); h = linear(silu_mul(linear(h)))
// and returns (h, residual): the caller applies the final norm. For MoE models the stack holds the attention halves
// and, where each layer's MLP is a float32 MoE layer it takes (`add_moe`: csrc/moe_layer.cpp), those too, so that
// `forward` runs whole steps; otherwise `attention`, one call a layer, and the caller runs each layer's MLP between
// them. Linears are float32 panels (csrc/linear_avx2.cpp,
// through AVX-512 registers where chosen) or, in bfloat16, the AVX512-BF16 GEMV on weights as loaded (up to 4 rows;
// at::linear past them, as the Python layers).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "decode_head.h"
#include "moe_layer.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace {

enum class LinearKind : int64_t { kBf16Gemv = 0, kPanelsAvx2 = 1, kPanelsAvx512 = 2 };

struct StackLinear {
  at::Tensor weight;  // panels [P, K, 16] (float32) or the weight [N, K] (bfloat16)
  std::optional<at::Tensor> bias;  // [N]
  int64_t out_features = 0;
};

struct StackLayer {
  at::Tensor input_norm, post_norm;  // [hidden]
  int64_t window = 0;                // attends the last `window` keys (0: all)
  std::optional<at::Tensor> q_norm, k_norm;  // [head_dim]: Qwen3's per-head norms before rotary
  std::vector<StackLinear> linears;  // qkv, o, gate_up, down
  std::shared_ptr<const llmserve_cpu::MoeLayer> moe;  // the MLP as an MoE layer in place of gate_up and down
};

constexpr size_t kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kNumLinears = 4;

// The tensors of one step every layer reads.
struct Step {
  const at::Tensor &cos, &sin, &slot_mapping, &block_table, &seq_lens, &query_start, &rows;
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  LinearKind kind;
  size_t num_linears;  // 4: whole layers (forward); 2: their attention halves only (attention), the MLPs in Python
  std::vector<StackLayer> layers;
  std::optional<llmserve_cpu::DecodeHead> head;  // the step's embedding, rotary, final norm and logits (`step`)
  std::vector<int64_t> kept_layers;  // layers whose input (the residual stream) a forward keeps: an EAGLE-3 head's
  mutable std::vector<at::Tensor> kept;  // the last forward's, one a kept_layers entry

  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t kind,
              bool has_mlps)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps), scale(scale),
        kind(static_cast<LinearKind>(kind)), num_linears(has_mlps ? kNumLinears : kGateUp) {
    TORCH_CHECK(kind >= 0 && kind <= 2, "DecodeStack: linear kind must be 0 (bf16 GEMV), 1 or 2 (panels)");
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
                "DecodeStack: bad head counts");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, int64_t window, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm) {
    TORCH_CHECK(layers.empty() || layers.back().linears.size() == num_linears, "DecodeStack: previous layer incomplete");
    TORCH_CHECK(input_norm.dim() == 1 && input_norm.sizes() == post_norm.sizes(), "DecodeStack: norm weights [hidden]");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeStack: q and k norms come together");
    layers.push_back(StackLayer{input_norm, post_norm, window, q_norm, k_norm, {}});
  }

  // transformers' RMSNorm as the Python layers run it on [T, heads, D] (torch ops in its order: the same bits)
  at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight) const {
    const at::Tensor x32 = x.to(at::kFloat);
    const at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
    return weight * (x32 * at::rsqrt(variance + eps)).to(x.scalar_type());
  }

  // The next of the last layer's linears, in the order qkv, o, gate_up, down (the first two without MLPs).
  void add_linear(at::Tensor weight, std::optional<at::Tensor> bias, int64_t out_features) {
    TORCH_CHECK(!layers.empty() && layers.back().linears.size() < num_linears, "DecodeStack: add_layer first");
    const bool is_bf16 = kind == LinearKind::kBf16Gemv;
    TORCH_CHECK(weight.scalar_type() == (is_bf16 ? at::kBFloat16 : at::kFloat) && weight.dim() == (is_bf16 ? 2 : 3),
                "DecodeStack: bfloat16 [N, K] weights for the GEMV, float32 [P, K, 16] panels otherwise");
    layers.back().linears.push_back(StackLinear{weight, bias, out_features});
  }

  // Layer i's MLP as a float32 Mixture-of-Experts layer (csrc/moe_layer.cpp), in a stack of attention halves: once
  // every layer has one, `forward` runs whole steps. load [E] int64: the layer's tokens per expert, added to.
  void add_moe(int64_t i, at::Tensor router, at::Tensor gate_up, at::Tensor down, int64_t top_k, bool is_renormalized,
               at::Tensor load) {
    TORCH_CHECK(i >= 0 && i < num_layers() && num_linears == kGateUp && layers[i].linears.size() == kGateUp &&
                    !layers[i].moe && kind != LinearKind::kBf16Gemv,
                "DecodeStack: add_moe once a layer, after its attention linears, in a float32 stack without MLPs");
    layers[i].moe = llmserve_cpu::make_moe_layer(router, gate_up, down, top_k, is_renormalized,
                                                 kind == LinearKind::kPanelsAvx512, load);
  }

  // Whether every layer's MLP is here (its linears, or an MoE layer): `forward` runs whole steps.
  bool has_mlps() const {
    return num_linears == kNumLinears ||
           std::all_of(layers.begin(), layers.end(), [](const StackLayer& layer) { return layer.moe != nullptr; });
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // x @ w^T (+ bias) into `out` through the stack's kernel; bfloat16 rows past the GEMV's take at::linear (what
  // F.linear runs in the Python layers), a new tensor.
  at::Tensor run_linear(const StackLinear& linear, const at::Tensor& x, at::Tensor out) const {
    switch (kind) {
      case LinearKind::kBf16Gemv:
        if (x.size(0) > llmserve_cpu::kBf16GemvMaxRows) return at::linear(x, linear.weight, linear.bias);
        llmserve_cpu::bf16_gemv(out, x, linear.weight, linear.bias);
        break;
      case LinearKind::kPanelsAvx2: llmserve_cpu::packed_linear(out, x, linear.weight, linear.bias); break;
      case LinearKind::kPanelsAvx512: llmserve_cpu::packed_linear_avx512(out, x, linear.weight, linear.bias); break;
    }
    return out;
  }

  // The q, k, q-and-k and v heads [T, H | Hkv | H + Hkv | Hkv, D] of a qkv output [T, (H + 2 Hkv) D]: made once a
  // step for the step's qkv buffer (views cost a dispatch each), anew where a linear returned a new tensor.
  struct QkvViews {
    at::Tensor qkv, q, k, qk, v;
  };
  QkvViews views_of(const at::Tensor& qkv) const {
    const at::Tensor heads = qkv.view({qkv.size(0), num_heads + 2 * num_kv_heads, head_dim});
    return QkvViews{qkv, heads.narrow(1, 0, num_heads), heads.narrow(1, num_heads, num_kv_heads),
                    heads.narrow(1, 0, num_heads + num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads)};
  }

  // The attention half of layer `layer` on its normed rows x [T, hidden]: qkv (into the buffer of qkv_views where
  // its kernel writes one), Qwen3's q/k norms, rotary, the KV write and paged attention into attn [T, H, D] (whose
  // [T, H * D] view is attn_rows) -> o_proj's output [T, hidden] (into o_out where its kernel writes one).
  at::Tensor attend(const StackLayer& layer, const at::Tensor& x, const at::Tensor& kv_cache, const Step& step,
                    const QkvViews& qkv_views, const at::Tensor& o_out, at::Tensor& attn,
                    const at::Tensor& attn_rows) const {
    const at::Tensor qkv = run_linear(layer.linears[kQkv], x, qkv_views.qkv);
    std::optional<QkvViews> fresh;
    const QkvViews& views = qkv.is_same(qkv_views.qkv) ? qkv_views : fresh.emplace(views_of(qkv));
    at::Tensor q = views.q, k = views.k;
    if (layer.q_norm.has_value()) {  // new tensors, each rotated on its own
      q = head_norm(q, *layer.q_norm);
      k = head_norm(k, *layer.k_norm);
      llmserve_cpu::rotary(q, step.cos, step.sin);
      llmserve_cpu::rotary(k, step.cos, step.sin);
    } else {  // one rotary over the q and k heads of qkv
      llmserve_cpu::rotary(views.qk, step.cos, step.sin);
    }
    llmserve_cpu::write_kv(kv_cache, step.slot_mapping, k, views.v);
    llmserve_cpu::paged_attention(attn, q, kv_cache, step.block_table, step.seq_lens, step.query_start, step.rows,
                                  scale, layer.window, std::nullopt);
    return run_linear(layer.linears[kO], attn_rows, o_out);
  }

  void check_step(const at::Tensor& x) const {
    TORCH_CHECK(!layers.empty() && layers.back().linears.size() == num_linears, "DecodeStack: no complete layers");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecodeStack: x must be a contiguous [T, hidden] tensor");
    TORCH_CHECK(layers.front().linears[kQkv].out_features == (num_heads + 2 * num_kv_heads) * head_dim,
                "DecodeStack: qkv width mismatch");
  }

  // x [T, hidden] (the embeddings; becomes the residual, updated in place), cos/sin [T, 1, D/2], one cache a layer,
  // the step's slot mapping [T] int64 and the attention kernel's int32 rows (every token a decode-like row's)
  // -> (h, residual) [T, hidden] before the final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                             std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping,
                                             at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start,
                                             at::Tensor rows) const {
    check_step(x);
    TORCH_CHECK(has_mlps(), "DecodeStack: built without the MLPs (attention only)");
    TORCH_CHECK(kv_caches.size() == layers.size(), "DecodeStack: one KV cache a layer");
    const Step step{cos, sin, slot_mapping, block_table, seq_lens, query_start, rows};
    const int64_t num_tokens = x.size(0), hidden = x.size(1);
    const StackLayer& first = layers.front();
    const int64_t gate_up_size = num_linears == kNumLinears ? first.linears[kGateUp].out_features : 0;
    const auto options = x.options();
    // the linears' outputs (run_linear may return new tensors instead), attention's and silu_mul's
    const at::Tensor h_out = at::empty({num_tokens, hidden}, options), o_out = at::empty({num_tokens, hidden}, options);
    const at::Tensor qkv_out = at::empty({num_tokens, first.linears[kQkv].out_features}, options);
    const at::Tensor gate_up_out = at::empty({num_tokens, gate_up_size}, options);
    at::Tensor attn = at::empty({num_tokens, num_heads, head_dim}, options);  // paged_attention's out
    const at::Tensor attn_rows = attn.view({num_tokens, num_heads * head_dim});
    const at::Tensor act = at::empty({num_tokens, gate_up_size / 2}, options);
    const QkvViews qkv_views = views_of(qkv_out);
    at::Tensor residual = x, h = h_out;
    kept.assign(kept_layers.size(), at::Tensor());
    keep_input(0, residual);
    llmserve_cpu::rms_norm(h, x, first.input_norm, eps);
    for (size_t i = 0; i < layers.size(); ++i) {
      const StackLayer& layer = layers[i];
      if (i > 0) {
        llmserve_cpu::add_rms_norm(h, residual, layer.input_norm, eps);
        keep_input(static_cast<int64_t>(i), residual);  // residual += h: now layer i's input
      }
      const at::Tensor o = attend(layer, h, kv_caches[i], step, qkv_views, o_out, attn, attn_rows);
      llmserve_cpu::add_rms_norm(o, residual, layer.post_norm, eps);
      if (layer.moe) {
        llmserve_cpu::run_moe_layer(*layer.moe, o, h_out);
        h = h_out;
        continue;
      }
      llmserve_cpu::silu_mul(act, run_linear(layer.linears[kGateUp], o, gate_up_out));
      h = run_linear(layer.linears[kDown], act, h_out);
    }
    return {h, residual};
  }

  // A copy of the residual stream entering layer i, for each kept_layers entry that names it (updated in place later).
  void keep_input(int64_t i, const at::Tensor& stream) const {
    at::Tensor copy;
    for (size_t j = 0; j < kept_layers.size(); ++j) {
      if (kept_layers[j] != i) continue;
      if (!copy.defined()) copy = stream.clone();
      kept[j] = copy;
    }
  }

  void keep_inputs(std::vector<int64_t> layer_ids) {
    for (int64_t i : layer_ids) TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: kept layer out of range");
    kept_layers = std::move(layer_ids);
  }

  std::vector<at::Tensor> kept_inputs() const { return kept; }

  // The step's prologue and epilogue (csrc/decode_head.h); head_weight in the linears' kind, vocab_size its rows;
  // cos_table, sin_table [P, D/2] in the embedding's dtype: the rotary's cos/sin of positions 0..P-1.
  void set_head(at::Tensor embedding, at::Tensor inv_freq, double rotary_scaling, at::Tensor cos_table,
                at::Tensor sin_table, at::Tensor final_norm, double final_eps, at::Tensor head_weight,
                int64_t vocab_size) {
    TORCH_CHECK(has_mlps(), "DecodeStack: a head needs whole layers");
    TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.size(0) * 2 == head_dim,
                "DecodeStack: inv_freq [D/2] float32");
    TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous(), "DecodeStack: the embedding [vocab, hidden]");
    TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == head_dim / 2 && cos_table.is_contiguous() &&
                    cos_table.sizes() == sin_table.sizes() && sin_table.is_contiguous() &&
                    cos_table.scalar_type() == embedding.scalar_type() &&
                    sin_table.scalar_type() == embedding.scalar_type(),
                "DecodeStack: cos and sin tables [P, D/2] in the embedding's dtype");
    const bool is_bf16 = kind == LinearKind::kBf16Gemv;
    TORCH_CHECK(head_weight.scalar_type() == (is_bf16 ? at::kBFloat16 : at::kFloat) &&
                    head_weight.dim() == (is_bf16 ? 2 : 3) && embedding.scalar_type() == head_weight.scalar_type(),
                "DecodeStack: the head's weight in the linears' kind, the embedding in the model's dtype");
    head = llmserve_cpu::DecodeHead{embedding, inv_freq, rotary_scaling, cos_table, sin_table, final_norm, final_eps,
                                    head_weight, vocab_size};
  }

  // The whole forward of a step in one call: ids, positions [T] int64 (and forward's step tensors), logits_indices
  // [N] int64 -> (hidden [T, hidden] after the final norm, the rows' logits [N, vocab] float32).
  std::tuple<at::Tensor, at::Tensor> step(at::Tensor ids, at::Tensor positions, std::vector<at::Tensor> kv_caches,
                                          at::Tensor slot_mapping, at::Tensor block_table, at::Tensor seq_lens,
                                          at::Tensor query_start, at::Tensor rows, at::Tensor logits_indices) const {
    TORCH_CHECK(head.has_value(), "DecodeStack: no head (set_head)");
    const at::Tensor x = llmserve_cpu::embed_rows(*head, ids);
    const auto [cos, sin] = llmserve_cpu::rotary_cos_sin(*head, positions, x.scalar_type());
    auto [h, residual] = forward(x, cos, sin, std::move(kv_caches), slot_mapping, block_table, seq_lens, query_start,
                                 rows);
    llmserve_cpu::add_rms_norm(h, residual, head->final_norm, head->final_eps);
    const at::Tensor sampled = llmserve_cpu::rows_at(h, logits_indices);  // [N, hidden]
    const at::Tensor out = at::empty({sampled.size(0), head->vocab_size}, sampled.options());
    const at::Tensor logits = run_linear(StackLinear{head->head_weight, std::nullopt, head->vocab_size}, sampled, out);
    return {h, llmserve_cpu::as_float(logits)};
  }

  // Layer i up to its MLP, as the Python layer runs it: h [T, hidden] (the embeddings when residual is None: layer
  // 0; else the previous MLP's output, normed in place with residual += h) -> (the post-attention normed rows for the
  // MLP, residual).
  std::tuple<at::Tensor, at::Tensor> attention(int64_t i, at::Tensor h, std::optional<at::Tensor> residual,
                                               at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                                               at::Tensor slot_mapping, at::Tensor block_table, at::Tensor seq_lens,
                                               at::Tensor query_start, at::Tensor rows) const {
    check_step(h);
    TORCH_CHECK(i >= 0 && i < num_layers(), "DecodeStack: layer index out of range");
    const StackLayer& layer = layers[i];
    const Step step{cos, sin, slot_mapping, block_table, seq_lens, query_start, rows};
    at::Tensor x = h, res = residual.has_value() ? *residual : h;
    if (residual.has_value()) {
      llmserve_cpu::add_rms_norm(x, res, layer.input_norm, eps);
    } else {
      x = at::empty_like(h);
      llmserve_cpu::rms_norm(x, h, layer.input_norm, eps);
    }
    const int64_t num_tokens = h.size(0);
    const auto options = h.options();
    const at::Tensor qkv_out = at::empty({num_tokens, layer.linears[kQkv].out_features}, options);
    const at::Tensor o_out = at::empty({num_tokens, h.size(1)}, options);
    at::Tensor attn = at::empty({num_tokens, num_heads, head_dim}, options);
    const at::Tensor o = attend(layer, x, kv_cache, step, views_of(qkv_out), o_out, attn,
                                attn.view({num_tokens, num_heads * head_dim}));
    llmserve_cpu::add_rms_norm(o, res, layer.post_norm, eps);
    return {o, res};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t, bool>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_linear", &DecodeStack::add_linear)
      .def("add_moe", &DecodeStack::add_moe)
      .def("has_mlps", &DecodeStack::has_mlps)
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_head", &DecodeStack::set_head)  // the step's prologue and epilogue: csrc/decode_head.h
      .def("step", &DecodeStack::step)
      .def("forward", &DecodeStack::forward)
      .def("attention", &DecodeStack::attention)
      .def("keep_inputs", &DecodeStack::keep_inputs)  // an EAGLE-3 head's feature layers (model/eagle.py)
      .def("kept_inputs", &DecodeStack::kept_inputs);
}
