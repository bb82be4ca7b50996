// DeepSeek-V3's router in float32 (engine.layers.routing.GroupLimitedSigmoidRouter): scores =
// sigmoid(h W^T); selection on scores + e_score_correction_bias: experts in n_group equal groups,
// a group scored by the sum of its two best biased scores, only the topk_group best groups
// eligible, the top_k best biased scores among them picked (ties: the lower index); weights = the
// unbiased scores of the picks, normalised over them (+ 1e-20) when asked, times the scaling.
#include "deepseek.h"
#include "simd.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace ms {

std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> route_grouped(const at::Tensor& h, const GroupRouter& r) {
  const int64_t T = h.size(0), H = h.size(1), E = r.w.size(0), K = r.top_k, G = r.n_group;
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2, "h must be contiguous float32 [T, H]");
  TORCH_CHECK(r.w.scalar_type() == at::kFloat && r.w.is_contiguous() && r.w.size(1) == H, "router must be float32 [E, H]");
  TORCH_CHECK(r.bias.scalar_type() == at::kFloat && r.bias.is_contiguous() && r.bias.numel() == E,
              "e_score_correction_bias must be float32 [E]");
  TORCH_CHECK(G >= 1 && E % G == 0 && r.topk_group >= 1 && r.topk_group <= G, "n_group / topk_group out of range");
  const int64_t per = E / G;
  TORCH_CHECK(K >= 1 && K <= r.topk_group * per, "top_k larger than the eligible experts");
  at::Tensor ids = at::empty({T, K}, at::kLong), w = at::empty({T, K}, at::kFloat);
  const float *hp = h.data_ptr<float>(), *wp = r.w.data_ptr<float>(), *bp = r.bias.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* op = w.data_ptr<float>();
  std::vector<float> s(E), c(E), gs(G);
  std::vector<int64_t> order(E), groups(G);
  auto by = [](const std::vector<float>& v) {  // descending, ties: the lower index first
    return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  for (int64_t t = 0; t < T; t++) {
    for (int64_t e = 0; e < E; e++) {
      s[e] = 1.0f / (1.0f + std::exp(-dot(hp + t * H, wp + e * H, H)));
      c[e] = s[e] + bp[e];
    }
    if (r.topk_group < G) {  // keep the topk_group best groups, the others out of the choice
      for (int64_t g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; e++) {
          if (c[e] > b1) { b2 = b1; b1 = c[e]; } else if (c[e] > b2) b2 = c[e];
        }
        gs[g] = per >= 2 ? b1 + b2 : b1;
      }
      std::iota(groups.begin(), groups.end(), 0);
      std::partial_sort(groups.begin(), groups.begin() + r.topk_group, groups.end(), by(gs));
      std::vector<bool> keep(G, false);
      for (int64_t k = 0; k < r.topk_group; k++) keep[groups[k]] = true;
      for (int64_t e = 0; e < E; e++) if (!keep[e / per]) c[e] = -INFINITY;
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), by(c));
    float sum = 0.f;
    for (int64_t k = 0; k < K; k++) sum += s[order[k]];
    const float den = sum + 1e-20f;
    for (int64_t k = 0; k < K; k++) {
      ip[t * K + k] = order[k];
      op[t * K + k] = (r.normalize ? s[order[k]] / den : s[order[k]]) * (float)r.scaling;
    }
  }
  std::vector<int64_t> uniq(ip, ip + T * K);  // the routed experts, ascending
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
  return {ids, w, uniq};
}

}  // namespace ms
