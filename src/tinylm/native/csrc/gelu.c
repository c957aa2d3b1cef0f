/* GELU (tanh approximation) for training: the backward with the forward recomputed in
 * the same pass, and the FFN's bias add + GELU. torch's CPU gelu(approximate="tanh") is
 * slow next to a plain tanh; these stream at close to memory speed. */
#include "tinylm.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* 1 / d: the CPU's reciprocal estimate refined by one Newton step (relative error
 * ~1e-7, a few ulp) where it has one for this vector width, else a division -- the
 * division was the slowest instruction of these compute-bound loops. */
static inline vf vrecip(vf d) {
#if VL == 16
    vf r = (vf)_mm512_rcp14_ps((__m512)d);
#elif VL == 8 && defined(__AVX__)
    vf r = (vf)_mm256_rcp_ps((__m256)d);
#else
    return 1.0f / d;
#endif
#if VL == 16 || (VL == 8 && defined(__AVX__))
    return r * (2.0f - d * r);
#endif
}

/* exp(-2u), u = sqrt(2/π)·(x + 0.044715·x³). As (1 + tanh u) / 2 = σ(2u) = 1 / (1 + e)
 * with e = exp(-2u), GELU_tanh(x) = x·σ(2u) and its derivative is σ + 2x·σ·(1 - σ)·u',
 * 1 - σ = e·σ (not a difference: exact where σ rounds to 1) -- one exp and one
 * reciprocal, fewer steps than through tanh. Past |2u| ~ 88 exp's clamp keeps σ at 0
 * or 1 as in float32. */
static inline vf vexp_m2u(vf x) {
    return vexp(x * (-2.0f * GELU_C + (-2.0f * GELU_C * GELU_K) * x * x));
}

/* dL/dx = grad · GELU'(x) for one row of n floats, in place in grad; y (if not NULL)
 * receives GELU(x) from the same σ(2u), and colsum (if not NULL) accumulates dL/dx. */
static inline void gelu_backward_row(const float *x, float *grad, float *y, float *colsum,
                                     long n) {
    long i = 0;
    for (; i + VL <= n; i += VL) {
        vf v = loadv(x + i), e = vexp_m2u(v), sg = vrecip(1.0f + e), vs = v * sg;
        vf d = sg + 2.0f * vs * (e * sg) * (GELU_C + (3.0f * GELU_C * GELU_K) * v * v);
        vf gx = loadv(grad + i) * d;
        if (y) storev(y + i, vs);
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
            storev(y + i, v * vrecip(1.0f + vexp_m2u(v)));
        }
        for (; i < N; i++) {
            float v = h[i] + (b ? b[i] : 0.0f);
            h[i] = v;
            y[i] = 0.5f * v * (1.0f + tanh_inner(v));
        }
    }
}
