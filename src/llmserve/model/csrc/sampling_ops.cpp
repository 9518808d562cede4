// The sampler's two heaviest CPU steps as one op each (JIT-built by llmserve/model/cpu_kernels.py; sample/ops.py
// calls them on CPU logits). Between two decode steps' weight streams the host runs with cold caches, where each
// ATen op costs tens of microseconds whatever its size; the torch versions are a dozen ops (penalties) and a
// partial sort of the whole row (top-k).
//
//   apply_penalties_  logits [B, V] float32 in place: for each penalised row, each distinct token it has seen (its
//                     prompt's with a repetition penalty, its outputs'), the same float32 arithmetic, in the same
//                     order, as sample/ops.py's torch version: x > 0 ? x / repetition : x * repetition (when the batch
//                     has prompt ids), then (x - frequency * count) - presence * (count > 0) (when it has output
//                     penalties), count the token's occurrences among the outputs. Ids equal to V are padding.
//   top_k_rows        logits [B, V] float32 -> (values, ids) [B, k], each row's k largest, descending; ties by the
//                     lower id, NaN above everything (as torch.topk ranks it). One pass over the row: eight values
//                     at a time are compared with the k-th best so far, and only a block holding a better one
//                     touches the heap.
//   sample_candidates each row's draw from its top-K candidates (sample/sampler.py's candidates path after the top-k,
//                     its noise drawn by torch): divided by the temperature; top-k, top-p and min-p masks as
//                     sample/ops.py applies them (ties with the k-th value kept; the best token always kept); a
//                     float32 softmax; the exponential race argmin(p / log u), first index on ties. Exact where torch's
//                     ops are (division, masks), within rounding of them in the softmax's exponentials.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// One row's penalties on its seen ids (prompt ids first, then outputs; V marks padding): `seen` is scratch.
// fp-contract off: x - frequency * count must round twice, as torch's separate ops do.
__attribute__((optimize("fp-contract=off"))) void penalise_row(
    float* x, int64_t vocab, const int64_t* prompt, int64_t num_prompt, const int64_t* output, int64_t num_output,
    float repetition, float frequency, float presence, bool has_repetition, bool has_output_penalties,
    std::vector<std::pair<int64_t, int>>& seen) {
  seen.clear();
  auto collect = [&](const int64_t* ids, int64_t n, int is_output) {
    for (int64_t j = 0; j < n; ++j) {
      if (ids[j] == vocab) continue;
      TORCH_CHECK(ids[j] >= 0 && ids[j] < vocab, "apply_penalties_: token id out of range");
      seen.emplace_back(ids[j], is_output);
    }
  };
  if (has_repetition) collect(prompt, num_prompt, 0);
  collect(output, num_output, 1);
  std::sort(seen.begin(), seen.end());
  for (size_t g = 0; g < seen.size();) {
    const int64_t id = seen[g].first;
    int count = 0;
    for (; g < seen.size() && seen[g].first == id; ++g) count += seen[g].second;
    float value = x[id];
    if (has_repetition) value = value > 0.f ? value / repetition : value * repetition;
    if (has_output_penalties) {
      const float c = static_cast<float>(count);
      const float by_frequency = frequency * c;
      const float by_presence = presence * (c > 0.f ? 1.f : 0.f);
      value = (value - by_frequency) - by_presence;
    }
    x[id] = value;
  }
}

void check_ids(const at::Tensor& ids, int64_t num_rows, const char* name) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == num_rows && ids.stride(1) == 1,
              "apply_penalties_: ", name, " must be int64 [P, L] with contiguous rows");
}

void check_per_row(const at::Tensor& t, at::ScalarType type, int64_t num_rows, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == 1 && t.size(0) == num_rows && t.is_contiguous(),
              "apply_penalties_: ", name, " must be a contiguous [P] tensor");
}

void apply_penalties_(at::Tensor logits, const at::Tensor& row_indices, const at::Tensor& repetition,
                      const at::Tensor& frequency, const at::Tensor& presence, const at::Tensor& output_ids,
                      const std::optional<at::Tensor>& prompt_ids, bool has_output_penalties) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_penalties_: logits must be float32 [B, V] with contiguous rows");
  const int64_t num_rows = row_indices.numel(), vocab = logits.size(1);
  check_per_row(row_indices, at::kLong, num_rows, "row_indices");
  check_per_row(repetition, at::kFloat, num_rows, "repetition");
  check_per_row(frequency, at::kFloat, num_rows, "frequency");
  check_per_row(presence, at::kFloat, num_rows, "presence");
  check_ids(output_ids, num_rows, "output_ids");
  const bool has_repetition = prompt_ids.has_value();
  if (has_repetition) check_ids(*prompt_ids, num_rows, "prompt_ids");
  const int64_t* rows = row_indices.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int>> seen;
  for (int64_t p = 0; p < num_rows; ++p) {
    TORCH_CHECK(rows[p] >= 0 && rows[p] < logits.size(0), "apply_penalties_: row index out of range");
    const int64_t* prompt = has_repetition ? prompt_ids->data_ptr<int64_t>() + p * prompt_ids->stride(0) : nullptr;
    penalise_row(logits.data_ptr<float>() + rows[p] * logits.stride(0), vocab, prompt,
                 has_repetition ? prompt_ids->size(1) : 0, output_ids.data_ptr<int64_t>() + p * output_ids.stride(0),
                 output_ids.size(1), repetition.data_ptr<float>()[p], frequency.data_ptr<float>()[p],
                 presence.data_ptr<float>()[p], has_repetition, has_output_penalties, seen);
  }
}

struct Entry {
  float value;
  int64_t id;
};

// a ranks above b: NaN first, then larger values, ties by the lower id.
inline bool ranks_above(const Entry& a, const Entry& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.id < b.id;
}

// The row's k best into values/ids, descending. `heap` is scratch: a heap whose top is the worst kept.
void top_k_row(const float* x, int64_t vocab, int64_t k, float* values, int64_t* ids, std::vector<Entry>& heap) {
  heap.clear();
  auto offer = [&](int64_t i) {
    const Entry e{x[i], i};
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end(), ranks_above);
    } else if (ranks_above(e, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), ranks_above);
      heap.back() = e;
      std::push_heap(heap.begin(), heap.end(), ranks_above);
    }
  };
  int64_t i = 0;
  for (; i < std::min(k, vocab); ++i) offer(i);
#if defined(__AVX2__)
  for (; i + 8 <= vocab; i += 8) {
    // a block can hold a better entry only where a value is above the worst kept, or unordered with it (NaN)
    const __m256 worst = _mm256_set1_ps(heap.front().value);
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), worst, _CMP_NLE_UQ)) == 0) continue;
    for (int64_t j = i; j < i + 8; ++j) offer(j);
  }
#endif
  for (; i < vocab; ++i) offer(i);
  std::sort_heap(heap.begin(), heap.end(), ranks_above);  // best first
  for (int64_t j = 0; j < k; ++j) {
    values[j] = heap[j].value;
    ids[j] = heap[j].id;
  }
}

std::tuple<at::Tensor, at::Tensor> top_k_rows(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "top_k_rows: logits must be float32 [B, V] with contiguous rows");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= vocab, "top_k_rows: k must be in [1, V]");
  at::Tensor values = at::empty({num_rows, k}, logits.options());
  at::Tensor ids = at::empty({num_rows, k}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* d = ids.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Entry> heap;
    heap.reserve(k);
    for (int64_t r = begin; r < end; ++r) top_k_row(x + r * stride, vocab, k, v + r * k, d + r * k, heap);
  });
  return {values, ids};
}

// x [K] -> p [K]: softmax, masked (-inf) entries 0.
void softmax(const float* x, int64_t n, float* p) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) max = std::max(max, x[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = x[j] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(x[j] - max);
    sum += p[j];
  }
  for (int64_t j = 0; j < n; ++j) p[j] /= sum;
}

struct CandidateParams {
  float temperature;
  int64_t top_k;  // <= 0: none
  float top_p;    // >= 1: none
  float min_p;    // <= 0: none
};

// One row: x [K] descending candidates' logits (scratch), ids [K], noise [K] in (0, 1) -> the drawn id.
int64_t draw_candidate(float* x, const int64_t* ids, const float* noise, int64_t n, const CandidateParams& c,
                       std::vector<float>& p) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) x[j] /= c.temperature;
  if (c.top_k > 0) {  // ranks below the k-th value (ties kept)
    const float kth = x[std::min(c.top_k, n) - 1];
    for (int64_t j = 0; j < n; ++j)
      if (x[j] < kth) x[j] = kNegInf;
  }
  p.resize(n);
  if (c.top_p < 1.f) {  // outside the nucleus: the tokens ranked above hold >= top_p
    softmax(x, n, p.data());
    float mass = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      mass += p[j];
      if (mass - p[j] >= c.top_p) x[j] = kNegInf;
    }
  }
  if (c.min_p > 0.f) {  // below min_p times the top probability
    softmax(x, n, p.data());
    const float threshold = *std::max_element(p.begin(), p.end()) * c.min_p;
    for (int64_t j = 0; j < n; ++j)
      if (p[j] < threshold) x[j] = kNegInf;
  }
  softmax(x, n, p.data());
  int64_t best = 0;
  float best_score = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {  // argmin p / log(u): log(u) < 0, masked tokens score -0.0
    const float score = p[j] / std::log(noise[j]);
    if (score < best_score) {
      best_score = score;
      best = j;
    }
  }
  return ids[best];
}

// A per-row parameter [B] (nullptr where the batch has none).
template <typename T>
const T* row_values(const std::optional<at::Tensor>& t, int64_t num_rows, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == c10::CppTypeToScalarType<T>::value && t->dim() == 1 && t->size(0) == num_rows &&
                  t->is_contiguous(),
              "sample_candidates: ", name, " must be a contiguous [B] tensor");
  return t->data_ptr<T>();
}

at::Tensor sample_candidates(const at::Tensor& cand_logits, const at::Tensor& cand_ids, const at::Tensor& noise,
                             const at::Tensor& temperature, const std::optional<at::Tensor>& top_k,
                             const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& min_p) {
  TORCH_CHECK(cand_logits.scalar_type() == at::kFloat && cand_logits.dim() == 2 && cand_logits.is_contiguous(),
              "sample_candidates: candidates' logits must be contiguous float32 [B, K]");
  const int64_t num_rows = cand_logits.size(0), n = cand_logits.size(1);
  TORCH_CHECK(cand_ids.scalar_type() == at::kLong && cand_ids.sizes() == cand_logits.sizes() && cand_ids.is_contiguous(),
              "sample_candidates: candidates' ids must be contiguous int64 [B, K]");
  TORCH_CHECK(noise.scalar_type() == at::kFloat && noise.sizes() == cand_logits.sizes() && noise.is_contiguous(),
              "sample_candidates: noise must be contiguous float32 [B, K]");
  TORCH_CHECK(n >= 1, "sample_candidates: no candidates");
  const float* temp = row_values<float>(temperature, num_rows, "temperature");
  const int64_t* ks = row_values<int64_t>(top_k, num_rows, "top_k");
  const float* ps = row_values<float>(top_p, num_rows, "top_p");
  const float* mins = row_values<float>(min_p, num_rows, "min_p");
  at::Tensor x = cand_logits.clone();
  at::Tensor out = at::empty({num_rows}, cand_ids.options());
  std::vector<float> p;
  for (int64_t r = 0; r < num_rows; ++r) {
    const CandidateParams c{temp[r], ks ? ks[r] : 0, ps ? ps[r] : 1.f, mins ? mins[r] : 0.f};
    out.data_ptr<int64_t>()[r] = draw_candidate(x.data_ptr<float>() + r * n, cand_ids.data_ptr<int64_t>() + r * n,
                                                noise.data_ptr<float>() + r * n, n, c, p);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("apply_penalties_(Tensor(a!) logits, Tensor row_indices, Tensor repetition, Tensor frequency, "
        "Tensor presence, Tensor output_ids, Tensor? prompt_ids, bool has_output_penalties) -> ()",
        &apply_penalties_);
  m.def("top_k_rows(Tensor logits, int k) -> (Tensor, Tensor)", &top_k_rows);
  m.def("sample_candidates(Tensor cand_logits, Tensor cand_ids, Tensor noise, Tensor temperature, Tensor? top_k, "
        "Tensor? top_p, Tensor? min_p) -> Tensor", &sample_candidates);
}
