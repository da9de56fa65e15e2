#include "pool.h"

#include <cstdlib>
#include <thread>

namespace shoal {

namespace {
constexpr int kPauseSpins = 100;  // 1-15 us of pure spinning (a pause is 10-140 cycles) before yielding
// Then sleep until the next job: longer than the gaps between a decode step's jobs, as a sleeping
// worker takes tens of microseconds to wake, and the caller meanwhile runs the job alone. Past
// the pause spins a worker yields its core, so the runner's Python work between steps still gets
// it. Measured 2026-12-04 (Xeon, 2 cores, SmolLM2 through the API, alternating builds): 30 us gave
// 136-141 tok/s, 300 us 138-143, 1 ms 138-148, 2 ms 140-160 (median 153), 10 ms 147-152; 1B Q4_0
// the same at 30 us and 2 ms (30-32). (An earlier host measured 2 ms ~4% slower than 30 us.)
constexpr long kSpinNs = 2'000'000;

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

void call(void* fn, int task) { (*static_cast<const std::function<void(int)>*>(fn))(task); }
}  // namespace

Pool& Pool::instance() {
  static Pool pool(env_threads());
  return pool;
}

Pool::Pool(int threads) : pool_(threads > 1 ? shoal_pool_start(threads, kPauseSpins, kSpinNs) : nullptr) {}

void Pool::run(int tasks, const std::function<void(int)>& fn) {
  if (pool_ == nullptr) {
    for (int i = 0; i < tasks; i++) fn(i);
    return;
  }
  shoal_pool_run(pool_, tasks, call, const_cast<std::function<void(int)>*>(&fn));
}

}  // namespace shoal
