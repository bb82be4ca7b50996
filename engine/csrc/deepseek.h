// DeepSeek-V3's blocks of the fused step: multi-head latent attention over the paged latent cache
// (mla.cpp) and the group-limited sigmoid router (route_grouped.cpp).
#pragma once
#include "step.h"

#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>
#include <vector>

namespace ms {

struct MLA {  // one MLA block with the norms around it (engine.layers.mla.MLAttention)
  std::optional<Linear> qa;   // q_a_proj (q LoRA), absent for a plain q_proj
  Linear qb, kva, o;          // q_b_proj (or q_proj), kv_a_proj_with_mqa, o_proj
  at::Tensor ln1, ln2, qan, kvan;  // float32 [H], [H], [q_lora_rank] (empty without q LoRA), [R]
  at::Tensor wuk, wuv;        // kv_b_proj's key and value parts, float32 [Nh, dn, R], [Nh, dv, R]
  int64_t nh, rank, rope, nope, vd, half;
  double eps, eps_q, eps_kv, scale;
  bool interleave;            // RoPE on interleaved pairs (DeepSeek's released layout)
};

// x += o_proj(absorbed MLA over each sequence's cached latents); the new tokens' latents (R + r,
// zero-padded to 2 * half) are written first, split over the cache's K and V halves
// (storage [L, 2, NB, BS, 1, half]). cos/sin [positions, r]. Returns the post-attention norm of x.
at::Tensor mla_block(const MLA& a, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<int64_t>& positions, const at::Tensor& storage, int64_t layer,
                     const at::Tensor& tables, const std::vector<int64_t>& qlens,
                     const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a);

struct GroupRouter {  // engine.layers.routing.GroupLimitedSigmoidRouter
  at::Tensor w, bias;  // float32 [E, H], [E] (e_score_correction_bias: selection only)
  int64_t top_k, n_group, topk_group;
  bool normalize;
  double scaling;
};

// (ids [T, K], weights [T, K], the distinct ids ascending), as route() returns them
std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> route_grouped(const at::Tensor& h, const GroupRouter& r);

}  // namespace ms
