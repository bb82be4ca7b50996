// Gated DeltaNet (docs/design.md, "The step contract"): a Qwen3-Next linear-attention layer as one
// native call for every row of a step, whatever its kind: each sequence brings T >= 1 rows (a
// prefill chunk, a decode row, or the k + 1 rows of a speculative verify row):
//   x += out_proj(gated_rmsnorm(delta_rule(l2norm(silu(causal_conv(qkv)))), silu(z)))
//        with qkvz, ba = in_proj_qkvz(rmsnorm(x)), in_proj_ba(rmsnorm(x));
//   returns h = rmsnorm(x) (the post-attention norm), as attn_block.
// Per value head h (r = Nv / Nk value heads per key head): beta = sigmoid(b), g = a * softplus(a_in
// + dt_bias) with a = -exp(A_log); S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T q.
// The conv and the rule run position by position (the recurrent form, exact: the numbers of plain
// decoding for every row; the torch layer's prefill runs the chunked form, equal up to float32
// summation order). Work items: (channel, sequence) pairs for the conv and (value head, sequence)
// pairs for the rule, head-major, so a long chunk's heads spread over the worker pool. Each head's
// state is read twice per position (decay + S^T k, then the rank-1 update + S^T q). A sequence
// with checkpoint buffers (a verify row: engine.kv.state.RecurrentState.checkpoint) gets its conv
// window and matrices after each of its positions written there, for KVCache.keep.
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
#include <optional>
#include <set>
#include <vector>

namespace ms {

namespace {

struct Dims {
  int64_t nk, nv, dk, dv, c, k;  // heads, head dims, conv channels, conv kernel
};

// One channel over n positions: y[i * stride] = silu(conv over (window, x[0..i])) for x[i * stride],
// the window [K-1] advanced; ck (or null): the window after position i at ck[i * ck_stride]
void conv_channel(int64_t k, float* win, const float* wt, const float* x, int64_t n, int64_t stride, float* y,
                  float* ck, int64_t ck_stride) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i * stride];
    float acc = wt[k - 1] * xi;
    for (int64_t j = 0; j < k - 1; ++j) acc += wt[j] * win[j];
    for (int64_t j = 0; j + 1 < k - 1; ++j) win[j] = win[j + 1];
    if (k > 1) win[k - 2] = xi;
    y[i * stride] = acc / (1.0f + std::exp(-acc));
    if (ck) std::copy(win, win + k - 1, ck + i * ck_stride);
  }
}

// L2 norm of each q head (then scaled by Dk^-1/2) and k head of one position's y [C]
void qk_norm(const Dims& s, float* y) {
  const float scale = 1.0f / std::sqrt((float)s.dk);
  for (int64_t h = 0; h < 2 * s.nk; ++h) {
    float* p = y + h * s.dk;
    float ss = 0.f;
    for (int64_t i = 0; i < s.dk; ++i) ss += p[i] * p[i];
    const float inv = 1.0f / std::sqrt(ss + 1e-6f) * (h < s.nk ? scale : 1.0f);
    for (int64_t i = 0; i < s.dk; ++i) p[i] *= inv;
  }
}

// value head h of one position: y [C] (after the conv and qk_norm), state sh [Dk, Dv] updated, o [Dv]
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

// The step's sequences: sequence i owns rows [start[i], start[i] + n[i]), its conv window
// win[i] [C, K-1] and matrices mat[i] [Nv, Dk, Dv], and optional per-position checkpoints
// ck_win[i] [n, C, K-1] / ck_mat[i] [n, Nv, Dk, Dv] (null: none)
struct Seqs {
  std::vector<int64_t> start, n;
  std::vector<float*> win, mat, ck_win, ck_mat;
  int64_t size() const { return (int64_t)n.size(); }
};

// mixed [T, C] (q | k | v before the conv) -> ys [T, C] after conv, SiLU and the q/k norms
void conv_rows(const Dims& s, const Seqs& q, const float* cw, const float* mixed, float* ys, int64_t T) {
  const int64_t S = q.size(), kw = s.k - 1;
  parallel(s.c * S, 1, 256, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t ch = it / S, i = it % S, row = q.start[i];
      float* ck = q.ck_win[i] ? q.ck_win[i] + ch * kw : nullptr;
      conv_channel(s.k, q.win[i] + ch * kw, cw + ch * s.k, mixed + row * s.c + ch, q.n[i], s.c,
                   ys + row * s.c + ch, ck, s.c * kw);
    }
  });
  parallel(T, 1, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) qk_norm(s, ys + t * s.c);
  });
}

// ys [T, C], g/beta [T, Nv] -> o [T, Nv, Dv]; each sequence's matrices advanced position by position
void delta_rows(const Dims& s, const Seqs& q, const float* ys, const float* g, const float* beta, float* o) {
  const int64_t S = q.size(), nv = s.nv, hs = s.dk * s.dv;
  parallel(nv * S, 1, 1, [&](int64_t b, int64_t e) {
    std::vector<float> mem(s.dv);
    for (int64_t it = b; it < e; ++it) {
      const int64_t h = it / S, i = it % S;
      float* sh = q.mat[i] + h * hs;
      for (int64_t p = 0; p < q.n[i]; ++p) {
        const int64_t t = q.start[i] + p, j = t * nv + h;
        delta_head(s, ys + t * s.c, h, sh, g[j], beta[j], o + j * s.dv, mem.data());
        if (q.ck_mat[i]) std::copy(sh, sh + hs, q.ck_mat[i] + (p * nv + h) * hs);
      }
    }
  });
}

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), what,
              " must be a contiguous float32 CPU tensor");
}

// the checkpoint buffer of one sequence of n rows (or null), checked against `shape` after n
float* checkpoint_ptr(const std::optional<at::Tensor>& t, int64_t n, std::initializer_list<int64_t> shape,
                      const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check_f32(*t, what);
  std::vector<int64_t> want{n};
  want.insert(want.end(), shape);
  TORCH_CHECK(t->sizes().vec() == want, "deltanet_block: ", what, " must be ", at::IntArrayRef(want),
              ", got ", t->sizes());
  return t->data_ptr<float>();
}

}  // namespace

at::Tensor deltanet_block(const DeltaNet& w, at::Tensor x, at::Tensor conv, at::Tensor matrix, int64_t layer,
                          const std::vector<int64_t>& slots, const std::vector<int64_t>& qlens,
                          const std::vector<std::optional<at::Tensor>>& ck_conv,
                          const std::vector<std::optional<at::Tensor>>& ck_matrix, int64_t dmt, bool i8a) {
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
  const int64_t S = (int64_t)slots.size();
  TORCH_CHECK((int64_t)qlens.size() == S, "deltanet_block: one state slot per sequence (", S,
              " slots, ", qlens.size(), " query lengths)");
  TORCH_CHECK(ck_conv.empty() || ((int64_t)ck_conv.size() == S && (int64_t)ck_matrix.size() == S),
              "deltanet_block: checkpoints: none, or one entry (or None) per sequence");
  TORCH_CHECK(ck_conv.size() == ck_matrix.size(), "deltanet_block: conv and matrix checkpoints differ in number");
  Seqs q;
  std::set<int64_t> seen;
  int64_t rows = 0;
  const int64_t per_slot_c = s.c * (s.k - 1), per_slot_m = w.nv * w.dk * w.dv;
  float *cp = conv.data_ptr<float>(), *mp = matrix.data_ptr<float>();
  for (int64_t i = 0; i < S; ++i) {
    const int64_t sl = slots[i], n = qlens[i];
    TORCH_CHECK(sl >= 0 && sl < conv.size(1), "deltanet_block: state slot ", sl, " out of range");
    TORCH_CHECK(seen.insert(sl).second, "deltanet_block: slot ", sl, " given twice (one entry per sequence)");
    TORCH_CHECK(n >= 0, "deltanet_block: query length ", n, " < 0");
    q.start.push_back(rows);
    q.n.push_back(n);
    q.win.push_back(cp + (layer * conv.size(1) + sl) * per_slot_c);
    q.mat.push_back(mp + (layer * matrix.size(1) + sl) * per_slot_m);
    const bool has = !ck_conv.empty();
    float* cc = has ? checkpoint_ptr(ck_conv[i], n, {s.c, s.k - 1}, "conv checkpoint") : nullptr;
    float* cm = has ? checkpoint_ptr(ck_matrix[i], n, {w.nv, w.dk, w.dv}, "matrix checkpoint") : nullptr;
    TORCH_CHECK((cc == nullptr) == (cm == nullptr), "deltanet_block: sequence ", i,
                " has a conv checkpoint without a matrix one or the reverse");
    q.ck_win.push_back(cc);
    q.ck_mat.push_back(cm);
    rows += n;
  }
  TORCH_CHECK(rows == T, "deltanet_block: the query lengths add up to ", rows, " rows, x has ", T);
  at::Tensor h = at::empty({T, H}, at::kFloat);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>();
  const float *cw = w.conv.data_ptr<float>(), *an = w.a.data_ptr<float>(), *dt = w.dt_bias.data_ptr<float>();
  const float *ln1 = w.ln1.data_ptr<float>(), *ln2 = w.ln2.data_ptr<float>(), *nw = w.norm.data_ptr<float>();
  const float eps = (float)w.eps;
  pybind11::gil_scoped_release no_gil;
  std::vector<float> hn(T * H), qkvz(T * w.qkvz.w.N), ba(T * 2 * w.nv), mixed(T * s.c), ys(T * s.c),
      z(T * vd), g(T * w.nv), beta(T * w.nv), o(T * vd), y(T * H);
  parallel(T, 1, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) rmsnorm(xp + t * H, ln1, H, eps, hn.data() + t * H);
  });
  std::vector<LinearJob> in{{w.qkvz.w, hn.data(), T, qkvz.data()}, {w.ba.w, hn.data(), T, ba.data()}};
  linears(in, dmt, i8a);
  parallel(T, 1, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) {
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
    }
  });
  conv_rows(s, q, cw, mixed.data(), ys.data(), T);
  delta_rows(s, q, ys.data(), g.data(), beta.data(), o.data());
  parallel(T * w.nv, 1, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i++) {  // gated RMSNorm per head: w * norm(o) * silu(z)
      float* oh = o.data() + i * w.dv;
      const float* zh = z.data() + i * w.dv;
      rmsnorm(oh, nw, w.dv, eps, oh);
      for (int64_t j = 0; j < w.dv; j++) oh[j] *= zh[j] / (1.0f + std::exp(-zh[j]));
    }
  });
  linear(w.out.w, o.data(), T, y.data(), dmt, i8a);
  parallel(T, 1, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) {
      for (int64_t i = t * H; i < (t + 1) * H; i++) xp[i] += y[i];
      rmsnorm(xp + t * H, ln2, H, eps, hp + t * H);
    }
  });
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
  Seqs q{{0}, {1}, {window.data_ptr<float>()}, {state.data_ptr<float>()}, {nullptr}, {nullptr}};
  at::Tensor out = at::empty({nv, dv}, at::kFloat);
  pybind11::gil_scoped_release no_gil;
  std::vector<float> y(c);
  conv_rows(s, q, weight.data_ptr<float>(), x.data_ptr<float>(), y.data(), 1);
  delta_rows(s, q, y.data(), g.data_ptr<float>(), beta.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

}  // namespace ms
