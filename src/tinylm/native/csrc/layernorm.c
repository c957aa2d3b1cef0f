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

/* One row of the forward, keeping its mean and 1/std; with rout, rout = x + rb (rb
 * NULL: a copy of x) in the same pass. */
static inline void ln_fwd_row(const float *xm, const float *w, const float *b, float *ym,
                              float *mean, float *rstd, const float *rb, float *rout,
                              long E, float eps) {
    float mu = hsum_row(xm, E) / (float)E;
    vf acc = {0};
    long i = 0;
    for (; i + VL <= E; i += VL) { vf d = loadv(xm + i) - mu; acc += d * d; }
    float var = hsum(acc);
    for (; i < E; i++) { float d = xm[i] - mu; var += d * d; }
    float r = 1.0f / sqrtf(var / (float)E + eps);
    *mean = mu;
    *rstd = r;
    for (i = 0; i + VL <= E; i += VL) {
        vf xv = loadv(xm + i), v = (xv - mu) * r;
        if (w) v *= loadv(w + i);
        if (b) v += loadv(b + i);
        storev(ym + i, v);
        if (rout) storev(rout + i, rb ? xv + loadv(rb + i) : xv);
    }
    for (; i < E; i++) {
        ym[i] = (xm[i] - mu) * r * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
        if (rout) rout[i] = xm[i] + (rb ? rb[i] : 0.0f);
    }
}

void tl_ln_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
               float *rstd, long M, long E, float eps, int threads) {
    tl_ln_fwd_res(x, w, b, y, mean, rstd, NULL, NULL, M, E, eps, threads);
}

/* tl_ln_fwd that also starts the residual sum around the norm's branch: rout = x + rb
 * (rb, E floats, may be NULL), into which the branch's last product then accumulates
 * -- the read of x for it is the norm's own. */
void tl_ln_fwd_res(const float *x, const float *w, const float *b, float *y, float *mean,
                   float *rstd, const float *rb, float *rout, long M, long E, float eps,
                   int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++)
        ln_fwd_row(x + m * E, w, b, y + m * E, mean + m, rstd + m, rb,
                   rout ? rout + m * E : NULL, E, eps);
}

/* One row of the backward: dx = rstd · (g - mean(g) - x̂ · mean(g · x̂)) (+ res) with
 * g = dy · w, x̂ = (x - mean) · rstd; pw, pb, pr (each NULL or E floats) accumulate
 * dy · x̂, dy and res -- a thread's share of dw, db and Σ_rows res. */
static inline void ln_bwd_row(const float *xm, const float *w, float mu, float r,
                              const float *dym, const float *rm, float *dxm, float *pw,
                              float *pb, float *pr, long E) {
    vf sg = {0}, sgx = {0};
    long i = 0;
    for (; i + VL <= E; i += VL) {
        vf xhat = (loadv(xm + i) - mu) * r, d = loadv(dym + i);
        vf g = w ? d * loadv(w + i) : d;
        sg += g;
        sgx += g * xhat;
        if (pw) storev(pw + i, loadv(pw + i) + d * xhat);
        if (pb) storev(pb + i, loadv(pb + i) + d);
    }
    float s_g = hsum(sg), s_gx = hsum(sgx);
    for (; i < E; i++) {
        float xhat = (xm[i] - mu) * r, d = dym[i], g = w ? d * w[i] : d;
        s_g += g;
        s_gx += g * xhat;
        if (pw) pw[i] += d * xhat;
        if (pb) pb[i] += d;
    }
    float a = s_g / (float)E, c = s_gx / (float)E;
    for (i = 0; i + VL <= E; i += VL) {  /* g and x̂ again, from L1 */
        vf xhat = (loadv(xm + i) - mu) * r, d = loadv(dym + i);
        vf g = w ? d * loadv(w + i) : d, v = (g - a - xhat * c) * r;
        if (rm) {
            vf rv = loadv(rm + i);
            v += rv;
            if (pr) storev(pr + i, loadv(pr + i) + rv);
        }
        storev(dxm + i, v);
    }
    for (; i < E; i++) {
        float xhat = (xm[i] - mu) * r, g = w ? dym[i] * w[i] : dym[i];
        dxm[i] = (g - a - xhat * c) * r + (rm ? rm[i] : 0.0f);
        if (pr) pr[i] += rm[i];
    }
}

/* The backward of tl_ln_fwd: dx (+ res, a residual path's gradient, if not NULL);
 * dw = Σ_rows dy · x̂, db = Σ_rows dy and dres = Σ_rows res (each may be NULL; dres
 * only with res): the last is the gradient of the bias of the product whose output
 * was added on that residual path, summed here instead of in a pass of its own. */
int tl_ln_bwd(const float *x, const float *w, const float *mean, const float *rstd,
              const float *dy, const float *res, float *dx, float *dw, float *db,
              float *dres, long M, long E, int threads) {
    if (threads < 1) threads = 1;
    float *outs[3] = {dw, db, res ? dres : NULL};
    int sums = outs[0] || outs[1] || outs[2];
    float *partial = sums ? calloc((size_t)threads * 3 * (size_t)E, sizeof(float)) : NULL;
    if (sums && !partial) threads = 1;  /* no memory for per-thread sums: one thread */
    float *one = sums && !partial ? calloc(3 * (size_t)E, sizeof(float)) : NULL;
    if (sums && !partial && !one) return TL_NOMEM;
    float *base = partial ? partial : one;
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float *p = base ? base + (long)id * 3 * E : NULL;
        float *pw = outs[0] ? p : NULL, *pb = outs[1] ? p + E : NULL;
        float *pr = outs[2] ? p + 2 * E : NULL;
        long lo = M * id / nt, hi = M * (id + 1) / nt;
        for (long m = lo; m < hi; m++)
            ln_bwd_row(x + m * E, w, mean[m], rstd[m], dy + m * E, res ? res + m * E : NULL,
                       dx + m * E, pw, pb, pr, E);
    }
    for (int k = 0; k < 3 && base; k++) {
        if (!outs[k]) continue;
        for (long i = 0; i < E; i++) {
            float sum = 0.0f;
            for (int t = 0; t < threads; t++) sum += base[(long)t * 3 * E + k * E + i];
            outs[k][i] = sum;
        }
    }
    free(base);
    return 0;
}
