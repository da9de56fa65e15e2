// A small pool of worker threads for the kernels: one job at a time, cut into tasks that the
// caller and the workers claim one by one.
//
// A worker whose core is busy with something else costs nothing: the caller takes its tasks.
// Workers spin briefly after each job (decode issues a few hundred jobs a token, microseconds
// apart), then yield, then sleep on a condition variable until the next one, so an idle runner
// uses no CPU. The pool is separate from the BLAS shim's: the two never run at the same time in
// one runner (a product is either ours or BLAS's) and each sleeps when idle.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shoal {

class Pool {
 public:
  // The process-wide pool: SHOAL_KERNEL_THREADS threads (caller included), else
  // SHOAL_BLAS_THREADS, else every hardware thread.
  static Pool& instance();

  explicit Pool(int threads);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return threads_; }

  // Run fn(0) .. fn(tasks - 1) on the pool and the calling thread; returns when all are done.
  // Jobs from several callers at once are serialised.
  void run(int tasks, const std::function<void(int)>& fn);

 private:
  void worker();
  void claim(unsigned generation);

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex job_lock_;  // one job at a time
  std::mutex sleep_lock_;
  std::condition_variable wake_;
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
  // high 32 bits: the job's generation; low 32: the next unclaimed task
  std::atomic<unsigned long long> work_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace shoal
