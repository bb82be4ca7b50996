// int4 weights x int8 activations: the activation format and the one sum both kernels compute,
// the AVX512-VNNI one (any number of tokens; quant.cpp) and the AMX one (16 x 16 tiles, for
// prefill-sized calls; amx.cpp). Both give the same bits for a (row, token) pair, so a token's
// result does not depend on the batch it ran in (docs/native-step.md, batch invariance).
//
// The sum for weight row n and token t, blocks b of 32 weights, groups g of G weights:
//   S_b   = sum over the block's 32 weights of code * q          (int32: exact in any order)
//   P[i]  = 0; for b ascending: P[b % 16] = fma(float(S_b), scale(g(b)) * dx_b, P[b % 16])
//           then for g ascending: P[g % 16] = fma(min(g), xg_g, P[g % 16])
//   out   = tree16(P): P[i] + P[i + 8], then + 4, + 2, + 1 (halving, as tree16 below)
// reference.linear_ref_int8_act is the same sum up to float rounding order.
#pragma once
#include "quant.h"

#include <cstdint>
#include <vector>

namespace ms {

// One token's int8 activations: q in chunks of 128 weights as [64 bytes: the low halves of its 4
// blocks (weights 0..15 of each)][64 bytes: the high halves], as the VNNI kernel reads them next
// to a chunk's 64 code bytes (byte j of a block = code j | code j + 16 << 4).
struct QAct {
  std::vector<int8_t> q;   // [J * 512], J = ceil(K / 512): the VNNI kernel reads 16 blocks (4 chunks)
                           // at a time, zero past K (quant_act_bytes)
  std::vector<float> db;   // [ceil(B / 16) * 16]: dx of each block (absmax / 127), 0 past K
  std::vector<float> xg;   // [K / G]: sums of x' = q * dx over each group
};

// Bytes of a QAct's q for K weights: whole groups of 16 blocks, as the VNNI kernel loads them (a
// K of 768 once got 768 bytes and the kernel read 1,024: past the buffer, a rare SIGSEGV when it
// ended at an unmapped page; bench/beyond_ram.py's 8 GB model, down projections of width 768)
inline int64_t quant_act_bytes(int64_t K) { return (K + 511) / 512 * 512; }

// q of weight k (natural order) inside a QAct's chunk layout
inline int64_t qact_index(int64_t k) {
  const int64_t b = k / 32, j = k % 32;
  return (b / 4) * 128 + (j < 16 ? 0 : 64) + (b % 4) * 16 + (j & 15);
}

// The AMX kernel's activations: T tokens in groups of 16 (the last padded with zero rows) as
// A tiles, each token's q in natural order (row t: K bytes); the blocks' dx and groups' xg per token.
struct AmxActs {
  int64_t T = 0, TG = 0, K = 0, NG = 0;
  std::vector<int8_t> img;  // [TG * 16][K]
  std::vector<float> dx;    // [T][K / 32]
  std::vector<float> xg;    // [T][NG]
};

// Whether this CPU and kernel let the process use AMX-INT8 tiles (asked once).
bool amx_usable();
// The switch (engine.options' `amx`, set by engine/quant/kernels.py; tests compare the two
// kernels): returns the previous setting. On takes effect only where amx_usable().
bool set_amx(bool on);
bool amx_on();

// Calls with at least this many tokens take the AMX kernel (below, VNNI measured as fast).
constexpr int64_t AMX_MIN_ROWS = 16;

void amx_acts(const QAct* const* acts, int64_t T, int64_t K, int64_t G, AmxActs& out);
// out[t * ldo + n] for rows [n0, ne) (at most 16) of an int4 weight and every token of x
void rows_int4_amx(const QW& w, int64_t n0, int64_t ne, const AmxActs& x, float* out, int64_t ldo);

}  // namespace ms
