// Row helpers of the fused step's blocks (step.cpp, mla.cpp): RoPE, KV rows in the
// cache's dtype, a linear with its bias. Float32 throughout, the torch layers' formulas.
#pragma once
#include "quant.h"
#include "simd.h"
#include "step.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>

namespace ms {

// x [N, D] rotated in place: x * cos + rotate_half(x) * sin (engine.layers.rope.apply_rotary) on
// the first rd dims of each head, the rest passed (engine.layers.gated_attention: partial RoPE)
inline void rope(float* x, int64_t heads, int64_t d, int64_t rd, const float* cos, const float* sin) {
  const int64_t half = rd / 2;
  for (int64_t h = 0; h < heads; h++) {
    float* p = x + h * d;
    for (int64_t i = 0; i < half; i++) {
      const float a = p[i], b = p[i + half];
      p[i] = a * cos[i] - b * sin[i];
      p[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return (float)v; }
inline float to_f(c10::Half v) { return (float)v; }

template <typename S>
void store_row(S* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = S(src[i]);
}

template <typename S>
void load_row(const S* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = to_f(src[i]);
}

struct KVView {  // one layer of the cache and one sequence's block table
  char* k; char* v; int64_t bs, row;  // row: elements per position (Nkv * D)
  const int32_t* table;
  template <typename S> S* at(char* base, int64_t pos) const {
    return (S*)base + ((int64_t)table[pos / bs] * bs + pos % bs) * row;
  }
};

inline void add_bias(float* y, const at::Tensor& bias, int64_t T, int64_t N) {
  if (!bias.defined() || bias.numel() == 0) return;
  const float* b = bias.data_ptr<float>();
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < N; i++) y[t * N + i] += b[i];
}

inline void apply(const Linear& l, const float* x, int64_t T, float* out, int64_t dmt, bool i8a) {
  linear(l.w, x, T, out, dmt, i8a);
  add_bias(out, l.bias, T, l.w.N);
}

inline const float* opt_ptr(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<float>() : nullptr;
}

}  // namespace ms
