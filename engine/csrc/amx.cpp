// int4 weights x int8 activations on AMX-INT8 tiles: prefill-sized calls (i8a.h has the sum).
//
// A 16-row unit of the weight is unpacked once into 16 x K code bytes (the A tiles); the tokens'
// activations come as B tiles (AmxActs, made once per input). Per block of 32 weights one
// TDPBUSD gives the 16 x 16 exact int32 sums S_b (codes are unsigned, activations signed, as in
// the VNNI kernel's vpdpbusd); four blocks run on four C tiles, stored row-major per weight row.
// The float part then runs per weight row over its blocks with the 16 lane sums P[0..15] in
// registers, vectorized over the 16 tokens: the same fma chain, and the same tree, as the VNNI
// kernel computes per token, so the bits agree. On a 2-core Sapphire Rapids-class Xeon one
// thread ran ~1.2-1.35x the VNNI kernel at 32-128 tokens (K 512-1024): the float part, one
// fma per block per (row, token), not the tiles, is the larger share.
#include "i8a.h"

#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace ms {
namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;

bool probe_amx() {
  const char* off = std::getenv("MOESTREAM_NO_AMX");
  if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) return false;
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

// tiles 0-3: C (16 weight rows x 16 tokens, int32); 4-5: A (16 rows x 32 codes); 6-7: B (8 x 64)
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

// S_b for blocks [0, B) of 16 weight rows (A: [16][K] codes) and one token group's B tiles,
// into C[row][b][16 tokens]
__attribute__((target("amx-tile,amx-int8")))
void tile_sums(const uint8_t* A, int64_t K, const int8_t* im, int64_t B, int32_t* C) {
  const int64_t ldc = B * 64;  // bytes between weight rows of C
  int64_t b = 0;
  for (; b + 4 <= B; b += 4) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, A + b * 32, K);       _tile_loadd(6, im + b * 512, 64);        _tile_dpbusd(0, 4, 6);
    _tile_loadd(5, A + b * 32 + 32, K);  _tile_loadd(7, im + b * 512 + 512, 64);  _tile_dpbusd(1, 5, 7);
    _tile_loadd(4, A + b * 32 + 64, K);  _tile_loadd(6, im + b * 512 + 1024, 64); _tile_dpbusd(2, 4, 6);
    _tile_loadd(5, A + b * 32 + 96, K);  _tile_loadd(7, im + b * 512 + 1536, 64); _tile_dpbusd(3, 5, 7);
    _tile_stored(0, C + b * 16, ldc);      _tile_stored(1, C + b * 16 + 16, ldc);
    _tile_stored(2, C + b * 16 + 32, ldc); _tile_stored(3, C + b * 16 + 48, ldc);
  }
  for (; b < B; b++) {
    _tile_zero(0);
    _tile_loadd(4, A + b * 32, K);
    _tile_loadd(6, im + b * 512, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_stored(0, C + b * 16, ldc);
  }
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
  o.T = T, o.TG = (T + 15) / 16, o.B = K / 32, o.NG = K / G;
  o.img.assign(o.TG * o.B * 512, 0);
  o.dx.assign(o.TG * o.B * 16, 0.f);
  o.xg.assign(o.TG * o.NG * 16, 0.f);
  for (int64_t t = 0; t < T; t++) {
    const QAct& a = *acts[t];
    const int64_t tg = t / 16, tl = t % 16;
    for (int64_t b = 0; b < o.B; b++) {
      const int8_t* src = a.q.data() + (b / 4) * 128 + (b % 4) * 16;  // the block's low half; + 64: high
      int8_t* dst = o.img.data() + (tg * o.B + b) * 512 + tl * 4;
      for (int r = 0; r < 8; r++) std::memcpy(dst + r * 64, src + (r < 4 ? r * 4 : 64 + (r - 4) * 4), 4);
      o.dx[(tg * o.B + b) * 16 + tl] = a.db[b];
    }
    for (int64_t g = 0; g < o.NG; g++) o.xg[(tg * o.NG + g) * 16 + tl] = a.xg[g];
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,amx-tile,amx-int8")))
void rows_int4_amx(const QW& w, int64_t n0, int64_t ne, const AmxActs& x, float* out, int64_t ldo) {
  const int64_t K = w.K, B = K / 32, NG = K / w.G, nr = ne - n0;
  const int sh = __builtin_ctzll(w.G / 32);  // block -> group
  static thread_local std::vector<uint8_t> A;
  static thread_local std::vector<int32_t> C;
  static thread_local std::vector<float> sc, mn;
  A.assign(16 * K, 0);  // rows past ne stay 0: their sums are computed and not written
  C.resize(16 * B * 16);
  sc.resize(16 * NG), mn.resize(16 * NG);
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t r = 0; r < nr; r++) {
    const uint8_t* row = w.codes + (n0 + r) * (K / 2);
    for (int64_t b = 0; b < B; b++) {  // block b's 16 bytes -> codes 0..15 (low nibbles), 16..31
      const __m128i v = _mm_loadu_si128((const __m128i*)(row + b * 16));
      _mm_storeu_si128((__m128i*)(A.data() + r * K + b * 32), _mm_and_si128(v, m4));
      _mm_storeu_si128((__m128i*)(A.data() + r * K + b * 32 + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    }
    for (int64_t g = 0; g < NG; g++) {
      sc[r * NG + g] = _cvtsh_ss(w.scales[(n0 + r) * NG + g]);
      mn[r * NG + g] = _cvtsh_ss(w.mins[(n0 + r) * NG + g]);
    }
  }
  load_tiles();  // each call: other code on this thread (oneDNN) may have set its own tiles
  for (int64_t tg = 0; tg < x.TG; tg++) {
    tile_sums(A.data(), K, x.img.data() + tg * B * 512, B, C.data());
    const float* dx = x.dx.data() + tg * B * 16;
    const float* xg = x.xg.data() + tg * NG * 16;
    const int64_t nt = std::min<int64_t>(16, x.T - tg * 16);
    for (int64_t r = 0; r < nr; r++) {
      const float* s = sc.data() + r * NG;
      const float* m = mn.data() + r * NG;
      const int32_t* c = C.data() + r * B * 16;
      __m512 P[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; i++) P[i] = _mm512_setzero_ps();
      int64_t b = 0;
      for (; b + 16 <= B; b += 16) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
          P[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + (b + i) * 16)),
                                 _mm512_mul_ps(_mm512_set1_ps(s[(b + i) >> sh]), _mm512_loadu_ps(dx + (b + i) * 16)),
                                 P[i]);
      }
#pragma GCC unroll 16
      for (int i = 0; i < 16; i++)
        if (b + i < B)
          P[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + (b + i) * 16)),
                                 _mm512_mul_ps(_mm512_set1_ps(s[(b + i) >> sh]), _mm512_loadu_ps(dx + (b + i) * 16)),
                                 P[i]);
      for (int64_t g = 0; g < NG; g += 16) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
          if (g + i < NG) P[i] = _mm512_fmadd_ps(_mm512_set1_ps(m[g + i]), _mm512_loadu_ps(xg + (g + i) * 16), P[i]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++) P[i] = _mm512_add_ps(P[i], P[i + 8]);
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) P[i] = _mm512_add_ps(P[i], P[i + 4]);
      P[0] = _mm512_add_ps(_mm512_add_ps(P[0], P[2]), _mm512_add_ps(P[1], P[3]));
      alignas(64) float res[16];
      _mm512_store_ps(res, P[0]);
      for (int64_t t = 0; t < nt; t++) out[(tg * 16 + t) * ldo + n0 + r] = res[t];
    }
  }
  release_tiles();
}

}  // namespace ms
