/* The one thread-pool design of Shoal's native side: the BLAS shim (sgemm_shim.c) and the kernels
 * extension (kernels/pool.cpp) each start one (they live in different shared objects, and never
 * run at the same time in a runner: a product is either ours or BLAS's).
 *
 * One job at a time is cut into tasks that the caller and the workers claim one by one, so a
 * worker whose core is busy with something else costs nothing: the caller takes its tasks.
 * Workers spin briefly after each job (decode issues hundreds of jobs a token, microseconds
 * apart), `pause_spins` of them with a pause, then yielding the core, and after `spin_ns` sleep
 * on a condition variable until the next job, so an idle runner uses no CPU.
 *
 * `work` packs the job's generation (high 32 bits) with the next unclaimed task (low 32): a claim
 * is a compare-and-swap that also proves the job is still the current one; once every task is
 * done the caller closes the generation, so a worker late on its counter can never claim past the
 * end while the next job is being written. Hidden: each shared object keeps its own copy. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef void (*shoal_task)(void *ctx, int task);
typedef struct ShoalPool ShoalPool;

/* A pool of `threads` (the caller included; fewer if a thread cannot be created); NULL when out
 * of memory. Its workers are detached: they end with the process. */
__attribute__((visibility("hidden"))) ShoalPool *shoal_pool_start(int threads, int pause_spins, long spin_ns);
__attribute__((visibility("hidden"))) int shoal_pool_threads(const ShoalPool *pool);
/* Run fn(ctx, 0) .. fn(ctx, tasks - 1) on the pool and the calling thread; return when all are
 * done. `shoal_pool_run` waits its turn behind another caller's job; `shoal_pool_try_run` returns
 * 0 at once instead (the caller then runs the job alone), else 1 once it ran. */
__attribute__((visibility("hidden"))) void shoal_pool_run(ShoalPool *pool, int tasks, shoal_task fn, void *ctx);
__attribute__((visibility("hidden"))) int shoal_pool_try_run(ShoalPool *pool, int tasks, shoal_task fn, void *ctx);
/* In a child after fork(): the workers stayed behind in the parent, so run every job alone. */
__attribute__((visibility("hidden"))) void shoal_pool_after_fork(ShoalPool *pool);

#ifdef __cplusplus
}
#endif
