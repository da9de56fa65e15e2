#include "pool.h"

#include <sched.h>

#include <chrono>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() { std::atomic_signal_fence(std::memory_order_seq_cst); }
#endif

namespace shoal {

namespace {
constexpr int kPauseSpins = 100;  // 1-15 us of pure spinning (a pause is 10-140 cycles) before yielding
constexpr unsigned kClosed = 0x7fffffffu;  // a task index above any job's
// Then sleep until the next job: longer than the gaps between a decode step's jobs, as a sleeping
// worker takes tens of microseconds to wake, and the caller meanwhile runs the job alone. Past
// the pause spins a worker yields its core, so the runner's Python work between steps still gets
// it. Measured 2026-12-04 (Xeon, 2 cores, SmolLM2 through the API, alternating builds): 30 us gave
// 136-141 tok/s, 300 us 138-143, 1 ms 138-148, 2 ms 140-160 (median 153), 10 ms 147-152; 1B Q4_0
// the same at 30 us and 2 ms (30-32). (An earlier host measured 2 ms ~4% slower than 30 us.)
constexpr auto kSpinTime = std::chrono::microseconds(2000);

int env_threads() {
  for (const char* name : {"SHOAL_KERNEL_THREADS", "SHOAL_BLAS_THREADS"}) {
    if (const char* value = std::getenv(name)) {
      int n = std::atoi(value);
      if (n > 0) return n < 64 ? n : 64;
    }
  }
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (n < 64 ? static_cast<int>(n) : 64);
}

unsigned generation_of(unsigned long long w) { return static_cast<unsigned>(w >> 32); }
int task_of(unsigned long long w) { return static_cast<int>(static_cast<unsigned>(w)); }
}  // namespace

Pool& Pool::instance() {
  static Pool pool(env_threads());
  return pool;
}

Pool::Pool(int threads) : threads_(threads < 1 ? 1 : threads) {
  for (int i = 1; i < threads_; i++) workers_.emplace_back([this] { worker(); });
}

Pool::~Pool() {
  stop_ = true;
  work_.fetch_add(1ull << 32);
  {
    std::lock_guard<std::mutex> lock(sleep_lock_);
    wake_.notify_all();
  }
  for (auto& t : workers_) t.join();
}

void Pool::claim(unsigned generation) {
  unsigned long long w = work_.load();
  while (generation_of(w) == generation && task_of(w) < tasks_) {
    if (!work_.compare_exchange_weak(w, w + 1)) continue;  // w holds the fresh value
    (*fn_)(task_of(w));
    done_.fetch_add(1);
    w = work_.load();
  }
}

void Pool::worker() {
  unsigned seen = generation_of(work_.load());
  while (!stop_) {
    auto start = std::chrono::steady_clock::now();
    for (int spins = 0; generation_of(work_.load()) == seen; spins++) {
      if (spins < kPauseSpins) {
        cpu_relax();
      } else {
        sched_yield();  // ready again in microseconds, but a busy core's other work runs
      }
      if ((spins & 255) == 255 && std::chrono::steady_clock::now() - start > kSpinTime) {
        std::unique_lock<std::mutex> lock(sleep_lock_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_of(work_.load()) != seen; });
        sleepers_.fetch_sub(1);
      }
    }
    seen = generation_of(work_.load());
    if (stop_) return;
    claim(seen);
  }
}

void Pool::run(int tasks, const std::function<void(int)>& fn) {
  if (tasks <= 0) return;
  if (threads_ == 1 || tasks == 1) {
    for (int i = 0; i < tasks; i++) fn(i);
    return;
  }
  std::lock_guard<std::mutex> job(job_lock_);
  fn_ = &fn;
  tasks_ = tasks;
  done_.store(0);
  unsigned generation = generation_of(work_.load()) + 1;
  work_.store(static_cast<unsigned long long>(generation) << 32);  // publishes fn_ and tasks_
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(sleep_lock_);
    wake_.notify_all();
  }
  claim(generation);
  // The last claimed tasks are usually microseconds away; if their thread lost its core, let
  // whatever else is runnable here (the Python thread building the next graph) have this one.
  for (int spins = 0; done_.load() < tasks; spins++) {
    if (spins < kPauseSpins) {
      cpu_relax();
    } else {
      sched_yield();
    }
  }
  // Closed: a worker still holding this generation's counter can never claim past the end
  // while the next job's fn_ and tasks_ are being written.
  work_.store((static_cast<unsigned long long>(generation) << 32) | kClosed);
}

}  // namespace shoal
