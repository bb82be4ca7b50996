// Integer activations: the activation formats, the one sum every kernel computes, and the
// kernels each instruction set's file implements (quant.cpp: AVX512-VNNI; quant_avx2.cpp: AVX2's
// vpmaddubsw / vpmaddwd; amx.cpp: AMX tiles for prefill-sized int4 calls), which jobs.cpp calls.
// int4 weights take int8 activations, int8 weights int16 ones. Every kernel gives the same bits
// for a (row, token) pair, so a token's result depends neither on the batch it ran in
// (docs/native-step.md, batch invariance) nor on the instruction set.
//
// int4 x int8:
//
// The sum for weight row n and token t, blocks b of 32 weights, groups g of G weights:
//   S_b   = sum over the block's 32 weights of code * q          (int32: exact in any order)
//   P[i]  = 0; for b ascending: P[b % 16] = fma(float(S_b), scale(g(b)) * dx_b, P[b % 16])
//           then for g ascending: P[g % 16] = fma(min(g), xg_g, P[g % 16])
//   out   = tree16(P): P[i] + P[i + 8], then + 4, + 2, + 1 (halving: quant.cpp tree16)
// reference.linear_ref_int8_act is the same sum up to float rounding order.
#pragma once
#include "quant.h"

#include <cstdint>
#include <type_traits>
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
  std::vector<int8_t> qt;  // the AVX2 build only: q again, each 8 blocks' bytes with one 32-bit
                           // lane per block (quant_avx2.cpp store_lanes_by_block), for prefill
};

// int8 weights x int16 activations: int8 ones (block-32 absmax / 127) are too coarse for int8
// weights: a dense model's outlier channels (SmolLM2's) leave the other 31 values of their block a
// few codes, and greedy answers break (docs/quantization.md#the-default-dense-format). int16
// codes (absmax / 32767) keep 8 more bits per block at the same instructions per weight. The sum
// for row n and token t: s_b = scale(g(b)) * dx_b; f[b % 2][i] = fma(float(sum of the products of
// weights 2i, 2i + 1 of block b), s_b, f[b % 2][i]) over the 16 lanes i, b ascending; out = tree16
// of f[0] + f[1].
struct QAct16 {
  std::vector<int16_t> q;  // [K]
  std::vector<float> dx;   // [K / 32]
};

// Each instruction set's kernels (one file of them is built into a module). Activations:
// quant_act / quant_act16 quantize one row of K floats (x' = q * dx, q = round-half-even(x / dx),
// dx = absmax / 127 or / 32767 per block of 32). Rows [nb, ne) of out[t * ldo + n]:
// rows_i8a for int4 weights and int8 activations, rows_i16a for int8 weights and int16 ones,
// rows_float for any format and float32 x [T, K] (the loop nest by direct_max_t).
void quant_act(const float* x, int64_t K, int64_t G, QAct& a);
void quant_act16(const float* x, int64_t K, QAct16& a);
void rows_i8a(const QW& w, int64_t nb, int64_t ne, const std::vector<const QAct*>& acts, float* out, int64_t ldo);
void rows_i16a(const QW& w, int64_t nb, int64_t ne, const std::vector<QAct16>& acts, float* out, int64_t ldo);
void rows_float(const QW& w, int64_t nb, int64_t ne, const float* x, int64_t T, float* out, int64_t ldo,
                int64_t direct_max_t);

// Every token of `acts`, TILE at a time (a kernel's register tile of tokens), then the rest as one
// smaller tile: f(std::integral_constant<int, tile>, acts, out).
template <int N, typename A, typename F>
inline void rest_tile(int64_t n, const A* a, float* o, F& f) {
  if constexpr (N > 0) {
    if (n == N) f(std::integral_constant<int, N>{}, a, o);
    else rest_tile<N - 1>(n, a, o, f);
  }
}
template <int TILE, typename A, typename F>
inline void by_tiles(const std::vector<A>& acts, float* out, int64_t ldo, F&& f) {
  const int64_t T = (int64_t)acts.size();
  int64_t t = 0;
  for (; t + TILE <= T; t += TILE) f(std::integral_constant<int, TILE>{}, acts.data() + t, out + t * ldo);
  rest_tile<TILE - 1>(T - t, acts.data() + t, out + t * ldo, f);
}

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
// Whether this build has integer-activation kernels on this CPU (AVX512-VNNI for quant.cpp,
// AVX2 always for quant_avx2.cpp): engine.quant.kernels.int8_activations asks it.
bool has_int8_dots();
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
