// The sampler's draw over whole rows on CPU (sample/sampler.py's rows path, when not every row has a top-k): one op
// for temperature, softmax, top-p, min-p and the draw, with no sort and no noise over the vocabulary.
//
//   sample_rows  logits [B, V] float32 (scratch: overwritten) -> [B] int64. Each row: divided by its temperature,
//                exponentiated against its max (masked -inf tokens weigh 0), then drawn from the tokens with at
//                least min_p times the best one's weight, by inverse CDF on the row's uniforms [B, R], or, for a
//                row with race noise (a seeded row: its generator's U over the vocabulary, [B, V]), by the
//                exponential race argmin(p / log u) as the other paths draw. Top-p without a sort: the nucleus is
//                the tokens with less than top_p of the (top-k-masked) mass strictly above them, an upper set in
//                probability; a drawn token outside it means every token as likely or less is outside too, so
//                the draw runs again over the tokens above it. A round fails with probability at most 1 - top_p;
//                a row that fails all R rounds takes its best token (in every nucleus). Greedy rows are skipped.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "avx2_math.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// x [V] /= temperature (the same division as torch's div_), then x_j <- exp(x_j - max) (0 where -inf): the
// weights, the best one 1. Returns their sum (0 when every token is masked).
float exponentiate(float* x, int64_t n, float temperature) {
  float max = kNegInf;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 vmax = _mm256_set1_ps(kNegInf);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + j), t);
    _mm256_storeu_ps(x + j, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float lane : lanes) max = std::max(max, lane);
#endif
  for (; j < n; ++j) {
    x[j] /= temperature;
    max = std::max(max, x[j]);
  }
  if (max == kNegInf) return 0.f;
  float sum = 0.f;
  j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(max), neg_inf = _mm256_set1_ps(kNegInf);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, neg_inf, _CMP_EQ_OQ),
                                      llmserve_cpu::exp_nonpositive(_mm256_sub_ps(v, shift)));
    _mm256_storeu_ps(x + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; j < n; ++j) {
    x[j] = x[j] == kNegInf ? 0.f : std::exp(x[j] - max);
    sum += x[j];
  }
  return sum;
}

// The first heaviest token: in every nucleus, and what a row with no token left falls back to.
int64_t heaviest(const float* w, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 1; j < n; ++j)
    if (w[j] > w[best]) best = j;
  return best;
}

// A token the draw can take: heavier than the pivot `above`, at least min-p's `floor`, not masked.
inline bool is_drawable(float w, float above, float floor) { return w > above && w >= floor && w > 0.f; }

// The weight of the tokens strictly heavier than `above` and at least `floor`.
float mass_above(const float* w, int64_t n, float above, float floor) {
  float sum = 0.f;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 va = _mm256_set1_ps(above), vf = _mm256_set1_ps(floor);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(w + j);
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, va, _CMP_GT_OQ), _mm256_cmp_ps(v, vf, _CMP_GE_OQ));
    acc = _mm256_add_ps(acc, _mm256_and_ps(keep, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; j < n; ++j)
    if (w[j] > above && w[j] >= floor) sum += w[j];
  return sum;
}

// Inverse CDF over the tokens heavier than `above` and at least `floor` (their weight `total`): the first whose
// running sum passes u * total; the last such token where rounding leaves the target unreached.
int64_t draw_inverse_cdf(const float* w, int64_t n, float above, float floor, float total, float u) {
  const float target = u * total;
  float cum = 0.f;
  int64_t last = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (is_drawable(w[j], above, floor)) {
      cum += w[j];
      last = j;
      if (cum > target) return j;
    }
  }
  return last;
}

// The exponential race over the same tokens: argmin w / log(u), log(u) < 0; first index on ties.
int64_t draw_race(const float* w, int64_t n, float above, float floor, const float* noise) {
  int64_t best = -1;
  float best_score = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    if (!is_drawable(w[j], above, floor)) continue;
    const float score = w[j] / std::log(noise[j]);
    if (score < best_score) {
      best_score = score;
      best = j;
    }
  }
  return best;
}

struct RowParams {
  float temperature, top_p, min_p;
  const float* uniforms;  // [R]
  int64_t num_rounds;
  const float* race_noise;  // [V], or nullptr: inverse CDF
};

int64_t draw_row(float* x, int64_t n, const RowParams& p) {
  const float sum = exponentiate(x, n, p.temperature);  // x: weights now, the best one 1
  if (sum == 0.f) return 0;  // every token masked
  const float floor = p.min_p > 0.f ? p.min_p : 0.f;  // min-p against the best token's weight, 1
  float above = -1.f, total = floor > 0.f ? mass_above(x, n, -1.f, floor) : sum;
  for (int64_t round = 0; round < p.num_rounds; ++round) {
    const int64_t token = p.race_noise != nullptr ? draw_race(x, n, above, floor, p.race_noise)
                                                  : draw_inverse_cdf(x, n, above, floor, total, p.uniforms[round]);
    if (token < 0) return heaviest(x, n);
    if (p.top_p >= 1.f) return token;
    const float heavier = mass_above(x, n, x[token], 0.f);  // the nucleus is taken before min-p
    if (heavier < p.top_p * sum) return token;
    above = x[token];
    total = mass_above(x, n, above, floor);
  }
  return heaviest(x, n);
}

template <typename T>
const T* per_row(const std::optional<at::Tensor>& t, int64_t num_rows, at::ScalarType type, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == type && t->dim() == 1 && t->size(0) == num_rows && t->is_contiguous(),
              "sample_rows: ", name, " must be a contiguous [B] tensor");
  return t->data_ptr<T>();
}

at::Tensor sample_rows(at::Tensor logits, const at::Tensor& temperature, const std::optional<at::Tensor>& top_p,
                       const std::optional<at::Tensor>& min_p, const at::Tensor& uniforms,
                       const std::optional<at::Tensor>& race_noise, const std::optional<at::Tensor>& is_race,
                       const std::optional<at::Tensor>& is_greedy) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "sample_rows: logits must be contiguous float32 [B, V]");
  const int64_t num_rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.dim() == 2 && uniforms.size(0) == num_rows &&
                  uniforms.size(1) >= 1 && uniforms.is_contiguous(),
              "sample_rows: uniforms must be contiguous float32 [B, R]");
  TORCH_CHECK(race_noise.has_value() == is_race.has_value(), "sample_rows: race_noise and is_race go together");
  if (race_noise.has_value())
    TORCH_CHECK(race_noise->scalar_type() == at::kFloat && race_noise->sizes() == logits.sizes() &&
                    race_noise->is_contiguous(),
                "sample_rows: race_noise must be contiguous float32 [B, V]");
  const float* temp = per_row<float>(temperature, num_rows, at::kFloat, "temperature");
  const float* ps = per_row<float>(top_p, num_rows, at::kFloat, "top_p");
  const float* mins = per_row<float>(min_p, num_rows, at::kFloat, "min_p");
  const bool* races = per_row<bool>(is_race, num_rows, at::kBool, "is_race");
  const bool* greedy = per_row<bool>(is_greedy, num_rows, at::kBool, "is_greedy");
  at::Tensor out = at::empty({num_rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  float* x = logits.data_ptr<float>();
  const int64_t num_rounds = uniforms.size(1);
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (greedy != nullptr && greedy[r]) {
        ids[r] = 0;  // the caller takes the argmax
        continue;
      }
      const bool is_race_row = races != nullptr && races[r];
      const RowParams p{temp[r], ps ? ps[r] : 1.f, mins ? mins[r] : 0.f, uniforms.data_ptr<float>() + r * num_rounds,
                        num_rounds, is_race_row ? race_noise->data_ptr<float>() + r * n : nullptr};
      ids[r] = draw_row(x + r * n, n, p);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("sample_rows(Tensor(a!) logits, Tensor temperature, Tensor? top_p, Tensor? min_p, Tensor uniforms, "
        "Tensor? race_noise, Tensor? is_race, Tensor? is_greedy) -> Tensor",
        &sample_rows);
}
