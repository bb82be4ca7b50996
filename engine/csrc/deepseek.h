// DeepSeek-V3's blocks of the fused step: multi-head latent attention over the paged latent cache
// (mla.cpp) and the group-limited sigmoid router (route_grouped.cpp).
#pragma once
#include "step.h"

#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>
#include <vector>

namespace ms {

struct MLA {  // one MLA block with the norms around it (engine.models.deepseek_v3.mla.MLAttention)
  std::optional<Linear> qa;   // q_a_proj (q LoRA), absent for a plain q_proj
  Linear qb, kva, o;          // q_b_proj (or q_proj), kv_a_proj_with_mqa, o_proj
  at::Tensor ln1, ln2, qan, kvan;  // float32 [H], [H], [q_lora_rank] (empty without q LoRA), [R]
  at::Tensor wuk, wuv;        // kv_b_proj's key and value parts, float32 [Nh, dn, R], [Nh, dv, R]
                              // (the reference path; empty when kvb is set)
  int64_t nh, rank, rope, nope, vd, half;
  double eps, eps_q, eps_kv, scale;
  bool interleave;            // RoPE on interleaved pairs (DeepSeek's released layout)
  std::optional<Linear> kvb;  // kv_b_proj itself, int8 or bf16 [Nh * (dn + dv), R]: read in place of
                              // wuk / wuv (head h's dn key rows, then its dv value rows)
};

// Rows of kv_b's key or value part as mla_kvb.cpp reads them: row (h, i) is row
// h * stride + first + i of `data` ([rows, R]: float32, int8 with fp16 scales [rows, R / G], bf16).
constexpr int KVB_F32 = -1;   // fmt of the float32 copy (beside quant.h's F_INT8, F_BF16)
constexpr int64_t KVB_TILE = 8;  // tokens per call of absorb_query / expand_value at most
struct KvbRows {
  int fmt;
  const void* data;
  const uint16_t* scales;
  int64_t R, G, stride, first;
};
// qlat[t, R] = sum_{d < nd} q[t * qs + d] * row(h, d), for t < nt <= KVB_TILE
void absorb_query(const KvbRows& w, int64_t h, const float* q, int64_t qs, int64_t nt, float* qlat, int64_t nd);
// out[t * os + v] = row(h, v) . olat[t, R], for v < nv, t < nt <= KVB_TILE
void expand_value(const KvbRows& w, int64_t h, const float* olat, int64_t nt, float* out, int64_t os, int64_t nv);

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
