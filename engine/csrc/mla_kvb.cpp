// The absorbed MLA's two products with kv_b_proj (deepseek.h, KvbRows), on its float32 copy or
// straight on its quantized codes (int8 with fp16 scales per group of G along R, or bf16), for a
// tile of tokens of one head:
//   absorb_query:  qlat[t, :] = sum_d q[t, d] W_uk[h, d, :]    (a transposed accumulate: each key
//                                                             row of kv_b scaled into the query)
//   expand_value:  out[t, v]  = W_uv[h, v, :] . olat[t, :]     (a row dot product)
// Each weight vector is loaded (and dequantized: code * scale, as engine.quant.reference
// .dequantize computes it) once per tile and used for every token of it, so a tile reads the head's
// rows once. AVX-512 or AVX2 (simd.h's vf; the translation unit is built for each) with a scalar
// tail when G is not a multiple of the vector width.
#include "deepseek.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace ms {

namespace {

#if defined(__AVX512F__)
inline vf load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline vf load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
inline vf load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline vf load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

inline float bf16_f(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One row of kv_b as the kernels read it: LANES weights at k (vector) or one (scalar), times the
// row's group scale for int8 (exactly dequantize()'s code * scale in float32).
template <int F> struct Row {
  const void* p;
  const uint16_t* sc;  // int8: the row's R / G fp16 scales
  float s = 1.f;
  inline void group(int64_t g) { if (F == F_INT8) s = _cvtsh_ss(sc[g]); }
  inline vf vec(int64_t k) const {
    if (F == F_INT8) return vmul(load_i8((const int8_t*)p + k), vset(s));
    if (F == F_BF16) return load_bf16((const uint16_t*)p + k);
    return vload((const float*)p + k);
  }
  inline float one(int64_t k) const {
    if (F == F_INT8) return (float)((const int8_t*)p)[k] * s;
    if (F == F_BF16) return bf16_f(((const uint16_t*)p)[k]);
    return ((const float*)p)[k];
  }
};

template <int F> Row<F> row(const KvbRows& w, int64_t r) {
  const int64_t R = w.R;
  if (F == F_INT8) return Row<F>{(const int8_t*)w.data + r * R, w.scales + r * (R / w.G)};
  if (F == F_BF16) return Row<F>{(const uint16_t*)w.data + r * R, nullptr};
  return Row<F>{(const float*)w.data + r * R, nullptr};
}

// NT tokens (a compile-time count, so the accumulators below stay in registers)
template <int F, int NT>
void absorb(const KvbRows& w, int64_t h, const float* q, int64_t qs, float* qlat, int64_t nd) {
  const int64_t R = w.R, G = F == F_INT8 ? w.G : R;
  for (int64_t t = 0; t < NT; t++) std::fill(qlat + t * R, qlat + (t + 1) * R, 0.f);
  for (int64_t d = 0; d < nd; d++) {
    Row<F> rw = row<F>(w, h * w.stride + w.first + d);
    vf c[NT];
    for (int t = 0; t < NT; t++) c[t] = vset(q[t * qs + d]);
    for (int64_t g = 0; g < R / G; g++) {
      rw.group(g);
      const int64_t ke = (g + 1) * G;
      int64_t k = g * G;
      for (; k + LANES <= ke; k += LANES) {
        const vf wv = rw.vec(k);
        for (int t = 0; t < NT; t++) vstore(qlat + t * R + k, vfma(c[t], wv, vload(qlat + t * R + k)));
      }
      for (; k < ke; k++) {
        const float wk = rw.one(k);
        for (int t = 0; t < NT; t++) qlat[t * R + k] += q[t * qs + d] * wk;
      }
    }
  }
}

// two accumulators per token (even and odd vectors), so one token's sum is two FMA chains
template <int F, int NT>
void expand(const KvbRows& w, int64_t h, const float* olat, float* out, int64_t os, int64_t nv) {
  const int64_t R = w.R, G = F == F_INT8 ? w.G : R;
  for (int64_t v = 0; v < nv; v++) {
    Row<F> rw = row<F>(w, h * w.stride + w.first + v);
    vf a0[NT], a1[NT];
    float tail[NT] = {};
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = vzero();
    for (int64_t g = 0; g < R / G; g++) {
      rw.group(g);
      const int64_t ke = (g + 1) * G;
      int64_t k = g * G;
      for (; k + 2 * LANES <= ke; k += 2 * LANES) {
        const vf w0 = rw.vec(k), w1 = rw.vec(k + LANES);
        for (int t = 0; t < NT; t++) {
          a0[t] = vfma(w0, vload(olat + t * R + k), a0[t]);
          a1[t] = vfma(w1, vload(olat + t * R + k + LANES), a1[t]);
        }
      }
      for (; k + LANES <= ke; k += LANES) {
        const vf w0 = rw.vec(k);
        for (int t = 0; t < NT; t++) a0[t] = vfma(w0, vload(olat + t * R + k), a0[t]);
      }
      for (; k < ke; k++) {
        const float wk = rw.one(k);
        for (int t = 0; t < NT; t++) tail[t] += wk * olat[t * R + k];
      }
    }
    for (int t = 0; t < NT; t++) out[t * os + v] = vsum(vadd(a0[t], a1[t])) + tail[t];
  }
}

// f<NT>() for the runtime token count nt (1 .. KVB_TILE)
template <typename Fn>
void by_tile(int64_t nt, Fn&& f) {
  switch (nt) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}
static_assert(KVB_TILE == 8, "by_tile covers 1 .. 8 tokens");

template <int F>
void absorb_f(const KvbRows& w, int64_t h, const float* q, int64_t qs, int64_t nt, float* qlat, int64_t nd) {
  by_tile(nt, [&](auto n) { absorb<F, decltype(n)::value>(w, h, q, qs, qlat, nd); });
}

template <int F>
void expand_f(const KvbRows& w, int64_t h, const float* olat, int64_t nt, float* out, int64_t os, int64_t nv) {
  by_tile(nt, [&](auto n) { expand<F, decltype(n)::value>(w, h, olat, out, os, nv); });
}

}  // namespace

void absorb_query(const KvbRows& w, int64_t h, const float* q, int64_t qs, int64_t nt, float* qlat, int64_t nd) {
  if (w.fmt == F_INT8) absorb_f<F_INT8>(w, h, q, qs, nt, qlat, nd);
  else if (w.fmt == F_BF16) absorb_f<F_BF16>(w, h, q, qs, nt, qlat, nd);
  else absorb_f<KVB_F32>(w, h, q, qs, nt, qlat, nd);
}

void expand_value(const KvbRows& w, int64_t h, const float* olat, int64_t nt, float* out, int64_t os, int64_t nv) {
  if (w.fmt == F_INT8) expand_f<F_INT8>(w, h, olat, nt, out, os, nv);
  else if (w.fmt == F_BF16) expand_f<F_BF16>(w, h, olat, nt, out, os, nv);
  else expand_f<KVB_F32>(w, h, olat, nt, out, os, nv);
}

}  // namespace ms
