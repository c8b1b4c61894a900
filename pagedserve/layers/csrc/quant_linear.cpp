// Weight-only quantized linear layers for CPUs: y[M, N] = x[M, K] . W[N, K]^T, with W in
// blocks of 32 weights that share a scale (llama.cpp's Q4_0, Q4_1, Q8_0, and the 4-bit
// K-quants, converted at load by layers/quantization.py).  Like llama.cpp, the
// activations are quantized to int8 per block of 32 (one float scale each) and every
// block's dot product is an integer dot product, scaled once.
//
// Layout (written by layers/quantization.py `pack`): rows are grouped in tiles of 16,
// one SIMD lane per row, so a tile's 16 dot products accumulate in one register and no
// horizontal sum is needed.  For tile t and block b:
//   kind 4-bit: 256 bytes, 4 chunks of 64; chunk p, byte 4*r + i holds row r's code of
//               k = 8p + i in its low nibble and of k = 8p + 4 + i in its high nibble;
//   kind 8-bit: 512 bytes, 8 chunks of 64; chunk j, byte 4*r + i holds row r's int8 code
//               of k = 4j + i;
//   d:   16 fp16 scales (one per row);  aux: 16 fp16 offsets (Q4_ASYM), or 16 int16
//        sums of the block's codes (Q8, for the VNNI path's unsigned trick); unused for Q4_SYM.
// A weight is   Q4_SYM: d*(u - 8)   Q4_ASYM: d*u + aux   Q8: d*s   (u unsigned, s signed).
//
// Paths, chosen at compile time for the machine (-march=native, capped like torch):
// AVX-512 VNNI (one vpdpbusd per 64 multiply-adds), AVX2 (vpmaddubsw), plain loops.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 16;
// Bytes ahead of the current block that the weight stream prefetches (decode is bound by
// how many cache-line reads are in flight; the hardware prefetcher alone keeps too few).
constexpr int kPrefetch = 2048;
constexpr int kBlock = 32;
enum Kind : int64_t { Q4_SYM = 0, Q4_ASYM = 1, Q8 = 2 };

inline int64_t block_bytes(int64_t kind) { return kind == Q8 ? 512 : 256; }

inline float half_to_float(uint16_t h) {
  c10::Half v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

// Activations: int8 codes per block of 32, the block's scale, and scale * sum(codes).
struct QuantizedX {
  const int8_t* q;   // [M, K]
  const float* d;    // [M, Kb]
  const float* ds;   // [M, Kb]
  int64_t M, K, Kb;
};

// ---------------------------------------------------------------- plain loops
void tile_plain(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
                const QuantizedX& x, int64_t m0, int64_t mr, int rows, float* y, int64_t ldy) {
  for (int64_t mm = 0; mm < mr; ++mm) {
    const int64_t m = m0 + mm;
    for (int r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.Kb; ++b) {
        const int8_t* xq = x.q + m * x.K + b * kBlock;
        int32_t dot = 0;
        if (kind == Q8) {
          const int8_t* c = reinterpret_cast<const int8_t*>(codes + b * 512);
          for (int k = 0; k < kBlock; ++k) dot += int32_t(c[(k / 4) * 64 + r * 4 + k % 4]) * xq[k];
        } else {
          const uint8_t* c = codes + b * 256;
          for (int k = 0; k < kBlock; ++k) {
            const int p = k / 8, w = k % 8;
            const uint8_t byte = c[p * 64 + r * 4 + (w % 4)];
            dot += int32_t(w < 4 ? (byte & 15) : (byte >> 4)) * xq[k];
          }
        }
        const float dw = half_to_float(d[b * kTile + r]);
        const float dx = x.d[m * x.Kb + b], dsx = x.ds[m * x.Kb + b];
        acc += dw * dx * float(dot);
        if (kind == Q4_SYM) acc -= 8.f * dw * dsx;
        if (kind == Q4_ASYM) acc += half_to_float(aux[b * kTile + r]) * dsx;
      }
      y[mm * ldy + r] = acc;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---------------------------------------------------------------- AVX-512 VNNI
template <int MR>
void tile_vnni(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
               const QuantizedX& x, int64_t m0, int rows, float* y, int64_t ldy) {
  // Two integer and two float accumulators per activation row: the dependency chains of
  // vpdpbusd (5 cycles) and of the fused multiply-adds are what bounds one row (decode).
  __m512 acc[MR], acc_off[MR];
  for (int mm = 0; mm < MR; ++mm) acc[mm] = acc_off[mm] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int8_t* xrow[MR];
  for (int mm = 0; mm < MR; ++mm) xrow[mm] = x.q + (m0 + mm) * x.K;
  for (int64_t b = 0; b < x.Kb; ++b) {
    __m512i ia[MR], ib[MR];
    for (int mm = 0; mm < MR; ++mm) ia[mm] = ib[mm] = _mm512_setzero_si512();
    if (kind == Q8) {
      const uint8_t* c = codes + b * 512;
      for (int j = 0; j < 8; j += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * j + 64), _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(c + 64 * j);
        const __m512i w1 = _mm512_loadu_si512(c + 64 * (j + 1));
        for (int mm = 0; mm < MR; ++mm) {
          int32_t x0, x1;
          std::memcpy(&x0, xrow[mm] + b * kBlock + 4 * j, 4);
          std::memcpy(&x1, xrow[mm] + b * kBlock + 4 * j + 4, 4);
          // x + 128 as unsigned bytes times the signed codes; 128 * sum(codes) is taken off below.
          ia[mm] = _mm512_dpbusd_epi32(ia[mm], _mm512_set1_epi32(x0 ^ int32_t(0x80808080)), w0);
          ib[mm] = _mm512_dpbusd_epi32(ib[mm], _mm512_set1_epi32(x1 ^ int32_t(0x80808080)), w1);
        }
      }
      const __m512i wsum = _mm512_slli_epi32(
          _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(aux + b * kTile))), 7);
      for (int mm = 0; mm < MR; ++mm) ia[mm] = _mm512_sub_epi32(ia[mm], wsum);
    } else {
      const uint8_t* c = codes + b * 256;
      for (int p = 0; p < 4; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * p), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(c + 64 * p);
        const __m512i lo = _mm512_and_si512(w, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        for (int mm = 0; mm < MR; ++mm) {
          int32_t xl, xh;
          std::memcpy(&xl, xrow[mm] + b * kBlock + 8 * p, 4);
          std::memcpy(&xh, xrow[mm] + b * kBlock + 8 * p + 4, 4);
          ia[mm] = _mm512_dpbusd_epi32(ia[mm], lo, _mm512_set1_epi32(xl));
          ib[mm] = _mm512_dpbusd_epi32(ib[mm], hi, _mm512_set1_epi32(xh));
        }
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kTile)));
    __m512 ov = _mm512_setzero_ps();
    if (kind == Q4_SYM) ov = _mm512_mul_ps(dv, _mm512_set1_ps(-8.f));
    if (kind == Q4_ASYM) ov = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(aux + b * kTile)));
    for (int mm = 0; mm < MR; ++mm) {
      const int64_t i = (m0 + mm) * x.Kb + b;
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(ia[mm], ib[mm]));
      acc[mm] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(x.d[i])), acc[mm]);
      if (kind != Q8) acc_off[mm] = _mm512_fmadd_ps(ov, _mm512_set1_ps(x.ds[i]), acc_off[mm]);
    }
  }
  const __mmask16 mask = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
  for (int mm = 0; mm < MR; ++mm) _mm512_mask_storeu_ps(y + mm * ldy, mask, _mm512_add_ps(acc[mm], acc_off[mm]));
}
constexpr int kMaxMR = 4;
#define PAGEDSERVE_TILE tile_vnni
#define PAGEDSERVE_QUANT_ISA "avx512-vnni"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---------------------------------------------------------------- AVX2: a tile as two halves of 8 rows
// acc[mm] += the block's integer sums scaled by weight and activation scales (plus, for
// the 4-bit kinds, their offset times the activations' block sum): rows 8h..8h+7 of
// block b, for activation rows m0..m0+MR-1.
template <int MR>
inline void add_block_avx2(const uint16_t* d, const uint16_t* aux, int64_t kind, const QuantizedX& x, int64_t m0,
                           int64_t b, int h, const __m256i* iacc, __m256* acc) {
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * kTile + 8 * h)));
  __m256 ov = _mm256_setzero_ps();
  if (kind == Q4_SYM) ov = _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
  if (kind == Q4_ASYM)
    ov = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(aux + b * kTile + 8 * h)));
  for (int mm = 0; mm < MR; ++mm) {
    const int64_t i = (m0 + mm) * x.Kb + b;
    acc[mm] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[mm]), _mm256_mul_ps(dv, _mm256_set1_ps(x.d[i])), acc[mm]);
    if (kind != Q8) acc[mm] = _mm256_fmadd_ps(ov, _mm256_set1_ps(x.ds[i]), acc[mm]);
  }
}

template <int MR>
void half_avx2(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
               const QuantizedX& x, int64_t m0, int h, float* out /* [MR][8] */) {
  __m256 acc[MR];
  for (int mm = 0; mm < MR; ++mm) acc[mm] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xrow[MR];
  for (int mm = 0; mm < MR; ++mm) xrow[mm] = x.q + (m0 + mm) * x.K;
  for (int64_t b = 0; b < x.Kb; ++b) {
    __m256i iacc[MR];
    if (kind == Q8) {
      for (int mm = 0; mm < MR; ++mm) iacc[mm] = _mm256_setzero_si256();
      const uint8_t* c = codes + b * 512 + 32 * h;
      for (int j = 0; j < 8; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * j), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * j));
        const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes; the sign moves to x
        for (int mm = 0; mm < MR; ++mm) {
          int32_t xv;
          std::memcpy(&xv, xrow[mm] + b * kBlock + 4 * j, 4);
          const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(xv), w);
          iacc[mm] = _mm256_add_epi32(iacc[mm], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
      }
    } else {
      __m256i sacc[MR];  // int16: 8 products of at most 2*15*127 each fit
      for (int mm = 0; mm < MR; ++mm) sacc[mm] = _mm256_setzero_si256();
      const uint8_t* c = codes + b * 256 + 32 * h;
      for (int p = 0; p < 4; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * p), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p));
        const __m256i lo = _mm256_and_si256(w, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        for (int mm = 0; mm < MR; ++mm) {
          int32_t xl, xh;
          std::memcpy(&xl, xrow[mm] + b * kBlock + 8 * p, 4);
          std::memcpy(&xh, xrow[mm] + b * kBlock + 8 * p + 4, 4);
          sacc[mm] = _mm256_add_epi16(sacc[mm], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)));
          sacc[mm] = _mm256_add_epi16(sacc[mm], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
        }
      }
      for (int mm = 0; mm < MR; ++mm) iacc[mm] = _mm256_madd_epi16(sacc[mm], ones);
    }
    add_block_avx2<MR>(d, aux, kind, x, m0, b, h, iacc, acc);
  }
  for (int mm = 0; mm < MR; ++mm) _mm256_storeu_ps(out + 8 * mm, acc[mm]);
}

// Both halves of a tile in one pass over its blocks, for one or two activation rows
// (decode): a pass per half streamed the tile from memory in the first and from cache in
// the second, when no memory read was in flight; one pass keeps the stream going (the
// 1.7B shape's Q4_0 linears: 57 -> 49 ms a token on a Zen 3, alternated in one process).
// More rows would need more than the 16 AVX2 registers, so they keep two passes.
template <int MR>
void full_avx2(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
               const QuantizedX& x, int64_t m0, float* out /* [MR][16] */) {
  __m256 acc[2][MR];
  for (int mm = 0; mm < MR; ++mm) acc[0][mm] = acc[1][mm] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xrow[MR];
  for (int mm = 0; mm < MR; ++mm) xrow[mm] = x.q + (m0 + mm) * x.K;
  for (int64_t b = 0; b < x.Kb; ++b) {
    __m256i iacc[2][MR];
    if (kind == Q8) {
      for (int mm = 0; mm < MR; ++mm) iacc[0][mm] = iacc[1][mm] = _mm256_setzero_si256();
      const uint8_t* c = codes + b * 512;
      for (int j = 0; j < 8; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * j), _MM_HINT_T0);
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * j + 32 * h));
          const __m256i aw = _mm256_sign_epi8(w, w);
          for (int mm = 0; mm < MR; ++mm) {
            int32_t xv;
            std::memcpy(&xv, xrow[mm] + b * kBlock + 4 * j, 4);
            const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(xv), w);
            iacc[h][mm] = _mm256_add_epi32(iacc[h][mm], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
          }
        }
      }
    } else {
      __m256i sacc[2][MR];
      for (int mm = 0; mm < MR; ++mm) sacc[0][mm] = sacc[1][mm] = _mm256_setzero_si256();
      const uint8_t* c = codes + b * 256;
      for (int p = 0; p < 4; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * p), _MM_HINT_T0);
        __m256i xl[MR], xh[MR];
        for (int mm = 0; mm < MR; ++mm) {
          int32_t l, hh;
          std::memcpy(&l, xrow[mm] + b * kBlock + 8 * p, 4);
          std::memcpy(&hh, xrow[mm] + b * kBlock + 8 * p + 4, 4);
          xl[mm] = _mm256_set1_epi32(l);
          xh[mm] = _mm256_set1_epi32(hh);
        }
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p + 32 * h));
          const __m256i lo = _mm256_and_si256(w, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
          for (int mm = 0; mm < MR; ++mm) {
            sacc[h][mm] = _mm256_add_epi16(sacc[h][mm], _mm256_maddubs_epi16(lo, xl[mm]));
            sacc[h][mm] = _mm256_add_epi16(sacc[h][mm], _mm256_maddubs_epi16(hi, xh[mm]));
          }
        }
      }
      for (int mm = 0; mm < MR; ++mm)
        for (int h = 0; h < 2; ++h) iacc[h][mm] = _mm256_madd_epi16(sacc[h][mm], ones);
    }
    _mm_prefetch(reinterpret_cast<const char*>(d + b * kTile) + kPrefetch / 8, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) add_block_avx2<MR>(d, aux, kind, x, m0, b, h, iacc[h], acc[h]);
  }
  for (int mm = 0; mm < MR; ++mm)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + 16 * mm + 8 * h, acc[h][mm]);
}

template <int MR>
void tile_avx2(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
               const QuantizedX& x, int64_t m0, int rows, float* y, int64_t ldy) {
  if constexpr (MR <= 2) {
    float full[MR * 16];
    full_avx2<MR>(codes, d, aux, kind, x, m0, full);
    for (int mm = 0; mm < MR; ++mm)
      for (int r = 0; r < rows; ++r) y[mm * ldy + r] = full[mm * 16 + r];
    return;
  }
  float out[2][MR * 8];
  half_avx2<MR>(codes, d, aux, kind, x, m0, 0, out[0]);
  if (rows > 8) half_avx2<MR>(codes, d, aux, kind, x, m0, 1, out[1]);
  for (int mm = 0; mm < MR; ++mm)
    for (int r = 0; r < rows; ++r) y[mm * ldy + r] = out[r / 8][mm * 8 + r % 8];
}
constexpr int kMaxMR = 4;
#define PAGEDSERVE_TILE tile_avx2
#define PAGEDSERVE_QUANT_ISA "avx2"

#else
#define PAGEDSERVE_QUANT_ISA "plain"
#endif

void run_tile(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind, const QuantizedX& x,
              int64_t m0, int64_t mr, int rows, float* y, int64_t ldy) {
#ifdef PAGEDSERVE_TILE
  while (mr > 0) {
    const int64_t n = std::min<int64_t>(mr, kMaxMR);
    switch (n) {
      case 4: PAGEDSERVE_TILE<4>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
      case 3: PAGEDSERVE_TILE<3>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
      case 2: PAGEDSERVE_TILE<2>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
      default: PAGEDSERVE_TILE<1>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
    }
    m0 += n;
    mr -= n;
    y += n * ldy;
  }
#else
  tile_plain(codes, d, aux, kind, x, m0, mr, rows, y, ldy);
#endif
}

void check_cpu_contiguous(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
}

// x [M, K] float32/bfloat16/float16 -> (int8 codes [M, K], scales [M, K/32], scale * code sum [M, K/32]).
std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x must be [M, K] with K a multiple of 32");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), Kb = K / kBlock;
  auto q = torch::empty({M, K}, torch::kInt8);
  auto d = torch::empty({M, Kb}, torch::kFloat32);
  auto ds = torch::empty({M, Kb}, torch::kFloat32);
  const float* src = xf.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  float* dsp = ds.data_ptr<float>();
  at::parallel_for(0, M * Kb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = src + i * kBlock;
      float amax = 0.f;
      for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int k = 0; k < kBlock; ++k) {
        const int32_t c = static_cast<int32_t>(std::nearbyint(v[k] * inv));
        qp[i * kBlock + k] = static_cast<int8_t>(c);
        sum += c;
      }
      dp[i] = scale;
      dsp[i] = scale * float(sum);
    }
  });
  return {q, d, ds};
}

// out[:, col : col + N] = x . W^T for one packed weight (codes, d, aux as described above).
void qgemm(torch::Tensor xq, torch::Tensor xd, torch::Tensor xds, torch::Tensor codes, torch::Tensor d,
           torch::Tensor aux, int64_t kind, int64_t N, torch::Tensor out, int64_t col) {
  for (auto* t : {&xq, &xd, &xds, &codes, &d}) check_cpu_contiguous(*t, "qgemm inputs");
  TORCH_CHECK(kind == Q4_SYM || kind == Q4_ASYM || kind == Q8, "unknown kind ", kind);
  TORCH_CHECK(kind == Q4_SYM || (aux.defined() && aux.is_contiguous()), "this kind needs its aux tensor");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.stride(1) == 1, "out must be float32 with unit stride");
  const int64_t M = xq.size(0), K = xq.size(1), Kb = K / kBlock;
  const int64_t tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(codes.numel() == tiles * Kb * block_bytes(kind), "codes do not match N=", N, ", K=", K);
  TORCH_CHECK(out.size(0) == M && col + N <= out.size(1), "out is too small");
  const QuantizedX x{xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xds.data_ptr<float>(), M, K, Kb};
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* ap = kind == Q4_SYM ? nullptr : static_cast<const uint16_t*>(aux.data_ptr());
  float* yp = out.data_ptr<float>() + col;
  const int64_t ldy = out.stride(0);
  constexpr int64_t kMChunk = 64;  // activation rows kept hot while a thread's tiles stream past
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMChunk) {
      const int64_t mr = std::min(kMChunk, M - m0);
      for (int64_t t = t0; t < t1; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, N - t * kTile));
        float* y = yp + m0 * ldy + t * kTile;
        if (rows == kTile) {
          run_tile(cp + t * Kb * block_bytes(kind), dp + t * Kb * kTile, ap ? ap + t * Kb * kTile : nullptr, kind,
                   x, m0, mr, rows, y, ldy);
        } else {  // the last, partial tile: through a buffer, so no store reaches past N
          float buf[kMChunk * kTile];
          run_tile(cp + t * Kb * block_bytes(kind), dp + t * Kb * kTile, ap ? ap + t * Kb * kTile : nullptr, kind,
                   x, m0, mr, kTile, buf, kTile);
          for (int64_t mm = 0; mm < mr; ++mm)
            for (int r = 0; r < rows; ++r) y[mm * ldy + r] = buf[mm * kTile + r];
        }
      }
    }
  });
}

// y [M, N] in x's dtype = x [M, Kx] . W^T, W made of row segments (a fused q|k|v whose
// shards are of different kinds): the whole layer in one call, activations quantized once.
// K >= Kx is the packed (block-padded) width; x's missing columns count as zeros.
torch::Tensor linear(const torch::Tensor& x, at::TensorList codes, at::TensorList d, at::TensorList aux,
                     at::IntArrayRef kinds, at::IntArrayRef ns, at::IntArrayRef offsets, int64_t N, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= K, "x must be [M, <= K]");
  TORCH_CHECK(codes.size() == d.size() && d.size() == aux.size() && aux.size() == kinds.size() &&
              kinds.size() == ns.size() && ns.size() == offsets.size() && !codes.empty(), "segment lists differ");
  auto xk = x.size(1) == K ? x : torch::constant_pad_nd(x, {0, K - x.size(1)});
  auto q = quantize_activations(xk);
  auto out = torch::empty({x.size(0), N}, torch::kFloat32);
  for (size_t i = 0; i < codes.size(); ++i)
    qgemm(q[0], q[1], q[2], codes[i], d[i], aux[i], kinds[i], ns[i], out, offsets[i]);
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}

// Rows `ids` of the packed weight, dequantized: [len(ids), K] float32 (embedding lookups).
torch::Tensor dequantize_rows(torch::Tensor codes, torch::Tensor d, torch::Tensor aux, int64_t kind, int64_t K,
                              torch::Tensor ids) {
  check_cpu_contiguous(codes, "codes");
  auto idx = ids.to(torch::kInt64).contiguous();
  const int64_t T = idx.numel(), Kb = K / kBlock;
  auto out = torch::empty({T, K}, torch::kFloat32);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* ap = kind == Q4_SYM ? nullptr : static_cast<const uint16_t*>(aux.data_ptr());
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = ip[i], t = n / kTile, r = n % kTile;
      for (int64_t b = 0; b < Kb; ++b) {
        const uint8_t* c = cp + (t * Kb + b) * block_bytes(kind);
        const float dw = half_to_float(dp[(t * Kb + b) * kTile + r]);
        float off = 0.f;
        if (kind == Q4_SYM) off = -8.f * dw;
        if (kind == Q4_ASYM) off = half_to_float(ap[(t * Kb + b) * kTile + r]);
        for (int k = 0; k < kBlock; ++k) {
          float u;
          if (kind == Q8) {
            u = float(reinterpret_cast<const int8_t*>(c)[(k / 4) * 64 + r * 4 + k % 4]);
          } else {
            const uint8_t byte = c[(k / 8) * 64 + r * 4 + (k % 8) % 4];
            u = float((k % 8) < 4 ? (byte & 15) : (byte >> 4));
          }
          op[i * K + b * kBlock + k] = dw * u + off;
        }
      }
    }
  });
  return out;
}

std::string isa() { return PAGEDSERVE_QUANT_ISA; }

}  // namespace (everything internal: builds for several ISAs load into one process in tests)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("quantize_activations", &quantize_activations, nogil);
  m.def("qgemm", &qgemm, nogil);
  m.def("linear", [](const torch::Tensor& x, const std::vector<torch::Tensor>& codes,
                     const std::vector<torch::Tensor>& d, const std::vector<torch::Tensor>& aux,
                     const std::vector<int64_t>& kinds, const std::vector<int64_t>& ns,
                     const std::vector<int64_t>& offsets, int64_t N, int64_t K) {
    return linear(x, codes, d, aux, kinds, ns, offsets, N, K);
  }, nogil);
  m.def("dequantize_rows", &dequantize_rows, nogil);
  m.def("isa", &isa);
}

// The same layer forward as a torch operator, torch.ops.<this module's name>.linear, so a
// torch.compile'd graph calls it directly (no Python in between); the namespace is the
// build's own, since builds for several ISAs can be loaded into one process.
#define PAGEDSERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDSERVE_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
PAGEDSERVE_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("linear(Tensor x, Tensor[] codes, Tensor[] d, Tensor[] aux, int[] kinds, int[] ns, int[] offsets, "
        "int N, int K) -> Tensor");
}
PAGEDSERVE_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) { m.impl("linear", &linear); }
