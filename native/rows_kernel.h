/* Dot-product kernels for skinny products Y = alpha * X @ W.T + beta * Y, X with 1 to SKINNY_MAX
 * rows (decode: one row per sequence in the batch), W row-major N x K (an nn.Linear weight).
 *
 * Included by sgemm_shim.c once per instruction set, with KNAME(x) (a name prefix), KTARGET (a GCC
 * target string) and KLANES (floats per vector) defined. Written with GCC vector extensions so that
 * one source gives AVX-512 and AVX2 code.
 *
 * Each weight row is streamed from memory once and used for every row of X from registers. The
 * rows of X come interleaved (XI: for each KLANES-wide column block, the M rows' vectors one after
 * the other), so a step reads M * KLANES consecutive floats: X's own rows sit 4 KB apart for the
 * usual K (a multiple of 1024), which maps them all to one L1 set and ran 4x slower.
 *
 * Every output element is summed in the same order whatever M (one vector accumulator over K, its
 * lanes as a tree, then the scalar tail), so a sequence decodes to the same bits alone or batched.
 */

typedef float KNAME(vec) __attribute__((vector_size(KLANES * 4), aligned(4)));

static inline __attribute__((always_inline, target(KTARGET))) KNAME(vec) KNAME(load)(const float *p) {
    return *(const KNAME(vec) *)p;
}

typedef float KNAME(half) __attribute__((vector_size(32)));
typedef float KNAME(quarter) __attribute__((vector_size(16)));

/* Horizontal sum as a tree (halves, then quarters): a chain of 16 scalar adds per output cost as
 * much as the dot product itself for small K or several rows of X. */
static inline __attribute__((always_inline, target(KTARGET))) float KNAME(sum)(KNAME(vec) v) {
#if KLANES == 16
    KNAME(half) h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    KNAME(half) h = v;
#endif
    KNAME(quarter) q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Rows [n0, n1) of W against the M rows of X, one weight row at a time: one stream from memory,
 * the fastest when the work per weight is small (M <= 2). */
static inline __attribute__((always_inline, target(KTARGET))) void
KNAME(stream)(const float *W, long ldw, const float *XI, const float *X, long ldx, float *Y, long ldy,
             int n0, int n1, int K, float alpha, float beta, const int M) {
    for (int n = n0; n < n1; n++) {
        const float *w = W + (long)n * ldw;
        KNAME(vec) acc[SKINNY_MAX]; /* a fixed size, not [M]: a VLA would live on the stack */
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            acc[m] = (KNAME(vec)){0};
        int k = 0;
        for (const float *xi = XI; k + KLANES <= K; k += KLANES, xi += M * KLANES) {
            KNAME(vec) wk = KNAME(load)(w + k);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                acc[m] += wk * KNAME(load)(xi + m * KLANES);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const float *x = X + (long)m * ldx;
            float dot = KNAME(sum)(acc[m]);
            for (int kk = k; kk < K; kk++)
                dot += w[kk] * x[kk];
            float *y = Y + (long)m * ldy + n, scaled = alpha * dot;
            *y = beta == 0.0f ? scaled : __builtin_fmaf(beta, *y, scaled); /* one rounding, any M */
        }
    }
}

/* Rows [n, n + R) of W against the M rows of X, M >= 3. From M = 3 on the arithmetic no longer
 * hides behind the memory stream of one row at a time, so R rows share every load of X and the next
 * tile's rows are prefetched: loads from memory then overlap the FMAs (measured, 1 thread: M = 4
 * ~10.5 -> ~14.5 GB/s, M = 8 ~7 -> ~10.5). Each output keeps its own accumulator and order. */
static inline __attribute__((always_inline, target(KTARGET))) void
KNAME(tile)(const float *W, long ldw, const float *XI, const float *X, long ldx, float *Y, long ldy, int n,
            int K, float alpha, float beta, const int M, const int R) {
    KNAME(vec) acc[4][SKINNY_MAX]; /* fixed sizes, not [R][M]: a VLA would live on the stack */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            acc[r][m] = (KNAME(vec)){0};
    int k = 0;
    for (const float *xi = XI; k + KLANES <= K; k += KLANES, xi += M * KLANES) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *w = W + (long)(n + r) * ldw + k;
            __builtin_prefetch(w + R * ldw);
            KNAME(vec) wk = KNAME(load)(w);
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                acc[r][m] += wk * KNAME(load)(xi + m * KLANES);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const float *w = W + (long)(n + r) * ldw;
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const float *x = X + (long)m * ldx;
            float dot = KNAME(sum)(acc[r][m]);
            for (int kk = k; kk < K; kk++)
                dot += w[kk] * x[kk];
            float *y = Y + (long)m * ldy + n + r, scaled = alpha * dot;
            *y = beta == 0.0f ? scaled : __builtin_fmaf(beta, *y, scaled); /* one rounding, any M */
        }
    }
}

/* Rows [n0, n1): M <= 2 streams, larger M in tiles of R rows (R * M accumulators, M vectors of X
 * and one of W fit the registers: 32 with AVX-512, 16 with AVX2), the rest one by one. */
static inline __attribute__((always_inline, target(KTARGET))) void
KNAME(block)(const float *W, long ldw, const float *XI, const float *X, long ldx, float *Y, long ldy,
             int n0, int n1, int K, float alpha, float beta, const int M) {
#if KLANES == 16
    const int R = M <= 6 ? 4 : M == 7 ? 3 : 2;
#else
    const int R = M >= 5 ? 1 : M == 3 ? 3 : 2;
#endif
    if (M <= 2) {
        KNAME(stream)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, M);
        return;
    }
    int n = n0;
    for (; n + R <= n1; n += R)
        KNAME(tile)(W, ldw, XI, X, ldx, Y, ldy, n, K, alpha, beta, M, R);
    for (; n < n1; n++)
        KNAME(tile)(W, ldw, XI, X, ldx, Y, ldy, n, K, alpha, beta, M, 1);
}

/* Y[:M, n0:n1] = alpha * X[:M] @ W[n0:n1].T + beta * Y, 1 <= M <= SKINNY_MAX; XI is X interleaved
 * (X itself when M == 1). Each case has M known at compile time: accumulators stay in registers. */
__attribute__((target(KTARGET))) static void KNAME(rows)(const float *W, long ldw, const float *XI,
                                                         const float *X, long ldx, float *Y, long ldy,
                                                         int M, int n0, int n1, int K, float alpha,
                                                         float beta) {
    switch (M) {
    case 1: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 1); break;
    case 2: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 2); break;
    case 3: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 3); break;
    case 4: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 4); break;
    case 5: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 5); break;
    case 6: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 6); break;
    case 7: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 7); break;
    default: KNAME(block)(W, ldw, XI, X, ldx, Y, ldy, n0, n1, K, alpha, beta, 8); break;
    }
}
