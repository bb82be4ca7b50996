// Multi-head latent attention (DeepSeek-V2/V3) as one native call per layer, the absorbed form of
// engine.models.deepseek_v3.mla.MLAttention for every token (decode and prefill alike):
//   hn = rmsnorm(x); q = q_b(rmsnorm(q_a(hn))) (or q_proj(hn)); kv = kv_a(hn)
//   latent = [rmsnorm(kv[:R]), rope(kv[R:])] written into the paged cache (K half | V half)
//   per head: q_lat = q_nope W_uk [R]; s_j = (q_lat . c_j + q_rot . k_rot_j) * scale over the
//   sequence's cached latents (causal); o_lat = sum_j softmax(s)_j c_j; o = W_uv o_lat [dv]
//   x += o_proj(o); returns rmsnorm(x) (post-attention)
// W_uk / W_uv (kv_b_proj's key and value parts) are read from kv_b_proj's int8 / bf16 codes
// (mla_kvb.cpp), or from float32 copies [Nh, dn, R] and [Nh, dv, R] (the reference path).
// The context's latents are read from the cache once per call (float32), then the query heads
// are split over the pool's threads.
#include "deepseek.h"
#include "pool.h"
#include "rows.h"
#include "simd.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace ms {

namespace {

// x[d] rotated in place on interleaved pairs (x0, x1), (x2, x3), ... and written de-interleaved
// (engine.models.deepseek_v3.mla.apply_rotary_interleaved); cos/sin [d]: d/2 frequencies repeated twice
void rope_interleaved(float* x, int64_t d, const float* cos, const float* sin) {
  static thread_local std::vector<float> t;
  t.assign(x, x + d);
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i++) {
    const float a = t[2 * i], b = t[2 * i + 1];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

// kv_b's key and value rows: the quantized kv_b_proj (int8 / bf16) when the block has it, else
// the float32 copies [Nh, dn, R] and [Nh, dv, R]
std::pair<KvbRows, KvbRows> kvb_rows(const MLA& a) {
  if (a.kvb) {
    const QW& w = a.kvb->w;
    const int64_t stride = a.nope + a.vd;
    return {KvbRows{w.fmt, w.codes, w.scales, a.rank, w.G, stride, 0},
            KvbRows{w.fmt, w.codes, w.scales, a.rank, w.G, stride, a.nope}};
  }
  return {KvbRows{KVB_F32, a.wuk.data_ptr<float>(), nullptr, a.rank, a.rank, a.nope, 0},
          KvbRows{KVB_F32, a.wuv.data_ptr<float>(), nullptr, a.rank, a.rank, a.vd, 0}};
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

// q [n, Nh, dn + r] of positions ctx .. ctx+n-1 of one sequence over its latents lat [ctx + n,
// 2 * half] (float32, new ones included) -> out [n, Nh, dv]. Tokens go in tiles of KVB_TILE, so
// kv_b's rows of a head are read once per tile.
void attend_latent(const MLA& a, const float* lat, const float* q, int64_t n, int64_t ctx, float* out) {
  const int64_t nh = a.nh, R = a.rank, r = a.rope, dn = a.nope, dv = a.vd, qk = dn + r, w = 2 * a.half;
  const int64_t total = ctx + n;
  const float scale = (float)a.scale;
  const std::pair<KvbRows, KvbRows> rows = kvb_rows(a);
  const KvbRows &uk = rows.first, &uv = rows.second;
  parallel(nh, 1, 1, [&](int64_t hb, int64_t he) {
    static thread_local std::vector<float> scores, qlat, olat;  // [g, total], [g, KVB_TILE, R] each
    const int64_t g = he - hb;
    scores.resize(g * total);
    qlat.resize(g * KVB_TILE * R);
    olat.resize(g * KVB_TILE * R);
    for (int64_t i0 = 0; i0 < n; i0 += KVB_TILE) {
      const int64_t nt = std::min(KVB_TILE, n - i0);
      for (int64_t h = hb; h < he; h++)  // kv_b's key part folded into the query
        absorb_query(uk, h, q + (i0 * nh + h) * qk, nh * qk, nt, qlat.data() + (h - hb) * KVB_TILE * R, dn);
      for (int64_t t = 0; t < nt; t++) {
        const int64_t i = i0 + t, seen = ctx + i + 1;  // causal: positions 0 .. ctx + i
        for (int64_t j = 0; j < seen; j++) {
          const float* l = lat + j * w;
          for (int64_t h = hb; h < he; h++) {
            const float* qrot = q + (i * nh + h) * qk + dn;
            const float* ql = qlat.data() + ((h - hb) * KVB_TILE + t) * R;
            scores[(h - hb) * total + j] = (dot(ql, l, R) + dot(qrot, l + R, r)) * scale;
          }
        }
        for (int64_t h = 0; h < g; h++) softmax(scores.data() + h * total, seen);
        for (int64_t h = 0; h < g; h++) std::fill_n(olat.data() + (h * KVB_TILE + t) * R, R, 0.f);
        for (int64_t j = 0; j < seen; j++)
          for (int64_t h = 0; h < g; h++)
            axpy(scores[h * total + j], lat + j * w, olat.data() + (h * KVB_TILE + t) * R, R);
      }
      for (int64_t h = hb; h < he; h++)  // and its value part after the weighted sum
        expand_value(uv, h, olat.data() + (h - hb) * KVB_TILE * R, nt, out + (i0 * nh + h) * dv, nh * dv, dv);
    }
  });
}

// the new tokens' latents written into the cache, then the whole context read back once in
// float32 (as the cache rounds it) and attended
template <typename S>
void sequence(const MLA& a, const KVView& kv, const float* lat, const float* q, int64_t n, int64_t ctx,
              float* out) {
  const int64_t half = a.half, total = ctx + n;
  for (int64_t i = 0; i < n; i++) {
    store_row(kv.at<S>(kv.k, ctx + i), lat + i * 2 * half, half);
    store_row(kv.at<S>(kv.v, ctx + i), lat + i * 2 * half + half, half);
  }
  std::vector<float> all(total * 2 * half);
  for (int64_t j = 0; j < total; j++) {
    load_row(kv.at<S>(kv.k, j), all.data() + j * 2 * half, half);
    load_row(kv.at<S>(kv.v, j), all.data() + j * 2 * half + half, half);
  }
  attend_latent(a, all.data(), q, n, ctx, out);
}

}  // namespace

at::Tensor mla_block(const MLA& a, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<int64_t>& positions, const at::Tensor& storage, int64_t layer,
                     const at::Tensor& tables, const std::vector<int64_t>& qlens,
                     const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a) {
  const int64_t T = x.size(0), H = x.size(1), nh = a.nh, R = a.rank, r = a.rope, dn = a.nope, dv = a.vd;
  const int64_t qk = dn + r, half = a.half, kvw = R + r;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && a.ln1.numel() == H, "x must be contiguous float32 [T, H]");
  TORCH_CHECK(storage.dim() == 6 && storage.size(4) == 1 && storage.size(5) == half && storage.is_contiguous(),
              "latent KV storage must be [L, 2, NB, BS, 1, ", half, "]");
  TORCH_CHECK(layer >= 0 && layer < storage.size(0), "layer out of range");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.size(0) == (int64_t)qlens.size() &&
              ctxs.size() == qlens.size(), "tables must be int32 [S, max blocks]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == r && cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "cos/sin tables must be float32 [positions, ", r, "]");
  TORCH_CHECK((int64_t)positions.size() == T, "one position per token");
  for (int64_t p : positions) TORCH_CHECK(p >= 0 && p < cos.size(0), "position ", p, " beyond the rotary table");
  TORCH_CHECK(a.qb.w.N == nh * qk && a.kva.w.N == kvw && a.o.w.K == nh * dv && a.o.w.N == H && a.kva.w.K == H &&
              a.kvan.numel() == R && 2 * half >= kvw && r % 2 == 0, "MLA weights do not match its shapes");
  if (a.kvb) {
    const QW& w = a.kvb->w;
    TORCH_CHECK((w.fmt == F_INT8 || w.fmt == F_BF16) && w.N == nh * (dn + dv) && w.K == R &&
                (w.fmt != F_INT8 || (w.G > 0 && R % w.G == 0)) && a.kvb->bias.numel() == 0,
                "MLA kv_b must be int8 or bf16 [", nh * (dn + dv), ", ", R, "] without a bias");
  } else {
    TORCH_CHECK(a.wuk.numel() == nh * dn * R && a.wuv.numel() == nh * dv * R && a.wuk.scalar_type() == at::kFloat &&
                a.wuv.scalar_type() == at::kFloat && a.wuk.is_contiguous() && a.wuv.is_contiguous(),
                "MLA float32 kv_b parts must be contiguous [", nh, ", ", dn, " / ", dv, ", ", R, "]");
  }
  TORCH_CHECK(a.qa ? a.qa->w.K == H && a.qb.w.K == a.qa->w.N && a.qan.numel() == a.qa->w.N : a.qb.w.K == H,
              "MLA q projections do not match");
  const auto st = storage.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "KV storage dtype");
  at::Tensor h = at::empty({T, H}, at::kFloat);
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t mb = tables.size(1), nb = storage.size(2), bs = storage.size(3);
  const int64_t plane = nb * bs * half * storage.element_size();
  char* kbase = (char*)storage.data_ptr() + (layer * 2) * plane;
  pybind11::gil_scoped_release no_gil;
  std::vector<float> hn(T * H), q(T * nh * qk), kv(T * kvw), lat(T * 2 * half, 0.f), o(T * nh * dv), y(T * H);
  const float eps = (float)a.eps;
  for (int64_t t = 0; t < T; t++) rmsnorm(xp + t * H, a.ln1.data_ptr<float>(), H, eps, hn.data() + t * H);
  if (a.qa) {  // q LoRA: q_a and kv_a in one parallel region, then the norm and q_b
    const Linear& qa = *a.qa;
    std::vector<float> qc(T * qa.w.N);
    std::vector<LinearJob> jobs{{qa.w, hn.data(), T, qc.data()}, {a.kva.w, hn.data(), T, kv.data()}};
    linears(jobs, dmt, i8a);
    add_bias(qc.data(), qa.bias, T, qa.w.N);
    for (int64_t t = 0; t < T; t++)
      rmsnorm(qc.data() + t * qa.w.N, a.qan.data_ptr<float>(), qa.w.N, (float)a.eps_q, qc.data() + t * qa.w.N);
    apply(a.qb, qc.data(), T, q.data(), dmt, i8a);
  } else {
    std::vector<LinearJob> jobs{{a.qb.w, hn.data(), T, q.data()}, {a.kva.w, hn.data(), T, kv.data()}};
    linears(jobs, dmt, i8a);
    add_bias(q.data(), a.qb.bias, T, a.qb.w.N);
  }
  add_bias(kv.data(), a.kva.bias, T, kvw);
  for (int64_t t = 0; t < T; t++) {  // the latent row (zero-padded) and the RoPE of q and k
    const int64_t p = positions[t];
    float* l = lat.data() + t * 2 * half;
    rmsnorm(kv.data() + t * kvw, a.kvan.data_ptr<float>(), R, (float)a.eps_kv, l);
    std::copy(kv.data() + t * kvw + R, kv.data() + (t + 1) * kvw, l + R);
    for (int64_t i = -1; i < nh; i++) {
      float* v = i < 0 ? l + R : q.data() + (t * nh + i) * qk + dn;
      if (a.interleave) rope_interleaved(v, r, cp + p * r, sp + p * r);
      else rope(v, 1, r, r, cp + p * r, sp + p * r);
    }
  }
  int64_t off = 0;
  for (size_t s = 0; s < qlens.size(); s++) {
    const int64_t n = qlens[s], ctx = ctxs[s];
    TORCH_CHECK((ctx + n + bs - 1) / bs <= mb, "block table too short for the context");
    KVView kvv{kbase, kbase + plane, bs, half, tp + s * mb};
    const float *ls = lat.data() + off * 2 * half, *qs = q.data() + off * nh * qk;
    float* os = o.data() + off * nh * dv;
    if (st == at::kFloat) sequence<float>(a, kvv, ls, qs, n, ctx, os);
    else if (st == at::kBFloat16) sequence<c10::BFloat16>(a, kvv, ls, qs, n, ctx, os);
    else sequence<c10::Half>(a, kvv, ls, qs, n, ctx, os);
    off += n;
  }
  TORCH_CHECK(off == T, "query lengths do not add up to the tokens");
  apply(a.o, o.data(), T, y.data(), dmt, i8a);
  for (int64_t i = 0; i < T * H; i++) xp[i] += y[i];
  for (int64_t t = 0; t < T; t++) rmsnorm(xp + t * H, a.ln2.data_ptr<float>(), H, eps, hp + t * H);
  return h;
}

}  // namespace ms
