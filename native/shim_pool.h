/* The BLAS shim's products on the pool (native/task_pool.h): included by sgemm_shim.c once, after
 * its settings (SPIN_NS, PAUSE_SPINS, CHUNKS_PER_THREAD), its OpenBLAS pointers and dot_rows, which
 * the chunks call. Static, as the rest of the shim: one translation unit, one small exported surface.
 *
 * One product is cut into chunks (rows of a matrix-vector product; column or row blocks of a matrix
 * product, each a single-threaded OpenBLAS sgemm) that the caller and the workers claim one by one.
 * (OpenBLAS's own threads split work statically and wait for each other: on a busy machine they
 * ran 3x slower than one thread, so OpenBLAS runs with one.) A product that finds the pool busy
 * (another thread of the process is in one) runs on its caller alone. */
#include "task_pool.h"

enum { ROWS, GEMM_COLUMNS, GEMM_ROWS };

struct product {
    int kind, chunk, chunks, extent; /* chunks of `chunk` rows/columns cover [0, extent) */
    int transA, transB, M, N, K, lda, ldb, ldc;
    const float *A, *B, *XI;
    float *C;
    float alpha, beta;
};
static ShoalPool *pool; /* NULL: one thread (SHOAL_BLAS_THREADS unset or 1, or out of memory) */

static void run_chunk(void *ctx, int index) {
    const struct product *job = ctx;
    int lo = index * job->chunk, hi = lo + job->chunk < job->extent ? lo + job->chunk : job->extent;
    int ta = job->transA != NoTrans, tb = job->transB != NoTrans;
    if (job->kind == ROWS) /* C[:, lo:hi] = A @ B[lo:hi, :].T */
        dot_rows(job->B, job->ldb, job->XI, job->A, job->lda, job->C, job->ldc, job->M, lo, hi, job->K,
                 job->alpha, job->beta);
    else if (job->kind == GEMM_COLUMNS) /* C[:, lo:hi] = op(A) @ op(B)[:, lo:hi] */
        real_sgemm(RowMajor, job->transA, job->transB, job->M, hi - lo, job->K, job->alpha, job->A,
                   job->lda, job->B + (tb ? (long)lo * job->ldb : lo), job->ldb, job->beta, job->C + lo,
                   job->ldc);
    else /* C[lo:hi, :] = op(A)[lo:hi, :] @ op(B) */
        real_sgemm(RowMajor, job->transA, job->transB, hi - lo, job->N, job->K, job->alpha,
                   job->A + (ta ? lo : (long)lo * job->lda), job->lda, job->B, job->ldb, job->beta,
                   job->C + (long)lo * job->ldc, job->ldc);
}

/* Run `job` (filled in but for its chunking) on the pool, cut into chunks of a multiple of `align`
 * (16 floats = one cache line of C) no smaller than `min_chunk`; 0 when the pool has one thread or
 * is busy (the caller then computes the product alone). */
static int run_parallel(struct product *job, int extent, int min_chunk) {
    int threads = pool != NULL ? shoal_pool_threads(pool) : 1;
    if (threads < 2)
        return 0;
    int align = 16, per = (extent + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD);
    per = per < min_chunk ? min_chunk : per;
    job->extent = extent, job->chunk = (per + align - 1) / align * align;
    job->chunks = (extent + job->chunk - 1) / job->chunk;
    return shoal_pool_try_run(pool, job->chunks, run_chunk, job);
}
