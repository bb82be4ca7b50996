// The step's persistent worker pool: splits one piece of work (rows of a weight, heads of an
// attention) over the cores, instead of a fork/join of threads per op.
//
// parallel(n_items, f) runs f(begin, end) on contiguous chunks of [0, n_items) taken by the
// caller and the workers, and returns when all are done. Every item is computed by the same code
// whichever thread runs it, so results do not depend on the split (batch invariance holds).
// Workers spin ~2 ms after a job (the next op of a decode step comes within microseconds, the next
// step within a millisecond), then sleep on a futex.
#pragma once
#include <cstdint>
#include <functional>

namespace ms {

// Set the number of threads (caller included) the pool uses; 1 = run everything on the caller.
void set_threads(int n);
int num_threads();
// f(begin, end) over [0, n) in chunks of multiples of `align` items; `min_share`: fewer threads
// when a thread's share would be below this many items.
void parallel(int64_t n, int64_t align, int64_t min_share, const std::function<void(int64_t, int64_t)>& f);
// The pool's self-check: `jobs` back-to-back parallel() calls over `n` items each, every item
// counted where it ran; returns how many items were not run exactly `jobs` times (0 when sound).
// Tiny jobs, one after another, are where a worker could still reach a finished job.
int64_t parallel_selfcheck(int64_t jobs, int64_t n);

}  // namespace ms
