// Gated DeltaNet at decode (DESIGN.md, "The step contract"): a Qwen3-Next linear-attention layer
// as one native call for the decode rows of a step, each row a different sequence's one new token:
//   x += out_proj(gated_rmsnorm(delta_rule(l2norm(silu(conv_step(qkv)))), silu(z)))
//        with qkvz, ba = in_proj_qkvz(rmsnorm(x)), in_proj_ba(rmsnorm(x));
//   returns h = rmsnorm(x) (the post-attention norm), as attn_block.
// Per value head h (r = Nv / Nk value heads per key head): beta = sigmoid(b), g = a * softplus(a_in
// + dt_bias) with a = -exp(A_log); S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T q.
// Each head's state is read twice (decay + S^T k, then the rank-1 update + S^T q), rows in
// order: two streaming passes; the (row, head) pairs are split over the worker pool.
// Layouts as the checkpoint's: in_proj_qkvz rows per key head [q Dk | k Dk | v r Dv | z r Dv],
// in_proj_ba per key head [b r | a r]. The torch reference is engine/layers/deltanet.py.
#include "deltanet.h"
#include "pool.h"
#include "simd.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <initializer_list>
#include <cmath>
#include <set>
#include <vector>

namespace ms {

namespace {

struct Dims {
  int64_t nk, nv, dk, dv, c, k;  // heads, head dims, conv channels, conv kernel
};

// y [C] = silu(conv over (window, x)), then x shifted into the window
void conv_step(const Dims& s, float* win, const float* w, const float* x, float* y) {
  const int64_t k = s.k;
  for (int64_t ch = 0; ch < s.c; ++ch) {
    float* wr = win + ch * (k - 1);
    const float* wt = w + ch * k;
    float acc = wt[k - 1] * x[ch];
    for (int64_t j = 0; j < k - 1; ++j) acc += wt[j] * wr[j];
    for (int64_t j = 0; j + 1 < k - 1; ++j) wr[j] = wr[j + 1];
    if (k > 1) wr[k - 2] = x[ch];
    y[ch] = acc / (1.0f + std::exp(-acc));
  }
  const float scale = 1.0f / std::sqrt((float)s.dk);
  for (int64_t h = 0; h < 2 * s.nk; ++h) {  // L2 norm of each q head (then scaled) and k head
    float* p = y + h * s.dk;
    float ss = 0.f;
    for (int64_t i = 0; i < s.dk; ++i) ss += p[i] * p[i];
    const float inv = 1.0f / std::sqrt(ss + 1e-6f) * (h < s.nk ? scale : 1.0f);
    for (int64_t i = 0; i < s.dk; ++i) p[i] *= inv;
  }
}

// value head h of one token: y [C] (after conv_step), state sh [Dk, Dv] updated, o [Dv]
void delta_head(const Dims& s, const float* y, int64_t h, float* sh, float g, float beta, float* o,
                float* mem) {
  const int64_t r = s.nv / s.nk, dk = s.dk, dv = s.dv;
  const float* q = y + (h / r) * dk;
  const float* kk = y + s.nk * dk + (h / r) * dk;
  const float* v = y + 2 * s.nk * dk + h * dv;
  const float decay = std::exp(g);
  std::fill(mem, mem + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = sh + i * dv;
    const float ki = kk[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      mem[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    mem[j] = (v[j] - mem[j]) * beta;  // the delta written
    o[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = sh + i * dv;
    const float ki = kk[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * mem[j];
      o[j] += qi * row[j];
    }
  }
}

// T tokens (each its own sequence): ys [T, C] after conv_step, states[t] [Nv, Dk, Dv], g/beta
// [T, Nv] -> o [T, Nv, Dv]; (token, head) pairs over the pool
void delta_rule(const Dims& s, const float* ys, const std::vector<float*>& states, const float* g,
                const float* beta, float* o) {
  const int64_t T = (int64_t)states.size(), nv = s.nv;
  parallel(T * nv, 1, 1, [&](int64_t b, int64_t e) {
    std::vector<float> mem(s.dv);
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / nv, h = i % nv;
      delta_head(s, ys + t * s.c, h, states[t] + h * s.dk * s.dv, g[i], beta[i], o + i * s.dv, mem.data());
    }
  });
}

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), what,
              " must be a contiguous float32 CPU tensor");
}

}  // namespace

at::Tensor deltanet_block(const DeltaNet& w, at::Tensor x, at::Tensor conv, at::Tensor matrix, int64_t layer,
                          const std::vector<int64_t>& slots, int64_t dmt, bool i8a) {
  check_f32(x, "x");
  check_f32(conv, "conv state");
  check_f32(matrix, "matrix state");
  const int64_t T = x.size(0), H = x.size(1), r = w.nv / w.nk;
  const Dims s{w.nk, w.nv, w.dk, w.dv, w.conv.size(0), w.conv.size(1)};
  const int64_t kd = w.nk * w.dk, vd = w.nv * w.dv, per_k = 2 * w.dk + 2 * r * w.dv;
  TORCH_CHECK(w.nv % w.nk == 0 && s.c == 2 * kd + vd && w.qkvz.w.N == 2 * kd + 2 * vd &&
              w.ba.w.N == 2 * w.nv && w.out.w.K == vd && w.qkvz.w.K == H && w.out.w.N == H,
              "deltanet_block: weights inconsistent with the heads");
  TORCH_CHECK(conv.dim() == 4 && conv.size(2) == s.c && conv.size(3) == s.k - 1 && matrix.dim() == 5 &&
              matrix.size(0) == conv.size(0) && matrix.size(1) == conv.size(1) && matrix.size(2) == w.nv &&
              matrix.size(3) == w.dk && matrix.size(4) == w.dv,
              "deltanet_block: state must be conv [Ll, S, C, K-1] and matrix [Ll, S, Nv, Dk, Dv]");
  TORCH_CHECK(layer >= 0 && layer < conv.size(0), "deltanet_block: state layer ", layer, " out of range");
  TORCH_CHECK((int64_t)slots.size() == T, "deltanet_block: one state slot per row (decode rows only)");
  std::set<int64_t> seen;
  for (int64_t sl : slots) {
    TORCH_CHECK(sl >= 0 && sl < conv.size(1), "deltanet_block: state slot ", sl, " out of range");
    TORCH_CHECK(seen.insert(sl).second, "deltanet_block: slot ", sl, " given twice (one row per sequence)");
  }
  at::Tensor h = at::empty({T, H}, at::kFloat);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>();
  float *cp = conv.data_ptr<float>(), *mp = matrix.data_ptr<float>();
  const float *cw = w.conv.data_ptr<float>(), *an = w.a.data_ptr<float>(), *dt = w.dt_bias.data_ptr<float>();
  const float eps = (float)w.eps;
  pybind11::gil_scoped_release no_gil;
  std::vector<float> hn(T * H), qkvz(T * w.qkvz.w.N), ba(T * 2 * w.nv), mixed(T * s.c), ys(T * s.c),
      z(T * vd), g(T * w.nv), beta(T * w.nv), o(T * vd), y(T * H);
  for (int64_t t = 0; t < T; t++) rmsnorm(xp + t * H, w.ln1.data_ptr<float>(), H, eps, hn.data() + t * H);
  std::vector<LinearJob> in{{w.qkvz.w, hn.data(), T, qkvz.data()}, {w.ba.w, hn.data(), T, ba.data()}};
  linears(in, dmt, i8a);
  std::vector<float*> states(T);
  for (int64_t t = 0; t < T; t++) {
    const float* src = qkvz.data() + t * w.qkvz.w.N;
    float* m = mixed.data() + t * s.c;
    for (int64_t kh = 0; kh < w.nk; kh++) {  // [q | k | v | z] per key head -> q, k, v side by side
      const float* p = src + kh * per_k;
      std::copy(p, p + w.dk, m + kh * w.dk);
      std::copy(p + w.dk, p + 2 * w.dk, m + kd + kh * w.dk);
      std::copy(p + 2 * w.dk, p + 2 * w.dk + r * w.dv, m + 2 * kd + kh * r * w.dv);
      std::copy(p + 2 * w.dk + r * w.dv, p + per_k, z.data() + t * vd + kh * r * w.dv);
      for (int64_t j = 0; j < r; j++) {
        const int64_t hv = kh * r + j, i = t * w.nv + hv;
        const float b = ba[t * 2 * w.nv + kh * 2 * r + j], a = ba[t * 2 * w.nv + kh * 2 * r + r + j] + dt[hv];
        beta[i] = 1.0f / (1.0f + std::exp(-b));
        g[i] = an[hv] * (a > 20.f ? a : std::log1p(std::exp(a)));  // softplus (torch's threshold 20)
      }
    }
    const int64_t slot = slots[t];
    conv_step(s, cp + (layer * conv.size(1) + slot) * s.c * (s.k - 1), cw, m, ys.data() + t * s.c);
    states[t] = mp + (layer * matrix.size(1) + slot) * w.nv * w.dk * w.dv;
  }
  delta_rule(s, ys.data(), states, g.data(), beta.data(), o.data());
  const float* nw = w.norm.data_ptr<float>();
  for (int64_t i = 0; i < T * w.nv; i++) {  // gated RMSNorm per head: w * norm(o) * silu(z)
    float* oh = o.data() + i * w.dv;
    const float* zh = z.data() + i * w.dv;
    rmsnorm(oh, nw, w.dv, eps, oh);
    for (int64_t j = 0; j < w.dv; j++) oh[j] *= zh[j] / (1.0f + std::exp(-zh[j]));
  }
  linear(w.out.w, o.data(), T, y.data(), dmt, i8a);
  for (int64_t i = 0; i < T * H; i++) xp[i] += y[i];
  for (int64_t t = 0; t < T; t++) rmsnorm(xp + t * H, w.ln2.data_ptr<float>(), H, eps, hp + t * H);
  return h;
}

at::Tensor deltanet_step(at::Tensor window, const at::Tensor& weight, const at::Tensor& x, at::Tensor state,
                         const at::Tensor& g, const at::Tensor& beta, int64_t nk, int64_t dk, int64_t dv) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&window, &weight, &x, &state, &g, &beta})
    check_f32(*t, "deltanet_step: every tensor");
  const int64_t c = x.size(0), k = weight.size(1), nv = state.size(0);
  TORCH_CHECK(nk > 0 && nv % nk == 0 && c == 2 * nk * dk + nv * dv && window.size(0) == c &&
              window.size(1) == k - 1 && weight.size(0) == c && state.size(1) == dk && state.size(2) == dv &&
              g.numel() == nv && beta.numel() == nv, "deltanet_step: inconsistent shapes");
  const Dims s{nk, nv, dk, dv, c, k};
  at::Tensor out = at::empty({nv, dv}, at::kFloat);
  pybind11::gil_scoped_release no_gil;
  std::vector<float> y(c);
  conv_step(s, window.data_ptr<float>(), weight.data_ptr<float>(), x.data_ptr<float>(), y.data());
  delta_rule(s, y.data(), {state.data_ptr<float>()}, g.data_ptr<float>(), beta.data_ptr<float>(),
             out.data_ptr<float>());
  return out;
}

}  // namespace ms
