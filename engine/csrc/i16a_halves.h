// int8 weights x int16 activations (i8a.h's sum) on 256-bit vectors: the AVX2 build's kernel for
// every call, and the AVX-512 build's for decode-sized ones (quant.cpp HALVES_MAX_T: on a Zen 4
// EPYC, whose 512-bit operations run as two 256-bit halves, this form was faster in a decode).
// Per block b, its 32 codes are sign-extended in two halves (in-lane vpmovsxbw) and vpmaddwd'd with
// q into f[b % 2] (lanes 0-7 and 8-15: four accumulator chains); out = tree16 of f[0] + f[1], the
// pairs of the 512-bit kernel's reduction. Both builds compile it with AVX2 (the AVX-512 flags
// imply it). BlockScales: the build's s[b] = scale(group of b) * dx[b] for a row.
#pragma once
#include "i8a.h"

#include <immintrin.h>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace ms {

// the sum of a vector's 8 lanes: lane i + lane i + 4, then + 2, + 1
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// i8a.h's tree16 of 16 lanes held as lanes 0-7 (lo) and 8-15 (hi): lo + hi, then halving
inline float tree16(__m256 lo, __m256 hi) { return hsum8(_mm256_add_ps(lo, hi)); }

template <int TT, auto BlockScales>
inline void rows_int8_i16a_halves(const QW& w, int64_t nb, int64_t ne, const QAct16* acts, float* out, int64_t ldo) {
  const int64_t K = w.K, G = w.G, NG = K / G, B = K / 32;
  static thread_local std::vector<float> sbuf;
  sbuf.resize(TT * B);
  float* const sb = sbuf.data();  // once: a thread_local in the loop is a TLS lookup per access
  const bool nta = stream_nta();
  for (int64_t n = nb; n < ne; n++) {
    const int8_t* row = (const int8_t*)w.codes + n * K;
    const uint16_t* srow = w.scales + n * NG;
    for (int t = 0; t < TT; t++) BlockScales(srow, G, acts[t].dx.data(), B, sb + t * B);
    __m256 f[TT][4];  // lanes 0-7 and 8-15 of f[0] (even blocks), then of f[1] (odd blocks)
    for (int t = 0; t < TT; t++)
      for (int i = 0; i < 4; i++) f[t][i] = _mm256_setzero_ps();
    // block b into f[t][O], f[t][O + 1]: O a constant, so the accumulators stay in registers
    auto block = [&](int64_t b, auto o) {
      constexpr int O = decltype(o)::value;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + b * 32)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + b * 32 + 16)));
      for (int t = 0; t < TT; t++) {
        const int16_t* q = acts[t].q.data() + b * 32;
        const __m256 s = _mm256_set1_ps(sb[t * B + b]);
        f[t][O] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i*)q))),
                                  s, f[t][O]);
        f[t][O + 1] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i*)(q + 16)))), s, f[t][O + 1]);
      }
    };
    int64_t b = 0;
    for (; b + 2 <= B; b += 2) {
      prefetch_stream(row + b * 32 + 2048, nta);
      block(b, std::integral_constant<int, 0>{});
      block(b + 1, std::integral_constant<int, 2>{});
    }
    if (b < B) block(b, std::integral_constant<int, 0>{});
    for (int t = 0; t < TT; t++)
      out[t * ldo + n] = tree16(_mm256_add_ps(f[t][0], f[t][2]), _mm256_add_ps(f[t][1], f[t][3]));
  }
}

}  // namespace ms
