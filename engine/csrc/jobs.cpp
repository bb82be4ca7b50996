// How a step's linears and experts are split over the worker pool, with their activations
// quantized once per input: the same for every instruction set (the row kernels it calls are
// quant.cpp's for AVX-512, quant_avx2.cpp's for AVX2; i8a.h). q/k/v of an attention are one
// parallel region; a MoE layer's experts two (gate/up rows of all of them, then down rows).
#include "i8a.h"
#include "phases.h"
#include "pool.h"
#include "quant.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace ms {

std::atomic<bool> g_stream_nta{true};  // quant.h: stream_nta
bool stream_nta() { return g_stream_nta.load(std::memory_order_relaxed); }
bool set_stream_nta(bool on) { return g_stream_nta.exchange(on); }

namespace {

// Rows are quantized on the pool (each row's codes do not depend on which thread made them); one
// row, a decode step's, stays on the calling thread.
constexpr int64_t QUANT_ROWS_PER_THREAD = 8;

void quant_into(const float* x, int64_t T, int64_t K, std::vector<QAct16>& acts) {
  acts.resize(T);
  parallel(T, 1, QUANT_ROWS_PER_THREAD, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) quant_act16(x + t * K, K, acts[t]);
  });
}


// into per-thread buffers (slot 0: an input, 1: an expert's hidden activation), reused across
// calls: a decode step makes thousands of these for experts as small as 18 KB
void quant_into(const float* x, int64_t T, int64_t K, int64_t G, std::vector<QAct>& acts) {
  acts.resize(T);
  parallel(T, 1, QUANT_ROWS_PER_THREAD, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) quant_act(x + t * K, K, G, acts[t]);
  });
}

// integer activations: int4 weights (any K % 32 == 0: int8 codes), int8 weights with K % 64 == 0 (int16)
bool use_i8a(const QW& w, int64_t i8a) {
  return i8a && (w.fmt == F_INT4 || (w.fmt == F_INT8 && w.K % 64 == 0));
}



constexpr int64_t UNIT = 16;  // rows per work unit (the VNNI kernels' L1 block)

// Units of UNIT rows over every job's `rows(job)`, as prefix sums: job j owns [start[j], start[j+1]).
template <typename Job, typename R>
std::vector<int64_t> unit_starts(const std::vector<Job>& jobs, R rows) {
  std::vector<int64_t> start(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); j++) start[j + 1] = start[j] + (rows(jobs[j]) + UNIT - 1) / UNIT;
  return start;
}

// A job of at most this many tokens (one register tile in every build: decode) takes a chunk's
// rows of it in one call, each weight one stream: in units of UNIT rows an expert's gate and up
// took turns every 8 KB. The 1.3B store's decode, 16 rounds of 32 tokens alternating in one
// process (2-core Zen 4 EPYC, 2026-12-05): gate_up 2.09 -> 1.81 ms a token and the token 6.59 ->
// 6.33 ms, faster in 16 of 16 rounds. A larger job keeps UNIT rows per call: its rows then stay
// in L1 while every tile of tokens passes over them.
constexpr int64_t STREAM_MAX_T = 3;

// f(job, first row, end row) for units [b, e) of `start`: per unit, or per job's run of units
// inside [b, e) for a job of at most STREAM_MAX_T tokens. Rows are computed alike either way.
template <typename Job, typename R, typename F>
void for_units(const std::vector<int64_t>& start, int64_t b, int64_t e, const std::vector<Job>& jobs, R rows, F f) {
  size_t j = std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1;
  for (int64_t unit = b; unit < e;) {
    while (unit >= start[j + 1]) j++;
    const int64_t last = jobs[j].T <= STREAM_MAX_T ? std::min(e, start[j + 1]) : unit + 1;
    const int64_t rb = (unit - start[j]) * UNIT;
    f(j, rb, std::min((last - start[j]) * UNIT, rows(jobs[j])));
    unit = last;
  }
}

// a thread's share: at least ~32K weights, so a split pays for its hand-off; in units
int64_t min_units(int64_t weights, int64_t units) {
  return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, weights / std::max<int64_t>(1, units)));
}

// How a weight takes its input: float, int8 activations (int4 weights) or int16 ones (int8 weights).
enum Acts { FLOAT_ACTS, INT4_ACTS, INT16_ACTS };

Acts acts_for(const QW& w, bool i8a) {
  return !use_i8a(w, i8a) ? FLOAT_ACTS : w.fmt == F_INT8 ? INT16_ACTS : INT4_ACTS;
}

// One input (T rows of K) as the weights it meets need it: quantized once, read by every thread.
struct Input {
  Acts kind = FLOAT_ACTS;
  const float* x = nullptr;
  int64_t T = 0;
  std::vector<QAct> a4;
  std::vector<const QAct*> p4;  // each row's int8 activation: into a4, or a table shared by jobs
  std::vector<QAct16> a16;
  std::vector<float> picked;    // the float rows of a job with row indices
  bool tiles = false;           // set by tile()
  AmxActs amx;

  void set(Acts k, const float* xs, int64_t t, const QW& w) {
    kind = k, x = xs, T = t, tiles = false;
    if (k == INT16_ACTS) quant_into(x, T, w.K, a16);
    else if (k == INT4_ACTS) {
      quant_into(x, T, w.K, w.G, a4);
      p4.resize(T);
      for (int64_t i = 0; i < T; i++) p4[i] = &a4[i];
    }
  }
  // int8 activations of source rows rows[i] from a table of them (row r at table[r], quantized
  // as set() would)
  void shared_rows(const int64_t* rows, int64_t t, const std::vector<QAct>& table) {
    kind = INT4_ACTS, x = nullptr, T = t, tiles = false;
    p4.resize(T);
    for (int64_t i = 0; i < T; i++) p4[i] = &table[rows[i]];
  }
  // after set() or shared_rows(): int8 activations of AMX_MIN_ROWS rows or more as AMX tiles too
  void tile(const QW& w) {
    tiles = kind == INT4_ACTS && T >= AMX_MIN_ROWS && amx_on();
    if (tiles) amx_acts(p4.data(), T, w.K, w.G, amx);
  }
  // rows x[rows[i]] of a [*, K] source, copied, then as set()
  void set_rows(Acts k, const float* src, const int64_t* rows, int64_t t, const QW& w) {
    picked.resize(t * w.K);
    gather_rows(src, rows, t, w.K, picked.data());
    set(k, picked.data(), t, w);
  }
  // rows [rb, re) of out[T, w.N] = input @ w.T
  void rows(const QW& w, int64_t rb, int64_t re, float* out, int64_t direct_max_t) const {
    if (kind == INT16_ACTS) rows_i16a(w, rb, re, a16, out, w.N);
    else if (kind == INT4_ACTS && tiles)
      for (int64_t n = rb; n < re; n += 16) rows_int4_amx(w, n, std::min(n + 16, re), amx, out, w.N);
    else if (kind == INT4_ACTS) rows_i8a(w, rb, re, p4, out, w.N);
    else rows_float(w, rb, re, x, T, out, w.N, direct_max_t);
  }
};

// One expert's state in experts(): its input, its hidden activation, its gate/up buffers.
struct ExpertState {
  Input in, hid;
  std::vector<float> g, u;
};

// gate and up (same shape) take int8 activations together, sharing the quantized x
Acts input_kind(const ExpertJob& jb, bool i8a) {
  return acts_for(jb.g, i8a) == acts_for(jb.u, i8a) && jb.g.G == jb.u.G ? acts_for(jb.g, i8a) : FLOAT_ACTS;
}

// The int8 activations of the rows that jobs with row indices read: each row of their source
// quantized once (in parallel), however many experts it was routed to. One source and one (K, G)
// per call (a MoE layer's routed experts all read its hidden state at one format); a job on
// another source or format quantizes its own copy of its rows.
struct SharedActs {
  std::vector<QAct> table;
  std::vector<char> need;
  const float* src = nullptr;
  int64_t K = 0, G = 0;

  bool covers(const ExpertJob& jb, bool i8a) const {
    return jb.rows != nullptr && input_kind(jb, i8a) == INT4_ACTS && jb.x == src && jb.g.K == K && jb.g.G == G;
  }
  void quantize(const std::vector<ExpertJob>& jobs, bool i8a) {
    src = nullptr;
    for (const ExpertJob& jb : jobs)
      if (jb.rows != nullptr && input_kind(jb, i8a) == INT4_ACTS) {
        src = jb.x, K = jb.g.K, G = jb.g.G;
        break;
      }
    if (src == nullptr) return;
    int64_t n = 0;
    for (const ExpertJob& jb : jobs)
      if (covers(jb, i8a))
        for (int64_t i = 0; i < jb.T; i++) n = std::max(n, jb.rows[i] + 1);
    if ((int64_t)table.size() < n) table.resize(n);
    need.assign(n, 0);
    for (const ExpertJob& jb : jobs)
      if (covers(jb, i8a))
        for (int64_t i = 0; i < jb.T; i++) need[jb.rows[i]] = 1;
    parallel(n, 1, QUANT_ROWS_PER_THREAD, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; r++)
        if (need[r]) quant_act(src + r * K, K, G, table[r]);
    });
  }
};

int64_t out_rows(const LinearJob& j) { return j.w.N; }
int64_t inter_rows(const ExpertJob& j) { return j.g.N; }
int64_t hidden_rows(const ExpertJob& j) { return j.d.N; }

}  // namespace

// Buffers are thread-local and reused: a decode step makes thousands of these calls, for weights as
// small as 18 KB. Neither function calls itself or the other, so one set per thread suffices. The
// pool's workers reach the caller's set through a local reference (a thread_local named inside
// the lambda would be each worker's own, empty one).
void linears(std::vector<LinearJob>& jobs, int64_t direct_max_t, bool i8a) {
  const size_t J = jobs.size();
  static thread_local std::vector<Input> mine;
  std::vector<Input>& ins = mine;
  ins.resize(J);
  std::vector<size_t> src(J);  // which input each job reads: consecutive jobs on one x share it
  int64_t work = 0;
  for (size_t j = 0; j < J; j++) {
    const LinearJob& jb = jobs[j];
    const Acts kind = acts_for(jb.w, i8a);
    const bool same = j > 0 && jobs[j - 1].x == jb.x && jobs[j - 1].T == jb.T && ins[src[j - 1]].kind == kind &&
                      jobs[j - 1].w.K == jb.w.K && jobs[j - 1].w.G == jb.w.G;
    src[j] = same ? src[j - 1] : j;
    if (!same) {
      ins[j].set(kind, jb.x, jb.T, jb.w);
      ins[j].tile(jb.w);
    }
    work += jb.w.N * jb.w.K;
  }
  const std::vector<int64_t> start = unit_starts(jobs, out_rows);
  parallel(start[J], 1, min_units(work, start[J]), [&](int64_t b, int64_t e) {
    for_units(start, b, e, jobs, out_rows, [&](size_t j, int64_t rb, int64_t re) {
      ins[src[j]].rows(jobs[j].w, rb, re, jobs[j].out, direct_max_t);
    });
  });
}

// Rows of a call (all jobs together) up to which experts() reuses the thread's per-job buffers:
// decode-sized calls (a step's experts, a batch of decoding sequences) make thousands of calls.
// A larger call (a prefill's layer) gets buffers of its own, freed when it returns: reused by job
// index, each job's buffers would keep the largest share any layer ever gave that index, and
// their sum crept up layer by layer (~15 MiB over a 64-token prefill of the 8 GB bench model, a
// 128-expert layer; issue 27), where a call's own need is its rows x I.
constexpr int64_t REUSE_MAX_ROWS = 256;

void experts(std::vector<ExpertJob>& jobs, int64_t direct_max_t, bool i8a) {
  PhaseClock clk;
  const size_t J = jobs.size();
  int64_t call_rows = 0;
  for (const ExpertJob& jb : jobs) call_rows += jb.T;
  static thread_local std::vector<ExpertState> mine;
  std::vector<ExpertState> own;
  std::vector<ExpertState>& st = call_rows <= REUSE_MAX_ROWS ? mine : own;
  st.resize(J);
  static thread_local SharedActs shared_mine;
  SharedActs& shared = shared_mine;
  shared.quantize(jobs, i8a);
  int64_t work = 0;
  for (size_t j = 0; j < J; j++) {
    const ExpertJob& jb = jobs[j];
    const Acts kind = input_kind(jb, i8a);
    if (shared.covers(jb, i8a)) st[j].in.shared_rows(jb.rows, jb.T, shared.table);
    else if (jb.rows != nullptr) st[j].in.set_rows(kind, jb.x, jb.rows, jb.T, jb.g);
    else st[j].in.set(kind, jb.x, jb.T, jb.g);
    st[j].g.resize(jb.T * jb.g.N);
    st[j].u.resize(jb.T * jb.g.N);
    work += jb.g.N * jb.g.K;
  }
  if (call_rows >= AMX_MIN_ROWS)  // AMX tiles of the inputs with rows enough (none in a decode step)
    parallel((int64_t)J, 1, 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; j++) st[j].in.tile(jobs[j].g);
    });
  // gate and up rows (and silu on them) of every job
  const std::vector<int64_t> su = unit_starts(jobs, inter_rows);
  const int64_t share = min_units(work, su[J]);
  parallel(su[J], 1, share, [&](int64_t b, int64_t e) {
    for_units(su, b, e, jobs, inter_rows, [&](size_t j, int64_t rb, int64_t re) {
      const ExpertJob& jb = jobs[j];
      ExpertState& s = st[j];
      const int64_t I = jb.g.N;
      s.in.rows(jb.g, rb, re, s.g.data(), direct_max_t);
      s.in.rows(jb.u, rb, re, s.u.data(), direct_max_t);
      for (int64_t t = 0; t < jb.T; t++)
        expert_hidden_n(s.g.data() + t * I + rb, s.u.data() + t * I + rb, re - rb, jb.act, jb.alpha, jb.limit,
                        jb.bg ? jb.bg + rb : nullptr, jb.bu ? jb.bu + rb : nullptr);
    });
  });
  clk.mark(PH_GATE_UP);
  // the hidden activations, as the down projections take them: jobs on the pool when they have
  // rows enough to pay for it (a decode step's experts have one each: the calling thread)
  parallel((int64_t)J, 1, call_rows >= 2 * QUANT_ROWS_PER_THREAD ? 1 : (int64_t)J, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; j++) {
      st[j].hid.set(acts_for(jobs[j].d, i8a), st[j].g.data(), jobs[j].T, jobs[j].d);
      st[j].hid.tile(jobs[j].d);
    }
  });
  const std::vector<int64_t> sd = unit_starts(jobs, hidden_rows);
  parallel(sd[J], 1, share, [&](int64_t b, int64_t e) {
    for_units(sd, b, e, jobs, hidden_rows, [&](size_t j, int64_t rb, int64_t re) {
      const ExpertJob& jb = jobs[j];
      st[j].hid.rows(jb.d, rb, re, jb.out, direct_max_t);
      if (jb.bd)
        for (int64_t t = 0; t < jb.T; t++)
          for (int64_t r = rb; r < re; r++) jb.out[t * jb.d.N + r] += jb.bd[r];
    });
  });
  clk.mark(PH_DOWN);
}

void linear(const QW& w, const float* x, int64_t T, float* out, int64_t direct_max_t, bool i8a) {
  std::vector<LinearJob> one{{w, x, T, out}};
  linears(one, direct_max_t, i8a);
}

void expert(const QW& wg, const QW& wu, const QW& wd, const float* x, int64_t T, float* out,
            int64_t direct_max_t, bool i8a) {
  std::vector<ExpertJob> one{{wg, wu, wd, x, T, out}};
  experts(one, direct_max_t, i8a);
}


}  // namespace ms
