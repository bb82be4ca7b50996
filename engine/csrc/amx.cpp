// int4 weights x int8 activations on AMX-INT8 tiles: prefill-sized calls (i8a.h has the sum).
//
// A tiles are 16 tokens' int8 activations (signed), B tiles a 16-row unit of the weight's codes
// (unsigned 0..15, in the tiles' 4-byte interleave, made once per unit), so one TDPBSUD per block
// of 32 weights gives the 16 x 16 exact int32 sums S_b (as vpdpbusd does in the VNNI kernel);
// four blocks run on four C tiles, stored per token. The float part then runs per token over its
// blocks with the 16 lane sums P[0..15] in registers, vectorized over the unit's 16 rows: the
// fma chain and the tree the VNNI kernel computes per (row, token), so the bits agree, and each
// token's 16 results are one store. On a 2-core Xeon a 512-token prefill of bench/vs_llama_cpp's
// model ran 1.10-1.16x the VNNI kernel (docs/quantization.md); per block the tile loads, the
// product and the 1 KiB store of sums are half the time (perf), the float part the rest.
#include "i8a.h"

#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace ms {
namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;
constexpr int64_t BLOCKS_PER_CHUNK = 32;  // a multiple of 16

bool probe_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
  // Linux hands tile state to a process that asks (5.16 on); every thread may then use it
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

std::atomic<bool> g_amx_on{true};

struct TileCfg {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: C (16 tokens x 16 weight rows, int32); 4-5: A (16 tokens x 32 q); 6-7: B (8 x 64)
__attribute__((target("amx-tile,amx-int8")))
void load_tiles() {
  TileCfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 4; i++) c.rows[i] = 16, c.colsb[i] = 64;
  for (int i = 4; i < 6; i++) c.rows[i] = 16, c.colsb[i] = 32;
  for (int i = 6; i < 8; i++) c.rows[i] = 8, c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

// S_b for blocks [0, B) of one token group (A: [16][K] q) and a unit's B tiles (Bw: [B][512]),
// into C[token][b][16 rows]
__attribute__((target("amx-tile,amx-int8")))
void tile_sums(const int8_t* A, int64_t K, const uint8_t* Bw, int64_t B, int32_t* C) {
  const int64_t ldc = B * 64;  // bytes between tokens of C
  int64_t b = 0;
  for (; b + 4 <= B; b += 4) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, A + b * 32, K);       _tile_loadd(6, Bw + b * 512, 64);        _tile_dpbsud(0, 4, 6);
    _tile_loadd(5, A + b * 32 + 32, K);  _tile_loadd(7, Bw + b * 512 + 512, 64);  _tile_dpbsud(1, 5, 7);
    _tile_loadd(4, A + b * 32 + 64, K);  _tile_loadd(6, Bw + b * 512 + 1024, 64); _tile_dpbsud(2, 4, 6);
    _tile_loadd(5, A + b * 32 + 96, K);  _tile_loadd(7, Bw + b * 512 + 1536, 64); _tile_dpbsud(3, 5, 7);
    _tile_stored(0, C + b * 16, ldc);      _tile_stored(1, C + b * 16 + 16, ldc);
    _tile_stored(2, C + b * 16 + 32, ldc); _tile_stored(3, C + b * 16 + 48, ldc);
  }
  for (; b < B; b++) {
    _tile_zero(0);
    _tile_loadd(4, A + b * 32, K);
    _tile_loadd(6, Bw + b * 512, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_stored(0, C + b * 16, ldc);
  }
}

// The B tiles of rows [n0, n0 + nr) (nr <= 16; missing rows 0): per block, tile row q holds the
// 4 codes 4q..4q+3 of each of the 16 rows. A block's 16 code bytes give codes 0..15 as low
// nibbles and 16..31 as high ones, so rows q < 4 come from the low nibbles, 4..7 from the high.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
void weight_tiles(const QW& w, int64_t n0, int64_t nr, uint8_t* Bw) {
  const int64_t K = w.K, B = K / 32;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512i idx[4];  // dword q of each 128-bit lane (row) of two sources: 8 rows
  for (int q = 0; q < 4; q++)
    idx[q] = _mm512_setr_epi32(q, 4 + q, 8 + q, 12 + q, 16 + q, 20 + q, 24 + q, 28 + q, q, q, q, q, q, q, q, q);
  for (int64_t b = 0; b < B; b++) {
    __m512i Z[4];  // rows 4k..4k+3 of the block, one per 128-bit lane
    for (int k = 0; k < 4; k++) {
      Z[k] = _mm512_setzero_si512();
      for (int l = 0; l < 4 && 4 * k + l < nr; l++)
        Z[k] = _mm512_mask_loadu_epi32(Z[k], (__mmask16)(0xF << (4 * l)),
                                       (const int32_t*)(w.codes + (n0 + 4 * k + l) * (K / 2) + b * 16) - 4 * l);
    }
    for (int h = 0; h < 2; h++) {
      __m512i L[4];
      for (int k = 0; k < 4; k++)
        L[k] = h == 0 ? _mm512_and_si512(Z[k], m4) : _mm512_and_si512(_mm512_srli_epi16(Z[k], 4), m4);
      for (int q = 0; q < 4; q++) {
        const __m512i x01 = _mm512_permutex2var_epi32(L[0], idx[q], L[1]);
        const __m512i x23 = _mm512_permutex2var_epi32(L[2], idx[q], L[3]);
        _mm512_storeu_si512(Bw + b * 512 + (4 * h + q) * 64, _mm512_inserti64x4(x01, _mm512_castsi512_si256(x23), 1));
      }
    }
  }
}

// P = fma(float(S_b), scale * dx_b, P) for 16 rows: c their S_b, s their group's scales
__attribute__((target("avx512f"), always_inline)) inline void fma_block(__m512& P, const int32_t* c, const float* s,
                                                                        float dx) {
  P = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c)), _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_set1_ps(dx)), P);
}

__attribute__((target("amx-tile")))
void release_tiles() { _tile_release(); }

}  // namespace

bool amx_usable() {
  static const bool ok = probe_amx();
  return ok;
}

bool set_amx(bool on) { return g_amx_on.exchange(on); }

bool amx_on() { return amx_usable() && g_amx_on.load(std::memory_order_relaxed); }

void amx_acts(const QAct* const* acts, int64_t T, int64_t K, int64_t G, AmxActs& o) {
  const int64_t B = K / 32;
  o.T = T, o.TG = (T + 15) / 16, o.K = K, o.NG = K / G;
  o.img.assign(o.TG * 16 * K, 0);
  o.dx.resize(T * B);
  o.xg.resize(T * o.NG);
  for (int64_t t = 0; t < T; t++) {
    const QAct& a = *acts[t];
    int8_t* dst = o.img.data() + t * K;
    for (int64_t b = 0; b < B; b++) {  // the block's low half, then its high half (QAct: + 64)
      const int8_t* src = a.q.data() + (b / 4) * 128 + (b % 4) * 16;
      std::memcpy(dst + b * 32, src, 16);
      std::memcpy(dst + b * 32 + 16, src + 64, 16);
    }
    std::memcpy(o.dx.data() + t * B, a.db.data(), B * sizeof(float));
    std::memcpy(o.xg.data() + t * o.NG, a.xg.data(), o.NG * sizeof(float));
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,amx-tile,amx-int8")))
void rows_int4_amx(const QW& w, int64_t n0, int64_t ne, const AmxActs& x, float* out, int64_t ldo) {
  const int64_t K = w.K, B = K / 32, NG = K / w.G, nr = ne - n0;
  const int sh = __builtin_ctzll(w.G / 32);  // block -> group
  static thread_local std::vector<uint8_t> Bw;
  static thread_local std::vector<int32_t> C;
  static thread_local std::vector<float> sc, mn;
  Bw.resize(B * 512);
  C.resize(16 * std::min(B, BLOCKS_PER_CHUNK) * 16);
  sc.assign(NG * 16, 0.f), mn.assign(NG * 16, 0.f);  // [group][row]: 16 rows' scales as a vector
  weight_tiles(w, n0, nr, Bw.data());
  for (int64_t r = 0; r < nr; r++)
    for (int64_t g = 0; g < NG; g++) {
      sc[g * 16 + r] = _cvtsh_ss(w.scales[(n0 + r) * NG + g]);
      mn[g * 16 + r] = _cvtsh_ss(w.mins[(n0 + r) * NG + g]);
    }
  const __mmask16 rows = (__mmask16)((1u << nr) - 1);
  // blocks in chunks of 32 (K 1,024): a chunk's C, A and B tiles stay in L1 (at K 2,048 unchunked
  // this kernel ran 0.7x the VNNI one); the lane sums of a token carry over to the next chunk in
  // Ps. A chunk starts at a multiple of 16 blocks, so lane b % 16 is the same whatever the chunking.
  static thread_local std::vector<float> Ps;
  if (B > BLOCKS_PER_CHUNK) Ps.resize(16 * 16 * 16);
  load_tiles();  // each call: other code on this thread (oneDNN) may have set its own tiles
  for (int64_t tg = 0; tg < x.TG; tg++) {
    const int64_t nt = std::min<int64_t>(16, x.T - tg * 16);
    for (int64_t b0 = 0; b0 < B; b0 += BLOCKS_PER_CHUNK) {
      const int64_t b1 = std::min(B, b0 + BLOCKS_PER_CHUNK), nb = b1 - b0;
      const bool first = b0 == 0, last = b1 == B;
      tile_sums(x.img.data() + tg * 16 * K + b0 * 32, K, Bw.data() + b0 * 512, nb, C.data());
      for (int64_t tl = 0; tl < nt; tl++) {
        const int64_t t = tg * 16 + tl;
        const float* dx = x.dx.data() + t * B;
        const int32_t* c = C.data() + tl * nb * 16 - b0 * 16;  // c + b * 16: block b's 16 rows
        float* ps = Ps.data() + tl * 256;
        __m512 P[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) P[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(ps + i * 16);
        int64_t b = b0;
        for (; b + 16 <= b1; b += 16) {
#pragma GCC unroll 16
          for (int i = 0; i < 16; i++) fma_block(P[i], c + (b + i) * 16, sc.data() + ((b + i) >> sh) * 16, dx[b + i]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
          if (b + i < b1) fma_block(P[i], c + (b + i) * 16, sc.data() + ((b + i) >> sh) * 16, dx[b + i]);
        if (!last) {
#pragma GCC unroll 16
          for (int i = 0; i < 16; i++) _mm512_storeu_ps(ps + i * 16, P[i]);
          continue;
        }
        const float* xg = x.xg.data() + t * NG;
        for (int64_t g = 0; g < NG; g += 16) {
#pragma GCC unroll 16
          for (int i = 0; i < 16; i++)
            if (g + i < NG) P[i] = _mm512_fmadd_ps(_mm512_loadu_ps(mn.data() + (g + i) * 16), _mm512_set1_ps(xg[g + i]), P[i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) P[i] = _mm512_add_ps(P[i], P[i + 8]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) P[i] = _mm512_add_ps(P[i], P[i + 4]);
        _mm512_mask_storeu_ps(out + t * ldo + n0, rows, _mm512_add_ps(_mm512_add_ps(P[0], P[2]), _mm512_add_ps(P[1], P[3])));
      }
    }
  }
  release_tiles();
}

}  // namespace ms
