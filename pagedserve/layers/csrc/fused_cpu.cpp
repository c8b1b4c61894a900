// The decoder's elementwise work on CPUs, one call each: residual add + RMSNorm, q/k
// RMSNorm + rotary, SiLU x up (layers/cpu_fused.py; the same three as the Triton
// kernels in layers/triton_fused.py, with the same rounding), and Gemma's: its RMSNorm
// (a (1 + weight) scale in float32, with the residual add after it) and GELU-tanh x up.
// float32, bfloat16 and float16 tensors: float32 is the default dtype on CPUs without
// native bf16 (AVX2 machines), where these and the layers' direct calls let a model
// start without torch.compile.
//
// Why: unfused, a layer runs some 35 small torch ops besides its matmuls and attention,
// and on a small model each one's dispatch costs more than its arithmetic (SmolLM2-135M
// decoded ~40% slower eagerly than compiled).  These give the eager model the fusion
// torch.compile gives, without importing dynamo and inductor (with the layers' direct
// calls, models/llama.py, a server starts without compiling: docs/architecture.md).
//
// Each kernel rounds to the tensor's dtype where the torch ops it replaces round (after
// the add, after the normalisation, after each product), so it differs from them only
// in the order of a row's sum of squares and in the last bits of exp (SiLU, GELU).  In
// float32 rounding is a no-op, so what keeps a float32 product and sum apart is that
// this file builds with -ffp-contract=off (cpu_fused.py): a*b + c*d contracted to one
// FMA would round once where torch rounds twice (rotary would differ in its last bit).
// FMAs appear only where we ask for them (madd: exp's polynomial).  It also builds with
// -fno-trapping-math, without which GCC leaves a loop with exp's clamps unvectorised
// (results are the same; only floating-point exception flags could differ).  The loops are
// plain C++ with `omp simd`: -march=native turns them into AVX-512, AVX2/FMA or SSE code
// at build time, whatever the machine has.  Rows run in parallel only when there are
// enough of them: a decode step's single row stays on the calling thread (no OpenMP
// region to wake).

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
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
#include <string>
#include <tuple>
#include <vector>

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

// a * b + c, one rounding where the CPU has FMA (the file builds without contraction).
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// exp(x) in plain arithmetic the compiler vectorises (libm's expf is a call per element):
// 2^k * p(r) with x = k ln2 + r, |r| <= ln2/2, p a degree-6 polynomial (Cephes' expf
// coefficients); within 2 ulp of expf, and the result is rounded to 16 bits anyway.
inline float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // k = round(x / ln2) by the 1.5 * 2^23 trick (std::floor keeps GCC from vectorising)
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = madd(k, 2.12194440e-4f, madd(k, -0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = madd(p, r, 1.3981999507e-3f);
  p = madd(p, r, 8.3334519073e-3f);
  p = madd(p, r, 4.1665795894e-2f);
  p = madd(p, r, 1.6666665459e-1f);
  p = madd(p, r, 5.0000001201e-1f);
  p = madd(p * r, r, r) + 1.0f;
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

// One element of a normalised row (x / rms(x), in float32) scaled, before its last
// rounding.  Llama's RMSNorm rounds x / rms(x) to the dtype and then scales by the
// weight; Gemma's scales by (1 + weight) in float32 and rounds once (HF's orders).
template <typename T, bool kGemma>
inline float scale_norm(float normed, T w) {
  if constexpr (kGemma) {
    return normed * (1.0f + to_f(w));
  } else {
    return to_f(w) * round_to<T>(normed);
  }
}

// Llama's: out = norm(x), or with r: out = norm(x + r) and rout = x + r.
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
      for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(scale_norm<T, false>(to_f(xr[i]) * inv, w[i]));
    }
  });
}

// Gemma's: out = norm(x), or with r: out = r + norm(x) (its norms follow a sub-block, and
// the residual add follows the norm; the norm rounds to the dtype before the add).
template <typename T>
void gemma_rms_rows(const T* x, int64_t sx, const T* r, int64_t sr, const T* w, T* out, int64_t rows, int64_t n,
                    float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * sx;
      T* o = out + row * n;
      const float inv = inv_rms(xr, n, eps);
      if (r == nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(scale_norm<T, true>(to_f(xr[i]) * inv, w[i]));
      } else {
        const T* rr = r + row * sr;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i)
          o[i] = from_f<T>(to_f(rr[i]) + round_to<T>(scale_norm<T, true>(to_f(xr[i]) * inv, w[i])));
      }
    }
  });
}

// One head normalised into buf, rounded to T as the norm module's output is.
template <typename T, bool kGemma>
void norm_head(const T* src, const T* w, int64_t d, float eps, float* buf) {
  const float inv = inv_rms(src, d, eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) buf[i] = round_to<T>(scale_norm<T, kGemma>(to_f(src[i]) * inv, w[i]));
}

// dst[i] = x[i] * c[i] + other[i] * s[i], each product rounded to T and then the sum
// (RotaryEmbedding.rotate: `other` is the head's other half, `s` the signed sin).
template <typename T>
void rotate_half_into(T* dst, const float* x, const float* other, const T* c, const T* s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    dst[i] = from_f<T>(round_to<T>(x[i] * to_f(c[i])) + round_to<T>(other[i] * to_f(s[i])));
}

template <typename T>
void norm_rope_rows(const T* qkv, int64_t stride, const T* cos, const T* sin, int64_t stride_c, const T* qw,
                    const T* kw, bool gemma, T* q, T* k, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
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
      if (w == nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) buf[i] = to_f(src[i]);
      } else if (gemma) {
        norm_head<T, true>(src, w, d, eps, buf);
      } else {
        norm_head<T, false>(src, w, d, eps, buf);
      }
      const T* c = cos + t * stride_c;
      const T* s = sin + t * stride_c;
      rotate_half_into(dst, buf, buf + half, c, s, half);
      rotate_half_into(dst + half, buf + half, buf, c + half, s + half, half);
#pragma omp simd
      for (int64_t i = rot; i < d; ++i) dst[i] = from_f<T>(buf[i]);
    }
  });
}

// The gates: act(g) in float32, rounded to T (where the torch op rounds), times up.
struct Silu {
  static float apply(float g) { return g / (1.0f + vexp(-g)); }
};
// GELU's tanh approximation in torch's order, 0.5 g (1 + tanh(u)) with u = sqrt(2/pi)
// (g + 0.044715 g^3), and tanh(u) = (e - 1) / (e + 1), e = exp(2u): one exp, and an
// absolute error about half float32's spacing at 1, so 1 + tanh(u) mostly rounds as
// torch's does (exp is clamped: e stays finite, and e - 1 is exact near e = 1).
struct GeluTanh {
  static float apply(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    const float e = vexp(2.0f * u);
    return 0.5f * g * (1.0f + (e - 1.0f) / (e + 1.0f));
  }
};

template <typename T, typename Act>
void gated_rows(const T* x, int64_t sx, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* g = x + row * sx;
      const T* u = g + n;
      T* o = out + row * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(round_to<T>(Act::apply(to_f(g[i]))) * to_f(u[i]));
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be [rows, width] with unit column stride");
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [", x.size(1), "] of x's dtype");
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x's shape and dtype");
  }
}

#define DISPATCH_FLOATS(dtype, ...)                                                                 \
  if ((dtype) == at::kFloat) {                                                                      \
    using scalar_t = float;                                                                         \
    __VA_ARGS__();                                                                                  \
  } else if ((dtype) == at::kBFloat16) {                                                            \
    using scalar_t = c10::BFloat16;                                                                 \
    __VA_ARGS__();                                                                                  \
  } else if ((dtype) == at::kHalf) {                                                                \
    using scalar_t = c10::Half;                                                                     \
    __VA_ARGS__();                                                                                  \
  } else {                                                                                          \
    TORCH_CHECK(false, "the fused CPU kernels take float32, bfloat16 or float16, not ", (dtype)); \
  }

// x [rows, n]; with residual: (norm(x + residual), x + residual), else (norm(x), undefined).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  check_norm_args(x, weight, residual);
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor new_residual;
  if (residual.has_value()) new_residual = at::empty({rows, n}, x.options());
  DISPATCH_FLOATS(x.scalar_type(), [&] {
    const scalar_t* r = residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* ro = residual.has_value() ? new_residual.data_ptr<scalar_t>() : nullptr;
    rms_rows<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0), r, residual.has_value() ? residual->stride(0) : 0,
                       weight.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), ro, rows, n,
                       static_cast<float>(eps));
  });
  return {out, new_residual};
}

// Gemma's norm of x [rows, n] (scale 1 + weight); with residual: residual + norm(x).
at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                          const std::optional<at::Tensor>& residual) {
  check_norm_args(x, weight, residual);
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  DISPATCH_FLOATS(x.scalar_type(), [&] {
    const scalar_t* r = residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr;
    gemma_rms_rows<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0), r,
                             residual.has_value() ? residual->stride(0) : 0, weight.const_data_ptr<scalar_t>(),
                             out.data_ptr<scalar_t>(), rows, n, static_cast<float>(eps));
  });
  return out;
}

void check_rope_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t kv_heads, int64_t d, int64_t rot, const std::optional<at::Tensor>& q_weight,
                     const std::optional<at::Tensor>& k_weight) {
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
}

// qkv [T, (H + 2 KVH) * D] -> rotated q [T, H, D], k [T, KVH, D]; cos, sin [T, (1,) R] (signed sin).
// With norm weights each head is first RMS-normalised, Gemma's way where `gemma` says so.
std::tuple<at::Tensor, at::Tensor> norm_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                             int64_t heads, int64_t kv_heads, int64_t d, int64_t rot,
                                             const std::optional<at::Tensor>& q_weight,
                                             const std::optional<at::Tensor>& k_weight, double eps, bool gemma) {
  check_rope_args(qkv, cos, sin, heads, kv_heads, d, rot, q_weight, k_weight);
  const int64_t t = qkv.size(0);
  at::Tensor q = at::empty({t, heads, d}, qkv.options());
  at::Tensor k = at::empty({t, kv_heads, d}, qkv.options());
  DISPATCH_FLOATS(qkv.scalar_type(), [&] {
    const scalar_t* qw = q_weight.has_value() ? q_weight->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* kw = k_weight.has_value() ? k_weight->const_data_ptr<scalar_t>() : nullptr;
    norm_rope_rows<scalar_t>(qkv.const_data_ptr<scalar_t>(), qkv.stride(0), cos.const_data_ptr<scalar_t>(),
                             sin.const_data_ptr<scalar_t>(), cos.stride(0), qw, kw, gemma, q.data_ptr<scalar_t>(),
                             k.data_ptr<scalar_t>(), t, heads, kv_heads, d, rot, static_cast<float>(eps));
  });
  return {q, k};
}

// x [rows, 2n] (gate | up) -> act(gate) * up [rows, n].
template <typename Act>
at::Tensor gated(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's width must be even (gate | up)");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  DISPATCH_FLOATS(x.scalar_type(), [&] {
    gated_rows<scalar_t, Act>(x.const_data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), rows, n);
  });
  return out;
}

// ---------------------------------------------------------------------------------
// A row of logits' two reductions (layers/vocab_reduce.py): its maximum and the first
// index holding it, and the indices of its k largest values.  torch's max(-1) and
// topk(k) walk a CPU row one scalar at a time, and the blocked torch version they had
// here took ~10 small ops (~80 us for one row of SmolLM2's 49,152 logits on a 2-core
// Zen 2, most of it dispatch): here each is one pass of vector compares over the row,
// chunk by chunk, looking inside a chunk only when it can hold the answer.  NaN is the
// largest value, as torch ranks it; comparisons only, so the answers are torch's.

constexpr int64_t kScanChunk = 64;  // elements per vector test before a scalar look inside
constexpr int64_t kMaxTopK = 64;    // the largest k row_topk keeps on the stack

// Whether any of x[0, n) is not <= t (greater, or NaN).  (An int, not a bool: GCC leaves
// a bool || reduction scalar.)
inline bool any_above(const float* x, int64_t n, float t) {
  int any = 0;
#pragma omp simd reduction(| : any)
  for (int64_t i = 0; i < n; ++i) any |= !(x[i] <= t);
  return any != 0;
}

// The first index of x[0, n) holding its maximum, NaN counting as the maximum.
int64_t first_max(const float* x, int64_t n) {
  int64_t at = 0;
  float best = x[0];
  if (best != best) return 0;
  for (int64_t c = 0; c < n; c += kScanChunk) {
    const int64_t e = std::min(n, c + kScanChunk);
    if (!any_above(x + c, e - c, best)) continue;
    for (int64_t i = c; i < e; ++i) {
      if (x[i] != x[i]) return i;
      if (x[i] > best) best = x[i], at = i;
    }
  }
  return at;
}

// k distinct indices of x[0, n)'s k largest values (k <= n, k <= kMaxTopK), in no order.
void topk_row(const float* x, int64_t n, int64_t k, int64_t* out) {
  float keys[kMaxTopK];  // the kept values, NaN as +inf (so a NaN is never displaced)
  auto key = [](float v) { return v != v ? INFINITY : v; };
  for (int64_t j = 0; j < k; ++j) keys[j] = key(x[j]), out[j] = j;
  int64_t low = std::min_element(keys, keys + k) - keys;  // the kept value to beat
  for (int64_t c = k; c < n; c += kScanChunk) {
    const int64_t e = std::min(n, c + kScanChunk);
    if (!any_above(x + c, e - c, keys[low])) continue;
    for (int64_t i = c; i < e; ++i) {
      const float v = key(x[i]);
      if (v > keys[low]) {
        keys[low] = v, out[low] = i;
        low = std::min_element(keys, keys + k) - keys;
      }
    }
  }
}

void check_logit_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, not ", x.scalar_type());
  TORCH_CHECK(x.size(1) > 0, "x's rows must not be empty");
}

// x [rows, n] -> (each row's maximum, the first index holding it), as x.max(-1).
std::tuple<at::Tensor, at::Tensor> row_max(const at::Tensor& x) {
  check_logit_rows(x);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor values = at::empty({rows}, x.options());
  at::Tensor indices = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.const_data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* ix = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      ix[r] = first_max(src + r * stride, n);
      v[r] = src[r * stride + ix[r]];
    }
  });
  return {values, indices};
}

// x [rows, n] -> [rows, k] indices of each row's k largest values, in no order (as
// x.topk(k).indices up to order, and which of equal values at the k-th place).
at::Tensor row_topk(const at::Tensor& x, int64_t k) {
  check_logit_rows(x);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(k >= 1 && k <= n && k <= kMaxTopK, "k must be in [1, min(width, ", kMaxTopK, ")], got ", k);
  at::Tensor out = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* src = x.const_data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) topk_row(src + r * stride, n, k, dst + r * k);
  });
  return out;
}

// ---------------------------------------------------------------------------------
// DecodeStack: a Llama-family model's decoder layers for one all-decode step, as one
// call (layers/decode_stack.py).  Each layer makes exactly the calls the Python direct
// path makes (LlamaDecoderLayer.bind_direct), in its order, so outputs are bitwise the
// same; what goes is Python between the calls: ~40 us a layer, a fifth of SmolLM2-135M's
// decode step (Zen 5, AVX-512 with native bf16).  The quantized projections and the
// attention live in their own extensions (quant_linear.cpp, paged_decode.cpp) and are
// called through torch's dispatcher, by the operator names those builds register.

// A bias-free quantized projection as quant_linear's operators take it
// (QuantizedWeight.kernel_args): one segment takes `linear1`, several `linear`.
struct Projection {
  std::vector<at::Tensor> codes, d, aux;
  std::vector<int64_t> kinds, ns, offsets;
  int64_t n, k, bits;
};

struct StackLayer {
  at::Tensor ln1, ln2;  // the norms before attention and before the MLP
  double eps1, eps2;
  Projection qkv, o, gate_up, down;
  std::optional<at::Tensor> q_norm, k_norm;  // Qwen3's per-head norms, or none
  double norm_eps;
  at::Tensor k_cache, v_cache;
};

using Linear1Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                             int64_t, int64_t, int64_t);
using LinearFn = at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, at::TensorList, at::IntArrayRef,
                            at::IntArrayRef, at::IntArrayRef, int64_t, int64_t, int64_t);
using PagedDecodeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, double, int64_t, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>();
}

class DecodeStack {
 public:
  // linear_ns: the quant_linear build's operator namespace; attention_op: the decode
  // kernel's operator (CpuPagedBackend.decode_operator).
  DecodeStack(const std::string& linear_ns, const std::string& attention_op, int64_t heads, int64_t kv_heads,
              int64_t head_dim, int64_t rotary_dim, double scale)
      : linear1_(find_op<Linear1Fn>(linear_ns + "::linear1")),
        linear_(find_op<LinearFn>(linear_ns + "::linear")),
        paged_decode_(find_op<PagedDecodeFn>(attention_op)),
        heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), rotary_dim_(rotary_dim), scale_(scale) {}

  void add_layer(StackLayer layer) { layers_.push_back(std::move(layer)); }

  // hidden [T, hidden] (the embeddings: no residual yet) -> (hidden, residual) after the
  // last layer, before the final norm.  cos, sin: the step's rotary rows; block_table,
  // seq_lens, window, slots: the step's one attention group (every row a decode);
  // fresh_blocks: blocks this step opens, zeroed in every layer's caches first.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                                         int64_t window, const at::Tensor& slots,
                                         const std::optional<at::Tensor>& fresh_blocks) const {
    TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1, "DecodeStack: hidden must be [T, hidden] rows");
    const int64_t t = hidden.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    at::Tensor residual;
    for (const StackLayer& layer : layers_) {
      if (fresh_blocks.has_value()) {
        layer.k_cache.index_fill_(0, *fresh_blocks, 0);
        layer.v_cache.index_fill_(0, *fresh_blocks, 0);
      }
      if (residual.defined()) {
        std::tie(hidden, residual) = rms_norm(hidden, layer.ln1, layer.eps1, residual);
      } else {
        residual = hidden;
        hidden = std::get<0>(rms_norm(hidden, layer.ln1, layer.eps1, std::nullopt));
      }
      const at::Tensor qkv = project(layer.qkv, hidden);
      auto [q, k] = norm_rope(qkv, cos, sin, heads_, kv_heads_, head_dim_, rotary_dim_, layer.q_norm, layer.k_norm,
                              layer.norm_eps, false);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads_, head_dim_});
      const at::Tensor attended = paged_decode_.call(q, layer.k_cache, layer.v_cache, block_table, seq_lens, scale_,
                                                     window, k, v, slots);
      hidden = project(layer.o, attended.reshape({t, q_size}));
      std::tie(hidden, residual) = rms_norm(hidden, layer.ln2, layer.eps2, residual);
      hidden = project(layer.down, gated<Silu>(project(layer.gate_up, hidden)));
    }
    return {hidden, residual};
  }

 private:
  at::Tensor project(const Projection& p, const at::Tensor& x) const {
    if (p.codes.size() == 1) return linear1_.call(x, p.codes[0], p.d[0], p.aux[0], p.kinds[0], p.n, p.k, p.bits);
    return linear_.call(x, p.codes, p.d, p.aux, p.kinds, p.ns, p.offsets, p.n, p.k, p.bits);
  }

  c10::TypedOperatorHandle<Linear1Fn> linear1_;
  c10::TypedOperatorHandle<LinearFn> linear_;
  c10::TypedOperatorHandle<PagedDecodeFn> paged_decode_;
  int64_t heads_, kv_heads_, head_dim_, rotary_dim_;
  double scale_;
  std::vector<StackLayer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil);
  m.def("gemma_rms_norm", &gemma_rms_norm, nogil);
  m.def("norm_rope", &norm_rope, nogil, py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("heads"),
        py::arg("kv_heads"), py::arg("head_dim"), py::arg("rotary_dim"), py::arg("q_weight"), py::arg("k_weight"),
        py::arg("eps"), py::arg("gemma") = false);
  m.def("silu_and_mul", &gated<Silu>, nogil);
  m.def("gelu_tanh_and_mul", &gated<GeluTanh>, nogil);
  m.def("row_max", &row_max, nogil);
  m.def("row_topk", &row_topk, nogil, py::arg("x"), py::arg("k"));
  m.attr("MAX_TOPK") = kMaxTopK;
  py::class_<Projection>(m, "Projection")
      .def(py::init([](std::vector<at::Tensor> codes, std::vector<at::Tensor> d, std::vector<at::Tensor> aux,
                       std::vector<int64_t> kinds, std::vector<int64_t> ns, std::vector<int64_t> offsets,
                       int64_t n, int64_t k, int64_t bits) {
             TORCH_CHECK(!codes.empty() && codes.size() == d.size() && d.size() == aux.size() &&
                             aux.size() == kinds.size() && kinds.size() == ns.size() && ns.size() == offsets.size(),
                         "Projection: one codes, d, aux, kind, n and offset per segment");
             return Projection{std::move(codes), std::move(d), std::move(aux), std::move(kinds), std::move(ns),
                               std::move(offsets), n, k, bits};
           }),
           py::arg("codes"), py::arg("d"), py::arg("aux"), py::arg("kinds"), py::arg("ns"), py::arg("offsets"),
           py::arg("n"), py::arg("k"), py::arg("bits"));
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const std::string&, const std::string&, int64_t, int64_t, int64_t, int64_t, double>(),
           py::arg("linear_ns"), py::arg("attention_op"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("rotary_dim"), py::arg("scale"))
      .def("add_layer",
           [](DecodeStack& self, at::Tensor ln1, double eps1, at::Tensor ln2, double eps2, Projection qkv, Projection o,
              Projection gate_up, Projection down, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
              double norm_eps, at::Tensor k_cache, at::Tensor v_cache) {
             self.add_layer(StackLayer{std::move(ln1), std::move(ln2), eps1, eps2, std::move(qkv), std::move(o),
                                       std::move(gate_up), std::move(down), std::move(q_norm), std::move(k_norm),
                                       norm_eps, std::move(k_cache), std::move(v_cache)});
           },
           py::arg("ln1"), py::arg("eps1"), py::arg("ln2"), py::arg("eps2"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("q_norm"), py::arg("k_norm"), py::arg("norm_eps"),
           py::arg("k_cache"), py::arg("v_cache"))
      .def("run", &DecodeStack::run, nogil, py::arg("hidden"), py::arg("cos"), py::arg("sin"),
           py::arg("block_table"), py::arg("seq_lens"), py::arg("window"), py::arg("slots"),
           py::arg("fresh_blocks"));
}
