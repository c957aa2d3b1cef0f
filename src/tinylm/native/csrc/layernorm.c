/* LayerNorm as F.layer_norm (biased variance, eps inside the square root; w and b may
 * be NULL): the forward keeps each row's mean and 1/std for the backward; both are
 * vectorised along the row and split over rows between threads. Decoding runs the
 * forward on its few rows with one thread.
 * dw and db are column sums over all rows: per-thread partial sums, added at the end
 * (kept interleaved per thread here: separate colsums_* rows ran slower). */

#include "tinylm.h"

static inline float hsum_row(const float *x, long E) {
    vf acc = {0};
    long i = 0;
    for (; i + VL <= E; i += VL) acc += loadv(x + i);
    float s = hsum(acc);
    for (; i < E; i++) s += x[i];
    return s;
}

void tl_ln_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
               float *rstd, long M, long E, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * E;
        float *ym = y + m * E;
        float mu = hsum_row(xm, E) / (float)E;
        vf acc = {0};
        long i = 0;
        for (; i + VL <= E; i += VL) { vf d = loadv(xm + i) - mu; acc += d * d; }
        float var = hsum(acc);
        for (; i < E; i++) { float d = xm[i] - mu; var += d * d; }
        float r = 1.0f / sqrtf(var / (float)E + eps);
        mean[m] = mu;
        rstd[m] = r;
        for (i = 0; i + VL <= E; i += VL) {
            vf v = (loadv(xm + i) - mu) * r;
            if (w) v *= loadv(w + i);
            if (b) v += loadv(b + i);
            storev(ym + i, v);
        }
        for (; i < E; i++)
            ym[i] = (xm[i] - mu) * r * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
    }
}

/* dx = rstd · (g - mean(g) - x̂ · mean(g · x̂)) (+ res, a residual path's gradient, if
 * not NULL) with g = dy · w and x̂ = (x - mean) · rstd; dw = Σ_rows dy · x̂,
 * db = Σ_rows dy (either may be NULL). */
int tl_ln_bwd(const float *x, const float *w, const float *mean, const float *rstd,
              const float *dy, const float *res, float *dx, float *dw, float *db, long M,
              long E, int threads) {
    if (threads < 1) threads = 1;
    int sums = dw || db;
    float *partial = sums ? calloc((size_t)threads * 2 * (size_t)E, sizeof(float)) : NULL;
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float *pw = partial ? partial + (long)id * 2 * E : NULL, *pb = pw ? pw + E : NULL;
        long lo = M * id / nt, hi = M * (id + 1) / nt;
        for (long m = lo; m < hi; m++) {
            const float *xm = x + m * E, *dym = dy + m * E;
            float mu = mean[m], r = rstd[m];
            vf sg = {0}, sgx = {0};
            long i = 0;
            for (; i + VL <= E; i += VL) {
                vf xhat = (loadv(xm + i) - mu) * r, d = loadv(dym + i);
                vf g = w ? d * loadv(w + i) : d;
                sg += g;
                sgx += g * xhat;
                if (pw) {
                    storev(pw + i, loadv(pw + i) + d * xhat);
                    storev(pb + i, loadv(pb + i) + d);
                }
            }
            float s_g = hsum(sg), s_gx = hsum(sgx);
            for (; i < E; i++) {
                float xhat = (xm[i] - mu) * r, d = dym[i], g = w ? d * w[i] : d;
                s_g += g;
                s_gx += g * xhat;
                if (pw) { pw[i] += d * xhat; pb[i] += d; }
            }
            float a = s_g / (float)E, c = s_gx / (float)E;
            float *dxm = dx + m * E;
            const float *rm = res ? res + m * E : NULL;
            for (i = 0; i + VL <= E; i += VL) {  /* g and x̂ again, from L1: no stores */
                vf xhat = (loadv(xm + i) - mu) * r, d = loadv(dym + i);
                vf g = w ? d * loadv(w + i) : d, v = (g - a - xhat * c) * r;
                storev(dxm + i, rm ? v + loadv(rm + i) : v);
            }
            for (; i < E; i++) {
                float xhat = (xm[i] - mu) * r, g = w ? dym[i] * w[i] : dym[i];
                dxm[i] = (g - a - xhat * c) * r + (rm ? rm[i] : 0.0f);
            }
        }
    }
    if (partial) {
        for (long i = 0; i < E; i++) {
            float sw = 0.0f, sb = 0.0f;
            for (int t = 0; t < threads; t++) {
                sw += partial[(long)t * 2 * E + i];
                sb += partial[(long)t * 2 * E + E + i];
            }
            if (dw) dw[i] = sw;
            if (db) db[i] = sb;
        }
        free(partial);
    } else if (sums) {  /* no memory for per-thread sums: one plain pass instead */
        for (long i = 0; i < E; i++) {
            if (dw) dw[i] = 0.0f;
            if (db) db[i] = 0.0f;
        }
        for (long m = 0; m < M; m++)
            for (long i = 0; i < E; i++) {
                float d = dy[m * E + i];
                if (dw) dw[i] += d * (x[m * E + i] - mean[m]) * rstd[m];
                if (db) db[i] += d;
            }
    }
    return 0;  /* the per-thread sums have a fallback: nothing here runs out of memory */
}
