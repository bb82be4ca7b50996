// Weights of the fused step (step.cpp), built once per layer from Python and kept alive there.
#pragma once
#include "quant.h"

#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>
#include <vector>

namespace ms {

constexpr int64_t SLOT_ROW = 13;  // slot table row: fmt, G, I, H, 9 part addresses (gate, up, down)

struct Linear {  // a dense weight: its QW over the tensors it keeps alive, optional float32 bias
  QW w;
  at::Tensor codes, scales, mins, bias;
};

struct Attn {  // one attention block with the norms around it
  Linear q, k, v, o;
  at::Tensor ln1, ln2, qn, kn;  // float32 [H], [H], [D] (qn/kn empty without q/k norm)
  int64_t nh, nkv, d;
  double eps;
  bool gated = false;      // q_proj rows [q_h | gate_h] per head, output * sigmoid(gate) (Qwen3-Next)
  int64_t rotary_dim = 0;  // RoPE on the first rotary_dim dims of each head (0: all d)
  at::Tensor sinks;    // float32 [Nh]: a learned logit per head in the softmax denominator (or empty)
  int64_t window = 0;  // sliding window: a query at p sees keys p - window < j <= p (0: every key)
};

struct FFN {  // a SwiGLU on every token: a dense MLP or a shared expert (gate: empty or float32 [H])
  Linear g, u, d;
  at::Tensor gate;
};

struct ExpertAct {  // a MoE layer's routed-expert activation (ACT_*) and biases (gpt-oss)
  int64_t act;
  double alpha, limit;
  at::Tensor gb, ub, db;  // float32 [E, I], [E, I], [E, H] (empty: none)
};

Linear make_linear(int64_t fmt, int64_t G, int64_t N, int64_t K, at::Tensor codes, at::Tensor scales,
                   at::Tensor mins, at::Tensor bias);
// cos/sin: the rotary tables [positions, D]; positions: each token's
at::Tensor attn_block(const Attn& a, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<int64_t>& positions, const at::Tensor& storage, int64_t layer,
                      const at::Tensor& tables, const std::vector<int64_t>& qlens,
                      const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a);
// attn_block writing the post-attention norm into h [T, H] (run_layers: one h for all its layers)
void attn_block_out(const Attn& a, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<int64_t>& positions, const at::Tensor& storage, int64_t layer,
                    const at::Tensor& tables, const std::vector<int64_t>& qlens,
                    const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a, at::Tensor h);
// (ids [T, K], weights [T, K], the distinct ids ascending)
// bias: float32 [E] added to the router's logits (or empty)
std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> route(const at::Tensor& h, const at::Tensor& wr,
                                                               int64_t top_k, bool normalize,
                                                               const at::Tensor& bias);
// route writing into ids [T, K] and weights [T, K]; returns the distinct ids ascending
std::vector<int64_t> route_out(const at::Tensor& h, const at::Tensor& wr, int64_t top_k, bool normalize,
                               const at::Tensor& bias, at::Tensor ids, at::Tensor w);
void ffn_block(at::Tensor x, const at::Tensor& h, const at::Tensor& ids, const at::Tensor& w,
               const std::vector<int64_t>& experts, const std::vector<int64_t>& slots,
               const at::Tensor& slot_table, const FFN* dense, int64_t dmt, bool i8a,
               const ExpertAct* act = nullptr, bool direct = false, const std::vector<at::Tensor>& pre = {});
// The unweighted outputs of routed experts from slots, one [n_u, H] per expert given (its tokens'
// rows in order; empty for one without a slot or tokens), for ffn_block's `pre`: a layer computes
// its resident experts while the others load, then combines all in expert order
std::vector<at::Tensor> expert_outputs(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& w,
                                       const std::vector<int64_t>& experts, const std::vector<int64_t>& slots,
                                       const at::Tensor& slot_table, int64_t dmt, bool i8a, const ExpertAct* act);
// A model's layers as one native call (layers.cpp): layer i is attn[i], then a dense SwiGLU
// (router[i] empty) or routing through router[i] and its experts from the expert cache's slots,
// looked up in `resident` [layers, experts] (int32 slot of an expert resident for good, -1 not),
// with the shared expert ffn[i] beside them.
struct Layers {
  std::vector<Attn> attn;
  std::vector<std::optional<FFN>> ffn;
  std::vector<at::Tensor> router;  // float32 [E, H], or empty: a dense layer
  std::vector<int64_t> top_k;
  std::vector<bool> normalize;
  std::optional<Linear> head;  // the LM head where the kernels run it (else Python computes logits)
  at::Tensor norm;             // the final norm's float32 weight [H] (with head)
  double eps = 0;
};
// Runs layers start, start + 1, ... of x's step until the last (returns its count) or until a
// sparse layer routes to an expert `resident` has no slot for: then returns that layer's index,
// its post-attention norm h and routing (ids, weights, distinct ids) with its attention done and
// its feed-forward not. hits[i] += the distinct experts of each sparse layer run here (hits zeroed
// first when start is 0). After the last layer, the logits of rows `head_rows` of x (head_block
// with the Layers' final norm and head; an undefined tensor when head_rows is empty), so a decode
// step whose experts are resident is this one call.
std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>, at::Tensor> run_layers(
    const Layers& m, int64_t start, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<int64_t>& positions, const at::Tensor& storage, const at::Tensor& tables,
    const std::vector<int64_t>& qlens, const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a,
    const at::Tensor& resident, const at::Tensor& slot_table, at::Tensor hits,
    const std::vector<int64_t>& head_rows);
// logits [R, V] of the final norm of rows `rows` of x through the LM head
at::Tensor head_block(const at::Tensor& x, const std::vector<int64_t>& rows, const at::Tensor& norm,
                      double eps, const Linear& head, int64_t dmt, bool i8a);

}  // namespace ms
