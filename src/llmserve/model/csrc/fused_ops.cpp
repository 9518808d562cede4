// Fused elementwise ops of a float32 decoder layer on CPU (JIT-built by llmserve/model/cpu_kernels.py).
//
// Each replaces a chain of torch ops (one dispatch, one pass over memory instead of several, and rows
// split over ATen's threads only when there is enough work for them):
//   rms_norm      out = w * (x * rsqrt(mean(x^2) + eps))                      (HF's order of operations)
//   add_rms_norm  residual += x; x = w * (residual * rsqrt(mean(residual^2) + eps))       (both in place)
//   silu_mul      out = silu(gate_up[:, :I]) * gate_up[:, I:]
//   rotary        neox rotary in place over qk [T, heads, D] (a strided view), cos/sin [T, 1, D/2]
//   write_kv      k, v [T, Hkv, D] (strided views) into the paged cache [2, N, bs, Hkv, D] at slot_mapping
// Each row is computed the same way whatever the number of rows: outputs do not depend on the batch.
// float32, or bfloat16 throughout (csrc/fused_ops_bf16.cpp, rounding where transformers' bf16 chains do), except
// write_kv, which takes float32 k/v, or bfloat16 ones into a bfloat16 cache: the cache may be float32, float16 (a float32 model's fp16 KV cache) or int8
// [2, N, bs, Hkv, D + 4] (--kv-cache-dtype int8): each kv head's row quantized symmetrically, scale =
// max|x| / 127, then its D int8 values and the float32 scale.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "avx2_math.h"
#include "fused_ops_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // rows go to other threads only in chunks of this much work

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

void check_rows(const at::Tensor& t, int64_t rows, int64_t cols, const char* what,
                at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols &&
                  t.is_contiguous(),
              what, ": expected a contiguous ", dtype == at::kFloat ? "float32" : "bfloat16", " [", rows, ", ", cols,
              "] tensor");
}

// A contiguous vector of n elements ([n] or any shape of n elements): the norms' weights, a row's cos/sin. Checked
// without a view (a view of a parameter costs autograd metadata, at every layer of a decode step).
void check_vector(const at::Tensor& t, int64_t n, const char* what, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == n && t.is_contiguous(), what, ": expected a contiguous ",
              dtype == at::kFloat ? "float32" : "bfloat16", " tensor of ", n, " elements");
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// out[i] = w[i] * (x[i] * r) with r = 1 / sqrt(mean(x^2) + eps)
inline void norm_row(float* __restrict out, const float* __restrict x, const float* __restrict w, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// k or v rows (float32; bfloat16 for a bfloat16 cache, copied as they are) into the cache's slots
template <typename C>
void store_rows(C* cache, const int64_t* slots, const at::Tensor& src, int64_t rows, int64_t heads, int64_t d) {
  using Src = std::conditional_t<std::is_same_v<C, c10::BFloat16>, c10::BFloat16, float>;
  const Src* x = ptr<Src>(src);
  const int64_t st = src.stride(0), sh = src.stride(1);
  for (int64_t t = 0; t < rows; ++t) {
    C* dst = cache + slots[t] * heads * d;
    for (int64_t h = 0; h < heads; ++h) {
      const Src* row = x + t * st + h * sh;
      if constexpr (std::is_same_v<C, Src>) {
        std::memcpy(dst + h * d, row, d * sizeof(C));
      } else {
        for (int64_t i = 0; i < d; ++i) dst[h * d + i] = static_cast<C>(row[i]);  // round to nearest even
      }
    }
  }
}

// int8 rows of width d + 4: round(x / scale) with scale = max|x| / 127 (1 for an all-zero row), then the scale
void store_rows_int8(int8_t* cache, const int64_t* slots, const at::Tensor& src, int64_t rows, int64_t heads,
                     int64_t d) {
  const float* x = src.data_ptr<float>();
  const int64_t st = src.stride(0), sh = src.stride(1), width = d + 4;
  for (int64_t t = 0; t < rows; ++t) {
    int8_t* dst = cache + slots[t] * heads * width;
    for (int64_t h = 0; h < heads; ++h) {
      const float* row = x + t * st + h * sh;
      float absmax = 0.f;
      for (int64_t i = 0; i < d; ++i) absmax = std::max(absmax, std::fabs(row[i]));
      const float scale = absmax > 0.f ? absmax / 127.f : 1.f;
      int8_t* out = dst + h * width;
      for (int64_t i = 0; i < d; ++i) {
        out[i] = static_cast<int8_t>(std::clamp(std::nearbyint(row[i] / scale), -127.f, 127.f));
      }
      std::memcpy(out + d, &scale, sizeof(scale));
    }
  }
}

}  // namespace

namespace llmserve_cpu {

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const at::ScalarType dtype = x.scalar_type();
  check_rows(x, rows, n, "rms_norm x", dtype);
  check_rows(out, rows, n, "rms_norm out", dtype);
  check_vector(weight, n, "rms_norm weight", dtype);
  if (is_bf16(x))
    return llmserve_cpu::rms_norm_bf16(ptr<c10::BFloat16>(out), ptr<c10::BFloat16>(x), ptr<c10::BFloat16>(weight),
                                       rows, n, static_cast<float>(eps));
  float *o = out.data_ptr<float>(), *w = weight.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(o + t * n, xs + t * n, w, n, static_cast<float>(eps));
  });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const at::ScalarType dtype = x.scalar_type();
  check_rows(x, rows, n, "add_rms_norm x", dtype);
  check_rows(residual, rows, n, "add_rms_norm residual", dtype);
  check_vector(weight, n, "add_rms_norm weight", dtype);
  if (is_bf16(x))
    return llmserve_cpu::add_rms_norm_bf16(ptr<c10::BFloat16>(x), ptr<c10::BFloat16>(residual),
                                           ptr<c10::BFloat16>(weight), rows, n, static_cast<float>(eps));
  float *xs = x.data_ptr<float>(), *res = residual.data_ptr<float>(), *w = weight.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float *xr = xs + t * n, *rr = res + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] = xr[i] + rr[i];
      norm_row(xr, rr, w, n, static_cast<float>(eps));
    }
  });
}

void silu_mul(at::Tensor out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), n = out.size(1);
  const at::ScalarType dtype = gate_up.scalar_type();
  check_rows(gate_up, rows, 2 * n, "silu_mul gate_up", dtype);
  check_rows(out, rows, n, "silu_mul out", dtype);
  if (is_bf16(gate_up))
    return llmserve_cpu::silu_mul_bf16(ptr<c10::BFloat16>(out), ptr<c10::BFloat16>(gate_up), rows, n);
  float* o = out.data_ptr<float>();
  const float* gu = gate_up.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(o + t * n, gu + t * 2 * n, gu + t * 2 * n + n, n);
  });
}

void rotary(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK((qk.scalar_type() == at::kFloat || is_bf16(qk)) && qk.dim() == 3 && qk.stride(2) == 1,
              "rotary: float32 or bfloat16 [T, heads, D]");
  const int64_t rows = qk.size(0), heads = qk.size(1), half = qk.size(2) / 2;
  TORCH_CHECK(qk.size(2) % 2 == 0, "rotary: head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin}) {
    check_vector(*t, rows * half, "rotary cos/sin", qk.scalar_type());
    TORCH_CHECK(t->dim() >= 1 && t->size(0) == rows, "rotary: cos/sin [T, 1, D/2]");
  }
  if (is_bf16(qk))
    return llmserve_cpu::rotary_bf16(ptr<c10::BFloat16>(qk), ptr<c10::BFloat16>(cos), ptr<c10::BFloat16>(sin), rows,
                                     heads, half, qk.stride(0), qk.stride(1));
  float* base = qk.data_ptr<float>();
  const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  const int64_t st = qk.stride(0), sh = qk.stride(1);
  at::parallel_for(0, rows, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cs + t * half, *s = sn + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float *x1 = base + t * st + h * sh, *x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

void write_kv(at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), "write_kv: cache [2, N, bs, Hkv, D]");
  const bool is_int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t rows = k.size(0), heads = kv_cache.size(3), d = kv_cache.size(4) - (is_int8 ? 4 : 0);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const at::ScalarType src_dtype = is_bf16(kv_cache) ? at::kBFloat16 : at::kFloat;
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == src_dtype && t->dim() == 3 && t->size(0) == rows && t->size(1) == heads &&
                    t->size(2) == d && t->stride(2) == 1,
                "write_kv: k/v must be float32 (bfloat16 into a bfloat16 cache) [T, Hkv, D] with a contiguous last dim");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == rows && slot_mapping.is_contiguous(),
              "write_kv: slot_mapping int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot out of range");
  const int64_t half = kv_cache.stride(0);
  switch (kv_cache.scalar_type()) {
    case at::kFloat: {
      float* c = kv_cache.data_ptr<float>();
      store_rows(c, slots, k, rows, heads, d);
      return store_rows(c + half, slots, v, rows, heads, d);
    }
    case at::kHalf: {
      c10::Half* c = kv_cache.data_ptr<c10::Half>();
      store_rows(c, slots, k, rows, heads, d);
      return store_rows(c + half, slots, v, rows, heads, d);
    }
    case at::kBFloat16: {
      c10::BFloat16* c = kv_cache.data_ptr<c10::BFloat16>();
      store_rows(c, slots, k, rows, heads, d);
      return store_rows(c + half, slots, v, rows, heads, d);
    }
    case at::kChar: {
      int8_t* c = kv_cache.data_ptr<int8_t>();
      store_rows_int8(c, slots, k, rows, heads, d);
      return store_rows_int8(c + half, slots, v, rows, heads, d);
    }
    default: TORCH_CHECK(false, "write_kv: the cache must be float32, float16, bfloat16 or int8");
  }
}

}  // namespace llmserve_cpu

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()", &llmserve_cpu::rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &llmserve_cpu::add_rms_norm);
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()", &llmserve_cpu::silu_mul);
  m.def("rotary(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()", &llmserve_cpu::rotary);
  m.def("write_kv(Tensor(a!) kv_cache, Tensor slot_mapping, Tensor k, Tensor v) -> ()", &llmserve_cpu::write_kv);
}
