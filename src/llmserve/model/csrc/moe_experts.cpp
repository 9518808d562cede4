// The float32 experts of one Mixture-of-Experts layer on CPU in two parallel regions (JIT-built by
// llmserve/model/cpu_kernels.py; model/moe_cpu.py calls it):
//
//   moe_experts  out [T*k, H]: row q = weights[q] * (expert of pair q)(its token's row), for the pairs the caller
//                sorted by expert (`pairs` [>= P]: each expert's run of `counts[e]` pairs in turn; rows [P, H] hold
//                their tokens' rows in that order). Other rows of out are left as they are.
//
// Experts are the dense layers' panels stacked: gate_up [E, 2I/16, H, 16] (gate features, then up), down
// [E, ceil(H/16), I, 16], biases [E, 2I] / [E, H] or none. The first region runs units (expert, 16 features,
// 64-row block): the gate panel and the up panel of those features, then silu(gate) * up into the activations
// [P, I]; the second runs units (expert, down panel, 64-row block), each row's 16 columns times its routing
// weight into its pair's row of out. Threads take contiguous runs of units, so each streams its own stretch of
// the experts' weights, across experts.
//
// The same panels, FMA chains (panel_blocks.h), silu (avx2_math.h) and weight product as the per-expert path
// (packed_linear, silu_mul, then torch's product): the same results, which depend only on the row's own token.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "avx2_math.h"
#include "moe_layer.h"
#include "panel_blocks.h"
#include "panel_gemm.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRowBlock = llmserve_cpu::kPanelRowBlock;  // 64
constexpr int64_t kChunk = 128;         // k-rows of a panel a row block passes over at a time (as linear_*.cpp)
constexpr int64_t kPrefetchRows = 256;  // k-rows ahead the weight stream is prefetched
constexpr int kMaxRows = 6;

struct Unit {
  int64_t expert, panel, row0, num_rows;  // row0: into the sorted rows
};

struct Problem {
  const float* rows;          // [P, H]
  const int64_t* pairs;       // [P] each sorted row's pair (token * k + j)
  const float* weights;       // [T*k]
  const float* gate_up;       // [E, 2I/16, H, 16]
  const float* down;          // [E, ceil(H/16), I, 16]
  const float* gate_up_bias;  // [E, 2I] or nullptr
  const float* down_bias;     // [E, H] or nullptr
  float* act;                 // [P, I]
  float* out;                 // [T*k, H]
  int64_t hidden, inter, num_down_panels;
  const float* gate_up_end;   // one past the stacked weights: prefetches stop there
  const float* down_end;
};

// The units of `num_panels` panels over each expert's run of sorted rows: expert, then panel, then row block.
std::vector<Unit> units_of(const std::vector<int64_t>& starts, int64_t num_panels) {
  std::vector<Unit> units;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(starts.size()); ++e)
    for (int64_t p = 0; p < num_panels; ++p)
      for (int64_t row0 = starts[e]; row0 < starts[e + 1]; row0 += kRowBlock)
        units.push_back({e, p, row0, std::min(kRowBlock, starts[e + 1] - row0)});
  return units;
}

// tile [num_rows, 16] = x [num_rows, k] @ panel [k, 16] (+ bias [16]), K in chunks of kChunk as
// panel_gemm.h's run_f32_panel_unit; with `prefetch` the first row block prefetches the stream kPrefetchRows
// k-rows ahead, past the panel's end into `next` (the panel read after this one), up to `end`.
template <class Block>
void panel_tile(Block block, const float* x, int64_t k, const float* panel, const float* next, const float* end,
                const float* bias, int64_t num_rows, bool prefetch, float* tile) {
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    const int kc = static_cast<int>(std::min(kChunk, k - k0));
    const int64_t ahead = k0 + kPrefetchRows;
    const float* pf = ahead < k ? panel + ahead * kPanel : next + (ahead - k) * kPanel;
    if (!prefetch || pf + kc * kPanel > end) pf = nullptr;
    llmserve_cpu::for_each_row_block<kMaxRows>(num_rows, [&](auto rows, int64_t r) {
      block(rows, x + r * k + k0, k, panel + k0 * kPanel, kc, tile + r * kPanel, kPanel, bias, k0 == 0,
            r == 0 ? pf : nullptr);
    });
  }
}

// Gate and up panel `u.panel` of the unit's rows, then silu(gate) * up into their 16 activation columns.
template <class Block>
void gate_up_unit(const Problem& p, const Unit& u, bool prefetch, Block block) {
  alignas(64) float gate[kRowBlock * kPanel], up[kRowBlock * kPanel];
  const int64_t h = p.hidden, i = p.inter, num_panels = 2 * i / kPanel;
  const float* panels = p.gate_up + u.expert * num_panels * h * kPanel;
  const float* bias = p.gate_up_bias ? p.gate_up_bias + u.expert * 2 * i + u.panel * kPanel : nullptr;
  const float* x = p.rows + u.row0 * h;
  const float* gate_panel = panels + u.panel * h * kPanel;
  const float* up_panel = gate_panel + i / kPanel * h * kPanel;  // the gate panel's features' up panel
  panel_tile(block, x, h, gate_panel, up_panel, p.gate_up_end, bias, u.num_rows, prefetch, gate);
  panel_tile(block, x, h, up_panel, gate_panel + h * kPanel, p.gate_up_end, bias ? bias + i : nullptr, u.num_rows,
             prefetch, up);
  for (int64_t r = 0; r < u.num_rows; ++r)
    llmserve_cpu::silu_mul_row(p.act + (u.row0 + r) * i + u.panel * kPanel, gate + r * kPanel, up + r * kPanel, kPanel);
}

// Down panel `u.panel` of the unit's activations, each row times its pair's weight into the pair's row of out.
template <class Block>
void down_unit(const Problem& p, const Unit& u, bool prefetch, Block block) {
  alignas(64) float tile[kRowBlock * kPanel];
  alignas(64) float bias_tile[kPanel] = {};  // the last panel's bias, zero-padded to 16 columns
  const int64_t h = p.hidden, i = p.inter;
  const int64_t num_cols = std::min(kPanel, h - u.panel * kPanel);
  const float* bias = p.down_bias ? p.down_bias + u.expert * h + u.panel * kPanel : nullptr;
  if (bias && num_cols < kPanel) {
    std::copy(bias, bias + num_cols, bias_tile);
    bias = bias_tile;
  }
  const float* panel = p.down + (u.expert * p.num_down_panels + u.panel) * i * kPanel;
  panel_tile(block, p.act + u.row0 * i, i, panel, panel + i * kPanel, p.down_end, bias, u.num_rows, prefetch, tile);
  for (int64_t r = 0; r < u.num_rows; ++r) {
    const int64_t pair = p.pairs[u.row0 + r];
    const float weight = p.weights[pair];
    float* dst = p.out + pair * h + u.panel * kPanel;
    for (int64_t c = 0; c < num_cols; ++c) dst[c] = tile[r * kPanel + c] * weight;
  }
}

// unit(units[u], prefetch) on ATen's threads, contiguous runs a thread; prefetch on a thread's first unit and on
// a panel's first row block (as panel_gemm.h's for_each_panel_unit).
template <class Run>
void for_each_unit(const std::vector<Unit>& units, Run run) {
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const bool is_first_block =
          u == 0 || units[u - 1].panel != units[u].panel || units[u - 1].expert != units[u].expert;
      run(units[u], u == begin || is_first_block);
    }
  });
}

template <class Block>
void run(const Problem& p, const std::vector<int64_t>& starts, Block block) {
  for_each_unit(units_of(starts, p.inter / kPanel), [&](const Unit& u, bool pf) { gate_up_unit(p, u, pf, block); });
  for_each_unit(units_of(starts, p.num_down_panels), [&](const Unit& u, bool pf) { down_unit(p, u, pf, block); });
}

const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t num_experts, int64_t n, const char* what) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == num_experts * n,
              "moe_experts: ", what, " must be a contiguous float32 [E, ", n, "] tensor");
  return bias->data_ptr<float>();
}

void check_inputs(const at::Tensor& out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& pairs,
                  const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down) {
  for (const at::Tensor* t : {&out, &rows, &weights, &gate_up, &down})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "moe_experts: float32 contiguous tensors expected");
  TORCH_CHECK(gate_up.dim() == 4 && down.dim() == 4 && gate_up.size(3) == kPanel && down.size(3) == kPanel &&
                  gate_up.size(0) == down.size(0),
              "moe_experts: panels must be [E, P, K, 16] (pack_linear_weight's, stacked)");
  const int64_t h = gate_up.size(2), i = down.size(2);
  TORCH_CHECK(gate_up.size(1) * kPanel == 2 * i && i % kPanel == 0,
              "moe_experts: gate_up must hold 2I features, I (down's K) a multiple of 16");
  TORCH_CHECK(down.size(1) == (h + kPanel - 1) / kPanel, "moe_experts: down must hold ceil(H / 16) panels of K = I");
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == h && out.dim() == 2 && out.size(1) == h,
              "moe_experts: rows [P, H] and out [T*k, H] expected");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.numel() == gate_up.size(0),
              "moe_experts: counts must be a contiguous int64 [E] tensor");
  TORCH_CHECK(pairs.scalar_type() == at::kLong && pairs.is_contiguous() && pairs.numel() >= rows.size(0),
              "moe_experts: pairs must be a contiguous int64 tensor of at least P pairs");
  TORCH_CHECK(weights.numel() == out.size(0), "moe_experts: one weight a row of out");
}

// Each expert's first sorted row, and P at the end; checked against the rows given and the pairs' range.
std::vector<int64_t> expert_starts(const at::Tensor& counts, const at::Tensor& rows, const at::Tensor& pairs,
                                   int64_t num_out_rows) {
  const int64_t* c = counts.data_ptr<int64_t>();
  std::vector<int64_t> starts{0};
  for (int64_t e = 0; e < counts.numel(); ++e) {
    TORCH_CHECK(c[e] >= 0, "moe_experts: negative count");
    starts.push_back(starts.back() + c[e]);
  }
  TORCH_CHECK(starts.back() == rows.size(0), "moe_experts: the counts must sum to the number of rows");
  const int64_t* q = pairs.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.size(0); ++r)
    TORCH_CHECK(0 <= q[r] && q[r] < num_out_rows, "moe_experts: pair index out of range");
  return starts;
}

}  // namespace

namespace llmserve_cpu {

void moe_experts(at::Tensor out, const at::Tensor& rows, const at::Tensor& counts, const at::Tensor& pairs,
                 const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                 const std::optional<at::Tensor>& gate_up_bias, const std::optional<at::Tensor>& down_bias,
                 bool use_avx512) {
  check_inputs(out, rows, counts, pairs, weights, gate_up, down);
  const std::vector<int64_t> starts = expert_starts(counts, rows, pairs, out.size(0));
  const int64_t num_experts = gate_up.size(0), h = gate_up.size(2), i = down.size(2);
  if (rows.size(0) == 0) return;
  at::Tensor act = at::empty({rows.size(0), i}, rows.options());
  const Problem p{rows.data_ptr<float>(), pairs.data_ptr<int64_t>(), weights.data_ptr<float>(),
                  gate_up.data_ptr<float>(), down.data_ptr<float>(),
                  bias_data(gate_up_bias, num_experts, 2 * i, "gate_up_bias"),
                  bias_data(down_bias, num_experts, h, "down_bias"), act.data_ptr<float>(), out.data_ptr<float>(),
                  h, i, down.size(1), gate_up.data_ptr<float>() + gate_up.numel(),
                  down.data_ptr<float>() + down.numel()};
#if defined(__AVX512F__)
  if (use_avx512)
    return run(p, starts, [](auto r, const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc,
                             const float* bias, bool first, const float* pf) {
      llmserve_cpu::f32_block_avx512<decltype(r)::value>(a, lda, b, kc, c, ldc, bias, first, pf);
    });
#endif
#if defined(__AVX2__) && defined(__FMA__)
  return run(p, starts, [](auto r, const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc,
                           const float* bias, bool first, const float* pf) {
    llmserve_cpu::f32_block_avx2<decltype(r)::value>(a, lda, b, kc, c, ldc, bias, first, pf);
  });
#else
  TORCH_CHECK(false, "moe_experts: built without AVX2 + FMA");
#endif
}

}  // namespace llmserve_cpu

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("moe_experts(Tensor(a!) out, Tensor rows, Tensor counts, Tensor pairs, Tensor weights, Tensor gate_up, "
        "Tensor down, Tensor? gate_up_bias, Tensor? down_bias, bool use_avx512) -> ()",
        &llmserve_cpu::moe_experts);
}
