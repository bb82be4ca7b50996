// The decode step's fused native calls (docs/design.md, "The step contract").
//
// A transformer layer is three calls from Python, whatever the batch:
//   attn_block : x += o_proj(attention(rope(qk_norm(qkv(rmsnorm(x)))))) over the KV blocks of
//                each sequence, read through its block table; returns h = rmsnorm(x) (post-attn)
//   route      : top-k of softmax(h @ router.T) in float32 (+ renormalisation)
//   ffn_block  : x += sum_k w[t,k] * expert_{ids[t,k]}(h[t]) (+ sigmoid-gated shared expert, or a
//                dense SwiGLU), the routed experts read from the expert cache's slots through a
//                slot table: one int64 row per slot [fmt, G, I, H, 9 part addresses]
// Between route and ffn_block Python asks the expert cache to make the routed experts resident
// and hands back their slot numbers; the kernels never see a Python object per expert.
//
// Shapes: x, h [T, H] float32 (T tokens of S sequences, flat); q [T, Nh, D]; k, v [T, Nkv, D];
// KV storage [L, 2, NB, BS, Nkv, D] (float32, bf16 or fp16; a contiguous per-sequence cache is the
// case NB = 1, BS = capacity); tables [S, max blocks] int32; cos, sin [T, D].
// Numbers: the same operations in the same order as the torch layers (engine/layers), float32
// throughout; only summation order differs (tests compare the two on random inputs).
#include "phases.h"
#include "pool.h"
#include "rows.h"
#include "simd.h"
#include "step.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

namespace ms {

std::atomic<bool> g_phase_timing{false};
double g_phase_seconds[PH_COUNT] = {};

namespace {

// A tile's K and V rows are requested together before it is computed: the rows are scattered
// over the paged cache's blocks, and the weights streamed between two layers have evicted them,
// so each would otherwise start with a full memory latency.
template <typename S>
void prefetch_row(const S* p, int64_t n) {
  for (int64_t b = 0; b < n * (int64_t)sizeof(S); b += 64) _mm_prefetch((const char*)p + b, _MM_HINT_T0);
}

// One query row of one sequence: the keys/values 0 .. ctx (the window's) split
// into tiles of TILE positions, each tile read as whole cache rows (every KV head of a position:
// one contiguous run, where a per-head split reads a few lines of each row from every thread)
// and reduced to per-head partials (the tile's max score, sum of exponentials, weighted sum of V),
// merged in tile order. The tile size, not the thread count, fixes the summation order, so the
// result does not depend on the split (measured in a decode step: at a 512-640 context 4.7 -> 3.4
// ms per token for attn_block on the 1.3B store against a split of the KV heads over threads).
// q [Nh, D] -> out [Nh, D]; query head h reads KV head h / (Nh / Nkv). sinks [Nh] (or null): each
// head's sink logit in its softmax denominator; window > 0: the query at position ctx reads keys
// ctx - window < j <= ctx only.
// Within a tile the K and V rows are converted to float32 once (bf16: a shift per value), a
// head's scores come LANES positions at a time through one transpose-and-add (vsums) instead of
// a horizontal sum per position, and its weighted sum of V stays in registers (D / LANES
// vectors). Measured on the 1.3B store (bf16 KV, 2-core EPYC): attention over a 576-position
// context 65 -> 29 us per layer (attn_block alone, hot), prefill of 512 tokens 568-644 -> 673-711
// tok/s.
constexpr int64_t TILE = 32;

// A tile's rows as float32: pointers into the cache (float32 storage) or rows converted into buf
template <typename S>
void tile_rows(const KVView& kv, char* base, int64_t a, int64_t m, float* buf, const float** rows) {
  for (int64_t i = 0; i < m; i++) {
    if constexpr (std::is_same_v<S, float>) {
      rows[i] = kv.at<float>(base, a + i);
    } else {
      float* dst = buf + i * kv.row;
      if constexpr (std::is_same_v<S, c10::BFloat16>) {
        if (kv.row % LANES == 0) load_bf16((const uint16_t*)kv.at<S>(base, a + i), dst, kv.row);
        else load_row(kv.at<S>(base, a + i), dst, kv.row);
      } else {
        load_row(kv.at<S>(base, a + i), dst, kv.row);
      }
      rows[i] = dst;
    }
  }
}

// s[j] = q . k_j * scale for the m <= TILE rows of one head (its d dims at offset off of each row),
// LANES positions per transpose-and-add (vsums), one accumulator chain per position; returns
// max_j s[j]. s has room for TILE values; zero: a row of at least d zeros (positions past m).
inline float tile_scores(const float* q, const float* const* rows, int64_t off, int64_t m, int64_t d, float scale,
                         float* s, const float* zero) {
  if (d % LANES) {  // heads narrower than a vector (small test models)
    float mx = -INFINITY;
    for (int64_t j = 0; j < m; j++) mx = std::max(mx, s[j] = dot(q, rows[j] + off, d) * scale);
    return mx;
  }
  vf top = vset(-INFINITY);
  for (int64_t j0 = 0; j0 < m; j0 += LANES) {
    const float* r[LANES];
    for (int jj = 0; jj < LANES; jj++) r[jj] = j0 + jj < m ? rows[j0 + jj] + off : zero;
    vf acc[LANES];
    for (int jj = 0; jj < LANES; jj++) acc[jj] = vzero();
    for (int64_t c = 0; c < d; c += LANES) {
      const vf qc = vload(q + c);
      for (int jj = 0; jj < LANES; jj++) acc[jj] = vfma(qc, vload(r[jj] + c), acc[jj]);
    }
    vstore(s + j0, vmul(vsums(acc), vset(scale)));
    for (int64_t j = m; j < j0 + LANES; j++) s[j] = -INFINITY;  // past the tile: out of the max
    top = vmax(top, vload(s + j0));
  }
  alignas(64) float t[LANES];
  vstore(t, top);
  return *std::max_element(t, t + LANES);
}

// o[0..d) = sum_j p[j] * v_j (the head's d dims at offset off of each row), DL = d / LANES
// accumulators in registers
template <int DL>
void tile_values(const float* p, const float* const* rows, int64_t off, int64_t m, float* o) {
  vf acc[DL];
  for (int c = 0; c < DL; c++) acc[c] = vzero();
  for (int64_t j = 0; j < m; j++) {
    const vf pj = vset(p[j]);
    const float* r = rows[j] + off;
    for (int c = 0; c < DL; c++) acc[c] = vfma(pj, vload(r + c * LANES), acc[c]);
  }
  for (int c = 0; c < DL; c++) vstore(o + c * LANES, acc[c]);
}

inline void tile_values_any(const float* p, const float* const* rows, int64_t off, int64_t m, int64_t d, float* o) {
  if (d % LANES) {
    std::fill(o, o + d, 0.f);
    for (int64_t j = 0; j < m; j++)
      for (int64_t c = 0; c < d; c++) o[c] += p[j] * rows[j][off + c];
    return;
  }
  switch (d / LANES) {
    case 2: tile_values<2>(p, rows, off, m, o); return;
    case 4: tile_values<4>(p, rows, off, m, o); return;
    case 8: tile_values<8>(p, rows, off, m, o); return;
    case 16: tile_values<16>(p, rows, off, m, o); return;
    default: break;
  }
  std::fill(o, o + d, 0.f);
  for (int64_t j = 0; j < m; j++)
    for (int64_t c = 0; c < d; c += LANES) vstore(o + c, vfma(vset(p[j]), vload(rows[j] + off + c), vload(o + c)));
}

// attend_tiles (below) for a float32 cache, or heads of any width (d % LANES != 0, small test
// models: the tile's rows converted to float32 first), one head at a time over the tile's rows,
// the whole tile's rows requested at once. On a float32 cache this was 0.97-1.0 ms of attention
// a decoded token against 1.12-1.33 for attend_tiles's ordered stream (1.3B store, 576 positions).
template <typename S>
void attend_tiles_f32(const KVView& kv, const float* q, int64_t seen, int64_t j0, int64_t nh, int64_t nkv, int64_t d,
                  int64_t tb, int64_t te, float* part) {
  const int64_t g = nh / nkv, stride = nh * (d + 2), row = nkv * d;
  const float scale = 1.0f / std::sqrt((float)d);
  static thread_local std::vector<float> s, kbuf, vbuf, zero;
  s.resize(nh * TILE);
  zero.assign(d, 0.f);
  kbuf.resize(std::is_same_v<S, float> ? 0 : TILE * row);
  vbuf.resize(std::is_same_v<S, float> ? 0 : TILE * row);
  const float* krows[TILE];
  const float* vrows[TILE];
  for (int64_t t = tb; t < te; t++) {
    const int64_t a = j0 + t * TILE, b = std::min(seen, a + TILE), m = b - a;
    float *mx = part + t * stride, *sum = mx + nh, *o = sum + nh;
    for (int64_t j = a; j < b; j++) {  // the tile's rows all requested at once (scattered blocks)
      prefetch_row(kv.at<S>(kv.k, j), row);
      prefetch_row(kv.at<S>(kv.v, j), row);
    }
    tile_rows<S>(kv, kv.k, a, m, kbuf.data(), krows);
    for (int64_t h = 0; h < nh; h++) {
      float* sh = s.data() + h * TILE;
      mx[h] = tile_scores(q + h * d, krows, (h / g) * d, m, d, scale, sh, zero.data());
      sum[h] = exp_shift(sh, m, mx[h]);
    }
    tile_rows<S>(kv, kv.v, a, m, vbuf.data(), vrows);
    for (int64_t h = 0; h < nh; h++) tile_values_any(s.data() + h * TILE, vrows, (h / g) * d, m, d, o + h * d);
  }
}

// LANES values of a cache row from p as float32, converted in registers
template <typename S>
inline vf vload_kv(const S* p) {
  if constexpr (std::is_same_v<S, float>) return vload(p);
  else if constexpr (std::is_same_v<S, c10::BFloat16>) return vload_bf16((const uint16_t*)p);
  else return vload_f16((const uint16_t*)p);
}

// A tile's rows are read in order, each whole (every KV head of a position: one contiguous run),
// K rows then V rows, and requested AHEAD rows before they are read: a bounded stream of
// requests the memory keeps busy, where requesting the whole tile at once stalled on a full
// miss queue and left the hardware prefetchers a strided pattern (one head's slice of every row).
constexpr int64_t AHEAD = 8;

// A tile's K rows are read one at a time, each whole and in order, every query head that needs a
// part of the row (its KV head's d dims) taking it then; its V rows four at a time, each KV head's
// part of the four in turn. The order before (4 rows at a time, one KV head's slice of each, for
// K too) is not a stream the hardware prefetchers follow, and the software requests above cap a
// thread's stream at ~12 GB/s (docs/native-step.md). On the 1.3B store (2-core Zen 4, alternating
// processes): a decode's attention at a 512-576 context 0.50-0.55 -> 0.47-0.48 ms a token, at 3.6K
// the same within the noise; a 2K prefill 406 -> 423 tok/s, a 512-token one the same.
//
// A row's scores come out as one vector over a block of query heads (the most whole KV heads'
// query heads that fit in LANES lanes; more than LANES per KV head: LANES of one): head h's score
// q_h . k_j * scale is one accumulator over the d / LANES chunks in order, then vsums's lane tree.
// st holds a tile's scores, then its weights: per block TILE rows of LANES floats, so the maxima,
// the exponentials and their sums run over heads in vectors. o_h adds p_j v_j for j in order
// (float32), in memory.
//
// GT, DLT: the group size g and d / LANES as constants (0: read at run time, any g and width).
template <int GT>
constexpr int block_heads(int64_t g) {
  const int64_t G = GT ? GT : g;
  return (int)(G <= LANES ? (LANES / G) * G : LANES);
}

template <typename S, int GT, int DLT>
void score_row(const float* q, const S* r, int64_t nh, int64_t g, int64_t d, float scale, float* st, vf* top) {
  const int64_t G = GT ? GT : g, DL = DLT ? DLT : d / LANES;
  const int bh = block_heads<GT>(g);
  for (int64_t b = 0, h0 = 0; h0 < nh; b++, h0 += bh) {
    const int n = (int)std::min<int64_t>(bh, nh - h0);
    vf acc[LANES];
    for (int a = 0; a < LANES; a++) acc[a] = vzero();
    const float* qb = q + h0 * d;
    if constexpr (GT > 0) {  // whole KV heads: each chunk converted once for its GT query heads
      for (int i0 = 0; i0 < LANES; i0 += GT) {
        if (i0 >= n) break;
        const S* rk = r + ((h0 + i0) / GT) * d;
        for (int64_t c = 0; c < DL; c++) {
          const vf kc = vload_kv(rk + c * LANES);
          for (int i = 0; i < GT; i++) acc[i0 + i] = vfma(vload(qb + (i0 + i) * d + c * LANES), kc, acc[i0 + i]);
        }
      }
    } else {  // one head at a time
      for (int i = 0; i < n; i++) {
        const S* rk = r + ((h0 + i) / G) * d;
        for (int64_t c = 0; c < DL; c++) acc[i] = vfma(vload(qb + i * d + c * LANES), vload_kv(rk + c * LANES), acc[i]);
      }
    }
    const vf sv = vmul(vsums(acc), vset(scale));
    vstore(st + b * TILE * LANES, sv);
    top[b] = vmax(top[b], sv);
  }
}

// o_h += p_h,j v_j + ... + p_h,j+NR-1 v_j+NR-1 (rows r[0 .. NR), added in that order, o read and
// written once for them) for every query head, each V chunk converted once for the GT query heads
// of its KV head; w: row j's weights in st (row j + e's e * LANES floats on)
template <typename S, int GT, int DLT, int NR>
void value_rows(const float* w, const S* const* r, int64_t nh, int64_t g, int64_t d, float* o) {
  const int64_t G = GT ? GT : g, DL = DLT ? DLT : d / LANES;
  const int bh = block_heads<GT>(g);
  const auto weight = [&](int64_t h, int e) { return vset(w[(h / bh) * TILE * LANES + h % bh + e * LANES]); };
  if constexpr (GT > 0) {
    for (int64_t h0 = 0; h0 < nh; h0 += GT) {
      vf p[NR][GT];
      for (int e = 0; e < NR; e++)
        for (int i = 0; i < GT; i++) p[e][i] = weight(h0 + i, e);
      for (int64_t c = 0; c < DL; c++) {
        vf vr[NR];
        for (int e = 0; e < NR; e++) vr[e] = vload_kv(r[e] + (h0 / GT) * d + c * LANES);
        for (int i = 0; i < GT; i++) {
          float* oh = o + (h0 + i) * d + c * LANES;
          vf x = vload(oh);
          for (int e = 0; e < NR; e++) x = vfma(p[e][i], vr[e], x);
          vstore(oh, x);
        }
      }
    }
  } else {  // one head at a time
    for (int64_t h = 0; h < nh; h++) {
      float* oh = o + h * d;
      for (int e = 0; e < NR; e++) {
        const S* a = r[e] + (h / G) * d;
        const vf pe = weight(h, e);
        for (int64_t c = 0; c < DL; c++) vstore(oh + c * LANES, vfma(pe, vload_kv(a + c * LANES), vload(oh + c * LANES)));
      }
    }
  }
}

template <typename S>
struct RowKernels {
  void (*score)(const float*, const S*, int64_t, int64_t, int64_t, float, float*, vf*);
  void (*values4)(const float*, const S* const*, int64_t, int64_t, int64_t, float*);  // 4 rows
  void (*values1)(const float*, const S* const*, int64_t, int64_t, int64_t, float*);  // 1 row
};

// The kernels for g query heads per KV head and heads of d dims: constants for the common
// shapes, else the run-time loops (the same arithmetic)
template <typename S>
RowKernels<S> row_kernels(int64_t g, int64_t d) {
#define MS_ROW(GV, DLV) \
  if (g == GV && d == DLV * LANES)                                                                  \
    return {&score_row<S, GV, DLV>, &value_rows<S, GV, DLV, 4>, &value_rows<S, GV, DLV, 1>};
#define MS_ROWS(GV) if constexpr (GV <= LANES) { MS_ROW(GV, 2) MS_ROW(GV, 4) MS_ROW(GV, 8) MS_ROW(GV, 16) }
  MS_ROWS(1) MS_ROWS(2) MS_ROWS(3) MS_ROWS(4) MS_ROWS(6) MS_ROWS(8)
#undef MS_ROWS
#undef MS_ROW
  return {&score_row<S, 0, 0>, &value_rows<S, 0, 0, 4>, &value_rows<S, 0, 0, 1>};
}

// The partials of tiles [tb, te) of one query row's context (positions j0 + TILE * t ..): per tile
// and head its score max, its sum of exp(score - max) and its weighted sum of values, in `part`
// (stride nh * (d + 2) per tile). The rows are read in the cache's dtype and converted in
// registers, each K/V chunk once for the query heads that share its KV head (GQA).
template <typename S>
void attend_tiles(const KVView& kv, const float* q, int64_t seen, int64_t j0, int64_t nh, int64_t nkv, int64_t d,
                  int64_t tb, int64_t te, float* part) {
  const int64_t g = nh / nkv, stride = nh * (d + 2), row = nkv * d;
  const float scale = 1.0f / std::sqrt((float)d);
  if (d % LANES || std::is_same_v<S, float>) {  // float32 rows, or heads narrower than a vector
    attend_tiles_f32<S>(kv, q, seen, j0, nh, nkv, d, tb, te, part);
    return;
  }
  const RowKernels<S> rk = row_kernels<S>(g, d);
  const int bh = block_heads<0>(g);
  const int64_t blocks = (nh + bh - 1) / bh;
  static thread_local std::vector<float> st;  // a tile's scores, then weights: [blocks][TILE][LANES]
  static thread_local std::vector<vf> top;    // per block: the tile's maxima, then the sums
  st.resize(blocks * TILE * LANES);
  top.resize(2 * blocks);
  // rows[0, m): the tile's K rows, rows[TILE, TILE + m): its V rows, rows[2 TILE, ...): the next
  // tile's K rows (requested while this tile's values are computed)
  const S* rows[3 * TILE];
  const auto fill = [&](int64_t t, const S** k, const S** v) {
    const int64_t a = j0 + t * TILE, m = std::min(seen, a + TILE) - a;
    for (int64_t j = 0; j < m; j++) {
      k[j] = kv.at<S>(kv.k, a + j);
      if (v) v[j] = kv.at<S>(kv.v, a + j);
    }
    return m;
  };
  const auto ahead = [&](const S* p) { prefetch_row(p, row); };
  int64_t m = fill(tb, rows, rows + TILE);
  for (int64_t j = 0; j < std::min(2 * m, AHEAD); j++) ahead(j < m ? rows[j] : rows[TILE + j - m]);
  for (int64_t t = tb; t < te; t++) {
    float *mx = part + t * stride, *sum = mx + nh, *o = sum + nh;
    const S** k = rows;
    const S** v = rows + TILE;
    vf* total = top.data() + blocks;
    for (int64_t b = 0; b < blocks; b++) top[b] = vset(-INFINITY), total[b] = vzero();
    for (int64_t j = 0; j < m; j++) {
      if (j + AHEAD < 2 * m) ahead(j + AHEAD < m ? k[j + AHEAD] : v[j + AHEAD - m]);  // K rows, then V rows
      rk.score(q, k[j], nh, g, d, scale, st.data() + j * LANES, top.data());
    }
    alignas(64) float tt[LANES], ts[LANES];
    for (int64_t b = 0; b < blocks; b++) {
      for (int64_t j = 0; j < m; j++) {
        float* sj = st.data() + (b * TILE + j) * LANES;
        const vf e = vexp(vsub(vload(sj), top[b]));
        vstore(sj, e);
        total[b] = vadd(total[b], e);
      }
      vstore(tt, top[b]);
      vstore(ts, total[b]);
      for (int64_t h = b * bh; h < std::min(nh, (b + 1) * bh); h++) mx[h] = tt[h - b * bh], sum[h] = ts[h - b * bh];
    }
    const int64_t mn = t + 1 < te ? fill(t + 1, rows + 2 * TILE, nullptr) : 0;
    const auto request = [&](int64_t j) {  // V rows, then the next tile's K rows
      if (j < m) ahead(v[j]);
      else if (j - m < mn) ahead(rows[2 * TILE + j - m]);
    };
    std::fill(o, o + nh * d, 0.f);
    int64_t j = 0;
    for (; j + 4 <= m; j += 4) {
      for (int e = 0; e < 4; e++) request(j + AHEAD + e);
      rk.values4(st.data() + j * LANES, v + j, nh, g, d, o);
    }
    for (; j < m; j++) {
      request(j + AHEAD);
      rk.values1(st.data() + j * LANES, v + j, nh, g, d, o);
    }
    if (t + 1 < te) {  // the next tile: its K rows (requested above) and V rows
      m = fill(t + 1, rows, rows + TILE);
    }
  }
}

// out[h] = the tiles' partials merged in tile order (sinks: a logit per head with no value)
inline void merge_tiles(const float* part, int64_t tiles, int64_t nh, int64_t d, const float* sinks, float* out) {
  const int64_t stride = nh * (d + 2);
  for (int64_t h = 0; h < nh; h++) {
    float top = sinks ? sinks[h] : -INFINITY;
    for (int64_t t = 0; t < tiles; t++) top = std::max(top, part[t * stride + h]);
    float total = sinks ? std::exp(sinks[h] - top) : 0.f;
    float* oh = out + h * d;
    std::fill(oh, oh + d, 0.f);
    for (int64_t t = 0; t < tiles; t++) {
      const float* pt = part + t * stride;
      const float w = std::exp(pt[h] - top);
      total += w * pt[nh + h];
      const float* ot = pt + 2 * nh + h * d;
      for (int64_t c = 0; c < d; c++) oh[c] += w * ot[c];
    }
    const float inv = 1.0f / total;
    for (int64_t c = 0; c < d; c++) oh[c] *= inv;
  }
}

// The first context position a query at `ctx` sees, and its number of tiles
inline void span(int64_t ctx, int64_t window, int64_t& j0, int64_t& tiles) {
  const int64_t seen = ctx + 1;
  j0 = window > 0 ? std::max<int64_t>(0, seen - window) : 0;
  tiles = (seen - j0 + TILE - 1) / TILE;
}

// One query row (a decode step's): its context's tiles split over the pool, then merged.
template <typename S>
void attend_one(const KVView& kv, const float* q, int64_t ctx, int64_t nh, int64_t nkv, int64_t d, float* out,
                const float* sinks, int64_t window) {
  int64_t j0, tiles;
  span(ctx, window, j0, tiles);
  static thread_local std::vector<float> mine;  // the caller's partials, reached by the workers
  std::vector<float>& part = mine;
  part.resize(tiles * nh * (d + 2));
  parallel(tiles, 1, 1, [&](int64_t tb, int64_t te) {
    attend_tiles<S>(kv, q, ctx + 1, j0, nh, nkv, d, tb, te, part.data());
  });
  merge_tiles(part.data(), tiles, nh, d, sinks, out);
}

// q [n, Nh, D] for positions ctx .. ctx+n-1 of one sequence whose keys/values (new ones included)
// are in the cache -> out [n, Nh, D], query head h reading KV head h / (Nh / Nkv). Each row is
// attend_one's arithmetic over its own context (the same tiles, merged in the same order), so a
// position's result does not depend on whether it came in a prefill chunk or a decode step, nor
// on the chunk's length. Several rows are split over the pool by row (a prefill's first rows have
// a tile or two: split by tile they would leave cores idle), in the order first, last, second,
// second to last, ...: rows' costs grow with their context, so each contiguous share is balanced.
template <typename S>
void attend(const KVView& kv, const float* q, int64_t n, int64_t ctx, int64_t nh, int64_t nkv,
            int64_t d, float* out, const float* sinks, int64_t window) {
  if (n == 1) {
    attend_one<S>(kv, q, ctx, nh, nkv, d, out, sinks, window);
    return;
  }
  parallel(n, 1, 1, [&](int64_t b, int64_t e) {
    static thread_local std::vector<float> part;
    for (int64_t k = b; k < e; k++) {
      const int64_t i = k % 2 == 0 ? k / 2 : n - 1 - k / 2;
      int64_t j0, tiles;
      span(ctx + i, window, j0, tiles);
      part.resize(tiles * nh * (d + 2));
      attend_tiles<S>(kv, q + i * nh * d, ctx + i + 1, j0, nh, nkv, d, 0, tiles, part.data());
      merge_tiles(part.data(), tiles, nh, d, sinks, out + i * nh * d);
    }
  });
}

template <typename S>
void write_kv(const KVView& kv, const float* k, const float* v, int64_t n, int64_t ctx) {
  for (int64_t i = 0; i < n; i++) {
    store_row(kv.at<S>(kv.k, ctx + i), k + i * kv.row, kv.row);
    store_row(kv.at<S>(kv.v, ctx + i), v + i * kv.row, kv.row);
  }
}

// a slot table row: [fmt, G, I, H, gate codes, scales, mins, up codes, scales, mins, down ...]
void slot_expert(const int64_t* r, QW& g, QW& u, QW& d) {
  const int fmt = (int)r[0];
  const int64_t G = r[1], I = r[2], H = r[3];
  auto w = [&](int64_t N, int64_t K, const int64_t* p) {
    return QW{fmt, G, N, K, (const uint8_t*)p[0], (const uint16_t*)p[1], (const uint16_t*)p[2]};
  };
  g = w(I, H, r + 4);
  u = w(I, H, r + 7);
  d = w(H, I, r + 10);
}

// a routed expert's activation and its biases (rows `e` of the layer's bias tensors)
void expert_act(const ExpertAct& a, int64_t e, ExpertJob& j) {
  j.act = (int)a.act;
  j.alpha = (float)a.alpha;
  j.limit = (float)a.limit;
  auto row = [&](const at::Tensor& b, int64_t n) -> const float* {
    if (!b.defined() || b.numel() == 0) return nullptr;
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.dim() == 2 && b.size(1) == n &&
                e < b.size(0), "expert biases must be float32 [E, ", n, "] covering expert ", e);
    return b.data_ptr<float>() + e * n;
  };
  j.bg = row(a.gb, j.g.N);
  j.bu = row(a.ub, j.u.N);
  j.bd = row(a.db, j.d.N);
}

}  // namespace

Linear make_linear(int64_t fmt, int64_t G, int64_t N, int64_t K, at::Tensor codes, at::Tensor scales,
                   at::Tensor mins, at::Tensor bias) {
  Linear l{make_qw(fmt, G, N, K, codes, scales, mins), codes, scales, mins, bias};
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == N &&
                                    bias.is_contiguous()), "bias must be float32 [N]");
  return l;
}

at::Tensor attn_block(const Attn& a, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<int64_t>& positions, const at::Tensor& storage, int64_t layer,
                      const at::Tensor& tables, const std::vector<int64_t>& qlens,
                      const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a) {
  at::Tensor h = at::empty({x.size(0), x.size(1)}, at::kFloat);
  attn_block_out(a, x, cos, sin, positions, storage, layer, tables, qlens, ctxs, dmt, i8a, h);
  return h;
}

void attn_block_out(const Attn& a, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<int64_t>& positions, const at::Tensor& storage, int64_t layer,
                    const at::Tensor& tables, const std::vector<int64_t>& qlens,
                    const std::vector<int64_t>& ctxs, int64_t dmt, bool i8a, at::Tensor h) {
  const int64_t T = x.size(0), H = x.size(1), nh = a.nh, nkv = a.nkv, d = a.d;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.numel() == T * H, "h must be float32 [T, H]");
  TORCH_CHECK(storage.dim() == 6 && storage.size(4) == nkv && storage.size(5) == d && storage.is_contiguous(),
              "KV storage must be [L, 2, NB, BS, Nkv, D]");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.size(0) == (int64_t)qlens.size(),
              "tables must be int32 [S, max blocks]");
  const int64_t rd = a.rotary_dim > 0 ? a.rotary_dim : d, qw = a.gated ? 2 * nh * d : nh * d;
  TORCH_CHECK(rd <= d && rd % 2 == 0 && a.q.w.N == qw, "rotary dims or q_proj width do not fit the heads");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == rd && cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "cos/sin tables must be float32 [positions, rotary dims]");
  TORCH_CHECK((int64_t)positions.size() == T, "one position per token");
  TORCH_CHECK(!a.sinks.defined() || a.sinks.numel() == 0 || (a.sinks.scalar_type() == at::kFloat &&
              a.sinks.is_contiguous() && a.sinks.numel() == nh), "sinks must be float32 [Nh]");
  const float* sinks = opt_ptr(a.sinks);
  for (int64_t p : positions) TORCH_CHECK(p >= 0 && p < cos.size(0), "position ", p, " beyond the rotary table");
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t mb = tables.size(1), nb = storage.size(2), bs = storage.size(3), row = nkv * d;
  const int64_t esz = storage.element_size(), plane = nb * bs * row * esz;
  char* kbase = (char*)storage.data_ptr() + (layer * 2) * plane;
  const auto st = storage.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "KV storage dtype");
  pybind11::gil_scoped_release no_gil;
  PhaseClock clk;
  std::vector<float> hn(T * H), q(T * qw), gate(a.gated ? T * nh * d : 0), k(T * row), v(T * row), o(T * nh * d), y(T * H);
  const float eps = (float)a.eps;
  for (int64_t t = 0; t < T; t++) rmsnorm(xp + t * H, a.ln1.data_ptr<float>(), H, eps, hn.data() + t * H);
  std::vector<LinearJob> qkv{{a.q.w, hn.data(), T, q.data()}, {a.k.w, hn.data(), T, k.data()},
                             {a.v.w, hn.data(), T, v.data()}};
  linears(qkv, dmt, i8a);  // one parallel region for the three
  clk.mark(PH_NORM_QKV);
  add_bias(q.data(), a.q.bias, T, a.q.w.N);
  add_bias(k.data(), a.k.bias, T, a.k.w.N);
  add_bias(v.data(), a.v.bias, T, a.v.w.N);
  if (a.gated)  // q_proj rows are [q_h | gate_h] per head: q compacted in place, the gates aside
    for (int64_t i = 0; i < T * nh; i++) {
      std::copy(q.data() + (2 * i + 1) * d, q.data() + (2 * i + 2) * d, gate.data() + i * d);
      std::memmove(q.data() + i * d, q.data() + 2 * i * d, d * sizeof(float));
    }
  const float *qn = opt_ptr(a.qn), *kn = opt_ptr(a.kn);
  for (int64_t t = 0; t < T; t++) {
    if (qn) for (int64_t i = 0; i < nh; i++) rmsnorm(q.data() + (t * nh + i) * d, qn, d, eps, q.data() + (t * nh + i) * d);
    if (kn) for (int64_t i = 0; i < nkv; i++) rmsnorm(k.data() + (t * nkv + i) * d, kn, d, eps, k.data() + (t * nkv + i) * d);
    const int64_t p = positions[t];
    rope(q.data() + t * nh * d, nh, d, rd, cp + p * rd, sp + p * rd);
    rope(k.data() + t * row, nkv, d, rd, cp + p * rd, sp + p * rd);
  }
  clk.mark(PH_ROPE_KV);
  int64_t off = 0;
  for (size_t s = 0; s < qlens.size(); s++) {
    const int64_t n = qlens[s], ctx = ctxs[s];
    TORCH_CHECK((ctx + n + bs - 1) / bs <= mb, "block table too short for the context");
    KVView kv{kbase, kbase + plane, bs, row, tp + s * mb};
    const float *ks = k.data() + off * row, *vs = v.data() + off * row, *qs = q.data() + off * nh * d;
    float* os = o.data() + off * nh * d;
    if (st == at::kFloat) { write_kv<float>(kv, ks, vs, n, ctx); attend<float>(kv, qs, n, ctx, nh, nkv, d, os, sinks, a.window); }
    else if (st == at::kBFloat16) { write_kv<c10::BFloat16>(kv, ks, vs, n, ctx); attend<c10::BFloat16>(kv, qs, n, ctx, nh, nkv, d, os, sinks, a.window); }
    else { write_kv<c10::Half>(kv, ks, vs, n, ctx); attend<c10::Half>(kv, qs, n, ctx, nh, nkv, d, os, sinks, a.window); }
    off += n;
  }
  TORCH_CHECK(off == T, "query lengths do not add up to the tokens");
  clk.mark(PH_ATTEND);
  for (size_t i = 0; i < gate.size(); i++) o[i] *= 1.0f / (1.0f + std::exp(-gate[i]));  // gated output
  apply(a.o, o.data(), T, y.data(), dmt, i8a);
  for (int64_t i = 0; i < T * H; i++) xp[i] += y[i];
  for (int64_t t = 0; t < T; t++) rmsnorm(xp + t * H, a.ln2.data_ptr<float>(), H, eps, hp + t * H);
  clk.mark(PH_O);
}

constexpr int64_t ROUTER_SHARE = 16;  // router rows per thread at least (a split pays for its hand-off)

std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> route(const at::Tensor& h, const at::Tensor& wr,
                                                               int64_t top_k, bool normalize,
                                                               const at::Tensor& bias) {
  at::Tensor ids = at::empty({h.size(0), top_k}, at::kLong), w = at::empty({h.size(0), top_k}, at::kFloat);
  std::vector<int64_t> uniq = route_out(h, wr, top_k, normalize, bias, ids, w);
  return {ids, w, uniq};
}

std::vector<int64_t> route_out(const at::Tensor& h, const at::Tensor& wr, int64_t top_k, bool normalize,
                               const at::Tensor& bias, at::Tensor ids, at::Tensor w) {
  PhaseClock clk;
  const int64_t T = h.size(0), H = h.size(1), E = wr.size(0);
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
              bias.numel() == E), "router bias must be float32 [E]");
  const float* bp = opt_ptr(bias);
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous(), "h must be contiguous float32");
  TORCH_CHECK(wr.scalar_type() == at::kFloat && wr.is_contiguous() && wr.size(1) == H, "router must be float32 [E, H]");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k out of range");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == T * top_k &&
              w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == T * top_k,
              "ids / weights must be int64 / float32 [T, top_k]");
  const float *hp = h.data_ptr<float>(), *wp = wr.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* op = w.data_ptr<float>();
  // the logits over the pool (each the same dot product wherever it runs): a decode step's router
  // (64 x 1024 float32, evicted by the weights streamed since) read by one thread was ~21 us a
  // layer on a 2-core EPYC, 0.25 ms of a token
  std::vector<float> logits(T * E);
  {
    pybind11::gil_scoped_release no_gil;
    parallel(T * E, 1, ROUTER_SHARE, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) logits[i] = dot(hp + (i / E) * H, wp + (i % E) * H, H) + (bp ? bp[i % E] : 0.f);
    });
  }
  std::vector<float> p(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; t++) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < E; e++) mx = std::max(mx, p[e] = logits[t * E + e]);
    for (int64_t e = 0; e < E; e++) sum += (p[e] = std::exp(p[e] - mx));
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float ks = 0.f;
    for (int64_t k = 0; k < top_k; k++) ks += p[order[k]];
    for (int64_t k = 0; k < top_k; k++) {
      ip[t * top_k + k] = order[k];
      op[t * top_k + k] = normalize ? p[order[k]] / ks : p[order[k]];
    }
  }
  std::vector<int64_t> uniq(ip, ip + T * top_k);  // the routed experts, ascending
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
  clk.mark(PH_ROUTE);
  return uniq;
}

namespace {

// One routed expert of a step's layer that has a slot and tokens: its tokens (rows of h, in
// order), their routing weights, its gathered input rows and its output rows [n, H] (ys: a
// tensor for expert_outputs or a precomputed one; else the buffer own, no dispatcher call).
struct Routed {
  int64_t u;  // its index in the experts given
  std::vector<int64_t> tok;
  std::vector<float> wt, own;
  at::Tensor ys;
  float* out() { return ys.defined() ? ys.data_ptr<float>() : own.data(); }
};

// The routed experts among `experts` (in the order given, ascending ids) that have a slot and
// tokens, with a job for each whose output is not given in `pre` (pre[u] [n_u, H] or empty),
// writing a new tensor (as_tensors) or a buffer; the jobs' pointers are set once the vectors
// stopped moving.
void gather(const at::Tensor& x, const at::Tensor& h, const at::Tensor& ids, const at::Tensor& w,
            const std::vector<int64_t>& experts, const std::vector<int64_t>& slots,
            const at::Tensor& slot_table, const ExpertAct* act, const std::vector<at::Tensor>& pre,
            bool as_tensors, std::vector<Routed>& routed, std::vector<ExpertJob>& jobs) {
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && h.is_contiguous() &&
              h.scalar_type() == at::kFloat && h.sizes() == x.sizes(), "x, h must be float32 [T, H]");
  const int64_t K = ids.numel() ? ids.size(1) : 0, U = (int64_t)experts.size();
  TORCH_CHECK(U == 0 || (ids.scalar_type() == at::kLong && w.scalar_type() == at::kFloat && ids.size(0) == T &&
                         ids.is_contiguous() && w.is_contiguous() && w.sizes() == ids.sizes()), "routing [T, K]");
  TORCH_CHECK((int64_t)slots.size() == U, "one slot per expert");
  TORCH_CHECK(pre.empty() || (int64_t)pre.size() == U, "one precomputed output (or none) per expert");
  const int64_t *ep = experts.data(), *sp = slots.data();
  bool any_slot = false;
  for (int64_t u = 0; u < U; u++) any_slot |= sp[u] >= 0;
  TORCH_CHECK(!any_slot || (slot_table.dim() == 2 && slot_table.size(1) == SLOT_ROW &&
                            slot_table.scalar_type() == at::kLong && slot_table.is_contiguous()),
              "slot table must be int64 [slots, ", SLOT_ROW, "]");
  const float* hp = h.data_ptr<float>();
  const int64_t* ip = U ? ids.data_ptr<int64_t>() : nullptr;
  const float* wp = U ? w.data_ptr<float>() : nullptr;
  const int64_t* rows = any_slot ? slot_table.data_ptr<int64_t>() : nullptr;
  const int64_t nslots = any_slot ? slot_table.size(0) : 0;
  std::vector<size_t> job_of;  // the routed entry each job computes
  routed.reserve(U);
  for (int64_t u = 0; u < U; u++) {  // experts in the order given (ascending ids), tokens in order
    if (sp[u] < 0) continue;  // computed elsewhere (e.g. on the CPU from the RAM tier)
    TORCH_CHECK(sp[u] < nslots, "slot out of range");
    const int64_t* r = rows + sp[u] * SLOT_ROW;
    TORCH_CHECK(r[3] == H, "slot ", sp[u], " holds an expert of hidden size ", r[3], ", not ", H);
    TORCH_CHECK(r[0] >= 0 && r[0] <= F_MXFP4, "slot ", sp[u], " holds format ", r[0], ", which the kernels do not decode");
    Routed e{u};
    for (int64_t i = 0; i < T * K; i++)
      if (ip[i] == ep[u]) { e.tok.push_back(i / K); e.wt.push_back(wp[i]); }
    const int64_t n = (int64_t)e.tok.size();
    if (n == 0) continue;
    if (!pre.empty() && pre[u].numel() > 0) {  // computed by an earlier call (expert_outputs)
      TORCH_CHECK(pre[u].scalar_type() == at::kFloat && pre[u].is_contiguous() && pre[u].dim() == 2 &&
                  pre[u].size(0) == n && pre[u].size(1) == H, "precomputed output of expert ", ep[u],
                  " must be float32 [", n, ", ", H, "]");
      e.ys = pre[u];
      routed.push_back(std::move(e));
      continue;
    }
    if (as_tensors)
      e.ys = at::empty({n, H}, at::kFloat);
    else
      e.own.resize(n * H);
    routed.push_back(std::move(e));
    job_of.push_back(routed.size() - 1);
    QW g, up, dn;
    slot_expert(r, g, up, dn);
    jobs.push_back(ExpertJob{g, up, dn, nullptr, n, nullptr});
    if (act != nullptr) expert_act(*act, ep[u], jobs.back());
  }
  for (size_t j = 0; j < jobs.size(); j++) {  // pointers once the vectors stopped moving
    jobs[j].x = hp;  // the expert's rows of h, read in place (quant.h: ExpertJob::rows)
    jobs[j].rows = routed[job_of[j]].tok.data();
    jobs[j].out = routed[job_of[j]].out();
  }
}

}  // namespace

std::vector<at::Tensor> expert_outputs(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& w,
                                       const std::vector<int64_t>& experts, const std::vector<int64_t>& slots,
                                       const at::Tensor& slot_table, int64_t dmt, bool i8a, const ExpertAct* act) {
  std::vector<Routed> routed;
  std::vector<ExpertJob> jobs;
  gather(h, h, ids, w, experts, slots, slot_table, act, {}, true, routed, jobs);
  {
    pybind11::gil_scoped_release no_gil;
    ms::experts(jobs, dmt, i8a);
  }
  // one entry per expert given: its output rows, empty for one without a slot or tokens
  std::vector<at::Tensor> out(experts.size(), at::empty({0, h.size(1)}, at::kFloat));
  for (const Routed& e : routed) out[e.u] = e.ys;
  return out;
}

void ffn_block(at::Tensor x, const at::Tensor& h, const at::Tensor& ids, const at::Tensor& w,
               const std::vector<int64_t>& experts, const std::vector<int64_t>& slots,
               const at::Tensor& slot_table, const FFN* dense, int64_t dmt, bool i8a,
               const ExpertAct* act, bool direct, const std::vector<at::Tensor>& pre) {
  // direct: each contribution is added straight into x, in expert order (a layer whose experts
  // come in several calls passes a zeroed sum of its own, so a token's contributions are added in
  // the same order however they are split); else into a zeroed sum then added to x, the same
  // order within one call. pre: outputs of some experts computed by expert_outputs (while the
  // others were loading), combined here in their place in the order, so the bits are those of
  // one call computing all of them (a job's rows do not depend on the other jobs of a call)
  PhaseClock clk;
  std::vector<Routed> routed;
  std::vector<ExpertJob> jobs;
  gather(x, h, ids, w, experts, slots, slot_table, act, pre, false, routed, jobs);
  clk.mark(PH_GATHER);
  const int64_t T = x.size(0), H = x.size(1);
  const float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  std::vector<float> local(direct ? 0 : T * H, 0.f), dense_y;
  float* acc = direct ? xp : local.data();
  if (dense != nullptr) {  // shared expert (optionally sigmoid-gated) or a dense SwiGLU MLP
    dense_y.resize(T * H);
    jobs.push_back(ExpertJob{dense->g.w, dense->u.w, dense->d.w, hp, T, dense_y.data()});
  }
  ms::experts(jobs, dmt, i8a);
  clk = PhaseClock{};
  for (Routed& e : routed) {
    const float* ys = e.out();
    for (size_t j = 0; j < e.tok.size(); j++) {
      float* a = acc + e.tok[j] * H;
      const float* y = ys + j * H;
      for (int64_t c = 0; c < H; c++) a[c] += y[c] * e.wt[j];
    }
  }
  if (dense != nullptr) {
    const float* gate = opt_ptr(dense->gate);
    for (int64_t t = 0; t < T; t++) {
      const float s = gate ? 1.0f / (1.0f + std::exp(-dot(hp + t * H, gate, H))) : 1.0f;
      for (int64_t c = 0; c < H; c++) acc[t * H + c] += gate ? s * dense_y[t * H + c] : dense_y[t * H + c];
    }
  }
  if (!direct)
    for (int64_t i = 0; i < T * H; i++) xp[i] += acc[i];
  clk.mark(PH_COMBINE);
}

at::Tensor head_block(const at::Tensor& x, const std::vector<int64_t>& rows, const at::Tensor& norm,
                      double eps, const Linear& head, int64_t dmt, bool i8a) {
  const int64_t H = x.size(1), R = (int64_t)rows.size();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && norm.numel() == H &&
              norm.scalar_type() == at::kFloat && head.w.K == H, "x [T, H], norm [H], head [V, H]");
  for (int64_t r : rows) TORCH_CHECK(r >= 0 && r < x.size(0), "row ", r, " out of range");
  at::Tensor out = at::empty({R, head.w.N}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  PhaseClock clk;
  std::vector<float> hn(R * H);
  for (int64_t i = 0; i < R; i++) rmsnorm(xp + rows[i] * H, norm.data_ptr<float>(), H, (float)eps, hn.data() + i * H);
  apply(head, hn.data(), R, op, dmt, i8a);
  clk.mark(PH_HEAD);
  return out;
}

}  // namespace ms
