// Paged decode attention for CPU: one query token per request, K/V read in place
// from the paged cache through the block table (no gather copy), softmax in float32.
//
// One task per request (at::parallel_for: torch's own OpenMP pool), or per range of its
// KV heads when there are fewer requests than threads, or per tile of up to 16 rows of one
// prompt (cpu_paged's exact prompt rows: decode_tile).  A task streams its heads' rows
// of the request's blocks, the next block's prefetched while this one is used: first
// the scores of its query heads (16 slots at a time, partial sums reduced by a
// transpose-add tree; bf16 over a bf16 cache with AVX512_BF16: the bf16 dot product over
// the block's K turned into columns, qk_bf16), then a vectorised exp and sum per head,
// then the weighted sum of V with the accumulators in registers across each block.
// Compiled with -march=native, those loops are AVX-512 intrinsics (16 slots at a time)
// where the CPU has AVX-512, AVX2/FMA intrinsics (8 slots at a time) where it has AVX2
// (most laptops, Zen 3 servers), and plain loops the compiler vectorises elsewhere.
// A row's output never depends on what else the call holds.
// Only the headers used (torch/extension.h would pull in all of torch: a third of the build time).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) {
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}
inline float load(c10::Half x) { return static_cast<float>(x); }
inline float load(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float load(c10::Float8_e5m2 x) { return static_cast<float>(x); }
inline float load(int8_t x) { return static_cast<float>(x); }

// An int8 cache row (kv_cache_dtype int8) is D values and then its float16 scale; every
// other cache dtype holds plain values (scale 1, and no code for it).
template <typename cache_t>
constexpr bool kScaled = std::is_same_v<cache_t, int8_t>;
template <typename cache_t, int64_t D>
inline float row_scale(const cache_t* row) {
  if constexpr (kScaled<cache_t>) {
    c10::Half h;
    std::memcpy(&h, row + D, sizeof(h));
    return static_cast<float>(h);
  } else {
    return 1.f;
  }
}

// Rows of one prompt that decode_tile attends together (see there), and the most scores
// (floats: rows x heads x keys) a tile may hold: 16 MiB a thread, e.g. 16 rows of 32 heads
// at 8k keys; longer contexts go in smaller tiles, down to a row at a time (the same result).
// 16, not 4: each tile reads the context once, and on an Intel Xeon (float32, 26 GB/s) one
// prompt of 4,096 tokens took 12.73 s with tiles of 4, 9.02 s with 16, 8.82 with 64 (AVX2
// build there: 19.54 -> 14.16 s); 512 tokens unchanged (0.44 / 0.43 s).
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileScores = int64_t{1} << 22;

// Whether this build has the bf16 dot product (qk_bf16 below).
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// float8 (a KV cache's kv_cache_dtype) through float16 bit patterns: e5m2 is the top
// byte of a float16; e4m3's 7 exponent-and-mantissa bits placed under a float16's sign
// read as the value times 2^-8 (subnormals included), undone by one multiply.
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.f));
}

// scores[g * L] = q[g] . k for the G query heads (q pre-scaled, float32).
template <typename scalar_t, int64_t D>
inline void qk_row(const float* q, int64_t G, const scalar_t* k, float* scores, int64_t L, float* mx) {
  constexpr int64_t NV = D / 16;
  __m512 kv[NV];
  for (int64_t c = 0; c < NV; ++c) kv[c] = load16(k + 16 * c);
  const float sk = row_scale<scalar_t, D>(k);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
    for (int64_t c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
    const float dot = _mm512_reduce_add_ps(acc) * sk;
    scores[g * L] = dot;
    mx[g] = std::max(mx[g], dot);
  }
}

// r[i] = sum of a[i]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree
// (45 shuffles/adds) instead of 16 separate horizontal sums.
inline __m512 sum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x88), _mm512_shuffle_f32x4(v, w, 0xDD));
}

// Scores of 16 consecutive slots of one block (rows k, k + k_stride, ...; the first n
// are real, the rest are read but masked) for the G query heads.
// (Called, not inlined: inlined into decode_tile's row loop, float32 prompt tiles ran
// 11-13% slower on the Zen 5.)
template <typename scalar_t, int64_t D>
__attribute__((noinline)) void qk_block(const float* q, int64_t G, const scalar_t* k, int64_t k_stride, int64_t n,
                                        float* scores, int64_t L, float* mx) {
  constexpr int64_t NV = D / 16;
  __m512 a[8][16];  // [g][slot] partial sums; G <= 8 here
  for (int64_t s = 0; s < 16; ++s) {
    __m512 kv[NV];
    for (int64_t c = 0; c < NV; ++c) kv[c] = load16(k + s * k_stride + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
      for (int64_t c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
      a[g][s] = acc;
    }
  }
  const __mmask16 valid = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 sk = _mm512_set1_ps(1.f);
  if constexpr (kScaled<scalar_t>) {
    float sc[16];
    for (int64_t s = 0; s < 16; ++s) sc[s] = row_scale<scalar_t, D>(k + s * k_stride);
    sk = _mm512_loadu_ps(sc);
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 r = _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(sum16(a[g]), sk));
    _mm512_mask_storeu_ps(scores + g * L, valid, r);
    mx[g] = std::max(mx[g], _mm512_reduce_max_ps(r));
  }
}
constexpr int64_t kSlots = 16;  // slots per qk_block

#if defined(__AVX512BF16__)
// bf16 queries over a bf16 cache (the AVX-512 default) with the CPU's bf16 dot product,
// `vdpbf16ps`: one instruction multiplies 16 slots' pairs of dims by a query's pair and
// adds both (exact) products into float32 lanes, rounding after each add, denormals as 0.
// For that the block's K rows are turned into columns: Kp[i] holds dims 2i, 2i+1 of the 16 slots, built by 16x16 transposes of
// 32-bit words.  Each slot's score is then a lane, with no horizontal sums (qk_block's
// 45-operation tree per 16 slots and head), and the transpose is shared by the G heads
// (and by a tile's rows).  With tiles, a 2,048-token prompt's attention in one layer
// (SmolLM2's 9 heads over 3) 24-26 -> 15 ms (Zen 5, 2 threads).  Every row's score is
// the same operations whatever else runs: four partial sums over the pairs (i mod 4, in
// order), added as (0 + 1) + (2 + 3), times the scale; as accurate as the float32 path
// (outputs correctly rounded to bf16 but for 0.02-0.05%, as that path's).

// In place: r[i] lane j <- r[j] lane i, for 16 vectors of 16 32-bit words.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
  }
  for (int k = 0; k < 16; k += 4) {  // r[k + m], 128-bit lane l: column 4l + m of rows k..k+3
    r[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // 4x4 transposes of 128-bit lanes
    const __m512i x0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), x1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
    t[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[8 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int k = 0; k < 16; ++k) r[k] = t[k];
}

// kt[i] (i < D / 2) <- dims 2i, 2i+1 of slots k, k + k_stride, ... (16 of them).
template <int64_t D>
inline void k_columns(const c10::BFloat16* k, int64_t k_stride, __m512i* kt) {
  for (int64_t h = 0; h < D / 32; ++h) {
    __m512i* r = kt + 16 * h;
    for (int64_t s = 0; s < 16; ++s) r[s] = _mm512_loadu_si512(k + s * k_stride + 32 * h);
    transpose16(r);
  }
}

// One query's 32-bit word i: its dims 2i and 2i + 1.
inline int32_t pair_at(const c10::BFloat16* q, int64_t i) {
  int32_t w;
  std::memcpy(&w, q + 2 * i, sizeof(w));
  return w;
}

// Scores of the 16 slots in kt for NS query heads q[0..NS-1] (bf16 rows), into
// scores[s] (the first n slots real, the rest -inf and not stored), mx[s] their maxima.
template <int64_t D, int NS>
inline void qk_bf16_heads(const __m512i* kt, const c10::BFloat16* const* q, int64_t n, float* const* scores,
                          float* const* mx, float scale) {
  __m512 acc[NS][4];
  for (int s = 0; s < NS; ++s)
    for (int j = 0; j < 4; ++j) acc[s][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; i += 4) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512bh kv = (__m512bh)kt[i + j];
#pragma GCC unroll 4
      for (int s = 0; s < NS; ++s)
        acc[s][j] = _mm512_dpbf16_ps(acc[s][j], kv, (__m512bh)_mm512_set1_epi32(pair_at(q[s], i + j)));
    }
  }
  const __mmask16 valid = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int s = 0; s < NS; ++s) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[s][0], acc[s][1]), _mm512_add_ps(acc[s][2], acc[s][3]));
    const __m512 v = _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
    _mm512_mask_storeu_ps(scores[s], valid, v);
    *mx[s] = std::max(*mx[s], _mm512_reduce_max_ps(v));
  }
}

// Scores of the 16 slots in kt for one KV head's G query heads (bf16 rows q + g * q_stride),
// into scores + g * L (the first n slots), maxima mx[g]: qk_block's contract, four heads
// at a time (16 accumulators and the K column fit the 32 registers).
template <int64_t D>
inline void qk_bf16(const __m512i* kt, const c10::BFloat16* q, int64_t q_stride, int64_t G, int64_t n,
                    float* scores, int64_t L, float* mx, float scale) {
  const c10::BFloat16* qh[8];
  float* sh[8];
  float* mh[8];
  for (int64_t g = 0; g < G; ++g) {
    qh[g] = q + g * q_stride;
    sh[g] = scores + g * L;
    mh[g] = mx + g;
  }
  int64_t s = 0;
  for (; s + 4 <= G; s += 4) qk_bf16_heads<D, 4>(kt, qh + s, n, sh + s, mh + s, scale);
  switch (G - s) {
    case 3: qk_bf16_heads<D, 3>(kt, qh + s, n, sh + s, mh + s, scale); break;
    case 2: qk_bf16_heads<D, 2>(kt, qh + s, n, sh + s, mh + s, scale); break;
    case 1: qk_bf16_heads<D, 1>(kt, qh + s, n, sh + s, mh + s, scale); break;
    default: break;
  }
}
#endif

// acc[g] += sum over the n slots s of p[g * L + s] * v[s] for the G query heads, the
// accumulators held in registers across the block (G is a template argument for that).
// Heads of 256 (Gemma 3) take CW of their 16 vectors per pass over the block, so that
// G * CW accumulators and CW loads fit the 32 registers; 64- and 128-wide heads take
// all of theirs in one pass, as tuned.  A lane's sum runs in the same order either way.
template <typename scalar_t, int64_t D, int64_t G>
inline void pv_block(const float* p, const scalar_t* v, int64_t v_stride, int64_t n, float* acc, int64_t L) {
  constexpr int64_t NV = D / 16;
  constexpr int64_t CW = D <= 128 ? NV : (G <= 2 ? 8 : (G <= 4 ? 4 : 2));
  for (int64_t c0 = 0; c0 < NV; c0 += CW) {
    __m512 a[G][CW];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < CW; ++j) a[g][j] = _mm512_loadu_ps(acc + g * D + 16 * (c0 + j));
    for (int64_t s = 0; s < n; ++s) {
      __m512 vv[CW];
      for (int64_t j = 0; j < CW; ++j) vv[j] = load16(v + s * v_stride + 16 * (c0 + j));
      const float sv = row_scale<scalar_t, D>(v + s * v_stride);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * L + s] * sv);
        for (int64_t j = 0; j < CW; ++j) a[g][j] = _mm512_fmadd_ps(pg, vv[j], a[g][j]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < CW; ++j) _mm512_storeu_ps(acc + g * D + 16 * (c0 + j), a[g][j]);
  }
}


// pv_sets' vector operations here (pv_sets is below the ISA blocks): 16 lanes, four of a
// head's vectors at a time, so that NS * 4 accumulators and 4 vectors of V fit the 32
// registers for NS <= 6.
struct PvLanes {
  using V = __m512;
  static constexpr int64_t kWidth = 16, kChunk = 4;
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static V widen(const T* p) { return load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#define PAGEDSERVE_PV_SETS 1

// exp(x) for 16 lanes: 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2, e^r by a
// degree-6 Taylor polynomial (relative error < 2e-7 on that range), 2^n by scalef.
// libm's scalar expf would be most of the kernel's time.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));  // below this e^x is 0 in float32 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);    // ln 2, low bits
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// s[t] = exp(s[t] - m) for t < L; returns their sum.
inline float exp_sum(float* s, int64_t L, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < L) {
    const __mmask16 k = static_cast<__mmask16>((1u << (L - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mv));
    _mm512_mask_storeu_ps(s + t, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(sum);
}

// acc[g] += p[g * L] * v for the G query heads.
template <typename scalar_t, int64_t D>
inline void pv_row(const float* p, int64_t G, const scalar_t* v, float* acc, int64_t L) {
  constexpr int64_t NV = D / 16;
  __m512 vv[NV];
  for (int64_t c = 0; c < NV; ++c) vv[c] = load16(v + 16 * c);
  const float sv = row_scale<scalar_t, D>(v);
  for (int64_t g = 0; g < G; ++g) {
    const __m512 pg = _mm512_set1_ps(p[g * L] * sv);
    float* ag = acc + g * D;
    for (int64_t c = 0; c < NV; ++c)
      _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(pg, vv[c], _mm512_loadu_ps(ag + 16 * c)));
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
constexpr int64_t kSlots = 8;  // slots per qk_block

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// float8 as load16 above does it, 8 at a time.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.f));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// r[i] = sum of a[i]'s 8 lanes, for 8 vectors at once: horizontal adds pair them up to
// low/high-half sums, one cross-lane add finishes.
inline __m256 sum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of 8 consecutive slots of one block (the first n real, the rest read but
// masked) for the G query heads.  One head at a time keeps its 8 partial sums, a q
// vector and a k vector in registers (AVX2 has 16); the block's k rows stay in L1.
template <typename scalar_t, int64_t D>
__attribute__((noinline)) void qk_block(const float* q, int64_t G, const scalar_t* k, int64_t k_stride, int64_t n,
                                        float* scores, int64_t L, float* mx) {
  constexpr int64_t NV = D / 8;
  const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    __m256 a[8];
    for (int64_t s = 0; s < 8; ++s) a[s] = _mm256_setzero_ps();
    for (int64_t c = 0; c < NV; ++c) {
      const __m256 qv = _mm256_loadu_ps(qg + 8 * c);
      for (int64_t s = 0; s < 8; ++s) a[s] = _mm256_fmadd_ps(qv, load8(k + s * k_stride + 8 * c), a[s]);
    }
    __m256 r = sum8(a);
    if constexpr (kScaled<scalar_t>) {
      float sc[8];
      for (int64_t s = 0; s < 8; ++s) sc[s] = row_scale<scalar_t, D>(k + s * k_stride);
      r = _mm256_mul_ps(r, _mm256_loadu_ps(sc));
    }
    r = _mm256_blendv_ps(neg_inf, r, _mm256_castsi256_ps(valid));
    _mm256_maskstore_ps(scores + g * L, valid, r);
    mx[g] = std::max(mx[g], hmax8(r));
  }
}

// acc[g] += sum over the n slots s of p[g * L + s] * v[s] for the G query heads.  The
// accumulators of CW vectors of each head stay in registers across the block (G * CW
// of them plus CW loads fit AVX2's 16), so wide heads take several passes over V.
template <typename scalar_t, int64_t D, int64_t G>
inline void pv_block(const float* p, const scalar_t* v, int64_t v_stride, int64_t n, float* acc, int64_t L) {
  constexpr int64_t NV = D / 8;
  constexpr int64_t CW = G <= 2 ? 4 : (G <= 4 ? 2 : 1);
  for (int64_t c0 = 0; c0 < NV; c0 += CW) {
    __m256 a[G][CW];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < CW; ++j) a[g][j] = _mm256_loadu_ps(acc + g * D + 8 * (c0 + j));
    for (int64_t s = 0; s < n; ++s) {
      __m256 vv[CW];
      for (int64_t j = 0; j < CW; ++j) vv[j] = load8(v + s * v_stride + 8 * (c0 + j));
      const float sv = row_scale<scalar_t, D>(v + s * v_stride);
      for (int64_t g = 0; g < G; ++g) {
        const __m256 pg = _mm256_set1_ps(p[g * L + s] * sv);
        for (int64_t j = 0; j < CW; ++j) a[g][j] = _mm256_fmadd_ps(pg, vv[j], a[g][j]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < CW; ++j) _mm256_storeu_ps(acc + g * D + 8 * (c0 + j), a[g][j]);
  }
}


// exp(x) for 8 lanes, x <= 0: as exp16 below, with 2^n built in the exponent bits
// (AVX2 has no scalef); x >= -87.3 keeps 2^n a normal float.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float exp_sum(float* s, int64_t L, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum8(sum);
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    total += s[t];
  }
  return total;
}

// One row at a time, for G > 8.
template <typename scalar_t, int64_t D>
inline void qk_row(const float* q, int64_t G, const scalar_t* k, float* scores, int64_t L, float* mx) {
  constexpr int64_t NV = D / 8;
  const float sk = row_scale<scalar_t, D>(k);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(k));
    for (int64_t c = 1; c < NV; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), load8(k + 8 * c), acc);
    const float dot = hsum8(acc) * sk;
    scores[g * L] = dot;
    mx[g] = std::max(mx[g], dot);
  }
}

template <typename scalar_t, int64_t D>
inline void pv_row(const float* p, int64_t G, const scalar_t* v, float* acc, int64_t L) {
  constexpr int64_t NV = D / 8;
  const float sv = row_scale<scalar_t, D>(v);
  for (int64_t g = 0; g < G; ++g) {
    const __m256 pg = _mm256_set1_ps(p[g * L] * sv);
    float* ag = acc + g * D;
    for (int64_t c = 0; c < NV; ++c)
      _mm256_storeu_ps(ag + 8 * c, _mm256_fmadd_ps(pg, load8(v + 8 * c), _mm256_loadu_ps(ag + 8 * c)));
  }
}

// pv_sets' vector operations here: 8 lanes, two of a head's vectors at a time, so that
// NS * 2 accumulators, 2 vectors of V and the broadcast fit AVX2's 16 registers (NS <= 6).
struct PvLanes {
  using V = __m256;
  static constexpr int64_t kWidth = 8, kChunk = 2;
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static V widen(const T* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#define PAGEDSERVE_PV_SETS 1
#else
constexpr int64_t kSlots = 0;  // no blocked path: row by row
template <typename scalar_t, int64_t D, int64_t G>
inline void pv_block(const float*, const scalar_t*, int64_t, int64_t, float*, int64_t) {}

inline float exp_sum(float* s, int64_t L, float m) {
  float sum = 0.f;
  for (int64_t t = 0; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}
template <typename scalar_t, int64_t D>
inline void qk_block(const float*, int64_t, const scalar_t*, int64_t, int64_t, float*, int64_t, float*) {}

template <typename scalar_t, int64_t D>
inline void qk_row(const float* q, int64_t G, const scalar_t* k, float* scores, int64_t L, float* mx) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < D; ++i) dot += qg[i] * load(k[i]);
    dot *= row_scale<scalar_t, D>(k);
    scores[g * L] = dot;
    mx[g] = std::max(mx[g], dot);
  }
}

template <typename scalar_t, int64_t D>
inline void pv_row(const float* p, int64_t G, const scalar_t* v, float* acc, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    const float pg = p[g * L] * row_scale<scalar_t, D>(v);
    float* ag = acc + g * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) ag[i] += pg * load(v[i]);
  }
}
#endif

#if defined(PAGEDSERVE_PV_SETS)
constexpr bool kPvSets = true;

// The most vectors, up to `chunk`, that divide a head's `nv` into equal passes (a head of
// 96 on AVX-512 is 6 vectors: passes of 3, not 4 and a pass reading past the head).
constexpr int64_t chunk_of(int64_t nv, int64_t chunk) {
  int64_t c = nv < chunk ? nv : chunk;
  while (nv % c != 0) --c;
  return c;
}

// The weighted sum of V for NS (row, head) sets of a tile over one block's n slots:
// acc[i] += sum over slots t of p[i][t] * v[t].  Each slot's V vectors are loaded and
// widened once for all the sets (pv_block widens them once per row); each lane's sum is
// pv_block's, the same multiply-adds in slot order, so every set's result is bit for bit
// what pv_block gives it.  Up to PvLanes::kChunk of a head's vectors at a time (chunk_of).
template <typename scalar_t, int64_t D, int NS>
inline void pv_sets(const float* const* p, const scalar_t* v, int64_t v_stride, int64_t n, float* const* acc) {
  using L = PvLanes;
  constexpr int64_t NV = D / L::kWidth;
  constexpr int64_t CW = chunk_of(NV, L::kChunk);
  for (int64_t c0 = 0; c0 < NV; c0 += CW) {
    L::V a[NS][CW];
    for (int i = 0; i < NS; ++i)
      for (int64_t j = 0; j < CW; ++j) a[i][j] = L::loadu(acc[i] + L::kWidth * (c0 + j));
    for (int64_t t = 0; t < n; ++t) {
      L::V vv[CW];
      for (int64_t j = 0; j < CW; ++j) vv[j] = L::widen(v + t * v_stride + L::kWidth * (c0 + j));
      const float sv = row_scale<scalar_t, D>(v + t * v_stride);
      for (int i = 0; i < NS; ++i) {
        const L::V pg = L::set1(p[i][t] * sv);
        for (int64_t j = 0; j < CW; ++j) a[i][j] = L::fmadd(pg, vv[j], a[i][j]);
      }
    }
    for (int i = 0; i < NS; ++i)
      for (int64_t j = 0; j < CW; ++j) L::storeu(acc[i] + L::kWidth * (c0 + j), a[i][j]);
  }
}
#else
constexpr bool kPvSets = false;  // (the plain loops: no blocked path, so no tiles)
template <typename scalar_t, int64_t D, int NS>
void pv_sets(const float* const*, const scalar_t*, int64_t, int64_t, float* const*) {}
#endif

// pv_sets for any number of sets, six at a time.
template <typename scalar_t, int64_t D>
__attribute__((noinline)) void pv_sets_any(const float* const* p, int64_t ns, const scalar_t* v, int64_t v_stride,
                                           int64_t n, float* const* acc) {
  int64_t i = 0;
  for (; i + 6 <= ns; i += 6) pv_sets<scalar_t, D, 6>(p + i, v, v_stride, n, acc + i);
  switch (ns - i) {
    case 5: pv_sets<scalar_t, D, 5>(p + i, v, v_stride, n, acc + i); break;
    case 4: pv_sets<scalar_t, D, 4>(p + i, v, v_stride, n, acc + i); break;
    case 3: pv_sets<scalar_t, D, 3>(p + i, v, v_stride, n, acc + i); break;
    case 2: pv_sets<scalar_t, D, 2>(p + i, v, v_stride, n, acc + i); break;
    case 1: pv_sets<scalar_t, D, 1>(p + i, v, v_stride, n, acc + i); break;
    default: break;
  }
}

// pv_block for a runtime G (every ISA above); false when there is no blocked path or no
// instantiation for G (the caller then goes row by row).
// (Called, not inlined: decode and decode_tile both call it, and inlined twice it cost
// the build seconds, not the kernel time.)
template <typename scalar_t, int64_t D>
__attribute__((noinline)) bool pv_block_any(int64_t G, const float* p, const scalar_t* v, int64_t v_stride, int64_t n, float* acc,
                         int64_t L) {
  if (kSlots == 0) return false;
  switch (G) {
    case 1: pv_block<scalar_t, D, 1>(p, v, v_stride, n, acc, L); return true;
    case 2: pv_block<scalar_t, D, 2>(p, v, v_stride, n, acc, L); return true;
    case 3: pv_block<scalar_t, D, 3>(p, v, v_stride, n, acc, L); return true;
    case 4: pv_block<scalar_t, D, 4>(p, v, v_stride, n, acc, L); return true;
    case 5: pv_block<scalar_t, D, 5>(p, v, v_stride, n, acc, L); return true;
    case 6: pv_block<scalar_t, D, 6>(p, v, v_stride, n, acc, L); return true;
    case 7: pv_block<scalar_t, D, 7>(p, v, v_stride, n, acc, L); return true;
    case 8: pv_block<scalar_t, D, 8>(p, v, v_stride, n, acc, L); return true;
    default: return false;
  }
}

// A group of kSlots slots that would read past its block (a block of fewer slots:
// block_size 1..8 on AVX-512, 1..4 on AVX2) is read from a copy: its n rows of one head,
// then the first row again up to kSlots (masked by qk_block / qk_bf16 as any group's
// missing slots).  The reads stay inside the cache, and each slot's score is the same
// operations as in a block of any size: the block size changes no output bit.
template <typename cache_t, int64_t D>
struct GroupCopy {
  static constexpr int64_t kRow = D + (kScaled<cache_t> ? static_cast<int64_t>(sizeof(c10::Half)) : 0);
  cache_t rows[(kSlots > 0 ? kSlots : 1) * kRow];

  // The group's first row and row stride: in place where the block holds all kSlots
  // slots from s0, else from the copy.
  std::pair<const cache_t*, int64_t> rows_of(const cache_t* k, int64_t k_stride, int64_t s0, int64_t n,
                                             int64_t bs) {
    if (s0 + kSlots <= bs) return {k, k_stride};
    fill(k, k_stride, n);
    return {rows, kRow};
  }
  __attribute__((noinline)) void fill(const cache_t* k, int64_t k_stride, int64_t n) {
    for (int64_t s = 0; s < kSlots; ++s)
      std::memcpy(rows + s * kRow, k + (s < n ? s : 0) * k_stride, sizeof(cache_t) * kRow);
  }
};

// Whether decode attends a prompt's rows in tiles (decode_tile) for these dtypes: where the
// cache holds the model's own 16 or 32 bits (the defaults).  Rows over float8 or int8
// caches go one at a time, with the same result (tiles only read blocks once): compiling
// decode_tile for all 14 dtype pairs took the native build from 25 to 38 s (Zen 5); for
// these 5, with pv_block_any called rather than inlined twice, 29 s (35 s since heads of 32
// and 96 were added to 64, 128 and 256).
template <typename scalar_t, typename cache_t>
constexpr bool kTiled = std::is_same_v<scalar_t, cache_t> ||
                        (std::is_same_v<scalar_t, float> && sizeof(cache_t) == 2);

// Whether decode's scores take the bf16 dot product (bf16 queries over a bf16 cache, on a
// CPU with AVX512_BF16); elsewhere qk_block in float32.
template <typename scalar_t, typename cache_t>
constexpr bool kBf16Pair = kBf16Dot && std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;

// One KV head's rows of a block: `n` rows of `bytes` each, `stride` bytes apart.
inline void prefetch_rows(const void* p, int64_t n, int64_t stride, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + s * stride + off, 0, 0);
}

// What decode_tile needs of decode's operands: shapes, strides (elements; k_slot ..
// v_row in bytes, as decode's), the block size and the scale.
struct TileArgs {
  int64_t H, Hkv, q_sb, q_sh, o_sb, o_sh, kc_sb, kc_ss, kc_sh, vc_sb, vc_ss, vc_sh, k_slot, k_row, v_slot, v_row, bs;
  float scale;
};
// A thread's workspace for its tiles, [row][head][...], kept across them.
struct TileBuffers {
  std::vector<float> q, acc, scores, mx, inv;
};

// Rows r = 0..R-1 of one prompt (R <= kTileRows), row r over the first L[r] keys of the
// same blocks (`blocks`: the longest row's table; the others' agree on their blocks), no
// sliding window in reach: decode's blocked path for each row, with each block prefetched,
// its K columns built (qk_bf16) and its V widened (pv_sets) once for the tile.  Each row's scores,
// softmax and weighted sum are the operations decode does for that row alone, in its
// order, so each row's output is bit for bit its own decode step's (the point: answers
// that do not depend on how a prompt was cut into chunks or how much of it a prefix-cache
// hit skipped).
template <typename scalar_t, typename cache_t, int64_t D>
void decode_tile(const TileArgs& a, const scalar_t* qp, const cache_t* kp, const cache_t* vp, const int32_t* blocks,
                 const int32_t* L, int64_t R, scalar_t* op, TileBuffers& tb) {
  const int64_t H = a.H, Hkv = a.Hkv, G = H / Hkv, bs = a.bs;
  int64_t Lmax = 0;
  for (int64_t r = 0; r < R; ++r) Lmax = std::max<int64_t>(Lmax, L[r]);
  tb.q.resize(R * H * D);
  tb.acc.assign(R * H * D, 0.f);
  tb.scores.resize(R * H * Lmax);  // row r, head h: scores from (r * H + h) * Lmax
  tb.mx.assign(R * H, -std::numeric_limits<float>::infinity());
  tb.inv.resize(R * H);
  for (int64_t r = 0; r < R && !kBf16Pair<scalar_t, cache_t>; ++r)  // (qk_bf16 reads q as it is)
    for (int64_t h = 0; h < H; ++h) {
      const scalar_t* src = qp + r * a.q_sb + h * a.q_sh;
      for (int64_t i = 0; i < D; ++i) tb.q[(r * H + h) * D + i] = load(src[i]) * a.scale;
    }
  const int64_t nblk = (Lmax + bs - 1) / bs;
  GroupCopy<cache_t, D> group;
  prefetch_rows(kp + blocks[0] * a.kc_sb, bs, a.k_slot, Hkv * a.k_row);
  for (int64_t j = 0; j < nblk; ++j) {
    if (j + 1 < nblk) prefetch_rows(kp + blocks[j + 1] * a.kc_sb, bs, a.k_slot, Hkv * a.k_row);
    else prefetch_rows(vp + blocks[0] * a.vc_sb, bs, a.v_slot, Hkv * a.v_row);
    const cache_t* kb = kp + blocks[j] * a.kc_sb;
    const int64_t nj = std::min(bs, Lmax - j * bs);
    for (int64_t s0 = 0; s0 < nj; s0 += kSlots)
      for (int64_t k = 0; k < Hkv; ++k) {
        const auto [ks, ks_stride] = group.rows_of(kb + s0 * a.kc_ss + k * a.kc_sh, a.kc_ss, s0,
                                                   std::min<int64_t>(kSlots, nj - s0), bs);
#if defined(__AVX512BF16__)
        __m512i kt[kBf16Pair<scalar_t, cache_t> ? D / 2 : 1];
        if constexpr (kBf16Pair<scalar_t, cache_t>) k_columns<D>(ks, ks_stride, kt);
#endif
        for (int64_t r = 0; r < R; ++r) {
          // decode's loop for this row: slots s0.. of block j, where its context reaches them
          const int64_t n = std::min<int64_t>(kSlots, std::min<int64_t>(bs, L[r] - j * bs) - s0);
          if (n <= 0) continue;
          float* sr = tb.scores.data() + (r * H + k * G) * Lmax + j * bs + s0;
          float* mr = tb.mx.data() + r * H + k * G;
#if defined(__AVX512BF16__)
          if constexpr (kBf16Pair<scalar_t, cache_t>) {
            qk_bf16<D>(kt, qp + r * a.q_sb + k * G * a.q_sh, a.q_sh, G, n, sr, Lmax, mr, a.scale);
            continue;
          }
#endif
          qk_block<cache_t, D>(tb.q.data() + (r * H + k * G) * D, G, ks, ks_stride, n, sr, Lmax, mr);
        }
      }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h)
      tb.inv[r * H + h] = 1.f / exp_sum(tb.scores.data() + (r * H + h) * Lmax, L[r], tb.mx[r * H + h]);
  for (int64_t j = 0; j < nblk; ++j) {
    if (j + 1 < nblk) prefetch_rows(vp + blocks[j + 1] * a.vc_sb, bs, a.v_slot, Hkv * a.v_row);
    const cache_t* vb = vp + blocks[j] * a.vc_sb;
    if constexpr (kPvSets) {
      // Every (row, head) set over the slots all the tile's rows reach in this block, then
      // each row's own further slots (its sums carry on from where they stopped).
      int64_t common = bs;
      for (int64_t r = 0; r < R; ++r) common = std::min(common, std::max<int64_t>(0, L[r] - j * bs));
      for (int64_t k = 0; k < Hkv; ++k) {
        const float* ps[kTileRows * 8];
        float* as[kTileRows * 8];
        int64_t ns = 0;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t g = 0; g < G; ++g, ++ns) {
            ps[ns] = tb.scores.data() + (r * H + k * G + g) * Lmax + j * bs;
            as[ns] = tb.acc.data() + (r * H + k * G + g) * D;
          }
        const cache_t* vk = vb + k * a.vc_sh;
        if (common > 0) pv_sets_any<cache_t, D>(ps, ns, vk, a.vc_ss, common, as);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t n = std::min(bs, L[r] - j * bs);
          if (n <= common) continue;
          const float* pr[8];
          for (int64_t g = 0; g < G; ++g) pr[g] = ps[r * G + g] + common;
          pv_sets_any<cache_t, D>(pr, G, vk + common * a.vc_ss, a.vc_ss, n - common, as + r * G);
        }
      }
      continue;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = std::min(bs, L[r] - j * bs);
      if (n <= 0) continue;
      for (int64_t k = 0; k < Hkv; ++k) {
        const float* p = tb.scores.data() + (r * H + k * G) * Lmax + j * bs;
        float* acc = tb.acc.data() + (r * H + k * G) * D;
        if (pv_block_any<cache_t, D>(G, p, vb + k * a.vc_sh, a.vc_ss, n, acc, Lmax)) continue;
        for (int64_t s = 0; s < n; ++s)  // (decode's row path; tiles are formed only where the above applies)
          pv_row<cache_t, D>(p + s, G, vb + s * a.vc_ss + k * a.vc_sh, acc, Lmax);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      scalar_t* dst = op + r * a.o_sb + h * a.o_sh;
      const float* src = tb.acc.data() + (r * H + h) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<scalar_t>(src[i] * tb.inv[r * H + h]);
    }
}

// scalar_t: q's and the output's dtype; cache_t: what the cache stores (the same, or
// narrower: kv_cache_dtype), converted to float32 as it is loaded.
template <typename scalar_t, typename cache_t, int64_t D>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out, double scale,
            int64_t window) {
  const int64_t B = q.size(0), H = q.size(1);
  if (B == 0) return;  // (no rows: nothing to attend, and no thread count to divide by)
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv;
  const int64_t q_sb = q.stride(0), q_sh = q.stride(1);
  const int64_t o_sb = out.stride(0), o_sh = out.stride(1);
  const int64_t kc_sb = k_cache.stride(0), kc_ss = k_cache.stride(1), kc_sh = k_cache.stride(2);
  const int64_t vc_sb = v_cache.stride(0), vc_ss = v_cache.stride(1), vc_sh = v_cache.stride(2);
  const int64_t bt_s = block_table.stride(0);
  // One head's row (its D values and, for int8, the scale after them) and the distance
  // between two slots' rows, in bytes.
  constexpr int64_t kElt = sizeof(cache_t);
  const int64_t k_row = kc_sh * kElt, k_slot = kc_ss * kElt, v_row = vc_sh * kElt, v_slot = vc_ss * kElt;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = static_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* vp = static_cast<const cache_t*>(v_cache.data_ptr());
  const int32_t* btp = block_table.data_ptr<int32_t>();
  const int32_t* slp = seq_lens.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  // kSlots slots at a time (a group past its block's end read from a copy: GroupCopy), and
  // at most 8 query heads per KV head (the partial sums live in registers or on the stack).
  const bool blocked = kSlots > 0 && G <= 8;

  // Tasks are (request, range of KV heads), or tiles (below).  With at least as many requests as threads a
  // task is a whole request, its blocks streamed whole (every KV head of a slot is
  // adjacent).  With fewer (one user's decode step), each request's heads are split into
  // contiguous ranges, one per thread it can have, so every thread works and each still
  // streams contiguous runs of every slot (a head alone would read 128-byte rows 4 KB apart,
  // which measured slower than one thread doing all 32 heads of a 1.7B model).
  // Each thread takes a contiguous run of tasks (neighbouring requests' blocks lie next to
  // each other), the runs cut where the keys to read, plus a fixed cost a task, are shared
  // equally: the rows of one prompt (cpu_paged's exact rows) grow in context row by row,
  // and runs of equal length left one thread three times the other's work (a 2,048-token
  // prompt's attention); dealing the tasks out in turn cost 32-stream decode steps ~5%
  // instead (Zen 5, AVX-512 with native bf16, 2 threads).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t parts = std::clamp<int64_t>((threads + B - 1) / B, 1, Hkv);
  // Tiles: runs of up to kTileRows rows over the same blocks at consecutive lengths (the
  // rows of one prompt: cpu_paged's exact rows), attended together by decode_tile; any
  // other row is a tile of its own.  A task is a tile or, with fewer rows than threads,
  // one row's range of KV heads.
  // Tiles no longer than keeps every thread a tile, and none whose scores (a row's H * L
  // floats each) would pass kTileScores.
  const int64_t tile_rows = std::clamp<int64_t>(B / threads, 1, kTileRows);
  std::vector<int64_t> tile{0};  // tile i: rows tile[i] .. tile[i + 1] - 1
  for (int64_t b = 1; b < B; ++b) {
    const int64_t prev = slp[b - 1];
    const bool joins = kTiled<scalar_t, cache_t> && blocked && parts == 1 && b - tile.back() < tile_rows &&
                       prev > 0 && slp[b] == prev + 1 && (window == 0 || slp[b] <= window) &&
                       (b - tile.back() + 1) * H * slp[b] <= kTileScores &&
                       std::memcmp(btp + (b - 1) * bt_s, btp + b * bt_s, sizeof(int32_t) * ((prev + bs - 1) / bs)) == 0;
    if (!joins) tile.push_back(b);
  }
  tile.push_back(B);
  const int64_t num_tiles = static_cast<int64_t>(tile.size()) - 1;
  const int64_t tasks = num_tiles * parts;
  std::vector<int64_t> first(threads + 1, tasks);  // thread t's run: tasks first[t] .. first[t + 1] - 1
  first[0] = 0;
  if (parts == 1 && num_tiles > threads) {
    constexpr int64_t kTaskCost = 32;  // a row's fixed work, in keys (its query, softmax and output)
    int64_t total = 0, sum = 0;
    for (int64_t b = 0; b < B; ++b) total += std::max<int32_t>(slp[b], 0) + kTaskCost;
    for (int64_t ti = 0, t = 1; ti < num_tiles && t < threads; ++ti) {
      for (int64_t b = tile[ti]; b < tile[ti + 1]; ++b) sum += std::max<int32_t>(slp[b], 0) + kTaskCost;
      while (t < threads && sum * threads >= total * t) first[t++] = ti + 1;
    }
  } else {
    for (int64_t t = 1; t < threads; ++t) first[t] = tasks * t / threads;
  }
  const TileArgs ta{H, Hkv, q_sb, q_sh, o_sb, o_sh, kc_sb, kc_ss, kc_sh, vc_sb, vc_ss, vc_sh, k_slot, k_row,
                    v_slot, v_row, bs, fscale};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores, mx(H), inv(H);
    TileBuffers tb;
    GroupCopy<cache_t, D> group;
    for (int64_t task = first[begin]; task < first[end]; ++task) {
      const int64_t ti = task / parts, part = task % parts, b = tile[ti];
      if constexpr (kTiled<scalar_t, cache_t>) {
        if (tile[ti + 1] - b > 1) {
          decode_tile<scalar_t, cache_t, D>(ta, qp + b * q_sb, kp, vp, btp + (tile[ti + 1] - 1) * bt_s, slp + b,
                                            tile[ti + 1] - b, op + b * o_sb, tb);
          continue;
        }
      }
      const int64_t h0 = Hkv * part / parts, h1 = Hkv * (part + 1) / parts, nh = h1 - h0;
      const int64_t L = slp[b];
      const int32_t* blocks = btp + b * bt_s;
      const int64_t nblk = (L + bs - 1) / bs;
      for (int64_t h = 0; h < nh * G; ++h) {
        const scalar_t* src = qp + b * q_sb + (h0 * G + h) * q_sh;
        for (int64_t i = 0; i < D; ++i) qf[h * D + i] = load(src[i]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(inv.begin(), inv.end(), 0.f);
      if (L > 0) {
        // A sliding window sees keys [start, L): blocks before the one holding `start`
        // are never read (they may be stale or the null block); the slots of that block
        // before `start` get probability 0.
        const int64_t start = window > 0 && L > window ? L - window : 0;
        const int64_t j0 = start / bs;
        const cache_t* kh = kp + h0 * kc_sh;  // this task's first head in slot 0 of block 0
        const cache_t* vh = vp + h0 * vc_sh;
        scores.resize(nh * G * L);
        std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
        prefetch_rows(kh + blocks[j0] * kc_sb, bs, k_slot, nh * k_row);
        for (int64_t j = j0; j < nblk; ++j) {
          if (j + 1 < nblk) prefetch_rows(kh + blocks[j + 1] * kc_sb, bs, k_slot, nh * k_row);
          else prefetch_rows(vh + blocks[j0] * vc_sb, bs, v_slot, nh * v_row);
          const cache_t* kb = kh + blocks[j] * kc_sb;
          const int64_t n = std::min(bs, L - j * bs);
          if (blocked) {
            for (int64_t s0 = 0; s0 < n; s0 += kSlots)
              for (int64_t k = 0; k < nh; ++k) {
                const int64_t ns = std::min<int64_t>(kSlots, n - s0);
                const auto [ks, ks_stride] = group.rows_of(kb + s0 * kc_ss + k * kc_sh, kc_ss, s0, ns, bs);
#if defined(__AVX512BF16__)
                if constexpr (kBf16Pair<scalar_t, cache_t>) {
                  __m512i kt[D / 2];
                  k_columns<D>(ks, ks_stride, kt);
                  qk_bf16<D>(kt, qp + b * q_sb + (h0 + k) * G * q_sh, q_sh, G, ns,
                             scores.data() + k * G * L + j * bs + s0, L, mx.data() + k * G, fscale);
                  continue;
                }
#endif
                qk_block<cache_t, D>(qf.data() + k * G * D, G, ks, ks_stride, ns,
                                      scores.data() + k * G * L + j * bs + s0, L, mx.data() + k * G);
              }
            continue;
          }
          for (int64_t s = 0; s < n; ++s)
            for (int64_t k = 0; k < nh; ++k)
              qk_row<cache_t, D>(qf.data() + k * G * D, G, kb + s * kc_ss + k * kc_sh,
                                  scores.data() + k * G * L + j * bs + s, L, mx.data() + k * G);
        }
        for (int64_t h = 0; h < nh * G; ++h) {
          float* sh = scores.data() + h * L;
          if (start > j0 * bs) {  // the max over the visible keys only, then hide the rest
            mx[h] = *std::max_element(sh + start, sh + L);
            std::fill(sh + j0 * bs, sh + start, 0.f);
          }
          inv[h] = 1.f / exp_sum(sh + start, L - start, mx[h]);
        }
        for (int64_t j = j0; j < nblk; ++j) {
          if (j + 1 < nblk) prefetch_rows(vh + blocks[j + 1] * vc_sb, bs, v_slot, nh * v_row);
          const cache_t* vb = vh + blocks[j] * vc_sb;
          const int64_t n = std::min(bs, L - j * bs);
          bool done = true;
          for (int64_t k = 0; k < nh && done; ++k)
            done = pv_block_any<cache_t, D>(G, scores.data() + k * G * L + j * bs, vb + k * vc_sh, vc_ss, n,
                                             acc.data() + k * G * D, L);
          if (done) continue;
          for (int64_t s = 0; s < n; ++s)
            for (int64_t k = 0; k < nh; ++k)
              pv_row<cache_t, D>(scores.data() + k * G * L + j * bs + s, G, vb + s * vc_ss + k * vc_sh,
                                  acc.data() + k * G * D, L);
        }
      }
      for (int64_t h = 0; h < nh * G; ++h) {
        scalar_t* dst = op + b * o_sb + (h0 * G + h) * o_sh;
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<scalar_t>(acc[h * D + i] * inv[h]);
      }
    }
  });
}

// decode for a runtime head size (32, 64, 96, 128 or 256: checked by the caller; a multiple of
// 32 for the bf16 columns, k_columns).
template <typename scalar_t, typename cache_t>
void decode_any_d(int64_t head_dim, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                  int64_t window) {
  if (head_dim == 32) decode<scalar_t, cache_t, 32>(q, k_cache, v_cache, block_table, seq_lens, out, scale, window);
  else if (head_dim == 64) decode<scalar_t, cache_t, 64>(q, k_cache, v_cache, block_table, seq_lens, out, scale, window);
  else if (head_dim == 96) decode<scalar_t, cache_t, 96>(q, k_cache, v_cache, block_table, seq_lens, out, scale, window);
  else if (head_dim == 128) decode<scalar_t, cache_t, 128>(q, k_cache, v_cache, block_table, seq_lens, out, scale, window);
  else decode<scalar_t, cache_t, 256>(q, k_cache, v_cache, block_table, seq_lens, out, scale, window);
}

// Row `d` values of float32 as a 16-bit cache stores them, as kv_dtype.to_cache converts
// them: rounded to nearest even, float16 first clamped to its finite range.
template <typename cache_t>
void convert_row(const float* from, cache_t* to, int64_t d) {
  constexpr float kHalfMax = 65504.f;
  for (int64_t i = 0; i < d; ++i) {
    if constexpr (std::is_same_v<cache_t, c10::Half>)
      to[i] = c10::Half(std::isnan(from[i]) ? from[i] : std::min(std::max(from[i], -kHalfMax), kHalfMax));
    else
      to[i] = cache_t(from[i]);
  }
}

// Writes each new token's K/V row ([T, Hkv, D], head_dim contiguous; the caches' dtype, or
// float32 into a 16-bit cache, converted as the layer's own store converts) at its flat
// slot (block id * block_size + offset) of the caches.  In the decode step this is the
// store the attention layer does first; done here it saves two tensor operations a layer,
// which at a 135M model's size are a few percent of the step.
void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots, const at::Tensor& k_cache,
              const at::Tensor& v_cache) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "paged_decode: key/value must be [tokens, kv_heads, head_dim] of the cache's heads");
  const at::ScalarType ct = k_cache.scalar_type();
  const bool convert = key.scalar_type() == at::kFloat && (ct == at::kBFloat16 || ct == at::kHalf);
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == ct &&
                  (key.scalar_type() == ct || convert),
              "paged_decode: key/value must have the cache's dtype (or float32 over a 16-bit cache)");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "paged_decode: key/value head_dim must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == key.size(0) &&
                  slots.is_contiguous(),
              "paged_decode: slot_mapping must be int64 [tokens]");
  const int64_t bs = k_cache.size(1), num_slots = k_cache.size(0) * bs, hkv = key.size(1), d = key.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)  // all checked before any is written
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "paged_decode: slot ", sp[t], " out of range [0, ", num_slots, ")");
  const int64_t elem = key.element_size(), celem = k_cache.element_size();
  for (int64_t t = 0; t < key.size(0); ++t) {
    const int64_t slot = sp[t];
    const int64_t blk = slot / bs, off = slot % bs;
    for (const auto& [src, dst] : {std::pair<const at::Tensor*, const at::Tensor*>{&key, &k_cache}, {&value, &v_cache}}) {
      const char* from = static_cast<const char*>(src->data_ptr()) + t * src->stride(0) * elem;
      char* to = static_cast<char*>(dst->data_ptr()) + (blk * dst->stride(0) + off * dst->stride(1)) * celem;
      for (int64_t h = 0; h < hkv; ++h) {
        const char* f = from + h * src->stride(1) * elem;
        char* o = to + h * dst->stride(2) * celem;
        if (!convert)
          std::memcpy(o, f, d * elem);
        else if (ct == at::kHalf)
          convert_row(reinterpret_cast<const float*>(f), reinterpret_cast<c10::Half*>(o), d);
        else
          convert_row(reinterpret_cast<const float*>(f), reinterpret_cast<c10::BFloat16*>(o), d);
      }
    }
  }
}

// The (q, cache) dtype pairs decode is instantiated for: q float32, bfloat16 or float16
// over a cache of the same dtype, of float8 or of int8; a float32 q also over a 16-bit
// cache, and a 16-bit q over the other 16-bit cache (bf16 compute with --kv-cache-dtype
// float16 took the torch path: slower, and its answers moved with the block size).
bool supported_dtypes(at::ScalarType qt, at::ScalarType ct) {
  if (qt != at::kFloat && qt != at::kBFloat16 && qt != at::kHalf) return false;
  if (ct == qt || ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2 || ct == at::kChar) return true;
  return ct == at::kBFloat16 || ct == at::kHalf;
}

// q [B, H, D] (rows of D contiguous); caches [num_blocks, block_size, Hkv, D] (head_dim
// contiguous); block_table [B, >= ceil(max seq_len / block_size)] int32; seq_lens [B]
// int32 (0: the row's output is zero); window > 0: a sliding window of that many keys ending at
// the query; key/value/slot_mapping, when given: the step's new K/V, stored first
// (store_kv).  Returns [B, H, D] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                        int64_t window, const std::optional<at::Tensor>& key,
                        const std::optional<at::Tensor>& value, const std::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(window >= 0, "paged_decode: window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode: head_dim must be contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "paged_decode: k_cache and v_cache dtypes differ");
  TORCH_CHECK(supported_dtypes(q.scalar_type(), k_cache.scalar_type()), "paged_decode: q must be float32, bfloat16 "
              "or float16 and the caches the same, float8 (e4m3fn, e5m2), int8, or 16-bit; got q ",
              q.scalar_type(), ", caches ", k_cache.scalar_type());
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && seq_lens.is_contiguous(), "paged_decode: index layout");
  // An int8 cache's rows end in their float16 scale (2 bytes).
  const int64_t row = k_cache.scalar_type() == at::kChar ? q.size(2) + 2 : q.size(2);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && k_cache.size(3) == row, "paged_decode: head shapes");
  TORCH_CHECK(block_table.size(0) >= q.size(0) && seq_lens.size(0) >= q.size(0), "paged_decode: batch sizes");
  // Every block the kernel will read must exist: a bad table is an error, not a stray read.
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), width = block_table.size(1);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_decode: k_cache and v_cache shapes differ");
  const int32_t* btp = block_table.data_ptr<int32_t>();
  const int32_t* slp = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t L = slp[b];
    TORCH_CHECK(L >= 0 && L <= width * bs, "paged_decode: seq_len ", L, " of row ", b,
                " exceeds its block table (", width, " blocks of ", bs, ")");
    const int64_t j0 = window > 0 && L > window ? (L - window) / bs : 0;  // blocks before it are not read
    for (int64_t j = j0; j < (L + bs - 1) / bs; ++j) {
      const int64_t blk = btp[b * block_table.stride(0) + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode: block id ", blk, " out of range [0, ",
                  num_blocks, ")");
    }
  }
  TORCH_CHECK(key.has_value() == value.has_value() && key.has_value() == slot_mapping.has_value(),
              "paged_decode: key, value and slot_mapping come together");
  if (key.has_value()) store_kv(*key, *value, *slot_mapping, k_cache, v_cache);
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256,
              "paged_decode: head_dim must be 32, 64, 96, 128 or 256");
  const auto cache = k_cache.scalar_type();
  // q's dtype, then the cache's: the same, 8-bit under any, or 16-bit under any.
  bool done = false;
#define PAGED_DECODE_CASE(QT, CT, CACHE_TYPE)                                              \
  if (!done && cache == CACHE_TYPE) {                                                    \
    decode_any_d<QT, CT>(head_dim, q, k_cache, v_cache, block_table, seq_lens, out, scale, window); \
    done = true;                                                                         \
  }
#define PAGED_DECODE_8BIT(QT)                                                \
  PAGED_DECODE_CASE(QT, c10::Float8_e4m3fn, at::kFloat8_e4m3fn)             \
  PAGED_DECODE_CASE(QT, c10::Float8_e5m2, at::kFloat8_e5m2)                 \
  PAGED_DECODE_CASE(QT, int8_t, at::kChar)
  switch (q.scalar_type()) {
    case at::kFloat:
      PAGED_DECODE_CASE(float, float, at::kFloat)
      PAGED_DECODE_CASE(float, c10::BFloat16, at::kBFloat16)
      PAGED_DECODE_CASE(float, c10::Half, at::kHalf)
      PAGED_DECODE_8BIT(float)
      break;
    case at::kBFloat16:
      PAGED_DECODE_CASE(c10::BFloat16, c10::BFloat16, at::kBFloat16)
      PAGED_DECODE_CASE(c10::BFloat16, c10::Half, at::kHalf)
      PAGED_DECODE_8BIT(c10::BFloat16)
      break;
    case at::kHalf:
      PAGED_DECODE_CASE(c10::Half, c10::Half, at::kHalf)
      PAGED_DECODE_CASE(c10::Half, c10::BFloat16, at::kBFloat16)
      PAGED_DECODE_8BIT(c10::Half)
      break;
    default:
      break;
  }
#undef PAGED_DECODE_8BIT
#undef PAGED_DECODE_CASE
  TORCH_CHECK(done, "paged_decode: no instantiation for q ", q.scalar_type(), ", caches ", cache);
  return out;
}

}  // namespace (everything internal: builds for several ISAs load into one process in tests)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (one query token per request)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_table"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("key") = pybind11::none(), pybind11::arg("value") = pybind11::none(),
        pybind11::arg("slot_mapping") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
}

// The same kernel as a torch operator, <this build's name>::paged_decode, for C++ callers
// (fused_cpu.cpp's DecodeStack calls it through the dispatcher); the namespace is the
// build's own, since builds for several ISAs can be loaded into one process.  It writes
// the step's key/value into the caches.  (The indirection expands the name's macro
// before TORCH_LIBRARY pastes it into its identifiers.)
#define PAGEDSERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDSERVE_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
PAGEDSERVE_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window, Tensor? key, Tensor? value, Tensor? slot_mapping) -> Tensor");
}
PAGEDSERVE_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) { m.impl("paged_decode", &paged_decode); }
