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
// int8 activations (VNNI) do not exist here: has_vnni() is false and i8a is ignored, so the
// results are x @ dequantize(w).T in float32 for every format (reference.linear_ref).
// Threads: linear() and expert() split a weight's rows over the worker pool (pool.h) in shares of
// 8 rows; a row's result is the same whichever tile, share or loop nest computes it (the same
// dequantized values and the same per-lane FMA order), so results depend neither on the thread
// count nor on T.
#include "pool.h"
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

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

  static inline void prefetch_codes(const QW& w, int64_t n, int64_t k) {
    if (n >= w.N) return;
    _mm_prefetch((const char*)w.codes + n * (w.K / 32 * BLOCK_BYTES) + k / 32 * BLOCK_BYTES, _MM_HINT_T0);
  }
};

// prefetch the scales/mins of rows [n0, n0 + R) (those that exist)
inline void prefetch_meta(const QW& w, int64_t n0, int R) {
  if (w.fmt == F_BF16 || n0 >= w.N) return;
  const int64_t ng = w.K / w.G, rows = n0 + R <= w.N ? R : w.N - n0, ssz = w.fmt == F_MXFP4 ? 1 : 2;
  const int64_t bytes = rows * ng * ssz;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)w.scales + n0 * ng * ssz + b, _MM_HINT_T0);
  if (w.fmt == F_INT4)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)(w.mins + n0 * ng) + b, _MM_HINT_T0);
}

// ---- direct loop ---------------------------------------------------------------------------
// out[t0 + t, n0 + r] = sum_k x[t0 + t, k] * w[n0 + r, k] for r < R, t < TT
template <int FMT, int R, int TT>
void tile_direct(const QW& w, int64_t n0, const float* x, int64_t t0, float* out, int64_t ldo) {
  const int64_t K = w.K, G = eff_group(w), NG = K / G, pf = g_prefetch_rows;
  if (pf > 0) prefetch_meta(w, n0 + pf, R);
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
        for (int r = 0; r < R; r++) Deq<FMT>::prefetch_codes(w, n0 + pf + r, k);
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
  if (pf > 0) prefetch_meta(w, n0 + pf, R);
  for (int r = 0; r < R; r++) {
    if (pf > 0)
      for (int64_t k = 0; k < K; k += Deq<FMT>::WEIGHTS_PER_LINE) Deq<FMT>::prefetch_codes(w, n0 + pf + r, k);
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

}  // namespace

namespace ms {

bool has_vnni() { return false; }  // float activations only on this path

void set_prefetch_rows(int64_t rows) { g_prefetch_rows = rows; }

// rows per thread share: at least ~32K weights, so a split pays for its hand-off (as quant.cpp)
static int64_t min_rows(const QW& w) { return std::max<int64_t>(8, (1 << 15) / w.K); }

void linear(const QW& w, const float* x, int64_t T, float* out, int64_t direct_max_t, bool /*i8a*/) {
  if (T == 0) return;
  parallel(w.N, 8, min_rows(w), [&](int64_t b, int64_t e) { rows_dispatch(w, b, e, x, T, out, w.N, direct_max_t); });
}

// One expert job: gate, up and the activation over a thread's share of the hidden rows, then down
static void run_expert(const ExpertJob& j, int64_t direct_max_t) {
  const int64_t T = j.T, I = j.g.N, H = j.d.N;
  if (T == 0) return;
  static thread_local std::vector<float> gbuf, ubuf, xbuf;  // [T, I] each, [T, K]: the caller's
  gbuf.resize(T * I);
  ubuf.resize(T * I);
  float *gp = gbuf.data(), *up = ubuf.data();
  const float* x = j.x;
  if (j.rows != nullptr) {  // the job's rows of its source, gathered
    xbuf.resize(T * j.g.K);
    gather_rows(j.x, j.rows, T, j.g.K, xbuf.data());
    x = xbuf.data();
  }
  parallel(I, 8, min_rows(j.g), [&](int64_t b, int64_t e) {
    rows_dispatch(j.g, b, e, x, T, gp, I, direct_max_t);
    rows_dispatch(j.u, b, e, x, T, up, I, direct_max_t);
    for (int64_t t = 0; t < T; t++)
      expert_hidden_n(gp + t * I + b, up + t * I + b, e - b, j.act, j.alpha, j.limit,
                      j.bg ? j.bg + b : nullptr, j.bu ? j.bu + b : nullptr);
  });
  linear(j.d, gp, T, j.out, direct_max_t, false);
  if (j.bd)
    for (int64_t t = 0; t < T; t++)
      for (int64_t r = 0; r < H; r++) j.out[t * H + r] += j.bd[r];
}

void expert(const QW& wg, const QW& wu, const QW& wd, const float* x, int64_t T, float* out,
            int64_t direct_max_t, bool /*i8a*/) {
  run_expert(ExpertJob{wg, wu, wd, x, T, out}, direct_max_t);
}

// The AVX2 build runs a group one linear after another (each splits its rows over the pool).
void linears(std::vector<LinearJob>& jobs, int64_t direct_max_t, bool i8a) {
  for (LinearJob& j : jobs) linear(j.w, j.x, j.T, j.out, direct_max_t, i8a);
}

// The AVX2 build runs a group one expert after another (each splits its rows over the pool).
void experts(std::vector<ExpertJob>& jobs, int64_t direct_max_t, bool i8a) {
  for (ExpertJob& j : jobs) run_expert(j, direct_max_t);
}

}  // namespace ms
