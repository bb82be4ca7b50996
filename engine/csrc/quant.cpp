// Quantized linear and SwiGLU-expert kernels for AVX-512 CPUs (moestream engine/quant).
//
// Shape legend: weight [N, K] (out, in), groups of G along K, 4-bit blocks of 32 (byte j of a
// block = code j | code j+16 << 4, see engine/quant/formats.py); x [T, K] float32; out [T, N].
//
// Two loop nests:
// - direct (small T, decode): a tile of 8 rows x 2 tokens keeps 16 16-lane accumulators in
//   registers; each 32-weight block is dequantized into two vectors and FMA'd against the tokens;
//   further token pairs re-read the tile's codes from L1, so memory is read once.
//   4-bit formats dequantize with one table lookup (vpermps) into a per-(row, group) 16-entry table
//   lut[c] = base[c] * scale + min (int4: base = 0..15; nf4: base = code book, min = 0), so a
//   block costs one byte->dword expansion, one shift and two permutes.
// - scratch (larger T): R rows are dequantized into an fp32 scratch (L1/L2 resident) and an
//   R x TT register-tiled FMA micro-kernel runs over all tokens, so dequantization is paid once per
//   weight per call.
// Threads: the row kernels run on one thread; linears() and experts() split rows in units of 16
// over the native worker pool (pool.cpp). An OpenMP build of the row kernels was measured slower
// inside a decode step on 2 cores (demo store 39.8 -> 19.8 tok/s).
#include "quant.h"
#include "i8a.h"
#include "phases.h"
#include "pool.h"
#include "simd.h"

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {
using namespace ms;


alignas(64) const float NF4_CB[16] = {
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
  -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
  0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
  0.44070982985687256f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
alignas(64) const float IOTA16[16] = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
// MXFP4: the E2M1 values of codes 0..15 (engine/quant/reference.py E2M1_VALUES)
alignas(64) const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// MXFP4 byte b of a block holds weights 2b (low nibble) and 2b + 1 (high): lookups of the low
// and the high nibbles give the even and the odd weights, interleaved back by these indices
alignas(64) const int32_t MX_LO[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
alignas(64) const int32_t MX_HI[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};


static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// Per-(row, group) state and the dequantization of one 32-weight block into two vectors.
template <int FMT> struct Deq {
  __m512 lut; __m512 sc;
  inline void group(const QW& w, int64_t n, int64_t g) {
    const int64_t ng = w.K / w.G;
    if (FMT == F_INT4) {
      lut = _mm512_fmadd_ps(_mm512_load_ps(IOTA16), _mm512_set1_ps(h2f(w.scales[n * ng + g])),
                            _mm512_set1_ps(h2f(w.mins[n * ng + g])));
    } else if (FMT == F_NF4) {
      lut = _mm512_mul_ps(_mm512_load_ps(NF4_CB), _mm512_set1_ps(h2f(w.scales[n * ng + g])));
    } else if (FMT == F_INT8) {
      sc = _mm512_set1_ps(h2f(w.scales[n * ng + g]));
    } else if (FMT == F_MXFP4) {  // E2M1 * 2^(s - 127): exact (a power of two)
      lut = _mm512_mul_ps(_mm512_load_ps(E2M1), _mm512_set1_ps(e8m0(((const uint8_t*)w.scales)[n * ng + g])));
    }
  }
  // k: index of the block's first weight in the row
  // prefetch the cache line of row n holding weight k (called once per 64 bytes of codes)
  static inline void prefetch(const QW& w, int64_t n, int64_t k) {
    if (n >= w.N) return;
    const char* p = FMT == F_INT4 || FMT == F_NF4 || FMT == F_MXFP4 ? (const char*)(w.codes + n * (w.K / 2) + k / 2)
                  : FMT == F_INT8 ? (const char*)(w.codes + n * w.K + k) : (const char*)(w.codes + (n * w.K + k) * 2);
    _mm_prefetch(p, _MM_HINT_T0);
  }
  static constexpr int64_t WEIGHTS_PER_LINE = FMT == F_INT4 || FMT == F_NF4 || FMT == F_MXFP4 ? 128 : FMT == F_INT8 ? 64 : 32;
  inline void block(const QW& w, int64_t n, int64_t k, __m512& w0, __m512& w1) const {
    if (FMT == F_INT4 || FMT == F_NF4) {
      __m128i b = _mm_loadu_si128((const __m128i*)(w.codes + n * (w.K / 2) + k / 2));
      __m512i v = _mm512_cvtepu8_epi32(b);
      w0 = _mm512_permutexvar_ps(v, lut);                       // vpermps uses index bits 3:0
      w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
    } else if (FMT == F_MXFP4) {
      __m128i b = _mm_loadu_si128((const __m128i*)(w.codes + n * (w.K / 2) + k / 2));
      __m512i v = _mm512_cvtepu8_epi32(b);
      const __m512 ev = _mm512_permutexvar_ps(v, lut), od = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
      w0 = _mm512_permutex2var_ps(ev, _mm512_load_si512(MX_LO), od);
      w1 = _mm512_permutex2var_ps(ev, _mm512_load_si512(MX_HI), od);
    } else if (FMT == F_INT8) {
      const int8_t* p = (const int8_t*)w.codes + n * w.K + k;
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))), sc);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))), sc);
    } else {
      const uint16_t* p = (const uint16_t*)w.codes + n * w.K + k;
      w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
      w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 16))), 16));
    }
  }
};

// group size for grouping purposes (bf16 has none: treat the whole row as one group)
static inline int64_t eff_group(const QW& w) { return w.fmt == F_BF16 ? w.K : w.G; }

// Direct tile: rows [n0, n0+R), tokens [t0, t0+TT). out[t, n] (+)= sum_k x[t, k] * w[n, k]
static int64_t g_pf_rows = 16;  // software prefetch distance in rows (tunable for the bench)

static inline void prefetch_meta(const QW& w, int64_t n0, int R) {
  if (w.fmt == F_BF16 || n0 >= w.N) return;
  const int64_t ng = w.K / w.G, ssz = w.fmt == F_MXFP4 ? 1 : 2;
  int64_t nr = n0 + R <= w.N ? R : w.N - n0;
  const char* s = (const char*)w.scales + n0 * ng * ssz;
  for (int64_t b = 0; b < nr * ng * ssz; b += 64) _mm_prefetch(s + b, _MM_HINT_T0);
  if (w.fmt == F_INT4) {
    const char* m = (const char*)(w.mins + n0 * ng);
    for (int64_t b = 0; b < nr * ng * 2; b += 64) _mm_prefetch(m + b, _MM_HINT_T0);
  }
}

template <int FMT, int R, int TT>
static void tile_direct(const QW& w, int64_t n0, const float* x, int64_t t0, float* out, int64_t ldo) {
  const int64_t K = w.K, G = eff_group(w), NG = K / G;
  const int64_t pf = g_pf_rows;
  if (pf > 0) prefetch_meta(w, n0 + pf, R);
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
  Deq<FMT> d[R];
  for (int64_t g = 0; g < NG; g++) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) d[r].group(w, n0 + r, g);
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      if (pf > 0 && k % Deq<FMT>::WEIGHTS_PER_LINE == 0) {
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) Deq<FMT>::prefetch(w, n0 + pf + r, k);
      }
      __m512 xa[TT], xb[TT];
#pragma GCC unroll 8
      for (int t = 0; t < TT; t++) {
        xa[t] = _mm512_loadu_ps(x + (t0 + t) * K + k);
        xb[t] = _mm512_loadu_ps(x + (t0 + t) * K + k + 16);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        __m512 w0, w1;
        d[r].block(w, n0 + r, k, w0, w1);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
          acc[r][t] = _mm512_fmadd_ps(w0, xa[t], acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(w1, xb[t], acc[r][t]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) out[(t0 + t) * ldo + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// Dequantize rows [n0, n0+R) into buf[R][K] (fp32).
template <int FMT>
static void deq_rows(const QW& w, int64_t n0, int R, float* buf) {
  const int64_t K = w.K, G = eff_group(w), NG = K / G;
  const int64_t pf = g_pf_rows;
  if (pf > 0) prefetch_meta(w, n0 + pf, R);
  for (int r = 0; r < R; r++) {
    if (pf > 0)
      for (int64_t k = 0; k < K; k += Deq<FMT>::WEIGHTS_PER_LINE) Deq<FMT>::prefetch(w, n0 + pf + r, k);
    Deq<FMT> d;
    float* b = buf + r * K;
    for (int64_t g = 0; g < NG; g++) {
      d.group(w, n0 + r, g);
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        __m512 w0, w1;
        d.block(w, n0 + r, k, w0, w1);
        _mm512_storeu_ps(b + k, w0);
        _mm512_storeu_ps(b + k + 16, w1);
      }
    }
  }
}

// Micro-kernel over a dequantized scratch: rows r in [0,R) of buf, tokens [t0, t0+TT).
template <int R, int TT>
static void micro(const float* buf, int64_t K, int64_t n0, const float* x, int64_t t0, float* out, int64_t ldo) {
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(buf + r * K + k);
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) {
      __m512 xv = _mm512_loadu_ps(x + (t0 + t) * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int t = 0; t < TT; t++) out[(t0 + t) * ldo + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

template <int R>
static void micro_all_tokens(const float* buf, int64_t K, int64_t n0, const float* x, int64_t T, float* out, int64_t ldo) {
  int64_t t = 0;
  for (; t + 6 <= T; t += 6) micro<R, 6>(buf, K, n0, x, t, out, ldo);
  switch (T - t) {
    case 5: micro<R, 5>(buf, K, n0, x, t, out, ldo); break;
    case 4: micro<R, 4>(buf, K, n0, x, t, out, ldo); break;
    case 3: micro<R, 3>(buf, K, n0, x, t, out, ldo); break;
    case 2: micro<R, 2>(buf, K, n0, x, t, out, ldo); break;
    case 1: micro<R, 1>(buf, K, n0, x, t, out, ldo); break;
    default: break;
  }
}

constexpr int RS = 4;  // rows per scratch tile

// Rows [nb, ne) of out = x @ w.T for all T tokens (one thread's share).
template <int FMT>
static void rows_range(const QW& w, int64_t nb, int64_t ne, const float* x, int64_t T, float* out, int64_t ldo,
                       int64_t direct_max_t) {
  if (T <= direct_max_t) {
    // tiles of 8 rows; tokens in pairs (R*TT = 16 accumulators), the rows' codes stay in L1
    // between the token pairs, so memory traffic is one pass whatever T is
    int64_t n = nb;
    for (; n + 8 <= ne; n += 8) {
      int64_t t = 0;
      for (; t + 2 <= T; t += 2) tile_direct<FMT, 8, 2>(w, n, x, t, out, ldo);
      if (t < T) tile_direct<FMT, 8, 1>(w, n, x, t, out, ldo);
    }
    for (; n < ne; n++) {
      int64_t t = 0;
      for (; t + 2 <= T; t += 2) tile_direct<FMT, 1, 2>(w, n, x, t, out, ldo);
      if (t < T) tile_direct<FMT, 1, 1>(w, n, x, t, out, ldo);
    }
    return;
  }
  std::vector<float> buf_v(RS * w.K + 16);
  float* buf = buf_v.data();
  int64_t n = nb;
  for (; n + RS <= ne; n += RS) {
    deq_rows<FMT>(w, n, RS, buf);
    micro_all_tokens<RS>(buf, w.K, n, x, T, out, ldo);
  }
  for (; n < ne; n++) {
    deq_rows<FMT>(w, n, 1, buf);
    micro_all_tokens<1>(buf, w.K, n, x, T, out, ldo);
  }
}

static void rows_dispatch(const QW& w, int64_t nb, int64_t ne, const float* x, int64_t T, float* out, int64_t ldo,
                          int64_t direct_max_t) {
  switch (w.fmt) {
    case F_INT4: rows_range<F_INT4>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    case F_NF4:  rows_range<F_NF4>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    case F_INT8: rows_range<F_INT8>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    case F_MXFP4: rows_range<F_MXFP4>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    default:     rows_range<F_BF16>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
  }
}

// ---- int4 weights x int8 activations (AVX512-VNNI; i8a.h has the sum) ------------------
// x is quantized per block of 32 to int8 (dx = absmax / 127, q = round-half-even(x * (1 / dx))).
// A chunk of 4 blocks (128 weights, 64 code bytes) meets its q as [64 bytes: low halves][64 bytes:
// high halves]: two vpdpbusd give 16 int32 lanes, lanes 4i..4i+3 summing block i; four chunks
// (16 blocks) are folded into one vector of the 16 blocks' exact sums S_b (two rounds of
// even/odd lane pairs), converted once and fma'd into the lane sums P. The result is x' @ w.T for
// the dequantized activations x' = q * dx; reference.linear_ref_int8_act is the same.
// The one quantization rule of a 32-value block x[0..31]: its scale d = absmax / qmax (127 for
// int8 codes, 32767 for int16) and the codes round-half-even(x * (1 / d)) as int32 in q0 (values
// 0..15) and q1 (16..31); 0 when d = 0.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
static inline __attribute__((always_inline)) float quant_block(const float* x, __m512i& q0, __m512i& q1,
                                                               float qmax = 127.f) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
  const float d = amax / qmax, inv = d > 0.f ? 1.f / d : 0.f;
  q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // MXCSR default: half to even
  q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
  return d;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
static void quant_act(const float* x, int64_t K, int64_t G, QAct& a) {
  a.q.assign(quant_act_bytes(K), 0);
  a.db.assign((K / 32 + 15) / 16 * 16, 0.f);
  a.xg.assign(K / G, 0.f);
  for (int64_t b = 0; b < K / 32; b++) {
    __m512i q0, q1;
    const float d = quant_block(x + 32 * b, q0, q1);
    const int64_t c = b / 4, i = b % 4;
    _mm_storeu_si128((__m128i*)(a.q.data() + c * 128 + i * 16), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(a.q.data() + c * 128 + 64 + i * 16), _mm512_cvtsepi32_epi8(q1));
    a.db[b] = d;
    a.xg[32 * b / G] += d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// i8a.h's tree16 of a vector's 16 lanes: lane i + lane i + 8, then + 4, + 2, + 1
__attribute__((target("avx512f,avx512dq")))
static inline float tree16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

template <int TT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")))
static void rows_int4_i8a(const QW& w, int64_t nb, int64_t ne, const QAct* const* acts, float* out, int64_t ldo) {
  const int64_t K = w.K, G = w.G, NG = K / G, B = K / 32, J = (B + 15) / 16;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  // lane i of a 16-block group -> its group's scale (G / 32 blocks per group: 1, 2 or 4)
  const __m512i gidx = _mm512_srlv_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(__builtin_ctzll(G / 32)));
  for (int64_t n = nb; n < ne; n++) {
    const uint8_t* row = w.codes + n * (K / 2);
    const uint16_t* srow = w.scales + n * NG;
    __m512 facc[TT];
    for (int t = 0; t < TT; t++) facc[t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < J; j++) {
      const int64_t nbk = std::min<int64_t>(16, B - 16 * j);  // blocks in this group of 16
      __m512i lo[4], hi[4];
      for (int c = 0; c < 4; c++) {
        const int64_t bytes = std::max<int64_t>(0, std::min<int64_t>(64, (nbk - 4 * c) * 16));
        const uint8_t* p = row + j * 256 + c * 64;
        __m512i v;
        if (bytes == 64) {
          _mm_prefetch((const char*)(p + 2048), _MM_HINT_T0);
          v = _mm512_loadu_si512(p);
        } else {  // the row's tail: masked (nothing read past it), zero codes
          v = _mm512_maskz_loadu_epi8((__mmask64)((1ull << bytes) - 1), p);
        }
        lo[c] = _mm512_and_si512(v, m4);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
      const int64_t ng = (nbk * 32 + G - 1) / G;
      const __m512 sg = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ng) - 1), srow + j * 512 / G));
      const __m512 sv = _mm512_permutexvar_ps(gidx, sg);  // 0 past the row: with S = 0, dx = 0 adds +0
      for (int t = 0; t < TT; t++) {
        const int8_t* q = acts[t]->q.data() + j * 512;
        __m512i a[4];
        for (int c = 0; c < 4; c++) {
          a[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c], _mm512_loadu_si512(q + c * 128));
          a[c] = _mm512_dpbusd_epi32(a[c], hi[c], _mm512_loadu_si512(q + c * 128 + 64));
        }
        const __m512i p0 = _mm512_add_epi32(_mm512_permutex2var_epi32(a[0], ev, a[1]), _mm512_permutex2var_epi32(a[0], od, a[1]));
        const __m512i p1 = _mm512_add_epi32(_mm512_permutex2var_epi32(a[2], ev, a[3]), _mm512_permutex2var_epi32(a[2], od, a[3]));
        const __m512i S = _mm512_add_epi32(_mm512_permutex2var_epi32(p0, ev, p1), _mm512_permutex2var_epi32(p0, od, p1));
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(sv, _mm512_loadu_ps(acts[t]->db.data() + 16 * j)),
                                  facc[t]);
      }
    }
    const uint16_t* mrow = w.mins + n * NG;  // + sum_g min_g * xg[g], 16 groups at a time
    for (int64_t g = 0; g < NG; g += 16) {
      const __mmask16 mk = NG - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (NG - g)) - 1);
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, mrow + g));
      for (int t = 0; t < TT; t++)
        facc[t] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mk, acts[t]->xg.data() + g), facc[t]);
    }
    for (int t = 0; t < TT; t++) out[t * ldo + n] = tree16(facc[t]);
  }
}

// ---- int8 weights x int16 activations (AVX512-VNNI vpdpwssd) -----------------------------
// int8 activations (block-32 absmax / 127) are too coarse for int8 weights: a dense model's
// outlier channels (SmolLM2's) leave the other 31 values of their block a few codes, and greedy
// answers break (docs/quantization.md#the-default-dense-format). int16 codes (absmax / 32767)
// keep 8 more bits per block at the same number of instructions per weight: the weight's codes
// are sign-extended to 16 bits (vpmovsxbw) and multiplied pairwise (vpdpwssd), 32 weights, one
// activation block, per vector. Per row: sum over blocks of scale(group) * dx(block) * sum(w * q).
struct QAct16 {
  std::vector<int16_t> q;  // [K]
  std::vector<float> dx;   // [K / 32]
};

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
static void quant_act16(const float* x, int64_t K, QAct16& a) {
  a.q.resize(K);
  a.dx.resize(K / 32);
  for (int64_t b = 0; b < K / 32; b++) {
    __m512i q0, q1;
    a.dx[b] = quant_block(x + 32 * b, q0, q1, 32767.f);
    _mm256_storeu_si256((__m256i*)(a.q.data() + 32 * b), _mm512_cvtsepi32_epi16(q0));
    _mm256_storeu_si256((__m256i*)(a.q.data() + 32 * b + 16), _mm512_cvtsepi32_epi16(q1));
  }
}

// s[b] = scale(group of block b) * dx[b] for the B blocks of one row and one token: the kernel's
// inner loop then broadcasts one float per block (no fp16 conversion or multiply there).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
static void block_scales(const uint16_t* srow, int64_t G, const float* dx, int64_t B, float* s) {
  const int64_t bpg = G / 32;  // blocks per group
  if (16 % bpg != 0) {
    for (int64_t b = 0; b < B; b++) s[b] = _cvtsh_ss(srow[b / bpg]) * dx[b];
    return;
  }
  const __m512i idx = _mm512_srlv_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(__builtin_ctzll(bpg)));
  for (int64_t b = 0; b < B; b += 16) {
    const int64_t nb = std::min<int64_t>(16, B - b), ng = (nb + bpg - 1) / bpg;
    const __m512 sc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ng) - 1), srow + b / bpg));
    const __mmask16 m = (__mmask16)((1u << nb) - 1);
    _mm512_mask_storeu_ps(s + b, m, _mm512_mul_ps(_mm512_permutexvar_ps(idx, sc), _mm512_maskz_loadu_ps(m, dx + b)));
  }
}

// One row at a time, 64 bytes of codes per step (two blocks, two accumulator chains), the row's
// stream prefetched 2 KiB ahead. Interleaving 2-4 rows (to share the activation loads) measured
// half the speed on cold weights here: the hardware prefetcher loses the streams.
template <int TT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")))
static void rows_int8_i16a(const QW& w, int64_t nb, int64_t ne, const QAct16* acts, float* out, int64_t ldo) {
  const int64_t K = w.K, G = w.G, NG = K / G, B = K / 32;
  const __m512i zero = _mm512_setzero_si512();
  static thread_local std::vector<float> sbuf;
  sbuf.resize(TT * B);
  for (int64_t n = nb; n < ne; n++) {
    const int8_t* row = (const int8_t*)w.codes + n * K;
    for (int t = 0; t < TT; t++) block_scales(w.scales + n * NG, G, acts[t].dx.data(), B, sbuf.data() + t * B);
    __m512 f0[TT], f1[TT];
    for (int t = 0; t < TT; t++) f0[t] = f1[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < B / 2; c++) {
      _mm_prefetch((const char*)(row + c * 64 + 2048), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(row + c * 64);
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1));
      for (int t = 0; t < TT; t++) {
        const int16_t* q = acts[t].q.data() + c * 64;
        const float* sb = sbuf.data() + t * B + 2 * c;
        f0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(zero, w0, _mm512_loadu_si512(q))),
                                _mm512_set1_ps(sb[0]), f0[t]);
        f1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(zero, w1, _mm512_loadu_si512(q + 32))),
                                _mm512_set1_ps(sb[1]), f1[t]);
      }
    }
    for (int t = 0; t < TT; t++) out[t * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(f0[t], f1[t]));
  }
}

// Rows are quantized on the pool (each row's codes do not depend on which thread made them); one
// row, a decode step's, stays on the calling thread.
constexpr int64_t QUANT_ROWS_PER_THREAD = 8;

static void quant_into(const float* x, int64_t T, int64_t K, std::vector<QAct16>& acts) {
  acts.resize(T);
  parallel(T, 1, QUANT_ROWS_PER_THREAD, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) quant_act16(x + t * K, K, acts[t]);
  });
}


// Every token of `acts`, TILE at a time (the VNNI kernels' register tile), then the rest as one
// smaller tile: f(tile, acts, out).
constexpr int TILE = 6;
template <int N, typename A, typename F>
static void rest_tile(int64_t n, const A* a, float* o, F& f) {
  if constexpr (N > 0) {
    if (n == N) f(std::integral_constant<int, N>{}, a, o);
    else rest_tile<N - 1>(n, a, o, f);
  }
}
template <typename A, typename F>
static void by_tiles(const std::vector<A>& acts, float* out, int64_t ldo, F&& f) {
  const int64_t T = (int64_t)acts.size();
  int64_t t = 0;
  for (; t + TILE <= T; t += TILE) f(std::integral_constant<int, TILE>{}, acts.data() + t, out + t * ldo);
  rest_tile<TILE - 1>(T - t, acts.data() + t, out + t * ldo, f);
}

// rows [nb, ne) of an int8 / int4 weight for tokens whose activations are already quantized
static void rows_i16a_int8(const QW& w, int64_t nb, int64_t ne, const std::vector<QAct16>& acts, float* out, int64_t ldo) {
  by_tiles(acts, out, ldo, [&](auto tt, const QAct16* a, float* o) { rows_int8_i16a<tt.value>(w, nb, ne, a, o, ldo); });
}

static void rows_i8a(const QW& w, int64_t nb, int64_t ne, const std::vector<const QAct*>& acts, float* out,
                     int64_t ldo) {
  by_tiles(acts, out, ldo, [&](auto tt, const QAct* const* a, float* o) { rows_int4_i8a<tt.value>(w, nb, ne, a, o, ldo); });
}

// into per-thread buffers (slot 0: an input, 1: an expert's hidden activation), reused across
// calls: a decode step makes thousands of these for experts as small as 18 KB
static void quant_into(const float* x, int64_t T, int64_t K, int64_t G, std::vector<QAct>& acts) {
  acts.resize(T);
  parallel(T, 1, QUANT_ROWS_PER_THREAD, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) quant_act(x + t * K, K, G, acts[t]);
  });
}

// integer activations: int4 weights (any K % 32 == 0: int8 codes), int8 weights with K % 64 == 0 (int16)
static bool use_i8a(const QW& w, int64_t i8a) {
  return i8a && (w.fmt == F_INT4 || (w.fmt == F_INT8 && w.K % 64 == 0));
}


}  // namespace

namespace ms {

bool has_vnni() { return __builtin_cpu_supports("avx512vnni"); }

void set_prefetch_rows(int64_t rows) { g_pf_rows = rows; }

namespace {

constexpr int64_t UNIT = 16;  // rows per work unit (the VNNI kernels' L1 block)

// Units of UNIT rows over every job's `rows(job)`, as prefix sums: job j owns [start[j], start[j+1]).
template <typename Job, typename R>
std::vector<int64_t> unit_starts(const std::vector<Job>& jobs, R rows) {
  std::vector<int64_t> start(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); j++) start[j + 1] = start[j] + (rows(jobs[j]) + UNIT - 1) / UNIT;
  return start;
}

// f(job, first row, end row) for units [b, e) of `start`
template <typename Job, typename R, typename F>
void for_units(const std::vector<int64_t>& start, int64_t b, int64_t e, const std::vector<Job>& jobs, R rows, F f) {
  size_t j = std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1;
  for (int64_t unit = b; unit < e; unit++) {
    while (unit >= start[j + 1]) j++;
    const int64_t rb = (unit - start[j]) * UNIT;
    f(j, rb, std::min(rb + UNIT, rows(jobs[j])));
  }
}

// a thread's share: at least ~32K weights, so a split pays for its hand-off; in units
int64_t min_units(int64_t weights, int64_t units) {
  return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, weights / std::max<int64_t>(1, units)));
}

// How a weight takes its input: float, int8 activations (int4 weights) or int16 ones (int8 weights).
enum Acts { FLOAT_ACTS, INT4_ACTS, INT16_ACTS };

Acts acts_for(const QW& w, bool i8a) {
  return !use_i8a(w, i8a) ? FLOAT_ACTS : w.fmt == F_INT8 ? INT16_ACTS : INT4_ACTS;
}

// One input (T rows of K) as the weights it meets need it: quantized once, read by every thread.
struct Input {
  Acts kind = FLOAT_ACTS;
  const float* x = nullptr;
  int64_t T = 0;
  std::vector<QAct> a4;
  std::vector<const QAct*> p4;  // each row's int8 activation: into a4, or a table shared by jobs
  std::vector<QAct16> a16;
  std::vector<float> picked;    // the float rows of a job with row indices
  bool tiles = false;           // set by tile()
  AmxActs amx;

  void set(Acts k, const float* xs, int64_t t, const QW& w) {
    kind = k, x = xs, T = t, tiles = false;
    if (k == INT16_ACTS) quant_into(x, T, w.K, a16);
    else if (k == INT4_ACTS) {
      quant_into(x, T, w.K, w.G, a4);
      p4.resize(T);
      for (int64_t i = 0; i < T; i++) p4[i] = &a4[i];
    }
  }
  // int8 activations of source rows rows[i] from a table of them (row r at table[r], quantized
  // as set() would)
  void shared_rows(const int64_t* rows, int64_t t, const std::vector<QAct>& table) {
    kind = INT4_ACTS, x = nullptr, T = t, tiles = false;
    p4.resize(T);
    for (int64_t i = 0; i < T; i++) p4[i] = &table[rows[i]];
  }
  // after set() or shared_rows(): int8 activations of AMX_MIN_ROWS rows or more as AMX tiles too
  void tile(const QW& w) {
    tiles = kind == INT4_ACTS && T >= AMX_MIN_ROWS && amx_on();
    if (tiles) amx_acts(p4.data(), T, w.K, w.G, amx);
  }
  // rows x[rows[i]] of a [*, K] source, copied, then as set()
  void set_rows(Acts k, const float* src, const int64_t* rows, int64_t t, const QW& w) {
    picked.resize(t * w.K);
    gather_rows(src, rows, t, w.K, picked.data());
    set(k, picked.data(), t, w);
  }
  // rows [rb, re) of out[T, w.N] = input @ w.T
  void rows(const QW& w, int64_t rb, int64_t re, float* out, int64_t direct_max_t) const {
    if (kind == INT16_ACTS) rows_i16a_int8(w, rb, re, a16, out, w.N);
    else if (kind == INT4_ACTS && tiles)
      for (int64_t n = rb; n < re; n += 16) rows_int4_amx(w, n, std::min(n + 16, re), amx, out, w.N);
    else if (kind == INT4_ACTS) rows_i8a(w, rb, re, p4, out, w.N);
    else rows_dispatch(w, rb, re, x, T, out, w.N, direct_max_t);
  }
};

// One expert's state in experts(): its input, its hidden activation, its gate/up buffers.
struct ExpertState {
  Input in, hid;
  std::vector<float> g, u;
};

// gate and up (same shape) take int8 activations together, sharing the quantized x
Acts input_kind(const ExpertJob& jb, bool i8a) {
  return acts_for(jb.g, i8a) == acts_for(jb.u, i8a) && jb.g.G == jb.u.G ? acts_for(jb.g, i8a) : FLOAT_ACTS;
}

// The int8 activations of the rows that jobs with row indices read: each row of their source
// quantized once (in parallel), however many experts it was routed to. One source and one (K, G)
// per call (a MoE layer's routed experts all read its hidden state at one format); a job on
// another source or format quantizes its own copy of its rows.
struct SharedActs {
  std::vector<QAct> table;
  std::vector<char> need;
  const float* src = nullptr;
  int64_t K = 0, G = 0;

  bool covers(const ExpertJob& jb, bool i8a) const {
    return jb.rows != nullptr && input_kind(jb, i8a) == INT4_ACTS && jb.x == src && jb.g.K == K && jb.g.G == G;
  }
  void quantize(const std::vector<ExpertJob>& jobs, bool i8a) {
    src = nullptr;
    for (const ExpertJob& jb : jobs)
      if (jb.rows != nullptr && input_kind(jb, i8a) == INT4_ACTS) {
        src = jb.x, K = jb.g.K, G = jb.g.G;
        break;
      }
    if (src == nullptr) return;
    int64_t n = 0;
    for (const ExpertJob& jb : jobs)
      if (covers(jb, i8a))
        for (int64_t i = 0; i < jb.T; i++) n = std::max(n, jb.rows[i] + 1);
    if ((int64_t)table.size() < n) table.resize(n);
    need.assign(n, 0);
    for (const ExpertJob& jb : jobs)
      if (covers(jb, i8a))
        for (int64_t i = 0; i < jb.T; i++) need[jb.rows[i]] = 1;
    parallel(n, 1, QUANT_ROWS_PER_THREAD, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; r++)
        if (need[r]) quant_act(src + r * K, K, G, table[r]);
    });
  }
};

int64_t out_rows(const LinearJob& j) { return j.w.N; }
int64_t inter_rows(const ExpertJob& j) { return j.g.N; }
int64_t hidden_rows(const ExpertJob& j) { return j.d.N; }

}  // namespace

// Buffers are thread-local and reused: a decode step makes thousands of these calls, for weights as
// small as 18 KB. Neither function calls itself or the other, so one set per thread suffices. The
// pool's workers reach the caller's set through a local reference (a thread_local named inside
// the lambda would be each worker's own, empty one).
void linears(std::vector<LinearJob>& jobs, int64_t direct_max_t, bool i8a) {
  const size_t J = jobs.size();
  static thread_local std::vector<Input> mine;
  std::vector<Input>& ins = mine;
  ins.resize(J);
  std::vector<size_t> src(J);  // which input each job reads: consecutive jobs on one x share it
  int64_t work = 0;
  for (size_t j = 0; j < J; j++) {
    const LinearJob& jb = jobs[j];
    const Acts kind = acts_for(jb.w, i8a);
    const bool same = j > 0 && jobs[j - 1].x == jb.x && jobs[j - 1].T == jb.T && ins[src[j - 1]].kind == kind &&
                      jobs[j - 1].w.K == jb.w.K && jobs[j - 1].w.G == jb.w.G;
    src[j] = same ? src[j - 1] : j;
    if (!same) {
      ins[j].set(kind, jb.x, jb.T, jb.w);
      ins[j].tile(jb.w);
    }
    work += jb.w.N * jb.w.K;
  }
  const std::vector<int64_t> start = unit_starts(jobs, out_rows);
  parallel(start[J], 1, min_units(work, start[J]), [&](int64_t b, int64_t e) {
    for_units(start, b, e, jobs, out_rows, [&](size_t j, int64_t rb, int64_t re) {
      ins[src[j]].rows(jobs[j].w, rb, re, jobs[j].out, direct_max_t);
    });
  });
}

// Rows of a call (all jobs together) up to which experts() reuses the thread's per-job buffers:
// decode-sized calls (a step's experts, a batch of decoding sequences) make thousands of calls.
// A larger call (a prefill's layer) gets buffers of its own, freed when it returns: reused by job
// index, each job's buffers would keep the largest share any layer ever gave that index, and
// their sum crept up layer by layer (~15 MiB over a 64-token prefill of the 8 GB bench model, a
// 128-expert layer; issue 27), where a call's own need is its rows x I.
constexpr int64_t REUSE_MAX_ROWS = 256;

void experts(std::vector<ExpertJob>& jobs, int64_t direct_max_t, bool i8a) {
  PhaseClock clk;
  const size_t J = jobs.size();
  int64_t call_rows = 0;
  for (const ExpertJob& jb : jobs) call_rows += jb.T;
  static thread_local std::vector<ExpertState> mine;
  std::vector<ExpertState> own;
  std::vector<ExpertState>& st = call_rows <= REUSE_MAX_ROWS ? mine : own;
  st.resize(J);
  static thread_local SharedActs shared_mine;
  SharedActs& shared = shared_mine;
  shared.quantize(jobs, i8a);
  int64_t work = 0;
  for (size_t j = 0; j < J; j++) {
    const ExpertJob& jb = jobs[j];
    const Acts kind = input_kind(jb, i8a);
    if (shared.covers(jb, i8a)) st[j].in.shared_rows(jb.rows, jb.T, shared.table);
    else if (jb.rows != nullptr) st[j].in.set_rows(kind, jb.x, jb.rows, jb.T, jb.g);
    else st[j].in.set(kind, jb.x, jb.T, jb.g);
    st[j].g.resize(jb.T * jb.g.N);
    st[j].u.resize(jb.T * jb.g.N);
    work += jb.g.N * jb.g.K;
  }
  if (call_rows >= AMX_MIN_ROWS)  // AMX tiles of the inputs with rows enough (none in a decode step)
    parallel((int64_t)J, 1, 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; j++) st[j].in.tile(jobs[j].g);
    });
  // gate and up rows (and silu on them) of every job
  const std::vector<int64_t> su = unit_starts(jobs, inter_rows);
  const int64_t share = min_units(work, su[J]);
  parallel(su[J], 1, share, [&](int64_t b, int64_t e) {
    for_units(su, b, e, jobs, inter_rows, [&](size_t j, int64_t rb, int64_t re) {
      const ExpertJob& jb = jobs[j];
      ExpertState& s = st[j];
      const int64_t I = jb.g.N;
      s.in.rows(jb.g, rb, re, s.g.data(), direct_max_t);
      s.in.rows(jb.u, rb, re, s.u.data(), direct_max_t);
      for (int64_t t = 0; t < jb.T; t++)
        expert_hidden_n(s.g.data() + t * I + rb, s.u.data() + t * I + rb, re - rb, jb.act, jb.alpha, jb.limit,
                        jb.bg ? jb.bg + rb : nullptr, jb.bu ? jb.bu + rb : nullptr);
    });
  });
  clk.mark(PH_GATE_UP);
  // the hidden activations, as the down projections take them: jobs on the pool when they have
  // rows enough to pay for it (a decode step's experts have one each: the calling thread)
  parallel((int64_t)J, 1, call_rows >= 2 * QUANT_ROWS_PER_THREAD ? 1 : (int64_t)J, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; j++) {
      st[j].hid.set(acts_for(jobs[j].d, i8a), st[j].g.data(), jobs[j].T, jobs[j].d);
      st[j].hid.tile(jobs[j].d);
    }
  });
  const std::vector<int64_t> sd = unit_starts(jobs, hidden_rows);
  parallel(sd[J], 1, share, [&](int64_t b, int64_t e) {
    for_units(sd, b, e, jobs, hidden_rows, [&](size_t j, int64_t rb, int64_t re) {
      const ExpertJob& jb = jobs[j];
      st[j].hid.rows(jb.d, rb, re, jb.out, direct_max_t);
      if (jb.bd)
        for (int64_t t = 0; t < jb.T; t++)
          for (int64_t r = rb; r < re; r++) jb.out[t * jb.d.N + r] += jb.bd[r];
    });
  });
  clk.mark(PH_DOWN);
}

void linear(const QW& w, const float* x, int64_t T, float* out, int64_t direct_max_t, bool i8a) {
  std::vector<LinearJob> one{{w, x, T, out}};
  linears(one, direct_max_t, i8a);
}

void expert(const QW& wg, const QW& wu, const QW& wd, const float* x, int64_t T, float* out,
            int64_t direct_max_t, bool i8a) {
  std::vector<ExpertJob> one{{wg, wu, wd, x, T, out}};
  experts(one, direct_max_t, i8a);
}

}  // namespace ms
