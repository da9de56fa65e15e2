/* The BLAS shim's thread pool: included by sgemm_shim.c once, after its settings (SPIN_NS, PAUSE_SPINS,
 * CHUNKS_PER_THREAD), its OpenBLAS pointers and dot_rows, which the chunks call. Static, as the rest
 * of the shim: the shim is one translation unit, one small exported surface. */

/* ---------------------------------------------------------------- a tiny thread pool ----------- */
/* One product at a time is cut into chunks (rows of a matrix-vector product; column or row blocks
 * of a matrix product, each a single-threaded OpenBLAS sgemm) that the caller and the workers
 * claim one by one. A worker that is not running (another process has its core) therefore costs
 * nothing: the caller takes its chunks. (OpenBLAS's own threads split work statically and wait for
 * each other: on a busy machine they ran 3x slower than one thread, so OpenBLAS runs with one.)
 * Workers spin a little after each product (decode issues hundreds a token, microseconds apart),
 * yield, and after SPIN_NS sleep on a condition variable until the next one.
 *
 * `work` packs the product's generation (high 32 bits) with the next unclaimed chunk (low 32): a
 * claim is a compare-and-swap that also proves the product is still the current one, so `job`
 * stays fixed while anyone works on it (the caller waits for every claimed chunk to be done). */

enum { ROWS, GEMM_COLUMNS, GEMM_ROWS };

static struct {
    int kind, chunk, chunks, extent; /* chunks of `chunk` rows/columns cover [0, extent) */
    int transA, transB, M, N, K, lda, ldb, ldc;
    const float *A, *B, *XI;
    float *C;
    float alpha, beta;
} job;
static int pool_threads = 1; /* including the caller */
static _Atomic unsigned long long work;
static _Atomic int chunks_done, sleepers;
static atomic_flag pool_busy = ATOMIC_FLAG_INIT;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;

static void run_chunk(int index) {
    int lo = index * job.chunk, hi = lo + job.chunk < job.extent ? lo + job.chunk : job.extent;
    int ta = job.transA != NoTrans, tb = job.transB != NoTrans;
    if (job.kind == ROWS) /* C[:, lo:hi] = A @ B[lo:hi, :].T */
        dot_rows(job.B, job.ldb, job.XI, job.A, job.lda, job.C, job.ldc, job.M, lo, hi, job.K, job.alpha,
                 job.beta);
    else if (job.kind == GEMM_COLUMNS) /* C[:, lo:hi] = op(A) @ op(B)[:, lo:hi] */
        real_sgemm(RowMajor, job.transA, job.transB, job.M, hi - lo, job.K, job.alpha, job.A, job.lda,
                   job.B + (tb ? (long)lo * job.ldb : lo), job.ldb, job.beta, job.C + lo, job.ldc);
    else /* C[lo:hi, :] = op(A)[lo:hi, :] @ op(B) */
        real_sgemm(RowMajor, job.transA, job.transB, hi - lo, job.N, job.K, job.alpha,
                   job.A + (ta ? lo : (long)lo * job.lda), job.lda, job.B, job.ldb, job.beta,
                   job.C + (long)lo * job.ldc, job.ldc);
}

/* Claim and run chunks of product `gen` until none is left or another product has begun. */
static void run_chunks(unsigned gen) {
    unsigned long long w = atomic_load(&work);
    while ((unsigned)(w >> 32) == gen && (int)(unsigned)w < job.chunks) {
        if (!atomic_compare_exchange_weak(&work, &w, w + 1))
            continue; /* w now holds the fresh value */
        run_chunk((int)(unsigned)w);
        atomic_fetch_add(&chunks_done, 1);
        w = atomic_load(&work);
    }
}

static long elapsed_ns(const struct timespec *since) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

static void *worker(void *arg) {
    (void)arg;
    unsigned seen = (unsigned)(atomic_load(&work) >> 32);
    for (;;) {
        struct timespec start;
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (int spins = 0; (unsigned)(atomic_load(&work) >> 32) == seen; spins++) {
            if (spins < PAUSE_SPINS)
                cpu_relax();
            else
                sched_yield(); /* still ready in microseconds, but a busy core's other work runs */
            if ((spins & 255) == 255 && elapsed_ns(&start) > SPIN_NS) {
                pthread_mutex_lock(&pool_lock);
                atomic_fetch_add(&sleepers, 1);
                while ((unsigned)(atomic_load(&work) >> 32) == seen)
                    pthread_cond_wait(&pool_wake, &pool_lock);
                atomic_fetch_sub(&sleepers, 1);
                pthread_mutex_unlock(&pool_lock);
            }
        }
        seen = (unsigned)(atomic_load(&work) >> 32);
        run_chunks(seen);
    }
    return NULL;
}

/* Run `job` (filled in but for its chunking) on the pool, cut into chunks of a multiple of `align`
 * (16 floats = one cache line of C) no smaller than `min_chunk`. */
static void run_parallel(int extent, int min_chunk) {
    int align = 16, per = (extent + pool_threads * CHUNKS_PER_THREAD - 1) / (pool_threads * CHUNKS_PER_THREAD);
    per = per < min_chunk ? min_chunk : per;
    job.extent = extent, job.chunk = (per + align - 1) / align * align;
    job.chunks = (extent + job.chunk - 1) / job.chunk;
    atomic_store(&chunks_done, 0);
    unsigned gen = (unsigned)(atomic_load(&work) >> 32) + 1;
    atomic_store(&work, (unsigned long long)gen << 32); /* seq_cst: a sleeper sees it or is seen */
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&pool_lock);
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_lock);
    }
    run_chunks(gen);
    for (int spins = 0; atomic_load(&chunks_done) < job.chunks; spins++) {
        if (spins < PAUSE_SPINS)
            cpu_relax();
        else
            sched_yield(); /* a worker holding a chunk was preempted: let it run */
    }
}

/* Take the pool, or return 0 when it has one thread or another thread of this process has it. */
static int take_pool(void) { return pool_threads > 1 && !atomic_flag_test_and_set(&pool_busy); }
static void release_pool(void) { atomic_flag_clear(&pool_busy); }
