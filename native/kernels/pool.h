// The kernels' thread pool: native/task_pool.h's (the design the BLAS shim uses too), started once
// per process, behind a C++ call that takes a lambda. See task_pool.h for how a job runs.
#pragma once

#include <functional>

#include "../task_pool.h"

namespace shoal {

class Pool {
 public:
  // The process-wide pool: SHOAL_KERNEL_THREADS threads (caller included), else
  // SHOAL_BLAS_THREADS, else every hardware thread.
  static Pool& instance();

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return pool_ != nullptr ? shoal_pool_threads(pool_) : 1; }

  // Run fn(0) .. fn(tasks - 1) on the pool and the calling thread; returns when all are done.
  // Jobs from several callers at once are serialised.
  void run(int tasks, const std::function<void(int)>& fn);

 private:
  explicit Pool(int threads);
  ShoalPool* pool_;  // nullptr: one thread, or out of memory
};

}  // namespace shoal
