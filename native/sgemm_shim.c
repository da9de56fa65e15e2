/* Shoal's BLAS shim: MLX's float32 matmuls on fast code, in the runner process only.
 *
 * The mlx-cpu wheel links `cblas_sgemm` from a bundled reference (netlib) BLAS: ~2-3 GFLOP/s.
 * This library, put in the runner's LD_PRELOAD by node/runner/fastpath.py, exports the same
 * `cblas_sgemm` and `cblas_dgemm` (libmlx.so imports no other level-2/3 BLAS symbol: check with
 * `nm -D --undefined-only libmlx.so`) and sends them to better code:
 *
 * - Matrix-matrix products (prefill) go to the OpenBLAS inside the PyPI wheel scipy-openblas32,
 *   whose symbols carry a `scipy_` prefix so they never clash with anyone's: ~100 GFLOP/s a core.
 * - Decode's products are memory bound: x @ W.T with x of 1 to 8 rows (one per sequence in a
 *   batch) and W row-major (every nn.Linear) runs a dot-product kernel of our own
 *   (native/rows_kernel.h, AVX-512 or AVX2+FMA chosen at run time) that streams each weight row once
 *   at the core's full read bandwidth (~25 GB/s a core here; OpenBLAS's sgemv ~18, its sgemm for a
 *   few rows ~5). Other matrix-vector shapes go to OpenBLAS's sgemv.
 * - Both run on a small pool of SHOAL_BLAS_THREADS threads (below), OpenBLAS itself on one.
 *
 * OpenBLAS is opened on the first call, not at load, so a program that merely inherits LD_PRELOAD
 * (the g++ that `mx.compile` runs) never starts a thread. Its path is $SHOAL_OPENBLAS_LIB, else
 * the one baked in at build time (-DSHOAL_OPENBLAS_DEFAULT="..."). If it cannot be opened, the
 * shim says so once on stderr and forwards to the next `cblas_sgemm` in the process (the reference
 * BLAS MLX was linked with): slower, never wrong.
 *
 * Knobs (environment): SHOAL_BLAS_THREADS (pool size, default 1), SHOAL_SHIM_GEMV=0 (every product
 * to OpenBLAS sgemm as is), SHOAL_SHIM_KERNEL=avx2|openblas (force a matrix-vector kernel: tests).
 *
 * Build (native/CMakeLists.txt does): cc -O2 -shared -fPIC -o libshoal_blas_shim.so sgemm_shim.c
 *   task_pool.c -ldl -lpthread -DSHOAL_OPENBLAS_DEFAULT='"/path/to/libscipy_openblas.so"'
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && !defined(SHOAL_NO_SIMD)
#include <immintrin.h>
#define SHOAL_X86 1
#else /* elsewhere (e.g. aarch64) OpenBLAS's sgemv does the matrix-vector products */
#define SHOAL_X86 0
#endif

#ifndef SHOAL_OPENBLAS_DEFAULT
#define SHOAL_OPENBLAS_DEFAULT ""
#endif

/* CBLAS enum values (cblas.h); the enums are passed as ints. */
enum { RowMajor = 101, ColMajor = 102 };
enum { NoTrans = 111, Trans = 112 };

enum {
    MAX_THREADS = 64,
    PARALLEL_MIN_FLOATS = 64 * 1024, /* below 256 KB of weights one thread is faster than waking more */
    PARALLEL_MIN_MACS = 1 << 22,     /* ~50 us of sgemm on one core */
    SKINNY_MAX = 8,                  /* x @ W.T with up to this many rows of x runs dot_rows */
    SPIN_NS = 2000000,               /* workers spin this long for the next product, then sleep */
    PAUSE_SPINS = 2000,              /* ~20 us of pure spinning before yielding the core */
    CHUNKS_PER_THREAD = 4,           /* small enough that a preempted worker delays little */
};

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
typedef void (*dgemm_fn)(int, int, int, int, int, int, double, const double *, int, const double *,
                         int, double, double *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
/* Y[m, n] = alpha * dot(X[m, :K], W[n, :K]) + beta * Y[m, n] for m < M, n in [n0, n1), with XI
 * the rows of X interleaved by `lanes` floats (native/rows_kernel.h); beta == 0 never reads Y. */
typedef void (*rows_fn)(const float *W, long ldw, const float *XI, const float *X, long ldx, float *Y,
                        long ldy, int M, int n0, int n1, int K, float alpha, float beta);

static sgemm_fn real_sgemm;
static dgemm_fn real_dgemm;
static sgemv_fn real_sgemv; /* NULL when falling back: no matrix-vector shortcut then */
static rows_fn dot_rows;    /* NULL: OpenBLAS does x @ W.T too */
static int lanes;           /* floats per vector of dot_rows */
static int use_gemv = 1;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* ---------------------------------------------------------------- dot-product kernels ---------- */
#if SHOAL_X86
#define KNAME(x) avx512_##x
#define KTARGET "avx512f"
#define KLANES 16
#include "rows_kernel.h"
#undef KNAME
#undef KTARGET
#undef KLANES
#define KNAME(x) avx2_##x
#define KTARGET "avx2,fma"
#define KLANES 8
#include "rows_kernel.h"
#undef KNAME
#undef KTARGET
#undef KLANES
#endif

#include "shim_pool.h"

/* X interleaved for dot_rows: for each `lanes`-wide column block, the M rows' vectors in turn.
 * Thread-local, grown as needed; X itself when M == 1 (the same layout). */
static const float *interleave(const float *X, int ldx, int M, int K) {
    static __thread float *buffer;
    static __thread size_t capacity;
    if (M == 1)
        return X;
    size_t need = (size_t)M * K;
    if (need > capacity) {
        free(buffer);
        buffer = malloc(need * sizeof(float));
        capacity = buffer ? need : 0;
        if (buffer == NULL)
            return NULL;
    }
    int blocks = K / lanes;
    for (int b = 0; b < blocks; b++)
        for (int m = 0; m < M; m++)
            memcpy(buffer + ((size_t)b * M + m) * lanes, X + (size_t)m * ldx + (size_t)b * lanes,
                   lanes * sizeof(float));
    return buffer;
}

/* C[:M, :N] = alpha * A[:M, :K] @ B[:N, :K].T + beta * C, M <= SKINNY_MAX: x @ W.T, every nn.Linear
 * in decode (M = sequences in the batch). 0 if it could not (no memory): use OpenBLAS then. */
static int rows_product(const float *A, int lda, const float *B, int ldb, float *C, int ldc, int M, int N,
                        int K, float alpha, float beta) {
    const float *XI = interleave(A, lda, M, K);
    if (XI == NULL)
        return 0;
    struct product job = {.kind = ROWS, .A = A, .lda = lda, .XI = XI, .B = B, .ldb = ldb, .C = C,
                          .ldc = ldc, .M = M, .N = N, .K = K, .alpha = alpha, .beta = beta};
    if ((long)N * K < PARALLEL_MIN_FLOATS || N < 64 || !run_parallel(&job, N, 16))
        dot_rows(B, ldb, XI, A, lda, C, ldc, M, 0, N, K, alpha, beta);
    return 1;
}

/* Row-major sgemm on the pool: split the longer of M and N into blocks. */
static void gemm_product(int transA, int transB, int M, int N, int K, float alpha, const float *A,
                         int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    struct product job = {.kind = N >= M ? GEMM_COLUMNS : GEMM_ROWS, .transA = transA, .transB = transB,
                          .M = M, .N = N, .K = K, .A = A, .lda = lda, .B = B, .ldb = ldb, .C = C,
                          .ldc = ldc, .alpha = alpha, .beta = beta};
    /* OpenBLAS packs A (or B) again for every block, hence the larger minimum. */
    if ((double)M * N * K < PARALLEL_MIN_MACS || (M < 64 && N < 64) || !run_parallel(&job, N >= M ? N : M, 64))
        real_sgemm(RowMajor, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static void single_threaded_after_fork(void) { /* the workers stayed behind */
    if (pool != NULL)
        shoal_pool_after_fork(pool);
}

static void start_pool(void) {
    const char *env = getenv("SHOAL_BLAS_THREADS");
    int threads = env && env[0] ? atoi(env) : 1;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    pthread_atfork(NULL, NULL, single_threaded_after_fork);
    if (threads > 1)
        pool = shoal_pool_start(threads, PAUSE_SPINS, SPIN_NS);
}

/* ---------------------------------------------------------------- setup and fallback ----------- */

void cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                 float *, int);

struct fallback_search {
    const char *name;
    void *self;
    void *found;
};

/* dl_iterate_phdr callback: the first loaded object other than this one that exports `name`. */
static int find_other(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct fallback_search *search = data;
    if (info->dlpi_name == NULL || info->dlpi_name[0] == '\0')
        return 0;
    void *handle = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == NULL)
        return 0;
    void *sym = dlsym(handle, search->name);
    dlclose(handle);
    if (sym != NULL && sym != search->self) {
        search->found = sym;
        return 1;
    }
    return 0;
}

static void *fallback(const char *name, void *self) {
    struct fallback_search search = {name, self, NULL};
    dl_iterate_phdr(find_other, &search);
    return search.found;
}

typedef void (*set_threads_fn)(int);

static void init(void) {
    const char *gemv = getenv("SHOAL_SHIM_GEMV");
    use_gemv = !(gemv != NULL && strcmp(gemv, "0") == 0);
    const char *path = getenv("SHOAL_OPENBLAS_LIB");
    if (path == NULL || path[0] == '\0')
        path = SHOAL_OPENBLAS_DEFAULT;
    void *lib = path[0] ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    set_threads_fn set_threads = NULL;
    if (lib != NULL) {
        real_sgemm = (sgemm_fn)dlsym(lib, "scipy_cblas_sgemm");
        real_dgemm = (dgemm_fn)dlsym(lib, "scipy_cblas_dgemm");
        real_sgemv = (sgemv_fn)dlsym(lib, "scipy_cblas_sgemv");
        set_threads = (set_threads_fn)dlsym(lib, "scipy_openblas_set_num_threads");
    }
    if (real_sgemm == NULL || real_dgemm == NULL || real_sgemv == NULL || set_threads == NULL) {
        fprintf(stderr, "shoal blas shim: cannot use OpenBLAS at '%s' (%s); using the default BLAS\n",
                path, lib == NULL ? dlerror() : "missing symbols");
        real_sgemm = (sgemm_fn)fallback("cblas_sgemm", (void *)cblas_sgemm);
        real_dgemm = (dgemm_fn)fallback("cblas_dgemm", (void *)cblas_sgemm);
        real_sgemv = NULL;
        if (real_sgemm == NULL || real_dgemm == NULL) {
            fprintf(stderr, "shoal blas shim: no other cblas_sgemm in this process; aborting\n");
            abort();
        }
        return;
    }
    set_threads(1); /* the pool splits the work; OpenBLAS's own threads would fight it */
    const char *kernel = getenv("SHOAL_SHIM_KERNEL");
    kernel = kernel ? kernel : "";
#if SHOAL_X86
    __builtin_cpu_init();
    if (strcmp(kernel, "openblas") == 0)
        dot_rows = NULL;
    else if (strcmp(kernel, "avx2") != 0 && __builtin_cpu_supports("avx512f"))
        dot_rows = avx512_rows, lanes = 16;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        dot_rows = avx2_rows, lanes = 8;
#else
    (void)kernel;
#endif
    start_pool();
}

/* ---------------------------------------------------------------- the exported symbols --------- */

/* y = alpha * op(A) x + beta * y through OpenBLAS sgemv; beta == 0 means "y is not read" (BLAS),
 * and MLX hands over uninitialized memory, so zero it first (0 * NaN is NaN). */
static void gemv(int trans, int rows, int cols, float alpha, const float *A, int lda, const float *x,
                 int incx, float beta, float *y, int incy, int leny) {
    if (beta == 0.0f)
        for (int i = 0; i < leny; i++)
            y[(long)i * incy] = 0.0f;
    real_sgemv(RowMajor, trans, rows, cols, alpha, A, lda, x, incx, beta, y, incy);
}

void cblas_sgemm(int order, int transA, int transB, int M, int N, int K, float alpha, const float *A,
                 int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    pthread_once(&once, init);
    if (real_sgemv == NULL || M <= 0 || N <= 0 || K <= 0) { /* fallback BLAS, or nothing to split */
        real_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    if (order == ColMajor) { /* C^T = op(B)^T op(A)^T, row-major */
        const float *T = A;
        A = B, B = T;
        int t = transA;
        transA = transB, transB = t;
        t = lda, lda = ldb, ldb = t;
        t = M, M = N, N = t;
    }
    int ta = transA != NoTrans, tb = transB != NoTrans;
    if (!use_gemv)
        gemm_product(transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    else if (!ta && tb && M <= SKINNY_MAX && dot_rows != NULL && /* x @ W.T: nn.Linear in decode */
             rows_product(A, lda, B, ldb, C, ldc, M, N, K, alpha, beta))
        return;
    else if (N == 1 && !ta && ldc == 1 && (tb || ldb == 1) && dot_rows != NULL) /* W @ x */
        rows_product(B, K, A, lda, C, 1, 1, M, K, alpha, beta);
    else if (M == 1) { /* row vector: c = a op(B), a is K long with stride (ta ? lda : 1) */
        if (tb) /* B stored N x K */
            gemv(NoTrans, N, K, alpha, B, ldb, A, ta ? lda : 1, beta, C, 1, N);
        else /* B stored K x N */
            gemv(Trans, K, N, alpha, B, ldb, A, ta ? lda : 1, beta, C, 1, N);
    } else if (N == 1) { /* column vector: c = op(A) b, b is K long with stride (tb ? 1 : ldb) */
        if (ta) /* A stored K x M */
            gemv(Trans, K, M, alpha, A, lda, B, tb ? 1 : ldb, beta, C, ldc, M);
        else /* A stored M x K */
            gemv(NoTrans, M, K, alpha, A, lda, B, tb ? 1 : ldb, beta, C, ldc, M);
    } else
        gemm_product(transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void cblas_dgemm(int order, int transA, int transB, int M, int N, int K, double alpha, const double *A,
                 int lda, const double *B, int ldb, double beta, double *C, int ldc) {
    pthread_once(&once, init);
    real_dgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
