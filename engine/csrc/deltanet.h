// Gated DeltaNet (Qwen3-Next's linear attention) in the native step: one layer's weights and its
// block (deltanet_block.cpp). The torch reference is engine/layers/deltanet.py.
#pragma once
#include "step.h"

#include <ATen/core/Tensor.h>
#include <optional>
#include <vector>

namespace ms {

struct DeltaNet {  // one Gated DeltaNet layer with the norms around it
  Linear qkvz, ba, out;  // in_proj_qkvz [2 Nk Dk + 2 Nv Dv, H], in_proj_ba [2 Nv, H], out_proj [H, Nv Dv]
  at::Tensor ln1, ln2;   // float32 [H]: the layer's input and post-attention norms (weights as applied)
  at::Tensor conv;       // float32 [C, K]: the depthwise conv, C = 2 Nk Dk + Nv Dv
  at::Tensor a, dt_bias; // float32 [Nv]: a = -exp(A_log), the decay's scale
  at::Tensor norm;       // float32 [Dv]: the gated RMSNorm's weight
  int64_t nk, nv, dk, dv;
  double eps;
};

// Every row of a step: sequence i brings qlens[i] >= 0 consecutive rows of x [T, H] (x += the
// layer's output, in place), its state in slot slots[i] of conv [Ll, S, C, K-1] and matrix
// [Ll, S, Nv, Dk, Dv] (layer `layer`, advanced in place over its rows in order). ck_conv/ck_matrix:
// empty, or per sequence None or the buffers [n, C, K-1] / [n, Nv, Dk, Dv] that receive the state
// after each of its n rows (a verify row's checkpoints). Returns h = the post-attention norm of x,
// as attn_block does.
at::Tensor deltanet_block(const DeltaNet& w, at::Tensor x, at::Tensor conv, at::Tensor matrix, int64_t layer,
                          const std::vector<int64_t>& slots, const std::vector<int64_t>& qlens,
                          const std::vector<std::optional<at::Tensor>>& ck_conv,
                          const std::vector<std::optional<at::Tensor>>& ck_matrix, int64_t dmt, bool i8a);
// One token of one sequence: conv step + SiLU + q/k L2 norms + gated delta rule. window [C, K-1],
// weight [C, K], x [C] (q | k | v before the conv), state [Nv, Dk, Dv], g, beta [Nv]; window and
// state advanced in place. -> o [Nv, Dv] (engine.layers.deltanet_native.decode_step)
at::Tensor deltanet_step(at::Tensor window, const at::Tensor& weight, const at::Tensor& x, at::Tensor state,
                         const at::Tensor& g, const at::Tensor& beta, int64_t nk, int64_t dk, int64_t dv);

}  // namespace ms
