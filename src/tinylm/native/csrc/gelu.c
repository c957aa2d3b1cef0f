/* GELU (tanh approximation) for training: the backward with the forward recomputed in
 * the same pass, and the FFN's bias add + GELU. torch's CPU gelu(approximate="tanh") is
 * slow next to a plain tanh; these stream at close to memory speed. */
#include "tinylm.h"

/* dL/dx = grad · GELU'(x) for one row of n floats, in place in grad; y (if not NULL)
 * receives GELU(x) from the same tanh, and colsum (if not NULL) accumulates dL/dx. */
static inline void gelu_backward_row(const float *x, float *grad, float *y, float *colsum,
                                     long n) {
    long i = 0;
    for (; i + VL <= n; i += VL) {
        vf v = loadv(x + i), t = vtanh_inner(v), right = 1.0f + t;
        vf d = 0.5f * right
              + 0.5f * v * (1.0f - t * t) * (GELU_C * (1.0f + 3.0f * GELU_K * v * v));
        vf gx = loadv(grad + i) * d;
        if (y) storev(y + i, 0.5f * v * right);
        storev(grad + i, gx);
        if (colsum) storev(colsum + i, loadv(colsum + i) + gx);
    }
    for (; i < n; i++) {
        float v = x[i], t = tanh_inner(v), right = 1.0f + t;
        float d = 0.5f * right
                + 0.5f * v * (1.0f - t * t) * (GELU_C * (1.0f + 3.0f * GELU_K * v * v));
        if (y) y[i] = 0.5f * v * right;
        grad[i] *= d;
        if (colsum) colsum[i] += grad[i];
    }
}

/* grad (M, N) holds dL/dGELU(x) and is overwritten with dL/dx; y (if not NULL) receives
 * GELU(x), the recomputed forward; colsum (N floats, if not NULL) receives dL/dx summed
 * over the M rows -- the gradient of a bias added before the GELU -- so no separate
 * pass re-reads dL/dx for it. */
void tl_gelu_backward(const float *x, float *grad, float *y, float *colsum, long M, long N,
                      int threads) {
    if (threads < 1) threads = 1;
    int rows_n = threads;
    float *rows = colsum ? colsums_begin(rows_n, N, colsum) : NULL;
    if (colsum && !rows) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float *acc = colsum ? colsums_row(rows, id, N, colsum) : NULL;
        long lo = M * id / nt, hi = M * (id + 1) / nt;
        for (long m = lo; m < hi; m++)
            gelu_backward_row(x + m * N, grad + m * N, y ? y + m * N : NULL, acc, N);
    }
    if (colsum) colsums_finish(rows, rows_n, N, colsum);
}

/* The FFN's middle in one pass: h = a + b (in place; b broadcast over the M rows, may be
 * NULL) and g = GELU(h), for a (M, N). Replaces a broadcast copy of the bias, the GEMM's
 * accumulate into it, and a separate GELU pass. */
void tl_bias_gelu(float *a, const float *b, float *g, long M, long N, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        float *h = a + m * N, *y = g + m * N;
        long i = 0;
        for (; i + VL <= N; i += VL) {
            vf v = loadv(h + i);
            if (b) { v += loadv(b + i); storev(h + i, v); }
            storev(y + i, 0.5f * v * (1.0f + vtanh_inner(v)));
        }
        for (; i < N; i++) {
            float v = h[i] + (b ? b[i] : 0.0f);
            h[i] = v;
            y[i] = 0.5f * v * (1.0f + tanh_inner(v));
        }
    }
}
