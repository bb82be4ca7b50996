// Quantized linear and SwiGLU-expert kernels for CPUs with AVX2 + FMA + F16C (x86-64-v3) but no
// AVX-512: the same contract as quant.cpp (quant.h), 8 float lanes per vector.
//
// Shape legend: weight w [N, K] (out, in), groups of G along K (bf16: the whole row is one group),
// codes in blocks of 32 weights; x [T, K] float32; out [T, N] = x @ w.T; expert gate/up [I, H],
// down [H, I], x [T, H], out [T, H]. K % 32 == 0.
//
// A 32-weight block is handled as four 8-lane chunks j = 0..3 (weights 8j .. 8j+7 of the block).
// 4-bit blocks are 16 code bytes, byte b = code b | code b+16 << 4 (engine/quant/formats.py), so
// chunk j comes from bytes 8(j&1) .. 8(j&1)+7, low nibbles for j < 2, high nibbles for j >= 2.
// Dequantization, per chunk (the float values are those of quant.cpp and reference.dequantize up
// to the rounding of one multiply-add):
//   int4: fma(float(code), scale, min)           nf4: lut[code] = NF4[code] * scale (two vpermps
//   int8: float(code) * scale                         over the 8-entry halves + a blend on bit 3)
//   bf16: the 16 bits moved to the top of a float
//
// Two loop nests, as in quant.cpp:
// - direct (T <= direct_max_t, decode): a tile of up to 4 rows x 3 tokens keeps its accumulators
//   in registers; each chunk of a row is dequantized once and FMA'd against every token of the
//   tile; further token triples of the same rows re-read the codes from L1.
// - scratch (larger T): 4 rows at a time are dequantized into a thread-local fp32 scratch and a
//   4 rows x 2 tokens register-tiled micro-kernel runs over all tokens, so dequantization is paid
//   once per weight per call.
// Measured (1024 x 1024, T = 1, group 64, 1 thread, 96 cold copies, on an AVX-512 Zen CPU forced
// to this build): int4 ~150 us, int8 ~165 us; the AVX-512 float kernels ~132 / ~135 us.
// Those are the float-activation kernels (rows_float). Integer activations (int4 x int8, int8 x
// int16: i8a.h) are further down, with the VNNI kernels' bits. Threads: jobs.cpp splits a weight's
// rows over the worker pool (pool.h); a row's result is the same whichever tile, share or loop
// nest computes it (the same dequantized values and the same per-lane FMA order), so results
// depend neither on the thread count nor on T.
#include "i8a.h"
#include "i16a_halves.h"
#include "quant.h"
#include "simd.h"

#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
using namespace ms;

alignas(32) const float NF4_CB[16] = {
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
  -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
  0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
  0.44070982985687256f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// MXFP4: the E2M1 values of codes 0..15 (engine/quant/reference.py E2M1_VALUES)
alignas(32) const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

int64_t g_prefetch_rows = 16;  // software prefetch distance in rows (0: off); set_prefetch_rows

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// group size for the loops (bf16 has no groups: the whole row)
inline int64_t eff_group(const QW& w) { return w.fmt == F_BF16 ? w.K : w.G; }

// One row's dequantizer: group() loads the (row, group) metadata, chunk() yields 8 weights.
template <int FMT> struct Deq {
  __m256 s, m;          // int4: scale, min; int8: scale
  __m256 lut_lo, lut_hi;  // nf4: NF4[0..7] * scale, NF4[8..15] * scale; mxfp4: E2M1 * 2^(e - 127)

  inline void group(const QW& w, int64_t n, int64_t g) {
    if (FMT == F_BF16) return;
    const int64_t i = n * (w.K / w.G) + g;
    if (FMT == F_MXFP4) {  // exact: E2M1 values times a power of two
      s = _mm256_set1_ps(e8m0(((const uint8_t*)w.scales)[i]));
      lut_lo = _mm256_mul_ps(_mm256_load_ps(E2M1), s);
      lut_hi = _mm256_mul_ps(_mm256_load_ps(E2M1 + 8), s);
      return;
    }
    s = _mm256_set1_ps(h2f(w.scales[i]));
    if (FMT == F_INT4) m = _mm256_set1_ps(h2f(w.mins[i]));
    if (FMT == F_NF4) {
      lut_lo = _mm256_mul_ps(_mm256_load_ps(NF4_CB), s);
      lut_hi = _mm256_mul_ps(_mm256_load_ps(NF4_CB + 8), s);
    }
  }

  // weights k + 8j .. k + 8j + 7 of row n (k: the first weight of a 32-block)
  inline __m256 chunk(const QW& w, int64_t n, int64_t k, int j) const {
    if (FMT == F_MXFP4) {  // bytes 4j .. 4j+3: weights 8j + 2b (low nibble), 8j + 2b + 1 (high)
      int32_t four;
      std::memcpy(&four, w.codes + n * (w.K / 2) + k / 2 + 4 * j, 4);
      const __m256i b = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four)),
                                                    _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
      const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                                         _mm256_set1_epi32(15));
      const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(c, 28));  // bit 3 picks the half
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, c), _mm256_permutevar8x32_ps(lut_hi, c), sel);
    }
    if (FMT == F_INT4 || FMT == F_NF4) {
      const uint8_t* p = w.codes + n * (w.K / 2) + k / 2 + 8 * (j & 1);
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
      if (FMT == F_INT4) {
        const __m256i c = j < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), s, m);
      }
      // vpermps reads index bits 2:0; bit 3 of the code (bit 3 or 7 of the byte) picks the half
      const __m256i idx = j < 2 ? v : _mm256_srli_epi32(v, 4);
      const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(v, j < 2 ? 28 : 24));
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, idx), _mm256_permutevar8x32_ps(lut_hi, idx), sel);
    } else if (FMT == F_INT8) {
      const int8_t* p = (const int8_t*)w.codes + n * w.K + k + 8 * j;
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))), s);
    } else {
      const uint16_t* p = (const uint16_t*)w.codes + n * w.K + k + 8 * j;
      return _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    }
  }

  // bytes of codes per 32-block; weights per 64-byte cache line of codes
  static constexpr int64_t BLOCK_BYTES = FMT == F_INT4 || FMT == F_NF4 || FMT == F_MXFP4 ? 16 : FMT == F_INT8 ? 32 : 64;
  static constexpr int64_t WEIGHTS_PER_LINE = 64 / BLOCK_BYTES * 32;

  static inline void prefetch_codes(const QW& w, int64_t n, int64_t k, bool nta) {
    if (n >= w.N) return;
    prefetch_stream((const char*)w.codes + n * (w.K / 32 * BLOCK_BYTES) + k / 32 * BLOCK_BYTES, nta);
  }
};

// prefetch the scales/mins of rows [n0, n0 + R) (those that exist)
inline void prefetch_meta(const QW& w, int64_t n0, int R, bool nta) {
  if (w.fmt == F_BF16 || n0 >= w.N) return;
  const int64_t ng = w.K / w.G, rows = n0 + R <= w.N ? R : w.N - n0, ssz = w.fmt == F_MXFP4 ? 1 : 2;
  const int64_t bytes = rows * ng * ssz;
  for (int64_t b = 0; b < bytes; b += 64) prefetch_stream((const char*)w.scales + n0 * ng * ssz + b, nta);
  if (w.fmt == F_INT4)
    for (int64_t b = 0; b < bytes; b += 64) prefetch_stream((const char*)(w.mins + n0 * ng) + b, nta);
}

// ---- direct loop ---------------------------------------------------------------------------
// out[t0 + t, n0 + r] = sum_k x[t0 + t, k] * w[n0 + r, k] for r < R, t < TT
template <int FMT, int R, int TT>
void tile_direct(const QW& w, int64_t n0, const float* x, int64_t t0, float* out, int64_t ldo) {
  const int64_t K = w.K, G = eff_group(w), NG = K / G, pf = g_prefetch_rows;
  const bool nta = stream_nta();
  if (pf > 0) prefetch_meta(w, n0 + pf, R, nta);
  __m256 acc[R][TT];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 3
    for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
  Deq<FMT> d[R];
  for (int64_t g = 0; g < NG; g++) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) d[r].group(w, n0 + r, g);
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      if (pf > 0 && k % Deq<FMT>::WEIGHTS_PER_LINE == 0) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) Deq<FMT>::prefetch_codes(w, n0 + pf + r, k, nta);
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        __m256 xv[TT];
#pragma GCC unroll 3
        for (int t = 0; t < TT; t++) xv[t] = _mm256_loadu_ps(x + (t0 + t) * K + k + 8 * j);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
          const __m256 wv = d[r].chunk(w, n0 + r, k, j);
#pragma GCC unroll 3
          for (int t = 0; t < TT; t++) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 3
    for (int t = 0; t < TT; t++) out[(t0 + t) * ldo + n0 + r] = hsum8(acc[r][t]);
}

// rows [n0, n0 + R) for all T tokens: token triples, then the 1-2 left
template <int FMT, int R>
void rows_direct(const QW& w, int64_t n0, const float* x, int64_t T, float* out, int64_t ldo) {
  int64_t t = 0;
  for (; t + 3 <= T; t += 3) tile_direct<FMT, R, 3>(w, n0, x, t, out, ldo);
  if (T - t == 2) tile_direct<FMT, R, 2>(w, n0, x, t, out, ldo);
  if (T - t == 1) tile_direct<FMT, R, 1>(w, n0, x, t, out, ldo);
}

// ---- scratch loop --------------------------------------------------------------------------
constexpr int RS = 4;  // rows per scratch tile

// buf[r, :] = w[n0 + r, :] as float32, r < R
template <int FMT>
void deq_rows(const QW& w, int64_t n0, int R, float* buf) {
  const int64_t K = w.K, G = eff_group(w), NG = K / G, pf = g_prefetch_rows;
  const bool nta = stream_nta();
  if (pf > 0) prefetch_meta(w, n0 + pf, R, nta);
  for (int r = 0; r < R; r++) {
    if (pf > 0)
      for (int64_t k = 0; k < K; k += Deq<FMT>::WEIGHTS_PER_LINE) Deq<FMT>::prefetch_codes(w, n0 + pf + r, k, nta);
    Deq<FMT> d;
    float* b = buf + r * K;
    for (int64_t g = 0; g < NG; g++) {
      d.group(w, n0 + r, g);
      for (int64_t k = g * G; k < (g + 1) * G; k += 32)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(b + k + 8 * j, d.chunk(w, n0 + r, k, j));
    }
  }
}

// out[t0 + t, n0 + r] = buf[r, :] . x[t0 + t, :] for r < R, t < TT
template <int R, int TT>
void micro(const float* buf, int64_t K, int64_t n0, const float* x, int64_t t0, float* out, int64_t ldo) {
  __m256 acc[R][TT];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 2
    for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(buf + r * K + k);
#pragma GCC unroll 2
    for (int t = 0; t < TT; t++) {
      const __m256 xv = _mm256_loadu_ps(x + (t0 + t) * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 2
    for (int t = 0; t < TT; t++) out[(t0 + t) * ldo + n0 + r] = hsum8(acc[r][t]);
}

template <int R>
void micro_all_tokens(const float* buf, int64_t K, int64_t n0, const float* x, int64_t T, float* out, int64_t ldo) {
  int64_t t = 0;
  for (; t + 2 <= T; t += 2) micro<R, 2>(buf, K, n0, x, t, out, ldo);
  if (t < T) micro<R, 1>(buf, K, n0, x, t, out, ldo);
}

// this thread's scratch of at least n floats (shared by every format's loop)
float* scratch(int64_t n) {
  static thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < n) buf.resize(n);
  return buf.data();
}

// ---- dispatch ------------------------------------------------------------------------------
// rows [nb, ne) of out = x @ w.T for all T tokens
template <int FMT>
void rows_range(const QW& w, int64_t nb, int64_t ne, const float* x, int64_t T, float* out, int64_t ldo,
                int64_t direct_max_t) {
  int64_t n = nb;
  if (T <= direct_max_t) {
    for (; n + 4 <= ne; n += 4) rows_direct<FMT, 4>(w, n, x, T, out, ldo);
    for (; n < ne; n++) rows_direct<FMT, 1>(w, n, x, T, out, ldo);
    return;
  }
  float* buf = scratch(RS * w.K);
  for (; n + RS <= ne; n += RS) {
    deq_rows<FMT>(w, n, RS, buf);
    micro_all_tokens<RS>(buf, w.K, n, x, T, out, ldo);
  }
  for (; n < ne; n++) {
    deq_rows<FMT>(w, n, 1, buf);
    micro_all_tokens<1>(buf, w.K, n, x, T, out, ldo);
  }
}

void rows_dispatch(const QW& w, int64_t nb, int64_t ne, const float* x, int64_t T, float* out, int64_t ldo,
                   int64_t direct_max_t) {
  switch (w.fmt) {
    case F_INT4: rows_range<F_INT4>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    case F_NF4:  rows_range<F_NF4>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    case F_INT8: rows_range<F_INT8>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    case F_MXFP4: rows_range<F_MXFP4>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
    default:     rows_range<F_BF16>(w, nb, ne, x, T, out, ldo, direct_max_t); break;
  }
}

// ---- integer activations (i8a.h has the formats and the sums) ------------------------------
// AVX2 has no VNNI: a u8 x s8 product pair is vpmaddubsw (int16, exact here: codes <= 15, |q| <= 127,
// two products <= 3810) and pairs of int16 are summed into int32 by vpmaddwd, int16 x int16 products
// likewise. The integer sums are exact, and the float steps are i8a.h's, lane for lane: a
// 16-lane vector of quant.cpp is two 8-lane ones here (lanes 0-7, 8-15), so the results are the
// VNNI kernels' bits.

// the max of a vector's 8 lanes
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// the sum of a vector's 8 int32 lanes (exact in any order)
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// The split kernel's layout of 8 blocks (y[l]: block l's 32 bytes in weight order): 8 vectors,
// vector i holding weights 4i .. 4i + 3 of block l in its 32-bit lane l (an 8 x 8 transpose of
// 32-bit lanes), stored at out[32 i ..]. A vpmaddubsw over two such vectors then sums pairs of one
// block, so vpaddw of all 8 and one vpmaddwd give each block's sum in its own lane: no fold.
inline void store_lanes_by_block(const __m256i y[8], uint8_t* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // t[i]: lanes 0, 1 of rows i, i + 1 interleaved (per 128 bits)
    t[i] = _mm256_unpacklo_epi32(y[i], y[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(y[i], y[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + c]: column c (low 128 bits) and c + 4 (high) of rows i .. i + 3
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; c++) {
    _mm256_storeu_si256((__m256i*)(out + 32 * c), _mm256_permute2x128_si256(u[c], u[c + 4], 0x20));
    _mm256_storeu_si256((__m256i*)(out + 32 * (c + 4)), _mm256_permute2x128_si256(u[c], u[c + 4], 0x31));
  }
}

// The one quantization rule of a 32-value block (quant.cpp quant_block): d = absmax / qmax, codes
// round-half-even(x * (1 / d)) as int32, q[i] holding values 8i .. 8i + 7; 0 when d = 0.
inline float quant_block(const float* x, __m256i q[4], float qmax) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs));
  }
  const float d = hmax8(m) / qmax, inv = d > 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));  // half to even
  return d;
}

// 16 int32 (a: values 0-7, b: 8-15) as 16 int16 in order, saturated
inline __m256i pack16(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

void quant_act_avx2(const float* x, int64_t K, int64_t G, QAct& a) {
  a.q.assign(quant_act_bytes(K), 0);
  a.db.assign((K / 32 + 15) / 16 * 16, 0.f);
  a.xg.assign(K / G, 0.f);
  for (int64_t b = 0; b < K / 32; b++) {
    __m256i q[4];
    const float d = quant_block(x + 32 * b, q, 127.f);
    const __m256i lo = pack16(q[0], q[1]), hi = pack16(q[2], q[3]);  // values 0-15, 16-31 as int16
    const int64_t c = b / 4, i = b % 4;
    _mm_storeu_si128((__m128i*)(a.q.data() + c * 128 + i * 16),
                     _mm_packs_epi16(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
    _mm_storeu_si128((__m128i*)(a.q.data() + c * 128 + 64 + i * 16),
                     _mm_packs_epi16(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
    a.db[b] = d;
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    a.xg[32 * b / G] += d * (float)hsum8_epi32(s);
  }
  a.qt.resize(a.q.size());  // the lane-per-block layout of the split kernel (below)
  for (int64_t j = 0; j < (int64_t)a.q.size() / 512; j++)
    for (int s = 0; s < 2; s++) {
      __m256i y[8];  // blocks 16j + 8s + l in natural order: weights 0-15, then 16-31
      for (int l = 0; l < 8; l++) {
        const int8_t* c = a.q.data() + j * 512 + (2 * s + l / 4) * 128 + (l % 4) * 16;
        y[l] = _mm256_loadu2_m128i((const __m128i*)(c + 64), (const __m128i*)c);
      }
      store_lanes_by_block(y, (uint8_t*)a.qt.data() + j * 512 + s * 256);
    }
}

void quant_act16_avx2(const float* x, int64_t K, QAct16& a) {
  a.q.resize(K);
  a.dx.resize(K / 32);
  for (int64_t b = 0; b < K / 32; b++) {
    __m256i q[4];
    a.dx[b] = quant_block(x + 32 * b, q, 32767.f);
    _mm256_storeu_si256((__m256i*)(a.q.data() + 32 * b), pack16(q[0], q[1]));
    _mm256_storeu_si256((__m256i*)(a.q.data() + 32 * b + 16), pack16(q[2], q[3]));
  }
}

// The scales of blocks 16j .. 16j + 15 of a row (its groups of G, fp16) as lanes 0-7 and 8-15;
// 0 past the row's nbk blocks (its last groups copied into zeros: nothing read past the row).
inline void block_group_scales(const uint16_t* srow, int64_t G, int64_t j, int64_t nbk, __m256& lo, __m256& hi) {
  const uint16_t* s = srow + j * 512 / G;
  if (G != 32 && G != 64 && G != 128) {
    alignas(32) float t[16];
    for (int64_t i = 0; i < 16; i++) t[i] = i < nbk ? h2f(s[i * 32 / G]) : 0.f;
    lo = _mm256_load_ps(t);
    hi = _mm256_load_ps(t + 8);
    return;
  }
  if (nbk < 16) {
    alignas(16) uint16_t tail[16] = {};
    std::memcpy(tail, s, (nbk * 32 + G - 1) / G * sizeof(uint16_t));
    block_group_scales(tail, G, 0, 16, lo, hi);
    return;
  }
  if (G == 32) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
    hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 8)));
  } else if (G == 64) {  // 8 groups: lane i of 16 takes group i / 2
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
    lo = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    hi = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
  } else {  // 4 groups: lane i takes group i / 4
    const __m256 v = _mm256_cvtph_ps(_mm_loadl_epi64((const __m128i*)s));
    lo = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    hi = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
  }
}

// lanes i < n of 8 set (a maskload's mask; none for n <= 0)
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::max<int64_t>(-1, std::min<int64_t>(8, n))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Block pair p of 16-block group j of a row (blocks 16j + 2p, + 1; codes at c = the group's 256
// bytes): 32 code bytes, 16 when only the first block is in the row (nothing read past it), zero
// past it
inline __m256i pair_codes(const uint8_t* c, int p, int64_t nbk) {
  if (2 * p + 2 <= nbk) return _mm256_loadu_si256((const __m256i*)(c + p * 32));
  if (2 * p + 1 == nbk) return _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i*)(c + p * 32)), 0);
  return _mm256_setzero_si256();
}

// The exact sums of a block pair's codes, split into their low (codes 0-15 of each block) and
// high (16-31) nibbles as bytes, against one token's q (its chunk layout, i8a.h): lanes 0-3 the
// first block's partial sums, 4-7 the second's.
inline __m256i pair_sums(__m256i lo, __m256i hi, const int8_t* q) {
  const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)q)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(q + 64))));
  return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}

// Rows [n0, n1) of an int4 weight with their nibbles split into bytes, for calls with many tokens
// (a prefill's), in the layout of QAct::qt (store_lanes_by_block: per row, 16-block group and set
// of 8 blocks, 8 vectors with one 32-bit lane per block; zero past the row): each token's pass
// over a row loads them, and XROWS rows at a time stay in L1.
inline int64_t split_bytes(const QW& w) { return (w.K / 32 + 15) / 16 * 512; }

void split_rows(const QW& w, int64_t n0, int64_t n1, uint8_t* out) {
  const int64_t B = w.K / 32, J = (B + 15) / 16;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; n++)
    for (int64_t j = 0; j < J; j++) {
      const int64_t nbk = std::min<int64_t>(16, B - 16 * j);
      const uint8_t* c = w.codes + n * (w.K / 2) + j * 256;
      for (int s = 0; s < 2; s++) {
        __m256i y[8];
        for (int p = 0; p < 4; p++) {  // blocks 2p, 2p + 1 of the set: low nibbles = weights 0-15
          const __m256i v = pair_codes(c, 4 * s + p, nbk);
          const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          y[2 * p] = _mm256_permute2x128_si256(lo, hi, 0x20);
          y[2 * p + 1] = _mm256_permute2x128_si256(lo, hi, 0x31);
        }
        store_lanes_by_block(y, out + ((n - n0) * J + j) * 512 + s * 256);
      }
    }
}

// The mins' term of i8a.h's sum for row n: P[g % 16] = fma(min(g), xg_g, P[g % 16]), g ascending;
// past NG the lanes add fma(0, 0) = +0, as VNNI's masked lanes (the last groups' mins copied into
// zeros, their xg masked loads: nothing read past either)
template <int TT>
inline void add_mins(const QW& w, int64_t n, const QAct* const* acts, __m256* plo, __m256* phi) {
  const int64_t NG = w.K / w.G;
  const uint16_t* mrow = w.mins + n * NG;  // 16 groups at a time
  for (int64_t g = 0; g < NG; g += 16) {
    const int64_t ng = std::min<int64_t>(16, NG - g);
    if (ng == 16) {
      const __m256 mlo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mrow + g)));
      const __m256 mhi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mrow + g + 8)));
      for (int t = 0; t < TT; t++) {
        const float* xg = acts[t]->xg.data() + g;
        plo[t] = _mm256_fmadd_ps(mlo, _mm256_loadu_ps(xg), plo[t]);
        phi[t] = _mm256_fmadd_ps(mhi, _mm256_loadu_ps(xg + 8), phi[t]);
      }
      continue;
    }
    alignas(16) uint16_t m[16] = {};
    std::memcpy(m, mrow + g, ng * sizeof(uint16_t));
    const __m256 mlo = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)m));
    const __m256 mhi = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(m + 8)));
    const __m256i klo = first_lanes(ng), khi = first_lanes(ng - 8);
    for (int t = 0; t < TT; t++) {
      const float* xg = acts[t]->xg.data() + g;
      plo[t] = _mm256_fmadd_ps(mlo, _mm256_maskload_ps(xg, klo), plo[t]);
      phi[t] = _mm256_fmadd_ps(mhi, _mm256_maskload_ps(xg + 8, khi), phi[t]);
    }
  }
}

// int4 weights x int8 activations over split rows (split_rows, rows [nb, ne)) and TT tokens' qt:
// per set of 8 blocks, 8 vpmaddubsw summed in 16 bits (at most 8 x 2 x 15 x 127 = 30,480: exact)
// and one vpmaddwd give the 8 blocks' S_b in order, then the float steps of i8a.h.
template <int TT>
void rows_int4_i8a_split(const QW& w, int64_t nb, int64_t ne, const QAct* const* acts, float* out, int64_t ldo,
                         const uint8_t* split) {
  const int64_t K = w.K, G = w.G, NG = K / G, B = K / 32, J = (B + 15) / 16;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = nb; n < ne; n++) {
    const uint16_t* srow = w.scales + n * NG;
    __m256 p[2][TT];
    for (int t = 0; t < TT; t++) p[0][t] = p[1][t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < J; j++) {
      const int64_t nbk = std::min<int64_t>(16, B - 16 * j);
      const uint8_t* sp = split + ((n - nb) * J + j) * 512;
      __m256 sc[2];
      block_group_scales(srow, G, j, nbk, sc[0], sc[1]);
      for (int s = 0; s < 2; s++) {
        const uint8_t* cs = sp + s * 256;
        __m256i acc[TT];
        for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int i = 0; i < (8 * s < nbk ? 8 : 0); i++) {  // a set past the row: sums 0
          const __m256i c = _mm256_loadu_si256((const __m256i*)(cs + i * 32));
          for (int t = 0; t < TT; t++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(acts[t]->qt.data() + j * 512 + s * 256 + i * 32));
            acc[t] = _mm256_add_epi16(acc[t], _mm256_maddubs_epi16(c, q));
          }
        }
        for (int t = 0; t < TT; t++) {
          const float* db = acts[t]->db.data() + 16 * j + 8 * s;
          p[s][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[t], ones)),
                                    _mm256_mul_ps(sc[s], _mm256_loadu_ps(db)), p[s][t]);
        }
      }
    }
    add_mins<TT>(w, n, acts, p[0], p[1]);
    for (int t = 0; t < TT; t++) out[t * ldo + n] = tree16(p[0][t], p[1][t]);
  }
}

// int4 weights x int8 activations: rows [nb, ne), TT tokens (decode: the codes split in
// registers per token). Per 16 blocks, S_b of 8 block pairs are folded by two rounds of vphaddd
// into lanes [S0 S2 S4 S6 | S1 S3 S5 S7] and put in order by one vpermd.
template <int TT>
void rows_int4_i8a(const QW& w, int64_t nb, int64_t ne, const QAct* const* acts, float* out, int64_t ldo) {
  const int64_t K = w.K, G = w.G, NG = K / G, B = K / 32, J = (B + 15) / 16;
  const __m256i m4 = _mm256_set1_epi8(0x0F), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const bool nta = stream_nta();
  for (int64_t n = nb; n < ne; n++) {
    const uint8_t* row = w.codes + n * (K / 2);
    const uint16_t* srow = w.scales + n * NG;
    __m256 plo[TT], phi[TT];
    for (int t = 0; t < TT; t++) plo[t] = phi[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < J; j++) {
      const int64_t nbk = std::min<int64_t>(16, B - 16 * j);  // blocks in this group of 16
      const uint8_t* c = row + j * 256;
      for (int64_t b = 0; b + 4 <= nbk; b += 4) prefetch_stream(c + b * 16 + 2048, nta);
      auto sums = [&](int p, const int8_t* q) {  // pair p against q
        const __m256i v = pair_codes(c, p, nbk);
        return pair_sums(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), q);
      };
      __m256 slo, shi;
      block_group_scales(srow, G, j, nbk, slo, shi);
      for (int t = 0; t < TT; t++) {
        const int8_t* q = acts[t]->q.data() + j * 512;
        __m256i h[4];
        for (int p = 0; p < 8; p += 2)  // pairs p, p + 1: blocks 2p .. 2p + 3, one chunk of q
          h[p / 2] = _mm256_hadd_epi32(sums(p, q + (p / 2) * 128), sums(p + 1, q + (p / 2) * 128 + 32));
        const __m256i s0 = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h[0], h[1]), order);  // S0 .. S7
        const __m256i s1 = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h[2], h[3]), order);  // S8 .. S15
        const float* db = acts[t]->db.data() + 16 * j;
        plo[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(slo, _mm256_loadu_ps(db)), plo[t]);
        phi[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(shi, _mm256_loadu_ps(db + 8)), phi[t]);
      }
    }
    add_mins<TT>(w, n, acts, plo, phi);
    for (int t = 0; t < TT; t++) out[t * ldo + n] = tree16(plo[t], phi[t]);
  }
}

// s[b] = scale(group of block b) * dx[b] for the B blocks of one row and one token (quant.cpp's
// block_scales: the same products), 8 blocks a vector where the groups allow it
inline void block_scales(const uint16_t* srow, int64_t G, const float* dx, int64_t B, float* s) {
  int64_t b = 0;
  if (G == 32 || G == 64 || G == 128) {
    const __m256i idx = G == 32 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                      : G == 64 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (; b + 8 <= B; b += 8) {
      const uint16_t* p = srow + b * 32 / G;  // the groups of blocks b .. b + 7: 8, 4 or 2 scales
      __m128i h;
      if (G == 32) h = _mm_loadu_si128((const __m128i*)p);
      else if (G == 64) h = _mm_loadl_epi64((const __m128i*)p);
      else { int32_t two; std::memcpy(&two, p, 4); h = _mm_cvtsi32_si128(two); }
      _mm256_storeu_ps(s + b, _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_cvtph_ps(h), idx), _mm256_loadu_ps(dx + b)));
    }
  }
  for (; b < B; b++) s[b] = h2f(srow[b * 32 / G]) * dx[b];
}

constexpr int TILE = 3;  // tokens per register tile (16 vector registers)
constexpr int SPLIT_TILE = 2;  // tokens per tile over split rows (1-4 measured within 8%; 2 the fastest)
constexpr int64_t SPLIT_BYTES = 16 << 10;  // split_rows's rows at a time: half of a 32 KiB L1

}  // namespace

namespace ms {

bool has_vnni() { return false; }
bool has_int8_dots() { return true; }  // AVX2's vpmaddubsw / vpmaddwd (above)

void set_prefetch_rows(int64_t rows) { g_prefetch_rows = rows; }

void quant_act(const float* x, int64_t K, int64_t G, QAct& a) { quant_act_avx2(x, K, G, a); }
void quant_act16(const float* x, int64_t K, QAct16& a) { quant_act16_avx2(x, K, a); }

// More tokens than one register tile: the rows' nibbles split once (split_rows), XROWS rows at a
// time, then every tile of tokens over them (rows_int4_i8a_split: 1.5x the fold's multiply-adds a
// second on a 1024 x 1024 weight and 64 tokens, 58 against 38 G a core on a Zen 3 EPYC); the
// same sums either way (batch invariance).
void rows_i8a(const QW& w, int64_t nb, int64_t ne, const std::vector<const QAct*>& acts, float* out, int64_t ldo) {
  if ((int64_t)acts.size() <= TILE) {
    by_tiles<TILE>(acts, out, ldo, [&](auto tt, const QAct* const* a, float* o) {
      rows_int4_i8a<tt.value>(w, nb, ne, a, o, ldo);
    });
    return;
  }
  const int64_t rb = split_bytes(w), xrows = std::max<int64_t>(1, SPLIT_BYTES / rb);
  static thread_local std::vector<uint8_t> buf;
  buf.resize(xrows * rb);
  uint8_t* const split = buf.data();
  for (int64_t n0 = nb; n0 < ne; n0 += xrows) {
    const int64_t n1 = std::min(ne, n0 + xrows);
    split_rows(w, n0, n1, split);
    by_tiles<SPLIT_TILE>(acts, out, ldo, [&](auto tt, const QAct* const* a, float* o) {
      rows_int4_i8a_split<tt.value>(w, n0, n1, a, o, ldo, split);
    });
  }
}

void rows_i16a(const QW& w, int64_t nb, int64_t ne, const std::vector<QAct16>& acts, float* out, int64_t ldo) {
  by_tiles<TILE>(acts, out, ldo, [&](auto tt, const QAct16* a, float* o) {
    rows_int8_i16a_halves<tt.value, block_scales>(w, nb, ne, a, o, ldo);
  });
}

void rows_float(const QW& w, int64_t nb, int64_t ne, const float* x, int64_t T, float* out, int64_t ldo,
                int64_t direct_max_t) {
  rows_dispatch(w, nb, ne, x, T, out, ldo, direct_max_t);
}

}  // namespace ms
