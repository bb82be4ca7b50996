// See pool.h.
//
// A job is split into more chunks than threads (CHUNKS_PER_THREAD each) that the caller and the
// workers take from one atomic counter, so a worker the OS has not scheduled yet (a busy or
// oversubscribed machine) costs nothing: the others take its chunks. The job lives on the
// caller's stack; workers reach it through `current` only while counted in `inside`, and the
// caller returns only after clearing `current` and seeing `inside` at zero (a sequentially
// consistent handshake: see run()).
#include "pool.h"

#include <immintrin.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace ms {

namespace {

// polls before an idle worker sleeps: ~1.8 ms here (a poll, _mm_pause and a load, ~27 ns on the
// 2-core EPYC dev machine). 1 << 14 (~0.45 ms) let workers fall asleep once or more per decoded
// token of the 1.3B test store (Python between steps), and waking them cost 8% of decode.
constexpr int SPIN = 1 << 16;
constexpr int64_t CHUNKS_PER_THREAD = 4;

struct Job {
  const std::function<void(int64_t, int64_t)>* f;
  int64_t n, align, units, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void take_chunks() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_acq_rel)) < chunks;) {
      const int64_t b = std::min(n, units * c / chunks * align), e = std::min(n, units * (c + 1) / chunks * align);
      if (b < e) (*f)(b, e);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

thread_local bool in_job = false;  // nested parallel() calls run on the calling thread

struct Pool {
  std::vector<std::thread> workers;
  std::atomic<uint32_t> gen{0};  // bumped per job; idle workers wait for a change
  std::atomic<Job*> current{nullptr};
  std::atomic<int> inside{0};     // workers that may be reading *current
  std::atomic<bool> stop{false};
  std::mutex busy;                // one job at a time; another caller runs serially
  int size = 1;

  // `seen` starts at the generation the worker was made in, not the one it first reads: a worker
  // the OS starts late must still see a stop (or a job) signalled before it ran, or resize()
  // would wait forever to join it.
  void work(uint32_t seen) {
    in_job = true;
    for (;;) {
      uint32_t g = gen.load(std::memory_order_acquire);
      for (int i = 0; g == seen && i < SPIN; i++) {
        _mm_pause();
        g = gen.load(std::memory_order_acquire);
      }
      if (g == seen) {
        gen.wait(seen, std::memory_order_acquire);
        continue;
      }
      seen = g;
      if (stop.load(std::memory_order_acquire)) return;
      // seq_cst pairs with run()'s clear-then-check (a store then a load on each side: with
      // release/acquire alone x86 may let both threads read the other's old value)
      inside.fetch_add(1, std::memory_order_seq_cst);
      if (Job* j = current.load(std::memory_order_seq_cst)) j->take_chunks();
      inside.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void resize(int n) {
    if (n == size) return;
    if (!workers.empty()) {
      stop.store(true, std::memory_order_release);
      gen.fetch_add(1, std::memory_order_acq_rel);
      gen.notify_all();
      for (auto& t : workers) t.join();
      workers.clear();
      stop.store(false, std::memory_order_release);
    }
    size = n;
    const uint32_t born = gen.load(std::memory_order_acquire);
    for (int i = 1; i < n; i++) workers.emplace_back([this, born] { work(born); });
  }

  void run(Job& job) {
    current.store(&job, std::memory_order_release);
    gen.fetch_add(1, std::memory_order_acq_rel);
    gen.notify_all();
    in_job = true;
    job.take_chunks();
    in_job = false;
    while (job.done.load(std::memory_order_acquire) < job.chunks) _mm_pause();
    // Dekker's handshake with work(): this thread clears `current` then reads `inside`, a worker
    // bumps `inside` then reads `current`. Both sequentially consistent, so either this thread
    // sees the worker inside and waits, or the worker sees no job. With a release store and an
    // acquire load (as before) the store could wait in this core's store buffer while the load
    // read 0, the worker read the finished job's address, and then worked on whatever this stack
    // held next (a later job half made, or other data: chunk counts and ranges from garbage).
    // Seen once, a decode at a 50% memory limit under O_DIRECT reads: the caller spinning in
    // this function and the worker spinning in its loop, for minutes, until killed.
    current.store(nullptr, std::memory_order_seq_cst);
    while (inside.load(std::memory_order_seq_cst) != 0) _mm_pause();
  }

  ~Pool() { resize(1); }
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

void set_threads(int n) {
  std::lock_guard<std::mutex> lock(pool().busy);
  pool().resize(n < 1 ? 1 : n);
}

int num_threads() { return pool().size; }

void parallel(int64_t n, int64_t align, int64_t min_share, const std::function<void(int64_t, int64_t)>& f) {
  Pool& p = pool();
  int t = in_job ? 1 : p.size;
  while (t > 1 && n / t < min_share) t--;
  std::unique_lock<std::mutex> lock(p.busy, std::defer_lock);
  if (t <= 1 || !lock.try_lock()) {
    f(0, n);
    return;
  }
  Job job;
  job.f = &f;
  job.n = n;
  job.align = align;
  job.units = (n + align - 1) / align;
  job.chunks = std::min<int64_t>(job.units, t * CHUNKS_PER_THREAD);
  p.run(job);
}

int64_t parallel_selfcheck(int64_t jobs, int64_t n) {
  std::vector<std::atomic<int64_t>> count(n);
  for (auto& c : count) c.store(0);
  const std::function<void(int64_t, int64_t)> f = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i++) count[i].fetch_add(1, std::memory_order_relaxed);
  };
  for (int64_t j = 0; j < jobs; j++) parallel(n, 1, 1, f);
  int64_t wrong = 0;
  for (auto& c : count) wrong += c.load() != jobs;
  return wrong;
}

}  // namespace ms
