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
// Threads: the row kernels run on one thread; linears() and experts() (jobs.cpp, shared with the
// AVX2 build) split rows in units of 16 over the native worker pool (pool.cpp). An OpenMP build
// of the row kernels was measured slower inside a decode step on 2 cores (demo store 39.8 -> 19.8
// tok/s).
#include "quant.h"
#include "i8a.h"
#include "i16a_halves.h"
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
  static inline void prefetch(const QW& w, int64_t n, int64_t k, bool nta) {
    if (n >= w.N) return;
    const char* p = FMT == F_INT4 || FMT == F_NF4 || FMT == F_MXFP4 ? (const char*)(w.codes + n * (w.K / 2) + k / 2)
                  : FMT == F_INT8 ? (const char*)(w.codes + n * w.K + k) : (const char*)(w.codes + (n * w.K + k) * 2);
    prefetch_stream(p, nta);
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

static inline void prefetch_meta(const QW& w, int64_t n0, int R, bool nta) {
  if (w.fmt == F_BF16 || n0 >= w.N) return;
  const int64_t ng = w.K / w.G, ssz = w.fmt == F_MXFP4 ? 1 : 2;
  int64_t nr = n0 + R <= w.N ? R : w.N - n0;
  const char* s = (const char*)w.scales + n0 * ng * ssz;
  for (int64_t b = 0; b < nr * ng * ssz; b += 64) prefetch_stream(s + b, nta);
  if (w.fmt == F_INT4) {
    const char* m = (const char*)(w.mins + n0 * ng);
    for (int64_t b = 0; b < nr * ng * 2; b += 64) prefetch_stream(m + b, nta);
  }
}

template <int FMT, int R, int TT>
static void tile_direct(const QW& w, int64_t n0, const float* x, int64_t t0, float* out, int64_t ldo) {
  const int64_t K = w.K, G = eff_group(w), NG = K / G;
  const int64_t pf = g_pf_rows;
  const bool nta = stream_nta();
  if (pf > 0) prefetch_meta(w, n0 + pf, R, nta);
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
        for (int r = 0; r < R; r++) Deq<FMT>::prefetch(w, n0 + pf + r, k, nta);
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
  const bool nta = stream_nta();
  if (pf > 0) prefetch_meta(w, n0 + pf, R, nta);
  for (int r = 0; r < R; r++) {
    if (pf > 0)
      for (int64_t k = 0; k < K; k += Deq<FMT>::WEIGHTS_PER_LINE) Deq<FMT>::prefetch(w, n0 + pf + r, k, nta);
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
static void quant_act4(const float* x, int64_t K, int64_t G, QAct& a) {
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
  const bool nta = stream_nta();
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
          prefetch_stream(p + 2048, nta);
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

// ---- int8 weights x int16 activations (AVX512-VNNI vpdpwssd; i8a.h has the sum) ----------
// The weight's codes are sign-extended to 16 bits (vpmovsxbw) and multiplied pairwise with the
// int16 activations (vpdpwssd), 32 weights, one activation block, per vector. Per row: sum over
// blocks of scale(group) * dx(block) * sum(w * q).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
static void quant_act16_512(const float* x, int64_t K, QAct16& a) {
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
  const bool nta = stream_nta();
  for (int64_t n = nb; n < ne; n++) {
    const int8_t* row = (const int8_t*)w.codes + n * K;
    for (int t = 0; t < TT; t++) block_scales(w.scales + n * NG, G, acts[t].dx.data(), B, sbuf.data() + t * B);
    __m512 f0[TT], f1[TT];
    for (int t = 0; t < TT; t++) f0[t] = f1[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < B / 2; c++) {
      prefetch_stream(row + c * 64 + 2048, nta);
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

// Decode-sized int8 x int16 calls (HALVES_MAX_T tokens or fewer) take the 256-bit kernel of
// i16a_halves.h, the same sums and float steps as rows_int8_i16a (i8a.h: the same bits). On a
// 2-core Zen 4 EPYC, whose 512-bit operations run as two 256-bit halves, 12 rounds of 32 decoded
// tokens of the 1.3B store alternating in one process (2026-12-05): norm + q/k/v 0.600 -> 0.552 ms,
// o_proj 0.394 -> 0.367, the int8 head 0.981 -> 0.908, each faster in 12 of 12 rounds; a 512-token
// prefill (6-token tiles) was 2% slower this way (faster in 2 of 8), so larger calls keep 512 bits.
constexpr int64_t HALVES_MAX_T = 3;

constexpr int TILE = 6;  // tokens per register tile of the VNNI kernels (i8a.h by_tiles)

}  // namespace

namespace ms {

void quant_act(const float* x, int64_t K, int64_t G, QAct& a) { quant_act4(x, K, G, a); }
void quant_act16(const float* x, int64_t K, QAct16& a) { quant_act16_512(x, K, a); }

void rows_i16a(const QW& w, int64_t nb, int64_t ne, const std::vector<QAct16>& acts, float* out, int64_t ldo) {
  if ((int64_t)acts.size() <= HALVES_MAX_T)
    by_tiles<TILE>(acts, out, ldo, [&](auto tt, const QAct16* a, float* o) { rows_int8_i16a_halves<tt.value, block_scales>(w, nb, ne, a, o, ldo); });
  else
    by_tiles<TILE>(acts, out, ldo, [&](auto tt, const QAct16* a, float* o) { rows_int8_i16a<tt.value>(w, nb, ne, a, o, ldo); });
}

void rows_i8a(const QW& w, int64_t nb, int64_t ne, const std::vector<const QAct*>& acts, float* out, int64_t ldo) {
  by_tiles<TILE>(acts, out, ldo, [&](auto tt, const QAct* const* a, float* o) { rows_int4_i8a<tt.value>(w, nb, ne, a, o, ldo); });
}

void rows_float(const QW& w, int64_t nb, int64_t ne, const float* x, int64_t T, float* out, int64_t ldo,
                int64_t direct_max_t) {
  rows_dispatch(w, nb, ne, x, T, out, ldo, direct_max_t);
}

bool has_vnni() { return __builtin_cpu_supports("avx512vnni"); }
bool has_int8_dots() { return has_vnni(); }

void set_prefetch_rows(int64_t rows) { g_pf_rows = rows; }

}  // namespace ms
