// The decoder's elementwise work on CPUs, one call each: residual add + RMSNorm, q/k
// RMSNorm + rotary, SiLU x up (layers/cpu_fused.py; the same three as the Triton
// kernels in layers/triton_fused.py, with the same rounding).
//
// Why: unfused, a layer runs some 35 small torch ops besides its matmuls and attention,
// and on a small model each one's dispatch costs more than its arithmetic (SmolLM2-135M
// decoded ~40% slower eagerly than compiled).  These give the eager model the fusion
// torch.compile gives, without importing dynamo and inductor (with the layers' direct
// calls, models/llama.py, a server starts without compiling: docs/architecture.md).
//
// Each kernel rounds to the tensor's dtype where the torch ops it replaces round (after
// the add, after the normalisation, after each product), so it differs from them only
// in the order of a row's sum of squares and in the last bits of exp (SiLU).  Rows run
// in parallel only when there are enough of them: a decode step's single row stays on
// the calling thread (no OpenMP region to wake).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

namespace {

// Elements one thread handles before a second one is worth waking.
constexpr int64_t kGrainElements = 32768;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)); }

// Conversions the compiler vectorises (c10's are written for one value at a time).
// bfloat16: the high half of a float, rounded to nearest even, NaN kept a NaN, exactly
// as c10::BFloat16 rounds; float16 goes through c10::Half.
template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }
template <>
inline float to_f(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }
template <>
inline c10::BFloat16 from_f(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

template <typename T>
inline float round_to(float v) { return to_f(from_f<T>(v)); }

// exp(x) in plain arithmetic the compiler vectorises (libm's expf is a call per element):
// 2^k * p(r) with x = k ln2 + r, |r| <= ln2/2, p a degree-6 polynomial (Cephes' expf
// coefficients); within 2 ulp of expf, and the result is rounded to 16 bits anyway.
inline float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // k = round(x / ln2) by the 1.5 * 2^23 trick (std::floor keeps GCC from vectorising)
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
float inv_rms(const T* x, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += to_f(x[i]) * to_f(x[i]);
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

template <typename T>
void rms_rows(const T* x, int64_t sx, const T* r, int64_t sr, const T* w, T* out, T* rout, int64_t rows,
              int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * sx;
      T* o = out + row * n;
      if (r != nullptr) {  // the new residual x + r, rounded, is what gets normalised
        const T* rr = r + row * sr;
        T* ro = rout + row * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) ro[i] = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
        xr = ro;
      }
      const float inv = inv_rms(xr, n, eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(xr[i]) * inv));
    }
  });
}

template <typename T>
void norm_rope_rows(const T* qkv, int64_t stride, const T* cos, const T* sin, int64_t stride_c, const T* qw,
                    const T* kw, T* q, T* k, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                    int64_t rot, float eps) {
  const int64_t all = heads + kv_heads, half = rot / 2;
  at::parallel_for(0, tokens * all, grain_rows(d), [&](int64_t begin, int64_t end) {
    float buf[1024];  // one head, normalised (head_dim <= 1024, checked by the caller)
    for (int64_t job = begin; job < end; ++job) {
      const int64_t t = job / all, h = job % all;
      const T* src = qkv + t * stride + h * d;
      const bool is_q = h < heads;
      T* dst = is_q ? q + (t * heads + h) * d : k + (t * kv_heads + h - heads) * d;
      const T* w = is_q ? qw : kw;
      if (w != nullptr) {
        const float inv = inv_rms(src, d, eps);
        for (int64_t i = 0; i < d; ++i) buf[i] = round_to<T>(to_f(w[i]) * round_to<T>(to_f(src[i]) * inv));
      } else {
        for (int64_t i = 0; i < d; ++i) buf[i] = to_f(src[i]);
      }
      const T* c = cos + t * stride_c;
      const T* s = sin + t * stride_c;
      for (int64_t i = 0; i < rot; ++i) {
        const float swapped = buf[i < half ? i + half : i - half];
        dst[i] = from_f<T>(round_to<T>(buf[i] * to_f(c[i])) + round_to<T>(swapped * to_f(s[i])));
      }
      for (int64_t i = rot; i < d; ++i) dst[i] = from_f<T>(buf[i]);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, int64_t sx, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* g = x + row * sx;
      const T* u = g + n;
      T* o = out + row * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float gate = to_f(g[i]);
        o[i] = from_f<T>(round_to<T>(gate / (1.0f + vexp(-gate))) * to_f(u[i]));
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be [rows, width] with unit column stride");
}

#define DISPATCH_16BIT(dtype, ...)                                                        \
  if ((dtype) == at::kBFloat16) {                                                         \
    using scalar_t = c10::BFloat16;                                                       \
    __VA_ARGS__();                                                                        \
  } else if ((dtype) == at::kHalf) {                                                      \
    using scalar_t = c10::Half;                                                           \
    __VA_ARGS__();                                                                        \
  } else {                                                                                \
    TORCH_CHECK(false, "the fused CPU kernels take bfloat16 or float16, not ", (dtype)); \
  }

// x [rows, n]; with residual: (norm(x + residual), x + residual), else (norm(x), undefined).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [", n, "] of x's dtype");
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor new_residual;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x's shape and dtype");
    new_residual = at::empty({rows, n}, x.options());
  }
  DISPATCH_16BIT(x.scalar_type(), [&] {
    const scalar_t* r = residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* ro = residual.has_value() ? new_residual.data_ptr<scalar_t>() : nullptr;
    rms_rows<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0), r, residual.has_value() ? residual->stride(0) : 0,
                       weight.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), ro, rows, n,
                       static_cast<float>(eps));
  });
  return {out, new_residual};
}

// qkv [T, (H + 2 KVH) * D] -> rotated q [T, H, D], k [T, KVH, D]; cos, sin [T, (1,) R] (signed sin).
std::tuple<at::Tensor, at::Tensor> norm_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                             int64_t heads, int64_t kv_heads, int64_t d, int64_t rot,
                                             const std::optional<at::Tensor>& q_weight,
                                             const std::optional<at::Tensor>& k_weight, double eps) {
  check_rows(qkv, "qkv");
  const int64_t t = qkv.size(0);
  TORCH_CHECK(d <= 1024 && rot <= d && rot % 2 == 0, "head_dim ", d, " (at most 1024) and rotary_dim ", rot,
              " (even, at most head_dim)");
  TORCH_CHECK(qkv.size(1) >= (heads + kv_heads) * d, "qkv is narrower than its q and k heads");
  // [T, rotary_dim] rows, or [T, 1, rotary_dim] as RotaryEmbedding.cos_sin gives them
  for (const at::Tensor* c : {&cos, &sin}) {
    TORCH_CHECK(c->device().is_cpu() && c->dim() >= 2 && c->size(0) == t && c->numel() == t * rot &&
                    c->size(-1) == rot && c->stride(-1) == 1 && c->stride(0) == cos.stride(0),
                "cos and sin must be [T, rotary_dim] rows (or [T, 1, rotary_dim]) with the same strides");
  }
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos and sin must have qkv's dtype");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "q and k norm weights come together");
  if (q_weight.has_value()) {
    TORCH_CHECK(q_weight->is_contiguous() && k_weight->is_contiguous() && q_weight->numel() == d &&
                    k_weight->numel() == d && q_weight->scalar_type() == qkv.scalar_type() &&
                    k_weight->scalar_type() == qkv.scalar_type(),
                "norm weights must be contiguous [head_dim] of qkv's dtype");
  }
  at::Tensor q = at::empty({t, heads, d}, qkv.options());
  at::Tensor k = at::empty({t, kv_heads, d}, qkv.options());
  DISPATCH_16BIT(qkv.scalar_type(), [&] {
    const scalar_t* qw = q_weight.has_value() ? q_weight->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* kw = k_weight.has_value() ? k_weight->const_data_ptr<scalar_t>() : nullptr;
    norm_rope_rows<scalar_t>(qkv.const_data_ptr<scalar_t>(), qkv.stride(0), cos.const_data_ptr<scalar_t>(),
                             sin.const_data_ptr<scalar_t>(), cos.stride(0), qw, kw, q.data_ptr<scalar_t>(),
                             k.data_ptr<scalar_t>(), t, heads, kv_heads, d, rot, static_cast<float>(eps));
  });
  return {q, k};
}

// x [rows, 2n] (gate | up) -> silu(gate) * up [rows, n].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's width must be even (gate | up)");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  DISPATCH_16BIT(x.scalar_type(), [&] {
    silu_mul_rows<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), rows, n);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil);
  m.def("norm_rope", &norm_rope, nogil);
  m.def("silu_and_mul", &silu_and_mul, nogil);
}
