// Weight-only quantized linear layers for CPUs: y[M, N] = x[M, K] . W[N, K]^T, with W in
// blocks of 32 weights that share a scale (llama.cpp's Q4_0, Q4_1, Q8_0, and the 4-bit
// K-quants, converted at load by layers/quantization.py).  The activations are quantized
// per block of 32 too (one float scale each), to 16-bit codes by default or to 8-bit ones
// (llama.cpp's scheme, an opt-in), and every block's dot product is an integer dot
// product, scaled once.
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
// AVX-512 VNNI (vpdpwssd / vpdpbusd; from 4 activation rows, two tiles at a time), AVX2 (vpmaddwd / vpmaddubsw; for 16-bit activations of 16
// rows or more, codes widened once per tile and the activations in panels), plain loops.

// Only the headers used (torch/extension.h would pull in all of torch: a third of the build time).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 16;
// Bytes ahead of the current block that the weight stream prefetches (decode is bound by
// how many cache-line reads are in flight; the hardware prefetcher alone keeps too few).
constexpr int kPrefetch = 2048;
constexpr int kBlock = 32;
constexpr int64_t kPanelRows = 4;  // activation rows per panel (AVX2's many-row path)
constexpr int64_t kMChunk = 64;  // activation rows kept hot while a thread's tiles stream past
enum Kind : int64_t { Q4_SYM = 0, Q4_ASYM = 1, Q8 = 2 };

inline int64_t block_bytes(int64_t kind) { return kind == Q8 ? 512 : 256; }

inline float half_to_float(uint16_t h) {
  c10::Half v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

// Activations, quantized per block of 32 (one float scale each) to 16-bit codes (the
// default: the rounding is 1/256 of what 8 bits give, far below the weights' own, so the
// answers are the dequantized model's) or 8-bit codes (llama.cpp's scheme: faster where
// compute bounds, i.e. long prompts; it changes answers on small models).  16-bit codes
// are stored in pair order: within every 4 values, x0 x2 x1 x3, so one 32-bit word holds
// the two activations that meet one 32-bit lane's two 16-bit weights (see dot16 below).
struct QuantizedX {
  const int8_t* q8;    // [M, K] when 8-bit
  const int16_t* q16;  // [M, K] when 16-bit (pair order)
  const float* d;      // [M, Kb]
  const float* ds;     // [M, Kb]: scale * sum(codes)
  int64_t M, K, Kb;
  // The same 16-bit activations as panels of kPanelRows rows (`pack_panels`), for the
  // AVX2 path of many rows; null where that path is not taken.
  const int32_t* panel = nullptr;  // [groups][Kb][16 words][kPanelRows]: word v of a block = its codes 2v, 2v+1 (pair order)
  const float* panel_d = nullptr;   // [groups][Kb][kPanelRows], rows past M zero
  const float* panel_ds = nullptr;  // likewise
};

// Where logical column k of a block sits in the 16-bit pair order.
inline int pair_pos(int k) { return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1); }

// ---------------------------------------------------------------- plain loops
void tile_plain(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
                const QuantizedX& x, int64_t m0, int64_t mr, int rows, float* y, int64_t ldy) {
  for (int64_t mm = 0; mm < mr; ++mm) {
    const int64_t m = m0 + mm;
    for (int r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.Kb; ++b) {
        const int64_t base = m * x.K + b * kBlock;
        int32_t dot = 0;
        for (int k = 0; k < kBlock; ++k) {
          const int32_t xv = x.q16 ? int32_t(x.q16[base + pair_pos(k)]) : int32_t(x.q8[base + k]);
          int32_t w;
          if (kind == Q8) {
            w = reinterpret_cast<const int8_t*>(codes + b * 512)[(k / 4) * 64 + r * 4 + k % 4];
          } else {
            const uint8_t byte = codes[b * 256 + (k / 8) * 64 + r * 4 + (k % 8) % 4];
            w = (k % 8) < 4 ? (byte & 15) : (byte >> 4);
          }
          dot += w * xv;
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

inline int32_t load_word(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---------------------------------------------------------------- AVX-512 VNNI
// XB: the activations' bits.  8: one vpdpbusd per 64 multiply-adds.  16: one vpdpwssd per
// 32, the weights widened in registers: a 32-bit lane (one row) holds two of the row's
// weights as int16, met by a broadcast word of two activations in pair order.
// Block b's weight scales for a tile's 16 rows: dv, and the offsets ov (Q4_SYM: -8 dv;
// Q4_ASYM: the stored offsets; Q8: none).  Both AVX-512 paths scale each block through
// these helpers, so their outputs are bit for bit the same.
struct BlockScales {
  __m512 dv, ov;
};
inline BlockScales block_scales_vnni(const uint16_t* d, const uint16_t* aux, int64_t kind, int64_t b) {
  const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kTile)));
  if (kind == Q4_SYM) return {dv, _mm512_mul_ps(dv, _mm512_set1_ps(-8.f))};
  if (kind == Q4_ASYM) return {dv, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(aux + b * kTile)))};
  return {dv, _mm512_setzero_ps()};
}
// acc += one activation row's integer sums of block b times the weight and activation
// scales (xd); with `offsets` (the 4-bit kinds), acc_off += the offsets times xds (the
// activation scale times its codes' sum).
inline void add_block_vnni(__m512i sum, const BlockScales& s, bool offsets, float xd, float xds, __m512& acc,
                           __m512& acc_off) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s.dv, _mm512_set1_ps(xd)), acc);
  if (offsets) acc_off = _mm512_fmadd_ps(s.ov, _mm512_set1_ps(xds), acc_off);
}
// 8-bit activations against Q8 codes multiply x + 128: 128 times each row's code sum of
// block b (aux) comes off the integer sums.
inline __m512i q8_bias_vnni(const uint16_t* aux, int64_t b) {
  return _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(aux + b * kTile))), 7);
}

template <int MR, int XB>
void tile_vnni(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
               const QuantizedX& x, int64_t m0, int rows, float* y, int64_t ldy) {
  // Several integer and two float accumulators per activation row: the dependency chains of
  // the dot products (5 cycles each) and of the fused multiply-adds bound one row (decode).
  constexpr int kChains = XB == 8 ? 2 : 4;
  __m512 acc[MR], acc_off[MR];
  for (int mm = 0; mm < MR; ++mm) acc[mm] = acc_off[mm] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i low4w = _mm512_set1_epi32(0x000F000F), high4w = _mm512_set1_epi32(0x00F000F0);
  for (int64_t b = 0; b < x.Kb; ++b) {
    __m512i ia[kChains][MR];
    for (int c = 0; c < kChains; ++c)
      for (int mm = 0; mm < MR; ++mm) ia[c][mm] = _mm512_setzero_si512();
    const int64_t xo = b * kBlock;
    if (kind == Q8) {
      const uint8_t* c = codes + b * 512;
      for (int j = 0; j < 8; j += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * j + 64), _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(c + 64 * j);
        const __m512i w1 = _mm512_loadu_si512(c + 64 * (j + 1));
        if constexpr (XB == 8) {
          for (int mm = 0; mm < MR; ++mm) {
            const int8_t* xr = x.q8 + (m0 + mm) * x.K + xo;
            // x + 128 as unsigned bytes times the signed codes; 128 * sum(codes) is taken off below.
            ia[0][mm] = _mm512_dpbusd_epi32(ia[0][mm], _mm512_set1_epi32(load_word(xr + 4 * j) ^ int32_t(0x80808080)), w0);
            ia[1][mm] = _mm512_dpbusd_epi32(ia[1][mm], _mm512_set1_epi32(load_word(xr + 4 * j + 4) ^ int32_t(0x80808080)), w1);
          }
        } else {  // bytes 0, 2 of a lane (k = 4j, 4j+2) and bytes 1, 3 (4j+1, 4j+3), sign-extended
          const __m512i e0 = _mm512_srai_epi16(_mm512_slli_epi16(w0, 8), 8), o0 = _mm512_srai_epi16(w0, 8);
          const __m512i e1 = _mm512_srai_epi16(_mm512_slli_epi16(w1, 8), 8), o1 = _mm512_srai_epi16(w1, 8);
          for (int mm = 0; mm < MR; ++mm) {
            const int16_t* xr = x.q16 + (m0 + mm) * x.K + xo + 4 * j;
            ia[0][mm] = _mm512_dpwssd_epi32(ia[0][mm], e0, _mm512_set1_epi32(load_word(xr)));
            ia[1][mm] = _mm512_dpwssd_epi32(ia[1][mm], o0, _mm512_set1_epi32(load_word(xr + 2)));
            ia[2][mm] = _mm512_dpwssd_epi32(ia[2][mm], e1, _mm512_set1_epi32(load_word(xr + 4)));
            ia[3][mm] = _mm512_dpwssd_epi32(ia[3][mm], o1, _mm512_set1_epi32(load_word(xr + 6)));
          }
        }
      }
      if constexpr (XB == 8) {
        const __m512i wsum = q8_bias_vnni(aux, b);
        for (int mm = 0; mm < MR; ++mm) ia[0][mm] = _mm512_sub_epi32(ia[0][mm], wsum);
      }
    } else {
      const uint8_t* c = codes + b * 256;
      for (int p = 0; p < 4; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64 * p), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(c + 64 * p);
        if constexpr (XB == 8) {
          const __m512i lo = _mm512_and_si512(w, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
          for (int mm = 0; mm < MR; ++mm) {
            const int8_t* xr = x.q8 + (m0 + mm) * x.K + xo + 8 * p;
            ia[0][mm] = _mm512_dpbusd_epi32(ia[0][mm], lo, _mm512_set1_epi32(load_word(xr)));
            ia[1][mm] = _mm512_dpbusd_epi32(ia[1][mm], hi, _mm512_set1_epi32(load_word(xr + 4)));
          }
        } else {  // the low nibbles of bytes 0, 2 (k = 8p, 8p+2), of bytes 1, 3; then the high nibbles,
                  // left in place (16 times the code: chains 2 and 3 are divided by 16 below, exactly)
          const __m512i w8 = _mm512_srli_epi32(w, 8);
          const __m512i w0 = _mm512_and_si512(w, low4w), w1 = _mm512_and_si512(w8, low4w);
          const __m512i w2 = _mm512_and_si512(w, high4w), w3 = _mm512_and_si512(w8, high4w);
          for (int mm = 0; mm < MR; ++mm) {
            const int16_t* xr = x.q16 + (m0 + mm) * x.K + xo + 8 * p;
            ia[0][mm] = _mm512_dpwssd_epi32(ia[0][mm], w0, _mm512_set1_epi32(load_word(xr)));
            ia[1][mm] = _mm512_dpwssd_epi32(ia[1][mm], w1, _mm512_set1_epi32(load_word(xr + 2)));
            ia[2][mm] = _mm512_dpwssd_epi32(ia[2][mm], w2, _mm512_set1_epi32(load_word(xr + 4)));
            ia[3][mm] = _mm512_dpwssd_epi32(ia[3][mm], w3, _mm512_set1_epi32(load_word(xr + 6)));
          }
        }
      }
    }
    const BlockScales scales = block_scales_vnni(d, aux, kind, b);
    for (int mm = 0; mm < MR; ++mm) {
      const int64_t i = (m0 + mm) * x.Kb + b;
      __m512i sum = _mm512_add_epi32(ia[0][mm], ia[1][mm]);
      if constexpr (kChains == 4) {
        const __m512i upper = _mm512_add_epi32(ia[2][mm], ia[3][mm]);
        sum = _mm512_add_epi32(sum, kind == Q8 ? upper : _mm512_srai_epi32(upper, 4));
      }
      add_block_vnni(sum, scales, kind != Q8, x.d[i], x.ds[i], acc[mm], acc_off[mm]);
    }
  }
  const __mmask16 mask = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
  for (int mm = 0; mm < MR; ++mm) _mm512_mask_storeu_ps(y + mm * ldy, mask, _mm512_add_ps(acc[mm], acc_off[mm]));
}
constexpr int kMaxMR = 4;
#define PAGEDSERVE_TILE tile_vnni

// Two neighbouring tiles (32 rows of W; the second's codes, scales and offsets `ts` and
// `tsd` further on) against MR activation rows: the batches and prompts path.  There,
// tile_vnni issues one broadcast load per vpdpwssd (or vpdpbusd), and those loads
// bounded it with the per-block scaling (the 1.7B shape's Q4_0 linears at 310 GMAC/s on a
// Zen 5, AVX-512 with native bf16, 2 threads; ~17% more with either taken away).  Here each
// activation word meets both tiles' weights: half the broadcasts per multiply-add (345-367
// GMAC/s from 32 rows, 285-293 at 8 against 265; 8-bit activations 430-506 -> 484-566,
// 8-bit codes 1.4x).  For 16-bit activations 4-bit high nibbles are shifted down
// once per chunk, so a row's integer sum is one chain per tile; it equals tile_vnni's
// (whose high nibbles are 16 times the code, divided out exactly), and the float
// operations on it are tile_vnni's, in its order: every output is bit for bit tile_vnni's.
// kQ8: the weights are 8-bit codes (kind Q8), a template argument: as a run-time branch in
// the chunk loop it cost the 4-bit kinds 10-25%.  XB: the activations' bits, as in tile_vnni
// (8: vpdpbusd, 64 multiply-adds each, on unwidened codes).
template <int MR, bool kQ8, int XB>
void pair_vnni(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind, int64_t ts, int64_t tsd,
               const QuantizedX& x, int64_t m0, float* y, int64_t ldy) {
  __m512 acc[2][MR], acc_off[2][MR];
  for (int t = 0; t < 2; ++t)
    for (int mm = 0; mm < MR; ++mm) acc[t][mm] = acc_off[t][mm] = _mm512_setzero_ps();
  const __m512i low4w = _mm512_set1_epi32(0x000F000F), low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < x.Kb; ++b) {
    __m512i ia[2][MR];
    for (int t = 0; t < 2; ++t)
      for (int mm = 0; mm < MR; ++mm) ia[t][mm] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      // Per tile, the codes of k = 8p..8p+7.  16-bit activations: k = 8p + {0, 2}, {1, 3},
      // {4, 6}, {5, 7} (pair order), 4-bit codes from one 64-byte chunk, 8-bit ones
      // sign-extended from two (bytes 0 and 2 of a lane, then 1 and 3).  8-bit activations:
      // k = 8p + 0..3, then 4..7 (low and high nibbles of one chunk, or two chunks as they are).
      __m512i w[2][4];
      for (int t = 0; t < 2; ++t) {
        if constexpr (kQ8) {
          const uint8_t* c = codes + t * ts + b * 512 + 128 * p;
          _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch + 64), _MM_HINT_T0);
          const __m512i v0 = _mm512_loadu_si512(c), v1 = _mm512_loadu_si512(c + 64);
          if constexpr (XB == 8) {
            w[t][0] = v0;
            w[t][1] = v1;
          } else {
            w[t][0] = _mm512_srai_epi16(_mm512_slli_epi16(v0, 8), 8);
            w[t][1] = _mm512_srai_epi16(v0, 8);
            w[t][2] = _mm512_srai_epi16(_mm512_slli_epi16(v1, 8), 8);
            w[t][3] = _mm512_srai_epi16(v1, 8);
          }
        } else {
          const uint8_t* c = codes + t * ts + b * 256 + 64 * p;
          _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetch), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(c);
          if constexpr (XB == 8) {
            w[t][0] = _mm512_and_si512(v, low4);
            w[t][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          } else {
            const __m512i v8 = _mm512_srli_epi32(v, 8);
            w[t][0] = _mm512_and_si512(v, low4w);
            w[t][1] = _mm512_and_si512(v8, low4w);
            w[t][2] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4w);
            w[t][3] = _mm512_and_si512(_mm512_srli_epi32(v8, 4), low4w);
          }
        }
      }
      for (int mm = 0; mm < MR; ++mm) {
        if constexpr (XB == 8) {
          const int8_t* xr = x.q8 + (m0 + mm) * x.K + b * kBlock + 8 * p;
          for (int j = 0; j < 2; ++j) {
            if constexpr (kQ8) {  // x + 128 as unsigned bytes times the signed codes; 128 * sum(codes) is taken off below
              const __m512i xb = _mm512_set1_epi32(load_word(xr + 4 * j) ^ int32_t(0x80808080));
              ia[0][mm] = _mm512_dpbusd_epi32(ia[0][mm], xb, w[0][j]);
              ia[1][mm] = _mm512_dpbusd_epi32(ia[1][mm], xb, w[1][j]);
            } else {
              const __m512i xb = _mm512_set1_epi32(load_word(xr + 4 * j));
              ia[0][mm] = _mm512_dpbusd_epi32(ia[0][mm], w[0][j], xb);
              ia[1][mm] = _mm512_dpbusd_epi32(ia[1][mm], w[1][j], xb);
            }
          }
        } else {
          const int16_t* xr = x.q16 + (m0 + mm) * x.K + b * kBlock + 8 * p;
          for (int j = 0; j < 4; ++j) {
            const __m512i xb = _mm512_set1_epi32(load_word(xr + 2 * j));
            ia[0][mm] = _mm512_dpwssd_epi32(ia[0][mm], w[0][j], xb);
            ia[1][mm] = _mm512_dpwssd_epi32(ia[1][mm], w[1][j], xb);
          }
        }
      }
    }
    for (int t = 0; t < 2; ++t) {
      const uint16_t* at = aux == nullptr ? nullptr : aux + t * tsd;
      if constexpr (kQ8 && XB == 8) {
        const __m512i wsum = q8_bias_vnni(at, b);
        for (int mm = 0; mm < MR; ++mm) ia[t][mm] = _mm512_sub_epi32(ia[t][mm], wsum);
      }
      const BlockScales scales = block_scales_vnni(d + t * tsd, at, kind, b);
      for (int mm = 0; mm < MR; ++mm) {
        const int64_t i = (m0 + mm) * x.Kb + b;
        add_block_vnni(ia[t][mm], scales, !kQ8, x.d[i], x.ds[i], acc[t][mm], acc_off[t][mm]);
      }
    }
  }
  for (int t = 0; t < 2; ++t)
    for (int mm = 0; mm < MR; ++mm) _mm512_storeu_ps(y + mm * ldy + kTile * t, _mm512_add_ps(acc[t][mm], acc_off[t][mm]));
}
#define PAGEDSERVE_PAIR pair_vnni
#define PAGEDSERVE_QUANT_ISA "avx512-vnni"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---------------------------------------------------------------- AVX2: a tile as two halves of 8 rows
// The integer dot products of block b with rows 8h..8h+7 of a tile, one register per
// activation row m0..m0+MR-1.  XB as in the AVX-512 path: 8-bit activations by
// vpmaddubsw (the sign moved onto x for the signed 8-bit codes), 16-bit by vpmaddwd.
template <int MR, int XB>
inline void block_dot_avx2(const uint8_t* codes, int64_t kind, const QuantizedX& x, int64_t m0, int64_t b, int h,
                           __m256i* iacc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t xo = b * kBlock;
  for (int mm = 0; mm < MR; ++mm) iacc[mm] = _mm256_setzero_si256();
  if (kind == Q8) {
    const uint8_t* c = codes + b * 512 + 32 * h;
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * j));
      if constexpr (XB == 8) {
        const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes; the sign moves to x
        for (int mm = 0; mm < MR; ++mm) {
          const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(load_word(x.q8 + (m0 + mm) * x.K + xo + 4 * j)), w);
          iacc[mm] = _mm256_add_epi32(iacc[mm], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
      } else {
        const __m256i e = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), o = _mm256_srai_epi16(w, 8);
        for (int mm = 0; mm < MR; ++mm) {
          const int16_t* xr = x.q16 + (m0 + mm) * x.K + xo + 4 * j;
          iacc[mm] = _mm256_add_epi32(iacc[mm], _mm256_add_epi32(_mm256_madd_epi16(e, _mm256_set1_epi32(load_word(xr))),
                                                                 _mm256_madd_epi16(o, _mm256_set1_epi32(load_word(xr + 2)))));
        }
      }
    }
    return;
  }
  const uint8_t* c = codes + b * 256 + 32 * h;
  if constexpr (XB == 8) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i sacc[MR];  // int16: 8 products of at most 2*15*127 each fit
    for (int mm = 0; mm < MR; ++mm) sacc[mm] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p));
      const __m256i lo = _mm256_and_si256(w, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      for (int mm = 0; mm < MR; ++mm) {
        const int8_t* xr = x.q8 + (m0 + mm) * x.K + xo + 8 * p;
        sacc[mm] = _mm256_add_epi16(sacc[mm], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_word(xr))));
        sacc[mm] = _mm256_add_epi16(sacc[mm], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_word(xr + 4))));
      }
    }
    for (int mm = 0; mm < MR; ++mm) iacc[mm] = _mm256_madd_epi16(sacc[mm], ones);
  } else {
    // as on AVX-512: the high nibbles stay in place (16 times the code), and their products'
    // sums are divided by 16, exactly, before they join the rest
    const __m256i low4w = _mm256_set1_epi32(0x000F000F), high4w = _mm256_set1_epi32(0x00F000F0);
    for (int p = 0; p < 4; ++p) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p));
      const __m256i w8 = _mm256_srli_epi32(w, 8);
      const __m256i w0 = _mm256_and_si256(w, low4w), w1 = _mm256_and_si256(w8, low4w);
      const __m256i w2 = _mm256_and_si256(w, high4w), w3 = _mm256_and_si256(w8, high4w);
      for (int mm = 0; mm < MR; ++mm) {
        const int16_t* xr = x.q16 + (m0 + mm) * x.K + xo + 8 * p;
        const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_set1_epi32(load_word(xr))),
                                             _mm256_madd_epi16(w1, _mm256_set1_epi32(load_word(xr + 2))));
        const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(w2, _mm256_set1_epi32(load_word(xr + 4))),
                                             _mm256_madd_epi16(w3, _mm256_set1_epi32(load_word(xr + 6))));
        iacc[mm] = _mm256_add_epi32(iacc[mm], _mm256_add_epi32(s01, _mm256_srai_epi32(s23, 4)));
      }
    }
  }
}

// acc[mm] += the block's integer sums scaled by weight and activation scales (plus, for
// the 4-bit kinds, their offset times the activations' block sum): rows 8h..8h+7 of
// block b, for MR activation rows whose block scales are xd[mm * xs] and xds[mm * xs]
// (rows of QuantizedX's d/ds, or a panel's).  Both AVX2 paths scale through here, so
// their outputs are bit for bit the same.
template <int MR>
inline void add_block_avx2(const uint16_t* d, const uint16_t* aux, int64_t kind, int64_t b, int h, const float* xd,
                           const float* xds, int64_t xs, const __m256i* iacc, __m256* acc) {
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * kTile + 8 * h)));
  __m256 ov = _mm256_setzero_ps();
  if (kind == Q4_SYM) ov = _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
  if (kind == Q4_ASYM)
    ov = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(aux + b * kTile + 8 * h)));
  for (int mm = 0; mm < MR; ++mm) {
    acc[mm] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[mm]), _mm256_mul_ps(dv, _mm256_set1_ps(xd[mm * xs])), acc[mm]);
    if (kind != Q8) acc[mm] = _mm256_fmadd_ps(ov, _mm256_set1_ps(xds[mm * xs]), acc[mm]);
  }
}

// Halves h0..h0+NH-1 of a tile in one pass over its blocks.  For one or two activation
// rows (decode) both halves go in one pass: a pass per half streamed the tile from memory
// in the first and from cache in the second, when no memory read was in flight; one pass
// keeps the stream going (the 1.7B shape's Q4_0 linears: 57 -> 49 ms a token on a Zen 3,
// alternated in one process).  More rows would need more than the 16 AVX2 registers, so
// they take a pass per half.
template <int MR, int XB, int NH>
void pass_avx2(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind, const QuantizedX& x,
               int64_t m0, int h0, float* out /* [MR][8 * NH] */) {
  __m256 acc[NH][MR];
  for (int h = 0; h < NH; ++h)
    for (int mm = 0; mm < MR; ++mm) acc[h][mm] = _mm256_setzero_ps();
  const int64_t bb = block_bytes(kind);
  for (int64_t b = 0; b < x.Kb; ++b) {
    for (int64_t l = 0; l < bb; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + b * bb + kPrefetch + l), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(d + b * kTile) + kPrefetch / 8, _MM_HINT_T0);
    for (int h = 0; h < NH; ++h) {
      __m256i iacc[MR];
      block_dot_avx2<MR, XB>(codes, kind, x, m0, b, h0 + h, iacc);
      const int64_t i = m0 * x.Kb + b;
      add_block_avx2<MR>(d, aux, kind, b, h0 + h, x.d + i, x.ds + i, x.Kb, iacc, acc[h]);
    }
  }
  for (int mm = 0; mm < MR; ++mm)
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(out + 8 * NH * mm + 8 * h, acc[h][mm]);
}

template <int MR, int XB>
void tile_avx2(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
               const QuantizedX& x, int64_t m0, int rows, float* y, int64_t ldy) {
  float out[MR * 16];
  if constexpr (MR <= 2) {
    pass_avx2<MR, XB, 2>(codes, d, aux, kind, x, m0, 0, out);
    for (int mm = 0; mm < MR; ++mm)
      for (int r = 0; r < rows; ++r) y[mm * ldy + r] = out[mm * 16 + r];
    return;
  }
  for (int h = 0; h < 2 && 8 * h < rows; ++h) {
    pass_avx2<MR, XB, 1>(codes, d, aux, kind, x, m0, h, out);
    for (int mm = 0; mm < MR; ++mm)
      for (int r = 8 * h; r < std::min(rows, 8 * h + 8); ++r) y[mm * ldy + r] = out[mm * 8 + r - 8 * h];
  }
}

// ---------------------------------------------------------------- AVX2, 16-bit activations, many rows
// For several activation rows (a batch, a prompt, a draft being verified) the arithmetic
// bounds, not the weight stream.  Above, widening the 4-bit codes inside the loop cost
// about as much as the multiply-adds, and each activation word's address was its own
// register (spilled: two loads per broadcast).  Here a tile's codes are widened to int16
// once per row chunk, kWideBlocks blocks at a time (`unpack_block_avx2`; below), the
// activations come as panels of kPanelRows rows
// (one base address, immediate offsets), and per block vector v (8 rows' pair of weights)
// meets word v of the block for both halves of the tile at once: 8 accumulators, 2
// weights and the broadcasts fit the 16 registers.  The integer sums equal tile_avx2's
// (its high nibbles were 16 times the code, divided out exactly) and each block is scaled
// by the same add_block_avx2, so the outputs are bit for bit its own.
// Measured on a real Zen 3, one thread, 1.7B-sized Q4_0 weights ([12288, 2048], [2048,
// 6144]): 37.5 -> 44.8 GMAC/s at 64 rows, 39.4 -> 41.6 at 256, unchanged at 16 (the scaling after each block,
// kept exact, is what is left: hand-scheduled multiply-adds alone reach ~55).
constexpr int64_t kWideMinRows = 16;  // fewer rows: tile_avx2 (at 4 rows this path measured 20% slower)

// Block b of a tile, widened: [2 halves][16 vectors], vector v of half h holding rows
// 8h..8h+7's two weights that meet the block's activation word v.
inline void unpack_block_avx2(const uint8_t* codes, int64_t kind, int64_t b, __m256i* out) {
  if (kind == Q8) {
    const uint8_t* c = codes + b * 512;
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * j + 32 * h));
        out[16 * h + 2 * j] = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);
        out[16 * h + 2 * j + 1] = _mm256_srai_epi16(w, 8);
      }
    return;
  }
  const uint8_t* c = codes + b * 256;
  const __m256i low4w = _mm256_set1_epi32(0x000F000F);
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < 4; ++p) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p + 32 * h));
      const __m256i w8 = _mm256_srli_epi32(w, 8);
      __m256i* o = out + 16 * h + 4 * p;
      o[0] = _mm256_and_si256(w, low4w);
      o[1] = _mm256_and_si256(w8, low4w);
      o[2] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4w);
      o[3] = _mm256_and_si256(_mm256_srli_epi16(w8, 4), low4w);
    }
}

// lo[mm] / hi[mm] += the integer sums of panel row mm with halves 0 / 1 of one widened
// block `wb` (16 vectors each, 512 bytes apart), the panel's words at `xp` ([16][4]):
// for each vector v, its two weight vectors meet row mm's word v by vpmaddwd.
// Written as assembly because GCC 12 compiled the same loop from intrinsics with a
// register copy per multiply-add (the eight accumulators moved back into place every
// pass: 8 vmovdqa per 8 vpmaddwd) and each weight vector loaded again by each of its
// four multiplies; here each is loaded once, and every sum is added in place.  Integer
// sums of the same products: bit for bit the intrinsics' result.  SmolLM2-135M's
// linears, AVX2 emulation on a Zen 5, 2 threads, taking turns in one process:
// 117.5 -> 139.5 GMAC/s at 32 rows, 131.5 -> 160.2 at 512.
static_assert(kPanelRows == 4, "wide_block_sums is written for panels of 4 rows");
#define PAGEDSERVE_PANEL_ROW(mm, off)                \
  "vpbroadcastd " #off "(%[x]), %[xv]\n"             \
  "vpmaddwd %[w0], %[xv], %[t0]\n"                   \
  "vpmaddwd %[w1], %[xv], %[t1]\n"                   \
  "vpaddd %[t0], %[l" #mm "], %[l" #mm "]\n"         \
  "vpaddd %[t1], %[h" #mm "], %[h" #mm "]\n"
inline void wide_block_sums(const __m256i* wb, const int32_t* xp, __m256i* lo, __m256i* hi) {
  __m256i w0, w1, xv, t0, t1;
  int64_t n = 16;
  asm volatile(
      "1:\n"
      "vmovdqa (%[w]), %[w0]\n"
      "vmovdqa 512(%[w]), %[w1]\n"
      PAGEDSERVE_PANEL_ROW(0, 0) PAGEDSERVE_PANEL_ROW(1, 4) PAGEDSERVE_PANEL_ROW(2, 8) PAGEDSERVE_PANEL_ROW(3, 12)
      "add $32, %[w]\n"
      "add $16, %[x]\n"
      "dec %[n]\n"
      "jnz 1b\n"
      : [l0] "+x"(lo[0]), [l1] "+x"(lo[1]), [l2] "+x"(lo[2]), [l3] "+x"(lo[3]), [h0] "+x"(hi[0]),
        [h1] "+x"(hi[1]), [h2] "+x"(hi[2]), [h3] "+x"(hi[3]), [w0] "=&x"(w0), [w1] "=&x"(w1), [xv] "=&x"(xv),
        [t0] "=&x"(t0), [t1] "=&x"(t1), [w] "+r"(wb), [x] "+r"(xp), [n] "+r"(n)
      :
      : "memory", "cc");
}
#undef PAGEDSERVE_PANEL_ROW

// out[kPanelRows][16] += panel g's rows times blocks b0..b1-1 of the tile, widened in `wu`
// ([b1 - b0][32] vectors).  Each block is scaled into `out` as it is summed, so a
// partial sum carries over from one run of blocks to the next unchanged.
void wide_panel_avx2(const __m256i* wu, const uint16_t* d, const uint16_t* aux, int64_t kind, const QuantizedX& x,
                     int64_t g, int64_t b0, int64_t b1, float* out) {
  constexpr int R = kPanelRows;
  for (int64_t b = b0; b < b1; ++b) {
    const __m256i* wb = wu + 32 * (b - b0);
    const int32_t* xp = x.panel + (g * x.Kb + b) * 16 * R;
    __m256i lo[R], hi[R];
    for (int mm = 0; mm < R; ++mm) lo[mm] = hi[mm] = _mm256_setzero_si256();
    wide_block_sums(wb, xp, lo, hi);
    const float* xd = x.panel_d + (g * x.Kb + b) * R;
    const float* xds = x.panel_ds + (g * x.Kb + b) * R;
    for (int h = 0; h < 2; ++h) {
      __m256 acc[R];
      for (int mm = 0; mm < R; ++mm) acc[mm] = _mm256_loadu_ps(out + 16 * mm + 8 * h);
      add_block_avx2<R>(d, aux, kind, b, h, xd, xds, 1, h ? hi : lo, acc);
      for (int mm = 0; mm < R; ++mm) _mm256_storeu_ps(out + 16 * mm + 8 * h, acc[mm]);
    }
  }
}

// Blocks of a tile widened at a time: 16 KB of int16 codes, which with a panel's 4 KB of
// the same blocks stay in a core's 32 KB L1 while every panel of the row chunk passes.
// Widening the whole tile first (256 KB at K = 8192) left them to L2, shared with the
// panels' stream.  Real Zen 3, 2 threads, old and new alternating in one process: the
// 1.7B shapes 56.5 -> 68.8 GMAC/s at 128 rows, 51.3 -> 55.7 at 512.  Every output still
// sums its blocks in order, in the same operations: bit for bit the unblocked result.
constexpr int64_t kWideBlocks = 16;

// Rows m0..m0+mr-1 (m0 a multiple of kPanelRows, mr <= kMChunk) of one tile through the
// widened codes.
void wide_tile_avx2(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind,
                    const QuantizedX& x, int64_t m0, int64_t mr, int rows, float* y, int64_t ldy) {
  __m256i wu[32 * kWideBlocks];
  float out[kMChunk * 16] = {};
  const int64_t groups = (mr + kPanelRows - 1) / kPanelRows;
  for (int64_t b0 = 0; b0 < x.Kb; b0 += kWideBlocks) {
    const int64_t b1 = std::min(x.Kb, b0 + kWideBlocks);
    // the codes of the next run of blocks (the next tile's after the last run; a prefetch
    // past the end is harmless) come in while this run's panels pass: they are read once,
    // from memory, and the hardware prefetcher alone left the loads here stalled.
    // SmolLM2-135M's linears, AVX2 emulation on a Zen 5, 2 threads, taking turns:
    // 140.1 -> 153.9 GMAC/s at 32 rows, 153.6 -> 161.9 at 64, 161.8 -> 165.3 at 512
    const int64_t bb = block_bytes(kind);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t l = 0; l < bb; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(codes + (b + kWideBlocks) * bb + l), _MM_HINT_T0);
      unpack_block_avx2(codes, kind, b, wu + 32 * (b - b0));
    }
    for (int64_t g = 0; g < groups; ++g)
      wide_panel_avx2(wu, d, aux, kind, x, m0 / kPanelRows + g, b0, b1, out + g * kPanelRows * 16);
  }
  for (int64_t mm = 0; mm < mr; ++mm)
    for (int r = 0; r < rows; ++r) y[mm * ldy + r] = out[mm * 16 + r];
}
#define PAGEDSERVE_WIDE_TILE wide_tile_avx2
constexpr int kMaxMR = 4;
#define PAGEDSERVE_TILE tile_avx2
#define PAGEDSERVE_QUANT_ISA "avx2"

#else
#define PAGEDSERVE_QUANT_ISA "plain"
#endif

// The 16-bit activations as panels for the AVX2 many-row path (QuantizedX::panel), kept
// in `p`; nothing where that path is not taken (8-bit codes, few rows, another ISA).
// Groups of panels in parallel, and no zero fill of what is written anyway: done on one
// thread, while the other waited, it was ~2% of SmolLM2-135M's 512-row prompt linears
// (134.8 -> 137.5 GMAC/s, AVX2 emulation on a Zen 5, 2 threads; bit for bit the same).
struct Panels {
  std::vector<int32_t> w;
  std::vector<float> d, ds;
};
void pack_panels(QuantizedX& x, Panels& p) {
#ifdef PAGEDSERVE_WIDE_TILE
  if (!x.q16 || x.M < kWideMinRows) return;
  constexpr int64_t R = kPanelRows;
  const int64_t groups = (x.M + R - 1) / R, Kb = x.Kb;
  p.w.resize(groups * Kb * 16 * R);
  p.d.resize(groups * Kb * R);
  p.ds.resize(groups * Kb * R);
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < Kb; ++b) {
        int32_t* w = p.w.data() + (g * Kb + b) * 16 * R;
        float* pd = p.d.data() + (g * Kb + b) * R;
        float* pds = p.ds.data() + (g * Kb + b) * R;
        for (int64_t mm = 0; mm < R; ++mm) {
          const int64_t m = g * R + mm;
          if (m >= x.M) {  // rows past M: zero codes and scales
            for (int v = 0; v < 16; ++v) w[v * R + mm] = 0;
            pd[mm] = pds[mm] = 0.f;
            continue;
          }
          const int16_t* src = x.q16 + m * x.K + b * kBlock;
          for (int v = 0; v < 16; ++v) w[v * R + mm] = load_word(src + 2 * v);
          pd[mm] = x.d[m * Kb + b];
          pds[mm] = x.ds[m * Kb + b];
        }
      }
  });
  x.panel = p.w.data();
  x.panel_d = p.d.data();
  x.panel_ds = p.ds.data();
#else
  (void)x;
  (void)p;
#endif
}

template <int XB>
void run_tile(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind, const QuantizedX& x,
              int64_t m0, int64_t mr, int rows, float* y, int64_t ldy) {
#ifdef PAGEDSERVE_WIDE_TILE
  if (XB == 16 && x.panel) {
    PAGEDSERVE_WIDE_TILE(codes, d, aux, kind, x, m0, mr, rows, y, ldy);
    return;
  }
#endif
#ifdef PAGEDSERVE_TILE
  while (mr > 0) {
    const int64_t n = std::min<int64_t>(mr, kMaxMR);
    switch (n) {
      case 4: PAGEDSERVE_TILE<4, XB>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
      case 3: PAGEDSERVE_TILE<3, XB>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
      case 2: PAGEDSERVE_TILE<2, XB>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
      default: PAGEDSERVE_TILE<1, XB>(codes, d, aux, kind, x, m0, rows, y, ldy); break;
    }
    m0 += n;
    mr -= n;
    y += n * ldy;
  }
#else
  tile_plain(codes, d, aux, kind, x, m0, mr, rows, y, ldy);
#endif
}

// Rows m0..m0+mr-1 of two full neighbouring tiles where this build has a two-tile path
// (kPairs); `ts`, `tsd`: the second tile's offset in codes and scales.
// Fewer rows (decode) stream one tile at a time: two tiles at 2 or 3 rows were 0-19% slower
// (the 1.7B shape's Q4_0 and SmolLM2-135M's Q4_1; Zen 5, 2 threads).
constexpr int64_t kPairMinRows = 4;
// Activation rows per pair_vnni call: more than its registers hold (the compiler keeps some
// accumulators in L1), yet faster than 4 (the 1.7B shape at 32 and 512 rows: 352 -> 360-367
// GMAC/s; 8 rows per call: 340-344; Zen 5, 2 threads, taking turns in one process).  A batch
// of 8 as one call of 8 was 5% faster at the 1.7B shape's Q4_0 but 9% slower at SmolLM2-135M's
// Q4_1 (whose offsets need a third set of accumulators): 6 + 2.
constexpr int64_t kPairMR = 6;
#ifdef PAGEDSERVE_PAIR
constexpr bool kPairs = true;
template <bool kQ8, int XB>
void run_pair_of(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind, int64_t ts, int64_t tsd,
                 const QuantizedX& x, int64_t m0, int64_t mr, float* y, int64_t ldy) {
  while (mr > 0) {
    const int64_t n = std::min<int64_t>(mr, kPairMR);
    switch (n) {
      case 6: PAGEDSERVE_PAIR<6, kQ8, XB>(codes, d, aux, kind, ts, tsd, x, m0, y, ldy); break;
      case 5: PAGEDSERVE_PAIR<5, kQ8, XB>(codes, d, aux, kind, ts, tsd, x, m0, y, ldy); break;
      case 4: PAGEDSERVE_PAIR<4, kQ8, XB>(codes, d, aux, kind, ts, tsd, x, m0, y, ldy); break;
      case 3: PAGEDSERVE_PAIR<3, kQ8, XB>(codes, d, aux, kind, ts, tsd, x, m0, y, ldy); break;
      case 2: PAGEDSERVE_PAIR<2, kQ8, XB>(codes, d, aux, kind, ts, tsd, x, m0, y, ldy); break;
      default: PAGEDSERVE_PAIR<1, kQ8, XB>(codes, d, aux, kind, ts, tsd, x, m0, y, ldy); break;
    }
    m0 += n;
    mr -= n;
    y += n * ldy;
  }
}
void run_pair(const uint8_t* codes, const uint16_t* d, const uint16_t* aux, int64_t kind, int64_t ts, int64_t tsd,
              const QuantizedX& x, int64_t m0, int64_t mr, float* y, int64_t ldy) {
  (x.q16 ? (kind == Q8 ? run_pair_of<true, 16> : run_pair_of<false, 16>)
          : (kind == Q8 ? run_pair_of<true, 8> : run_pair_of<false, 8>))(codes, d, aux, kind, ts, tsd, x, m0, mr, y, ldy);
}
#else
constexpr bool kPairs = false;
void run_pair(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, const QuantizedX&, int64_t,
              int64_t, float*, int64_t) {}
#endif

void check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
}

#if defined(__AVX2__) && defined(__F16C__)
// 8 activations as float32 (a bf16 widens by a shift, a half through F16C: both exact).
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// One block of 32 activations to 16-bit codes in pair order, its scale and scale * code
// sum: the scalar loop's arithmetic (the same amax, a float32 product rounded to nearest
// even by the conversion, as nearbyint does), 8 lanes at a time; the same results for
// every finite block (a NaN or inf product, from a non-finite input or an amax below
// ~1e-34, is a garbage code on both paths: 0 there, -32768 here).  The scalar loop took
// ~2.6 ns a value (nearbyint and the pair-order stores do not vectorise): 12% of a
// 512-token prompt of SmolLM2-135M (Zen 5).
template <typename T>
inline void quantize_block16(const T* src, int16_t* q, float* d, float* ds) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = load8(src + 8 * j);
    m = _mm256_max_ps(_mm256_and_ps(v[j], abs_mask), m);  // a NaN lane keeps m, as std::max does
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float scale = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i pair_order = _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);
  __m256i sum = _mm256_setzero_si256();
  __m256i c[4];
  for (int j = 0; j < 4; ++j) {
    c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
    sum = _mm256_add_epi32(sum, c[j]);
    c[j] = _mm256_permutevar8x32_epi32(c[j], pair_order);
  }
  for (int j = 0; j < 2; ++j) {  // packs interleaves 128-bit lanes; the permute puts them back
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * j], c[2 * j + 1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * j), p);
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  *d = scale;
  *ds = scale * float(_mm_cvtsi128_si32(s));
}
#endif

// x [M, K] float32/bfloat16/float16 -> codes [M, K] (int8, or int16 in pair order), scales
// [M, K/32], scale * code sum [M, K/32], written to q8 or q16 (the other null), d, ds.
// Round to nearest, scale amax / (2^(bits-1) - 1).  x is read in its own dtype (a decode
// step's ~100 layers would otherwise each pay for a converted copy).
void quantize_into(const at::Tensor& xc, int8_t* q8, int16_t* q16, float* dp, float* dsp) {
  const int64_t M = xc.size(0), Kb = xc.size(1) / kBlock;
  const float qmax = q8 ? 127.f : 32767.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "quantize_activations", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    at::parallel_for(0, M * Kb, 256, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__) && defined(__F16C__)
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (q16) {
          for (int64_t i = begin; i < end; ++i) quantize_block16(src + i * kBlock, q16 + i * kBlock, dp + i, dsp + i);
          return;
        }
      }
#endif
      float v[kBlock];
      for (int64_t i = begin; i < end; ++i) {
        float amax = 0.f;
        for (int k = 0; k < kBlock; ++k) {
          v[k] = static_cast<float>(src[i * kBlock + k]);
          amax = std::max(amax, std::fabs(v[k]));
        }
        const float scale = amax / qmax, inv = amax > 0.f ? qmax / amax : 0.f;
        int32_t sum = 0;
        for (int k = 0; k < kBlock; ++k) {
          const int32_t c = static_cast<int32_t>(std::nearbyint(v[k] * inv));
          if (q8) q8[i * kBlock + k] = static_cast<int8_t>(c);
          else q16[i * kBlock + pair_pos(k)] = static_cast<int16_t>(c);
          sum += c;
        }
        dp[i] = scale;
        dsp[i] = scale * float(sum);
      }
    });
  });
}

void check_activations(const at::Tensor& x, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 16, "activation bits must be 8 or 16, got ", bits);
}

// The same as tensors (codes, scales, scale * code sum): what qgemm takes from Python.
std::vector<at::Tensor> quantize_activations(at::Tensor x, int64_t bits) {
  check_activations(x, bits);
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), Kb = K / kBlock;
  auto q = at::empty({M, K}, bits == 8 ? at::kChar : at::kShort);
  auto d = at::empty({M, Kb}, at::kFloat);
  auto ds = at::empty({M, Kb}, at::kFloat);
  quantize_into(xc, bits == 8 ? q.data_ptr<int8_t>() : nullptr, bits == 16 ? q.data_ptr<int16_t>() : nullptr,
                d.data_ptr<float>(), ds.data_ptr<float>());
  return {q, d, ds};
}

// out[:, col : col + N] = x . W^T for one packed weight (codes, d, aux as described above);
// the activations' bits are xq's: int8 or int16.  out is float32, bfloat16 or float16: the
// tiles sum in float32 and a 16-bit out is written through a tile's buffer, so the layer
// needs no converted copy of its output.
using TileFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const QuantizedX&, int64_t,
                       int64_t, int, float*, int64_t);  // run_tile<bits>

template <typename T>
void qgemm_into(const QuantizedX& x, const uint8_t* cp, const uint16_t* dp, const uint16_t* ap, int64_t kind,
                int64_t N, T* yp, int64_t ldy, TileFn tile) {
  const int64_t M = x.M, Kb = x.Kb;
  const int64_t tiles = (N + kTile - 1) / kTile;
  const bool pairs = kPairs && M >= kPairMinRows;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMChunk) {
      const int64_t mr = std::min(kMChunk, M - m0);
      for (int64_t t = t0; t < t1; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, N - t * kTile));
        T* y = yp + m0 * ldy + t * kTile;
        const uint8_t* c = cp + t * Kb * block_bytes(kind);
        const uint16_t* dt = dp + t * Kb * kTile;
        const uint16_t* at = ap ? ap + t * Kb * kTile : nullptr;
        if (pairs && t + 1 < t1 && (t + 2) * kTile <= N) {  // two full tiles of this thread's
          const int64_t ts = Kb * block_bytes(kind), tsd = Kb * kTile;
          if constexpr (std::is_same_v<T, float>) {
            run_pair(c, dt, at, kind, ts, tsd, x, m0, mr, y, ldy);
          } else {
            float buf[kMChunk * 2 * kTile];
            run_pair(c, dt, at, kind, ts, tsd, x, m0, mr, buf, 2 * kTile);
            for (int64_t mm = 0; mm < mr; ++mm)
              for (int r = 0; r < 2 * kTile; ++r) y[mm * ldy + r] = static_cast<T>(buf[mm * 2 * kTile + r]);
          }
          ++t;
          continue;
        }
        if constexpr (std::is_same_v<T, float>) {
          if (rows == kTile) {
            tile(c, dt, at, kind, x, m0, mr, rows, y, ldy);
            continue;
          }
        }
        // a 16-bit out, or the last, partial tile (no store may reach past N): through a buffer
        float buf[kMChunk * kTile];
        tile(c, dt, at, kind, x, m0, mr, kTile, buf, kTile);
        for (int64_t mm = 0; mm < mr; ++mm)
          for (int r = 0; r < rows; ++r) y[mm * ldy + r] = static_cast<T>(buf[mm * kTile + r]);
      }
    }
  };
  const int64_t threads = at::get_num_threads();
  if (M > kMChunk || threads == 1) {  // a fixed share each: every thread keeps its tiles over all the row chunks
    at::parallel_for(0, tiles, 1, run);
    return;
  }
  // A few activation rows (decode): the tiles go out in runs, two per thread, to whichever
  // thread asks next, so a thread the OS has paused (on a machine whose cores the server's
  // other threads share) leaves half its work to the others instead of stalling the whole
  // layer.  Runs that long keep each thread's weight stream sequential: with eight runs
  // per thread the threads' reads interleaved and one row streamed SmolLM2-135M's 120
  // projections at 32.6 GB/s against 38.9 (Zen 5: AVX-512, native bf16; 22.5 against 27.7 in AVX2 emulation),
  // 14.0 against 15.3 at 8 rows; the 1.7B shape's larger ones alike (38.0, 38.7).
  const int64_t grab = std::max<int64_t>(1, tiles / (threads * 2));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t0; (t0 = next.fetch_add(grab)) < tiles;) run(t0, std::min(t0 + grab, tiles));
  });
}

// out[:, col : col + N] = x . W^T for one packed weight (codes, d, aux).
void qgemm_segment(const QuantizedX& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& aux,
                   int64_t kind, int64_t N, at::Tensor& out, int64_t col) {
  TORCH_CHECK(kind == Q4_SYM || kind == Q4_ASYM || kind == Q8, "unknown kind ", kind);
  check_cpu_contiguous(codes, "codes");
  check_cpu_contiguous(d, "scales");
  TORCH_CHECK(kind == Q4_SYM || (aux.defined() && aux.is_contiguous()), "this kind needs its aux tensor");
  const int64_t tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(codes.numel() == tiles * x.Kb * block_bytes(kind), "codes do not match N=", N, ", K=", x.K);
  TORCH_CHECK(out.size(0) == x.M && col + N <= out.size(1), "out is too small");
  const TileFn tile = x.q16 ? &run_tile<16> : &run_tile<8>;
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* ap = kind == Q4_SYM ? nullptr : static_cast<const uint16_t*>(aux.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "qgemm", [&] {
    qgemm_into<scalar_t>(x, cp, dp, ap, kind, N, out.data_ptr<scalar_t>() + col, out.stride(0), tile);
  });
}

void qgemm(at::Tensor xq, at::Tensor xd, at::Tensor xds, at::Tensor codes, at::Tensor d,
           at::Tensor aux, int64_t kind, int64_t N, at::Tensor out, int64_t col) {
  for (auto* t : {&xq, &xd, &xds}) check_cpu_contiguous(*t, "qgemm inputs");
  TORCH_CHECK(xq.scalar_type() == at::kChar || xq.scalar_type() == at::kShort, "xq must be int8 or int16");
  TORCH_CHECK(out.device().is_cpu() && out.stride(1) == 1, "out must be a CPU tensor with unit stride");
  const bool wide = xq.scalar_type() == at::kShort;
  const int64_t M = xq.size(0), K = xq.size(1);
  QuantizedX x{wide ? nullptr : xq.data_ptr<int8_t>(), wide ? xq.data_ptr<int16_t>() : nullptr,
               xd.data_ptr<float>(), xds.data_ptr<float>(), M, K, K / kBlock};
  Panels panels;
  pack_panels(x, panels);
  qgemm_segment(x, codes, d, aux, kind, N, out, col);
}

// The quantized activations of the layer forward being computed on this thread: a
// grow-only scratch up to kScratchMax codes (a decode step's ~100 layer calls then
// allocate nothing but their outputs), fresh buffers for longer prompts (not held after).
constexpr int64_t kScratchMax = 1 << 20;
struct Activations {
  std::vector<int16_t> q;  // int8 codes use its first half
  std::vector<float> d, ds;
  Panels panels;
  QuantizedX quantize(const at::Tensor& xk, int64_t bits) {
    const int64_t M = xk.size(0), K = xk.size(1), Kb = K / kBlock;
    if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
    if (static_cast<int64_t>(d.size()) < M * Kb) d.resize(M * Kb), ds.resize(M * Kb);
    int8_t* q8 = bits == 8 ? reinterpret_cast<int8_t*>(q.data()) : nullptr;
    int16_t* q16 = bits == 16 ? q.data() : nullptr;
    quantize_into(xk, q8, q16, d.data(), ds.data());
    QuantizedX x{q8, q16, d.data(), ds.data(), M, K, Kb};
    pack_panels(x, panels);
    return x;
  }
};

// y [M, N] in x's dtype = x [M, Kx] . W^T, W made of row segments (a fused q|k|v whose
// shards are of different kinds): the whole layer in one call, activations quantized once
// to `bits`.  K >= Kx is the packed (block-padded) width; x's missing columns count as zeros.
at::Tensor linear(const at::Tensor& x, at::TensorList codes, at::TensorList d, at::TensorList aux,
                  at::IntArrayRef kinds, at::IntArrayRef ns, at::IntArrayRef offsets, int64_t N, int64_t K,
                  int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= K && x.device().is_cpu(), "x must be a CPU tensor [M, <= K]");
  TORCH_CHECK(codes.size() == d.size() && d.size() == aux.size() && aux.size() == kinds.size() &&
              kinds.size() == ns.size() && ns.size() == offsets.size() && !codes.empty(), "segment lists differ");
  auto xk = (x.size(1) == K ? x : at::constant_pad_nd(x, {0, K - x.size(1)})).contiguous();
  check_activations(xk, bits);
  thread_local Activations scratch;
  Activations fresh;
  const QuantizedX xq = (xk.numel() <= kScratchMax ? scratch : fresh).quantize(xk, bits);
  auto out = at::empty({xk.size(0), N}, x.options());
  for (size_t i = 0; i < codes.size(); ++i) qgemm_segment(xq, codes[i], d[i], aux[i], kinds[i], ns[i], out, offsets[i]);
  return out;
}

// The layer forward of a weight of one segment (most layers, once a fused weight's shards
// are merged): no list arguments, which a compiled graph's wrapper builds and the
// dispatcher converts on every call.
at::Tensor linear1(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& aux,
                   int64_t kind, int64_t N, int64_t K, int64_t bits) {
  return linear(x, {codes}, {d}, {aux}, {kind}, {N}, {0}, N, K, bits);
}

// Row n of a packed weight (Kb blocks a row), its first Kx columns dequantized in column
// order: fn(column, weight) for each.  dequantize_rows and row_dots read rows through it.
template <typename Fn>
inline void for_each_weight(const uint8_t* cp, const uint16_t* dp, const uint16_t* ap, int64_t kind, int64_t Kb,
                            int64_t n, int64_t Kx, Fn&& fn) {
  const int64_t t = n / kTile, r = n % kTile;
  for (int64_t b = 0; b * kBlock < Kx; ++b) {
    const uint8_t* c = cp + (t * Kb + b) * block_bytes(kind);
    const float dw = half_to_float(dp[(t * Kb + b) * kTile + r]);
    float off = 0.f;
    if (kind == Q4_SYM) off = -8.f * dw;
    if (kind == Q4_ASYM) off = half_to_float(ap[(t * Kb + b) * kTile + r]);
    for (int j = 0; j < kBlock && b * kBlock + j < Kx; ++j) {
      float u;
      if (kind == Q8) {
        u = float(reinterpret_cast<const int8_t*>(c)[(j / 4) * 64 + r * 4 + j % 4]);
      } else {
        const uint8_t byte = c[(j / 8) * 64 + r * 4 + (j % 8) % 4];
        u = float((j % 8) < 4 ? (byte & 15) : (byte >> 4));
      }
      fn(b * kBlock + j, dw * u + off);
    }
  }
}

// Rows `ids` of the packed weight, dequantized: [len(ids), K] float32 (embedding lookups).
at::Tensor dequantize_rows(at::Tensor codes, at::Tensor d, at::Tensor aux, int64_t kind, int64_t K,
                              at::Tensor ids) {
  check_cpu_contiguous(codes, "codes");
  auto idx = ids.to(at::kLong).contiguous();
  const int64_t T = idx.numel(), Kb = K / kBlock;
  auto out = at::empty({T, K}, at::kFloat);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* ap = kind == Q4_SYM ? nullptr : static_cast<const uint16_t*>(aux.data_ptr());
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for_each_weight(cp, dp, ap, kind, Kb, ip[i], K, [&](int64_t col, float w) { op[i * K + col] = w; });
  });
  return out;
}

// out[i, j] = row ids[i, j] of the packed weight, dequantized, dotted with x[i] (float32
// [n, Kx], Kx <= K): the LM head's exact top logits (layers/embedding.py), one call where
// gathering the rows and multiplying them out in torch took four ops.  Each dot sums its
// row in column order, so a row's value never depends on the batch around it.
at::Tensor row_dots(at::Tensor codes, at::Tensor d, at::Tensor aux, int64_t kind, int64_t K, at::Tensor ids,
                    at::Tensor x) {
  check_cpu_contiguous(codes, "codes");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be int64 [n, k]");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == ids.size(0) && x.size(1) <= K && x.scalar_type() == at::kFloat &&
                  x.stride(1) == 1 && x.device().is_cpu(),
              "x must be float32 CPU rows [n, <= K], one per row of ids");
  const int64_t rows = ids.size(0), k = ids.size(1), Kx = x.size(1), Kb = K / kBlock;
  const int64_t capacity = codes.numel() / (Kb * block_bytes(kind)) * kTile;  // rows the tiles hold
  for (int64_t i = 0; i < rows * k; ++i)
    TORCH_CHECK(ids.data_ptr<int64_t>()[i] >= 0 && ids.data_ptr<int64_t>()[i] < capacity, "row id ",
                ids.data_ptr<int64_t>()[i], " outside the weight's ", capacity, " rows");
  auto out = at::empty({rows, k}, at::kFloat);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* ap = kind == Q4_SYM ? nullptr : static_cast<const uint16_t*>(aux.data_ptr());
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * k, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = xp + (i / k) * x.stride(0);
      float acc = 0.f;
      for_each_weight(cp, dp, ap, kind, Kb, ip[i], Kx, [&](int64_t col, float w) { acc += w * xr[col]; });
      op[i] = acc;
    }
  });
  return out;
}

// The tiled code layout (header comment) of [N, K] codes, one byte each (4-bit codes
// 0..15, or int8), rows past N zero: layers/quantization.py `pack`.  One pass over the
// codes, where the same in torch ops took strided copies of every byte a few times over.
at::Tensor pack_codes(const at::Tensor& codes, int64_t kind) {
  check_cpu_contiguous(codes, "codes");
  TORCH_CHECK(codes.dim() == 2 && codes.element_size() == 1 && codes.size(1) % kBlock == 0,
              "pack_codes: codes must be [N, K] bytes with K a multiple of 32");
  const int64_t N = codes.size(0), K = codes.size(1), Kb = K / kBlock, tiles = (N + kTile - 1) / kTile;
  const int64_t bytes = block_bytes(kind);
  auto out = at::empty({tiles * Kb * bytes}, at::kByte);
  const uint8_t* src = static_cast<const uint8_t*>(codes.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < Kb; ++b) {
        uint8_t* o = dst + (t * Kb + b) * bytes;
        for (int r = 0; r < kTile; ++r) {
          const int64_t row = t * kTile + r;
          const uint8_t* c = src + row * K + b * kBlock;
          for (int j = 0; j < bytes / 64; ++j) {
            for (int i = 0; i < 4; ++i) {
              uint8_t v = 0;
              if (row < N) v = kind == Q8 ? c[4 * j + i] : uint8_t(c[8 * j + i] | (c[8 * j + 4 + i] << 4));
              o[j * 64 + 4 * r + i] = v;
            }
          }
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
  m.def("linear", [](const at::Tensor& x, const std::vector<at::Tensor>& codes,
                     const std::vector<at::Tensor>& d, const std::vector<at::Tensor>& aux,
                     const std::vector<int64_t>& kinds, const std::vector<int64_t>& ns,
                     const std::vector<int64_t>& offsets, int64_t N, int64_t K, int64_t bits) {
    return linear(x, codes, d, aux, kinds, ns, offsets, N, K, bits);
  }, nogil);
  m.def("linear1", &linear1, nogil);
  m.def("dequantize_rows", &dequantize_rows, nogil);
  m.def("row_dots", &row_dots, nogil);
  m.def("pack_codes", &pack_codes, nogil);
  m.def("isa", &isa);
}

// The same layer forward as a torch operator, torch.ops.<this module's name>.linear, so a
// torch.compile'd graph calls it directly (no Python in between); the namespace is the
// build's own, since builds for several ISAs can be loaded into one process.
#define PAGEDSERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDSERVE_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
PAGEDSERVE_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("linear(Tensor x, Tensor[] codes, Tensor[] d, Tensor[] aux, int[] kinds, int[] ns, int[] offsets, "
        "int N, int K, int bits) -> Tensor");
  m.def("linear1(Tensor x, Tensor codes, Tensor d, Tensor aux, int kind, int N, int K, int bits) -> Tensor");
}
PAGEDSERVE_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear1", &linear1);
}
