// Gated DeltaNet decode step on the CPU: one new token of one sequence through one layer's causal
// conv (window advanced in place), SiLU, per-head L2 norms of q and k, and the gated delta rule on
// the layer's state (updated in place). The torch reference is engine/layers/deltanet.py
// (causal_conv + l2norm + recurrent_delta_rule); tests/engine/models/test_qwen3_next.py compares
// them on random inputs.
//
// Shapes (float32, contiguous): window [C, K-1], weight [C, K], x [C] (q | k | v of the token
// before the conv), state [Nv, Dk, Dv], g, beta [Nv]; C = 2 Nk Dk + Nv Dv. Returns o [Nv, Dv].
// Each value head reads its state twice (decay + S^T k, then the rank-1 update + S^T q), rows in
// order, so the step is two streaming passes over the state; heads run in parallel.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

namespace {

torch::Tensor decode_step(torch::Tensor window, torch::Tensor weight, torch::Tensor x, torch::Tensor state,
                          torch::Tensor g, torch::Tensor beta, int64_t nk, int64_t dk, int64_t dv) {
  for (const auto* t : {&window, &weight, &x, &state, &g, &beta}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->device().is_cpu(),
                "deltanet decode_step: float32 contiguous CPU tensors only");
  }
  const int64_t c = x.size(0), k = weight.size(1), nv = state.size(0);
  TORCH_CHECK(c == 2 * nk * dk + nv * dv && window.size(0) == c && window.size(1) == k - 1 &&
                  weight.size(0) == c && state.size(1) == dk && state.size(2) == dv && nv % nk == 0,
              "deltanet decode_step: inconsistent shapes");
  std::vector<float> y(c);
  float* win = window.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t ch = 0; ch < c; ++ch) {  // conv over (window, x), then shift x into the window
    float* wr = win + ch * (k - 1);
    const float* wt = w + ch * k;
    float acc = wt[k - 1] * xp[ch];
    for (int64_t j = 0; j < k - 1; ++j) acc += wt[j] * wr[j];
    for (int64_t j = 0; j + 1 < k - 1; ++j) wr[j] = wr[j + 1];
    if (k > 1) wr[k - 2] = xp[ch];
    y[ch] = acc / (1.0f + std::exp(-acc));  // SiLU
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t h = 0; h < 2 * nk; ++h) {  // L2 norm of each q head (then scaled) and k head
    float* p = y.data() + h * dk;
    float ss = 0.f;
    for (int64_t i = 0; i < dk; ++i) ss += p[i] * p[i];
    const float inv = 1.0f / std::sqrt(ss + 1e-6f) * (h < nk ? scale : 1.0f);
    for (int64_t i = 0; i < dk; ++i) p[i] *= inv;
  }
  auto out = torch::empty({nv, dv}, x.options());
  float* o = out.data_ptr<float>();
  float* s = state.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const int64_t r = nv / nk;
  at::parallel_for(0, nv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> mem(dv), delta(dv);
    for (int64_t h = h0; h < h1; ++h) {
      const float* q = y.data() + (h / r) * dk;
      const float* kk = y.data() + nk * dk + (h / r) * dk;
      const float* v = y.data() + 2 * nk * dk + h * dv;
      float* sh = s + h * dk * dv;
      float* oh = o + h * dv;
      const float decay = std::exp(gp[h]);
      std::fill(mem.begin(), mem.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        float* row = sh + i * dv;
        const float ki = kk[i];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] *= decay;
          mem[j] += ki * row[j];
        }
      }
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = (v[j] - mem[j]) * bp[h];
        oh[j] = 0.f;
      }
      for (int64_t i = 0; i < dk; ++i) {
        float* row = sh + i * dv;
        const float ki = kk[i], qi = q[i];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] += ki * delta[j];
          oh[j] += qi * row[j];
        }
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "Gated DeltaNet: conv step + delta-rule update of one token");
}
