/* The thread pool of native/task_pool.h. */
#define _GNU_SOURCE
#include "task_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

enum { CLOSED = 0x7fffffff }; /* a task index above any job's */

struct ShoalPool {
    int threads, pause_spins;
    long spin_ns;
    shoal_task fn;
    void *ctx;
    int tasks;
    _Atomic unsigned long long work;
    _Atomic int done, sleepers;
    atomic_flag busy;
    pthread_mutex_t job_lock, sleep_lock;
    pthread_cond_t wake;
};

static unsigned generation_of(unsigned long long w) { return (unsigned)(w >> 32); }
static int task_of(unsigned long long w) { return (int)(unsigned)w; }

static long elapsed_ns(const struct timespec *since) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

/* Claim and run tasks of job `generation` until none is left or another job has begun. */
static void claim(ShoalPool *pool, unsigned generation) {
    unsigned long long w = atomic_load(&pool->work);
    while (generation_of(w) == generation && task_of(w) < pool->tasks) {
        if (!atomic_compare_exchange_weak(&pool->work, &w, w + 1))
            continue; /* w now holds the fresh value */
        pool->fn(pool->ctx, task_of(w));
        atomic_fetch_add(&pool->done, 1);
        w = atomic_load(&pool->work);
    }
}

static void *worker(void *arg) {
    ShoalPool *pool = arg;
    unsigned seen = generation_of(atomic_load(&pool->work));
    for (;;) {
        struct timespec start;
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (int spins = 0; generation_of(atomic_load(&pool->work)) == seen; spins++) {
            if (spins < pool->pause_spins)
                cpu_relax();
            else
                sched_yield(); /* ready again in microseconds, but a busy core's other work runs */
            if ((spins & 255) == 255 && elapsed_ns(&start) > pool->spin_ns) {
                pthread_mutex_lock(&pool->sleep_lock);
                atomic_fetch_add(&pool->sleepers, 1);
                while (generation_of(atomic_load(&pool->work)) == seen)
                    pthread_cond_wait(&pool->wake, &pool->sleep_lock);
                atomic_fetch_sub(&pool->sleepers, 1);
                pthread_mutex_unlock(&pool->sleep_lock);
            }
        }
        seen = generation_of(atomic_load(&pool->work));
        claim(pool, seen);
    }
    return NULL;
}

ShoalPool *shoal_pool_start(int threads, int pause_spins, long spin_ns) {
    ShoalPool *pool = calloc(1, sizeof *pool);
    if (pool == NULL)
        return NULL;
    pool->threads = 1, pool->pause_spins = pause_spins, pool->spin_ns = spin_ns;
    atomic_flag_clear(&pool->busy);
    pthread_mutex_init(&pool->job_lock, NULL);
    pthread_mutex_init(&pool->sleep_lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    for (int i = 1; i < threads; i++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, worker, pool);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        pool->threads = i + 1;
    }
    return pool;
}

int shoal_pool_threads(const ShoalPool *pool) { return pool->threads; }

void shoal_pool_after_fork(ShoalPool *pool) { pool->threads = 1; }

/* The job, once this caller holds the pool. */
static void run_held(ShoalPool *pool, int tasks, shoal_task fn, void *ctx) {
    pool->fn = fn, pool->ctx = ctx, pool->tasks = tasks;
    atomic_store(&pool->done, 0);
    unsigned generation = generation_of(atomic_load(&pool->work)) + 1;
    atomic_store(&pool->work, (unsigned long long)generation << 32); /* seq_cst: publishes the job */
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->sleep_lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->sleep_lock);
    }
    claim(pool, generation);
    /* The last claimed tasks are usually microseconds away; if their thread lost its core, let
     * whatever else is runnable here have this one. */
    for (int spins = 0; atomic_load(&pool->done) < tasks; spins++) {
        if (spins < pool->pause_spins)
            cpu_relax();
        else
            sched_yield();
    }
    atomic_store(&pool->work, ((unsigned long long)generation << 32) | CLOSED);
}

static void run_alone(int tasks, shoal_task fn, void *ctx) {
    for (int i = 0; i < tasks; i++)
        fn(ctx, i);
}

void shoal_pool_run(ShoalPool *pool, int tasks, shoal_task fn, void *ctx) {
    if (tasks <= 0)
        return;
    if (pool->threads == 1 || tasks == 1) {
        run_alone(tasks, fn, ctx);
        return;
    }
    pthread_mutex_lock(&pool->job_lock);
    while (atomic_flag_test_and_set(&pool->busy))
        sched_yield(); /* a try_run holds it: microseconds */
    run_held(pool, tasks, fn, ctx);
    atomic_flag_clear(&pool->busy);
    pthread_mutex_unlock(&pool->job_lock);
}

int shoal_pool_try_run(ShoalPool *pool, int tasks, shoal_task fn, void *ctx) {
    if (pool->threads == 1 || atomic_flag_test_and_set(&pool->busy))
        return 0;
    if (tasks > 0)
        run_held(pool, tasks, fn, ctx);
    atomic_flag_clear(&pool->busy);
    return 1;
}
