// The quantized-weight contract shared by the kernels (quant.cpp) and the fused step (step.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ms {

enum { F_INT4 = 0, F_NF4 = 1, F_INT8 = 2, F_BF16 = 3, F_MXFP4 = 4 };

// Expert activations: SwiGLU silu(g) * u, or gpt-oss's clamped SwiGLU
// (min(u, limit) clamped to [-limit, limit] + 1) * g' * sigmoid(alpha g'), g' = min(g, limit).
enum { ACT_SILU = 0, ACT_CLAMPED_SWIGLU = 1 };

struct QW {            // one quantized weight [N, K]
  int fmt; int64_t G, N, K;
  const uint8_t* codes;      // int4/nf4/mxfp4: [N, K/2]; int8: [N, K] (int8); bf16: [N, K] (2 bytes each)
  const uint16_t* scales;    // [N, K/G] fp16 (not bf16); mxfp4: [N, K/32] E8M0 *bytes* (read as uint8)
  const uint16_t* mins;      // [N, K/G] fp16 (int4 only)
};

// An E8M0 scale byte's value 2^(s - 127) (s = 0: the subnormal 2^-127; 255: inf)
inline float e8m0(uint8_t s) {
  const uint32_t bits = s == 0 ? 0x00400000u : (uint32_t)s << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A checked QW over tensors (which the caller keeps alive).
QW make_qw(int64_t fmt, int64_t G, int64_t N, int64_t K, const at::Tensor& codes,
           const at::Tensor& scales, const at::Tensor& mins);
at::Tensor as_f32_2d(const at::Tensor& x, int64_t K);

// out[T, N] = x[T, K] @ w.T, rows split over the pool. i8a: int4 weights take int8 and int8 weights
// with K % 64 == 0 int16 activations (VNNI).
void linear(const QW& w, const float* x, int64_t T, float* out, int64_t direct_max_t, bool i8a);
// SwiGLU expert out[T, H] = (silu(x @ g.T) * (x @ u.T)) @ d.T; g/u [I, H], d [H, I].
void expert(const QW& g, const QW& u, const QW& d, const float* x, int64_t T, float* out,
            int64_t direct_max_t, bool i8a);
// One linear's call in a group: out[T, N] = x[T, K] @ w.T.
struct LinearJob {
  QW w;
  const float* x;
  int64_t T;
  float* out;
};
// Several linears at once (an attention's q, k and v): the same numbers as linear() on each, their
// rows split over the pool in one parallel region.
void linears(std::vector<LinearJob>& jobs, int64_t direct_max_t, bool i8a);

// One SwiGLU expert's call in a group: out[T, H] = expert(x[T, H]). Optional float32 biases
// bg, bu [I] (added to gate and up before the activation) and bd [H] (added to the output), and
// the activation (ACT_*; alpha and limit for the clamped SwiGLU).
struct ExpertJob {
  QW g, u, d;
  const float* x;
  int64_t T;
  float* out;
  // rows: the job's T input rows are x[rows[0..T-1]] (a MoE layer's routed tokens, read in place:
  // jobs on one x share each row's quantized activation), else x's first T rows
  const int64_t* rows = nullptr;
  int act = ACT_SILU;
  float alpha = 0.f, limit = 0.f;
  const float *bg = nullptr, *bu = nullptr, *bd = nullptr;
};
// out[t] = src[rows[t]] for t < T, rows of K floats (a job's rows copied where a kernel needs them contiguous)
inline void gather_rows(const float* src, const int64_t* rows, int64_t T, int64_t K, float* out) {
  for (int64_t t = 0; t < T; t++) std::copy(src + rows[t] * K, src + (rows[t] + 1) * K, out + t * K);
}
// Several experts at once (a MoE layer's routed experts and its shared expert): the same numbers
// as expert() on each, with the work of all of them split over the pool in two parallel regions
// (gate/up rows, then down rows) instead of two per expert.
void experts(std::vector<ExpertJob>& jobs, int64_t direct_max_t, bool i8a);
bool has_vnni();
void set_prefetch_rows(int64_t rows);
// How the kernels request the weight rows they stream ahead of use. A decode step reads each
// weight once per token, far more bytes than the caches hold (~150 MB on the 1.3B bench model):
// fetched as ordinary lines they evict from L3 what every token reads again (the KV cache, the
// activations, the router, the interpreter between the native calls). On (the default, the
// stream_nta runtime option): prefetchnta. On a 2-core Zen 4 EPYC, 16 alternating rounds of 32
// decoded tokens in one process: 5.76 -> 5.53 ms a token (faster in 13 of 16; attention 0.67 ->
// 0.57, Python between the calls 0.55 -> 0.49, routing 0.18 -> 0.14), a 512-token prefill the same.
// A hint only: the bits never depend on it.
bool stream_nta();
bool set_stream_nta(bool on);  // returns the previous setting
inline void prefetch_stream(const void* p, bool nta) {
  if (nta) __builtin_prefetch(p, 0, 0);  // prefetchnta
  else __builtin_prefetch(p, 0, 3);      // prefetcht0
}

at::Tensor qlinear(at::Tensor x, int64_t fmt, int64_t G, int64_t N, int64_t K, at::Tensor codes,
                   at::Tensor scales, at::Tensor mins, int64_t direct_max_t, int64_t i8a);
at::Tensor expert_forward(at::Tensor x, int64_t fmt, int64_t G, int64_t I, int64_t H,
                          at::Tensor gc, at::Tensor gs, at::Tensor gm,
                          at::Tensor uc, at::Tensor us, at::Tensor um,
                          at::Tensor dc, at::Tensor ds, at::Tensor dm,
                          int64_t direct_max_t, int64_t i8a);

}  // namespace ms
