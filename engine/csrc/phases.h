// Where a step's wall time goes, phase by phase, on the thread that calls the step (the pool's
// workers only help inside a phase): bench/vs_llama_cpp.py reads it
// through the module's phase_times(). Off unless set_phase_timing(true): a mark is then one
// relaxed load. For profiling one step at a time: the sums are plain globals.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>

namespace ms {

enum Phase : int {
  PH_NORM_QKV,   // attention: input norm, q/k/v projections
  PH_ROPE_KV,    // attention: q/k norm, RoPE, the KV cache write
  PH_ATTEND,     // attention: scores and values over the context
  PH_O,          // attention: o_proj, residual, post-attention norm
  PH_ROUTE,      // router: logits, softmax, top-k
  PH_GATHER,     // experts: each expert's rows and activations quantized
  PH_GATE_UP,    // experts: gate and up projections, SiLU
  PH_DOWN,       // experts: hidden activations quantized, down projections
  PH_COMBINE,    // experts: weighted sum and residual
  PH_HEAD,       // final norm and LM head
  PH_COUNT
};

inline constexpr const char* PHASE_NAMES[PH_COUNT] = {"norm_qkv", "rope_kv", "attend", "o_proj", "route",
                                                      "gather", "gate_up", "down", "combine", "head"};

extern std::atomic<bool> g_phase_timing;
extern double g_phase_seconds[PH_COUNT];

// Marks the end of a phase: the time since the clock's last mark (or its start) goes to it.
struct PhaseClock {
  using clock = std::chrono::steady_clock;
  bool on = g_phase_timing.load(std::memory_order_relaxed);
  clock::time_point last = on ? clock::now() : clock::time_point{};
  void mark(Phase p) {
    if (!on) return;
    const clock::time_point now = clock::now();
    g_phase_seconds[p] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

}  // namespace ms
