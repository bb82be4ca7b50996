// A decode step's layers as one native call (step.h: Layers, run_layers): the loop of
// engine/step.py's NativeStep.forward over attn_block, route and ffn_block, with the expert
// cache's residency read from a table instead of asked of Python per layer. Python runs only
// before (embedding, the step's block tables) and after (LM head, sampling), and for a layer
// whose experts are not all resident: run_layers stops there and Python's fetch path (acquire,
// load, compute) takes that layer's feed-forward, then calls again from the next layer.
// The calls are the ones Python makes, in the same order, so the results are the same bits.
#include "step.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace ms {

std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>, at::Tensor> run_layers(
    const Layers& m, int64_t start, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<int64_t>& positions, const at::Tensor& storage, const at::Tensor& tables,
    const std::vector<int64_t>& qlens, const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a,
    const at::Tensor& resident, const at::Tensor& slot_table, at::Tensor hits,
    const std::vector<int64_t>& head_rows) {
  const int64_t L = (int64_t)m.attn.size();
  TORCH_CHECK(m.ffn.size() == (size_t)L && m.router.size() == (size_t)L && m.top_k.size() == (size_t)L &&
              m.normalize.size() == (size_t)L, "one attention, feed-forward and router entry per layer");
  TORCH_CHECK(start >= 0 && start <= L, "start layer out of range");
  TORCH_CHECK(head_rows.empty() || m.head.has_value(), "head rows given to layers built without a head");
  TORCH_CHECK(resident.scalar_type() == at::kInt && resident.dim() == 2 && resident.is_contiguous(),
              "resident must be int32 [layers, experts]");
  TORCH_CHECK(hits.scalar_type() == at::kLong && hits.numel() == L && hits.is_contiguous(), "hits must be int64 [layers]");
  const int32_t* rp = resident.data_ptr<int32_t>();
  const int64_t rl = resident.size(0), re = resident.size(1);
  int64_t* hp = hits.data_ptr<int64_t>();
  if (start == 0) std::fill(hp, hp + L, int64_t{0});  // a step's first call: its hits start at 0
  const at::Tensor none_ids = at::empty({0}, at::kLong), none_w = at::empty({0}, at::kFloat);
  // one post-attention norm and one routing buffer for the call's layers (each layer's ffn_block
  // is done with them before the next layer writes them): no allocation per layer
  const int64_t T = x.size(0);
  at::Tensor h = at::empty({T, x.size(1)}, at::kFloat), ids, w;
  for (int64_t i = start; i < L; i++) {
    attn_block_out(m.attn[i], x, cos, sin, positions, storage, i, tables, qlens, ctxs, dmt, i8a, h);
    const FFN* dense = m.ffn[i] ? &*m.ffn[i] : nullptr;
    if (!m.router[i].defined() || m.router[i].numel() == 0) {
      ffn_block(x, h, none_ids, none_w, {}, {}, none_ids, dense, dmt, i8a);
      continue;
    }
    if (!ids.defined() || ids.size(1) != m.top_k[i]) {
      ids = at::empty({T, m.top_k[i]}, at::kLong);
      w = at::empty({T, m.top_k[i]}, at::kFloat);
    }
    std::vector<int64_t> uniq = route_out(h, m.router[i], m.top_k[i], m.normalize[i], at::Tensor(), ids, w);
    std::vector<int64_t> slots(uniq.size());
    bool all = i < rl;
    for (size_t u = 0; all && u < uniq.size(); u++) {
      TORCH_CHECK(uniq[u] < re, "expert ", uniq[u], " beyond the residency table");
      all = (slots[u] = rp[i * re + uniq[u]]) >= 0;
    }
    if (!all) return {i, h, ids, w, uniq, at::Tensor()};
    hp[i] += (int64_t)uniq.size();
    ffn_block(x, h, ids, w, uniq, slots, slot_table, dense, dmt, i8a);
  }
  at::Tensor logits = head_rows.empty() ? at::Tensor() : head_block(x, head_rows, m.norm, m.eps, *m.head, dmt, i8a);
  return {L, at::Tensor(), at::Tensor(), at::Tensor(), {}, logits};
}

}  // namespace ms
