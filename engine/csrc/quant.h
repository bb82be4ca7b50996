// The quantized-weight contract shared by the kernels (quant.cpp) and the fused step (step.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace ms {

// e^x for 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6 (relative error
// < 2e-7 against std::exp over the float range; inputs clamped to [-87.3, 88.7]).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u, for n values
inline void silu_mul_n(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                          _mm512_loadu_ps(u + i)));
  }
  for (; i < n; i++) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

enum { F_INT4 = 0, F_NF4 = 1, F_INT8 = 2, F_BF16 = 3 };

struct QW {            // one quantized weight [N, K]
  int fmt; int64_t G, N, K;
  const uint8_t* codes;      // int4/nf4: [N, K/2]; int8: [N, K] (int8); bf16: [N, K] (2 bytes each)
  const uint16_t* scales;    // [N, K/G] fp16 (not bf16)
  const uint16_t* mins;      // [N, K/G] fp16 (int4 only)
};

// A checked QW over tensors (which the caller keeps alive).
QW make_qw(int64_t fmt, int64_t G, int64_t N, int64_t K, const at::Tensor& codes,
           const at::Tensor& scales, const at::Tensor& mins);
at::Tensor as_f32_2d(const at::Tensor& x, int64_t K);

// out[T, N] = x[T, K] @ w.T on this thread. i8a: int4 weights take int8 activations (VNNI);
// slot picks the thread-local activation buffer (0: an input, 1: a hidden activation).
void linear(const QW& w, const float* x, int64_t T, float* out, int64_t direct_max_t, bool i8a, int slot);
// SwiGLU expert out[T, H] = (silu(x @ g.T) * (x @ u.T)) @ d.T on this thread; g/u [I, H], d [H, I].
void expert(const QW& g, const QW& u, const QW& d, const float* x, int64_t T, float* out,
            int64_t direct_max_t, bool i8a);
bool has_vnni();
void set_prefetch_rows(int64_t rows);

at::Tensor qlinear(at::Tensor x, int64_t fmt, int64_t G, int64_t N, int64_t K, at::Tensor codes,
                   at::Tensor scales, at::Tensor mins, int64_t direct_max_t, int64_t i8a);
at::Tensor expert_forward(at::Tensor x, int64_t fmt, int64_t G, int64_t I, int64_t H,
                          at::Tensor gc, at::Tensor gs, at::Tensor gm,
                          at::Tensor uc, at::Tensor us, at::Tensor um,
                          at::Tensor dc, at::Tensor ds, at::Tensor dm,
                          int64_t direct_max_t, int64_t i8a);

}  // namespace ms
