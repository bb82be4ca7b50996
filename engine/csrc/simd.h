// Vector helpers of the native step and kernels, one implementation per instruction set: AVX-512
// (16 lanes) when the translation unit is built for it, else AVX2 + FMA (8 lanes). The same
// formulas in both, so results differ only in float32 summation order.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ms {

#if defined(__AVX512F__)
constexpr int LANES = 16;
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf vpow2i(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
// lane i = the sum of the lanes of v[i], for LANES vectors (a transpose-and-add tree: 15
// additions for 16 sums, where 16 horizontal sums take 64 shuffles and additions)
inline vf vsums(const vf* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)  // 128-bit lane l: v[2i] and v[2i+1] pairwise over its 4 floats
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
// LANES bfloat16 values (the high halves of float32s) / fp16 values (F16C) as float32
inline vf vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf vload_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
// n bfloat16 values (n a multiple of LANES) to float32
inline void load_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += LANES) vstore(dst + i, vload_bf16(src + i));
}
#else
constexpr int LANES = 8;
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vpow2i(vf p, vf n) {  // n in [-126, 127] after the clamp in vexp
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf vsums(const vf* v) {  // lane i = the sum of the lanes of v[i], for 8 vectors
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline vf vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void load_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += LANES) vstore(dst + i, vload_bf16(src + i));
}
#endif

// e^x lane-wise: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6 (relative error
// < 2e-7 against std::exp; inputs clamped to [-87.3, 88.3]).
inline vf vexp(vf x) {
  x = vmax(vmin(x, vset(88.3f)), vset(-87.3f));
  const vf n = vround(vmul(x, vset(1.44269504f)));
  vf r = vfnma(n, vset(0.693359375f), x);
  r = vfnma(n, vset(-2.12194440e-4f), r);
  vf p = vset(1.0f / 720);
  p = vfma(p, r, vset(1.0f / 120));
  p = vfma(p, r, vset(1.0f / 24));
  p = vfma(p, r, vset(1.0f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  return vpow2i(p, n);
}

inline float dot(const float* a, const float* b, int64_t n) {
  vf v = vzero();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) v = vfma(vload(a + i), vload(b + i), v);
  float acc = vsum(v);
  for (; i < n; i++) acc += a[i] * b[i];
  return acc;
}

// g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u, for n values
inline void silu_mul_n(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const vf gv = vload(g + i);
    const vf e = vexp(vsub(vzero(), gv));
    vstore(g + i, vmul(vdiv(gv, vadd(vset(1.0f), e)), vload(u + i)));
  }
  for (; i < n; i++) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// out = w * (x * rsqrt(mean(x^2) + eps)), as engine.layers.norm.rms_norm in float32 (out may be x)
inline void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / (float)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

// gpt-oss's clamped SwiGLU: g[i] = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),
// g' = min(g, limit) (engine.models.gpt_oss.clamped_swiglu), for n values
inline void clamped_swiglu_n(float* g, const float* u, int64_t n, float alpha, float limit) {
  int64_t i = 0;
  const vf lim = vset(limit), one = vset(1.0f);
  for (; i + LANES <= n; i += LANES) {
    const vf gv = vmin(vload(g + i), lim);
    const vf uv = vmax(vmin(vload(u + i), lim), vsub(vzero(), lim));
    const vf e = vexp(vsub(vzero(), vmul(gv, vset(alpha))));
    vstore(g + i, vmul(vadd(uv, one), vdiv(gv, vadd(one, e))));
  }
  for (; i < n; i++) {
    const float gv = std::min(g[i], limit), uv = std::max(std::min(u[i], limit), -limit);
    g[i] = (uv + 1.0f) * (gv / (1.0f + std::exp(-gv * alpha)));
  }
}

// An expert's hidden activation in place of its gate rows g[0..n) (up rows u), the optional
// biases (bg, bu: the same n rows) added first
inline void expert_hidden_n(float* g, float* u, int64_t n, int act, float alpha, float limit,
                            const float* bg, const float* bu) {
  if (bg) for (int64_t i = 0; i < n; i++) g[i] += bg[i];
  if (bu) for (int64_t i = 0; i < n; i++) u[i] += bu[i];
  if (act == 1) clamped_swiglu_n(g, u, n, alpha, limit);  // ACT_CLAMPED_SWIGLU (quant.h)
  else silu_mul_n(g, u, n);
}

// s[j] = e^(s[j] - mx) for j < n, in place; returns their sum
inline float exp_shift(float* s, int64_t n, float mx) {
  const vf m = vset(mx);
  vf acc = vzero();
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    const vf e = vexp(vsub(vload(s + j), m));
    vstore(s + j, e);
    acc = vadd(acc, e);
  }
  float sum = vsum(acc);
  for (; j < n; j++) sum += (s[j] = std::exp(s[j] - mx));
  return sum;
}

// softmax of s[0..n) in place, float32; a finite `sink` is one more logit in the denominator
// whose share is dropped (attention sinks)
inline void softmax(float* s, int64_t n, float sink = -INFINITY) {
  float mx = sink;
  for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
  float sum = exp_shift(s, n, mx);
  if (sink != -INFINITY) sum += std::exp(sink - mx);
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n; j++) s[j] *= inv;
}

}  // namespace ms
