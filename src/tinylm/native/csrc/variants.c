/* The architecture variants' pieces for training (tinylm.native.variants): RMSNorm
 * forward and backward; QK-norm and the rotary positions applied to the q and k heads of
 * a qkv buffer, written straight into the attention kernel's (N, 3·H·D) layout with each
 * grouped-query key/value head repeated for its query heads, and the backward of all
 * that; ReLU² forward and backward. Each replaces a chain of torch passes (and the
 * concatenations that built the kernel's input) with one pass over the rows, split over
 * rows between threads; the gains' gradients are per-thread column sums (colsums_*). */

#include "tinylm.h"

/* --- RMSNorm ------------------------------------------------------------------------------
 * y = x·r·w with r = 1/sqrt(mean(x²) + eps); backward with g = dy·w:
 * dx = r·g − x·(r³·mean(g·x)) (+ res), dw = Σ_rows dy·x·r. w may be NULL (no gains). */

static inline float rms_row(const float *x, const float *w, float *y, long E, float eps) {
    float r = 1.0f / sqrtf(dot(x, x, E) / (float)E + eps);
    long i = 0;
    for (; i + VL <= E; i += VL) {
        vf v = loadv(x + i) * r;
        storev(y + i, w ? v * loadv(w + i) : v);
    }
    for (; i < E; i++) y[i] = x[i] * r * (w ? w[i] : 1.0f);
    return r;
}

static inline void rms_back_row(const float *x, const float *w, float r, const float *dy,
                                const float *res, float *dx, float *dw, long E) {
    vf acc = {0};
    long i = 0;
    for (; i + VL <= E; i += VL) {
        vf d = loadv(dy + i), xv = loadv(x + i), g = w ? d * loadv(w + i) : d;
        acc += g * xv;
        if (dw) storev(dw + i, loadv(dw + i) + d * xv * r);
    }
    float s = hsum(acc);
    for (; i < E; i++) {
        s += (w ? dy[i] * w[i] : dy[i]) * x[i];
        if (dw) dw[i] += dy[i] * x[i] * r;
    }
    float c = s * r * r * r / (float)E;
    for (i = 0; i + VL <= E; i += VL) {  /* dy and x again, from L1 */
        vf d = loadv(dy + i), g = w ? d * loadv(w + i) : d, v = g * r - loadv(x + i) * c;
        storev(dx + i, res ? v + loadv(res + i) : v);
    }
    for (; i < E; i++)
        dx[i] = (w ? dy[i] * w[i] : dy[i]) * r - x[i] * c + (res ? res[i] : 0.0f);
}

void tl_rms_fwd(const float *x, const float *w, float *y, float *rs, long M, long E,
                float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) rs[m] = rms_row(x + m * E, w, y + m * E, E, eps);
}

void tl_rms_bwd(const float *x, const float *w, const float *rs, const float *dy,
                const float *res, float *dx, float *dw, long M, long E, int threads) {
    if (threads < 1) threads = 1;
    int rows_n = threads;
    float *rows = dw ? colsums_begin(rows_n, E, dw) : NULL;
    if (dw && !rows) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float *acc = dw ? colsums_row(rows, id, E, dw) : NULL;
        long lo = M * id / nt, hi = M * (id + 1) / nt;
        for (long m = lo; m < hi; m++)
            rms_back_row(x + m * E, w, rs[m], dy + m * E, res ? res + m * E : NULL,
                         dx + m * E, acc, E);
    }
    if (dw) colsums_finish(rows, rows_n, E, dw);
}

/* --- QK-norm and the rotation ---------------------------------------------------------------
 * RoPE on one head of D = 2h: y₁ = u₁·cos₁ + u₂·s₁, y₂ = u₂·cos₂ + u₁·s₂ with the tables
 * cos and s = sin± = (−sin₁, sin₂) of the head's position (variants.rope_tables); its
 * transpose: du₁ = dy₁·cos₁ − dy₂·s₁, du₂ = dy₂·cos₂ − dy₁·s₂. */

static inline void rope_row(const float *u, const float *c, const float *s, float *y,
                            long D, float sign) {
    long h = D / 2, i = 0;
    for (; i + VL <= h; i += VL) {
        vf a = loadv(u + i), b = loadv(u + h + i);
        storev(y + i, a * loadv(c + i) + sign * b * loadv(s + i));
        storev(y + h + i, b * loadv(c + h + i) + sign * a * loadv(s + h + i));
    }
    for (; i < h; i++) {
        float a = u[i], b = u[h + i];
        y[i] = a * c[i] + sign * b * s[i];
        y[h + i] = b * c[h + i] + sign * a * s[h + i];
    }
}

/* One q or k head forward: x (D) -> y = RoPE(QKNorm(x)); returns QK-norm's 1/RMS. */
static inline float qk_head(const float *x, const float *w, const float *c, const float *s,
                            float *y, float *tmp, long D, float eps, int norm) {
    float r = 1.0f;
    const float *u = x;
    if (norm) { r = rms_row(x, w, c ? tmp : y, D, eps); u = c ? tmp : y; }
    if (c) rope_row(u, c, s, y, D, 1.0f);
    else if (!norm) memcpy(y, x, sizeof(float) * (size_t)D);
    return r;
}

/* qkv (N, (H + 2·Hkv)·D), rows n = b·C + c at position c -> out (N, 3·H·D):
 * [RoPE(QKNorm(q)) | k heads, head j repeated for query heads j·g .. j·g + g − 1 |
 * v heads likewise], g = H / Hkv; rs (N, H + Hkv) receives QK-norm's 1/RMS per head.
 * norm = 0: no QK-norm (qw, kw, rs unused); cos = NULL: no rotation. */
int tl_qk_fwd(const float *qkv, const float *qw, const float *kw, const float *cos,
              const float *sinpm, float *out, float *rs, long N, long C, long H, long Hkv,
              long D, float eps, int norm, int threads) {
    long g = H / Hkv, in_w = (H + 2 * Hkv) * D, out_w = 3 * H * D;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *tmp = malloc(sizeof(float) * (size_t)D);
        if (!tmp) {
            #pragma omp atomic write
            failed = 1;
        } else {
            #pragma omp for schedule(static)
            for (long n = 0; n < N; n++) {
                const float *xr = qkv + n * in_w, *c = cos ? cos + (n % C) * D : NULL;
                const float *s = cos ? sinpm + (n % C) * D : NULL;
                float *o = out + n * out_w, *rn = rs + n * (H + Hkv);
                for (long h = 0; h < H; h++)
                    rn[h] = qk_head(xr + h * D, qw, c, s, o + h * D, tmp, D, eps, norm);
                for (long j = 0; j < Hkv; j++) {
                    float *k0 = o + H * D + j * g * D, *v0 = o + 2 * H * D + j * g * D;
                    rn[H + j] = qk_head(xr + (H + j) * D, kw, c, s, k0, tmp, D, eps, norm);
                    memcpy(v0, xr + (H + Hkv + j) * D, sizeof(float) * (size_t)D);
                    for (long r = 1; r < g; r++) {
                        memcpy(k0 + r * D, k0, sizeof(float) * (size_t)D);
                        memcpy(v0 + r * D, v0, sizeof(float) * (size_t)D);
                    }
                }
            }
            free(tmp);
        }
    }
    return failed ? TL_NOMEM : 0;
}

/* Decoding: x = RoPE(QKNorm(x)) in place for the n heads of D at the start of each of B
 * rows (row stride ld), all at one position whose tables c and s = sin± (D) are given
 * (c = NULL: no rotation; norm = 0: no QK-norm, w unused). tmp: D floats. */
void tl_rope_heads(float *x, long ld, long B, long n, long D, const float *w,
                   const float *c, const float *s, float eps, int norm, float *tmp) {
    if (!norm && !c) return;  /* nothing to do (and qk_head would copy a head onto itself) */
    for (long b = 0; b < B; b++)
        for (long h = 0; h < n; h++) {
            float *head = x + b * ld + h * D;
            qk_head(head, w, c, s, head, tmp, D, eps, norm);
        }
}

/* The same for a ragged batch: row b at its own position pos[b], whose tables are rows
 * pos[b] of c and s ((positions, D) each; c = NULL: no rotation). */
void tl_rope_rows(float *x, long ld, long B, long n, long D, const float *w, const float *c,
                  const float *s, const long *pos, float eps, int norm, float *tmp) {
    if (!norm && !c) return;
    for (long b = 0; b < B; b++)
        tl_rope_heads(x + b * ld, ld, 1, n, D, w, c ? c + pos[b] * D : 0,
                      c ? s + pos[b] * D : 0, eps, norm, tmp);
}

/* One q or k head backward: dy (D) the gradient of RoPE(QKNorm(x)) -> dx; the gains'
 * gradient added into dw (if norm). tmp: D floats. */
static inline void qk_head_back(const float *x, const float *w, float r, const float *c,
                                const float *s, const float *dy, float *dx, float *dw,
                                float *tmp, long D, int norm) {
    const float *du = dy;
    if (c) { rope_row(dy, c, s, norm ? tmp : dx, D, -1.0f); du = norm ? tmp : dx; }
    if (norm) rms_back_row(x, w, r, du, NULL, dx, dw, D);
    else if (!c) memcpy(dx, dy, sizeof(float) * (size_t)D);
}

/* Sum the g repeated heads' gradients (stride D) into one: dst (D). */
static inline void sum_heads(const float *src, float *dst, long g, long D) {
    memcpy(dst, src, sizeof(float) * (size_t)D);
    for (long r = 1; r < g; r++) axpy(dst, 1.0f, src + r * D, D);
}

/* The backward of tl_qk_fwd: dout (N, 3·H·D) -> dqkv (N, (H + 2·Hkv)·D); dw (2·D, if
 * not NULL and norm) receives the q gains' gradient then the k gains'. */
int tl_qk_bwd(const float *dout, const float *qkv, const float *qw, const float *kw,
              const float *rs, const float *cos, const float *sinpm, float *dqkv, float *dw,
              long N, long C, long H, long Hkv, long D, int norm, int threads) {
    if (threads < 1) threads = 1;
    long g = H / Hkv, in_w = (H + 2 * Hkv) * D, out_w = 3 * H * D;
    int rows_n = threads, failed = 0;
    float *rows = dw && norm ? colsums_begin(rows_n, 2 * D, dw) : NULL;
    if (dw && norm && !rows) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        int id = omp_get_thread_num();
        float *acc = dw && norm ? colsums_row(rows, id, 2 * D, dw) : NULL;
        float *tmp = malloc(sizeof(float) * 2 * (size_t)D);
        if (!tmp) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            if (!tmp) continue;
            const float *xr = qkv + n * in_w, *dr = dout + n * out_w, *rn = rs + n * (H + Hkv);
            const float *c = cos ? cos + (n % C) * D : NULL, *s = cos ? sinpm + (n % C) * D : NULL;
            float *o = dqkv + n * in_w;
            for (long h = 0; h < H; h++)
                qk_head_back(xr + h * D, qw, rn[h], c, s, dr + h * D, o + h * D,
                             acc, tmp, D, norm);
            for (long j = 0; j < Hkv; j++) {
                const float *dk = dr + H * D + j * g * D, *dv = dr + 2 * H * D + j * g * D;
                if (g > 1) { sum_heads(dk, tmp + D, g, D); dk = tmp + D; }
                qk_head_back(xr + (H + j) * D, kw, rn[H + j], c, s, dk, o + (H + j) * D,
                             acc ? acc + D : NULL, tmp, D, norm);
                sum_heads(dv, o + (H + Hkv + j) * D, g, D);
            }
        }
        free(tmp);
    }
    if (dw && norm) colsums_finish(rows, rows_n, 2 * D, dw);
    return failed ? TL_NOMEM : 0;
}

/* --- ReLU² ----------------------------------------------------------------------------------
 * g = relu(h)²; backward: dL/dh = dL/dg · 2·relu(h), in place in grad, with g recomputed
 * into y (if not NULL) in the same pass. */

void tl_relu2(const float *h, float *g, long n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < (n + 4095) / 4096; b++) {
        long lo = b * 4096, hi = lo + 4096 < n ? lo + 4096 : n, i = lo;
        for (; i + VL <= hi; i += VL) {
            vf v = loadv(h + i), r = vsel(v > splat(0.0f), v, splat(0.0f));
            storev(g + i, r * r);
        }
        for (; i < hi; i++) g[i] = h[i] > 0.0f ? h[i] * h[i] : 0.0f;
    }
}

void tl_relu2_backward(const float *h, float *grad, float *y, long n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < (n + 4095) / 4096; b++) {
        long lo = b * 4096, hi = lo + 4096 < n ? lo + 4096 : n, i = lo;
        for (; i + VL <= hi; i += VL) {
            vf v = loadv(h + i), r = vsel(v > splat(0.0f), v, splat(0.0f));
            storev(grad + i, loadv(grad + i) * (r + r));
            if (y) storev(y + i, r * r);
        }
        for (; i < hi; i++) {
            float r = h[i] > 0.0f ? h[i] : 0.0f;
            grad[i] *= r + r;
            if (y) y[i] = r * r;
        }
    }
}
