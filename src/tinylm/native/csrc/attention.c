/* Causal self-attention for training, straight from the fused QKV projection.
 *
 * qkv is (B, C, 3, H, D) contiguous: row (b, t) holds q, k, v of every head, so each
 * head's Q, K, V are (C, D) matrices with row stride 3·H·D, read in place (no split,
 * no copies). out is (B, C, H, D) -- the (B·C, H·D) input of the output projection --
 * and lse (B, H, C) keeps each row's log-sum-exp for the backward, which recomputes
 * the attention weights instead of storing them (as flash attention does). The
 * backward writes dQ, dK, dV into one (B, C, 3, H, D) buffer: the gradient of the QKV
 * projection's output, again without a split or a concatenation.
 *
 * Threads take whole (batch row, head) pairs. A head's scores P (C, Cp) live in a
 * per-thread buffer (Cp = C rounded up to 16), so the context is kept short (the
 * caller uses torch's SDPA beyond a limit). Every product is one register-blocked
 * micro-kernel (mk): 4 output rows × up to 64 columns of accumulators, one broadcast
 * coefficient times 16-float vectors per FMA -- no horizontal sums. */

#include "tinylm.h"

#define MK_R 4   /* rows per micro-kernel call */
#define MK_C 4   /* 16-float column vectors per call (64 columns) */

/* y[r][0 : 16·NC) = alpha · Σ_{k0 <= k < k1} a[r·sr + k·sk] · x[k·ldx + 0 : 16·NC), r < R */
static inline __attribute__((always_inline)) void mk(
        const float *a, long sr, long sk, const float *x, long ldx, long k0, long k1,
        float *y, long ldy, float alpha, const int R, const int NC) {
    v16 acc[MK_R][MK_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = (v16){0};
    for (long k = k0; k < k1; k++) {
        const float *xr = x + k * ldx;
        v16 xv[MK_C];
        for (int c = 0; c < NC; c++) xv[c] = load16(xr + 16 * c);
        for (int r = 0; r < R; r++) {
            float av = a[r * sr + k * sk];
            for (int c = 0; c < NC; c++) acc[r][c] += xv[c] * av;
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) store16(y + r * ldy + 16 * c, acc[r][c] * alpha);
}

#define MK_CASE(R, NC) \
    case (R) * 8 + (NC): mk(a, sr, sk, xc, ldx, k0, k1, yc, ldy, alpha, R, NC); break;
#define MK_ROW(R) MK_CASE(R, 1) MK_CASE(R, 2) MK_CASE(R, 3) MK_CASE(R, 4)

/* mk for any R <= 4 and any width that is a multiple of 16 (in groups of 64 columns). */
static void mk_any(const float *a, long sr, long sk, const float *x, long ldx, long k0,
                   long k1, float *y, long ldy, float alpha, int R, long width) {
    for (long c0 = 0; c0 < width; c0 += 16 * MK_C) {
        int nc = (int)((width - c0) / 16 < MK_C ? (width - c0) / 16 : MK_C);
        const float *xc = x + c0;
        float *yc = y + c0;
        switch (R * 8 + nc) {
            MK_ROW(1) MK_ROW(2) MK_ROW(3) MK_ROW(4)
            default: break;
        }
    }
}

/* A 16×16 block transposed in registers: four rounds of interleaving row i with row
 * i + 8 (a perfect shuffle of the index bits; after four, rows and columns swap). */
static inline void transpose16(v16 r[16]) {
    for (int round = 0; round < 4; round++) {
        v16 n[16];
        for (int i = 0; i < 8; i++) {
            n[2 * i] = __builtin_shufflevector(r[i], r[i + 8], 0, 16, 1, 17, 2, 18, 3, 19,
                                               4, 20, 5, 21, 6, 22, 7, 23);
            n[2 * i + 1] = __builtin_shufflevector(r[i], r[i + 8], 8, 24, 9, 25, 10, 26, 11,
                                                   27, 12, 28, 13, 29, 14, 30, 15, 31);
        }
        for (int i = 0; i < 16; i++) r[i] = n[i];
    }
}

/* t (D, Cp) = first C rows of m (row stride ld) transposed; columns C..Cp zero. D is a
 * multiple of 16: whole 16×16 blocks go through registers, the last C % 16 rows one
 * float at a time. */
static void transpose_head(const float *m, long ld, long C, long D, long Cp, float *t) {
    long C16 = C / 16 * 16;
    for (long j0 = 0; j0 < C16; j0 += 16)
        for (long d0 = 0; d0 < D; d0 += 16) {
            v16 r[16];
            for (int i = 0; i < 16; i++) r[i] = load16(m + (j0 + i) * ld + d0);
            transpose16(r);
            for (int i = 0; i < 16; i++) store16(t + (d0 + i) * Cp + j0, r[i]);
        }
    for (long j = C16; j < C; j++) {
        const float *row = m + j * ld;
        for (long d = 0; d < D; d++) t[d * Cp + j] = row[d];
    }
    for (long d = 0; d < D; d++)
        for (long j = C; j < Cp; j++) t[d * Cp + j] = 0.0f;
}

/* s (C, Cp) = alpha · A·Tᵀ, only the causal part: row i gets columns up to
 * round16(i + 1) (the rest of the block row is computed too, and never read).
 * A is (C, D) with row stride lda; T is (D, Cp), the other operand transposed. */
static void causal_products(const float *A, long lda, const float *T, long C, long D,
                            long Cp, float alpha, float *s) {
    for (long i0 = 0; i0 < C; i0 += MK_R) {
        int R = (int)(C - i0 < MK_R ? C - i0 : MK_R);
        mk_any(A + i0 * lda, lda, 1, T, Cp, 0, D, s + i0 * Cp, Cp, alpha, R,
               round16(i0 + R));
    }
}

/* Row i of s in place: exp(s[i][j] - m) for j <= i (m = the row max, or the given lse),
 * zero for i < j < round16(i + 1); every entry up to there is finite on entry (computed
 * by causal_products). With normalise, the weights are divided by their sum and the
 * row's log-sum-exp is returned; without, lse is returned. */
static float causal_exp_row(float *s, long i, float lse, int normalise) {
    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 neg_inf = (v16){0} - __builtin_inff();
    long n = i + 1, end = round16(n);
    float m = lse;
    if (normalise) {
        v16 mx = neg_inf;
        for (long j = 0; j < end; j += 16) {
            v16 x = vsel(lane + (float)j < (float)n, load16(s + j), neg_inf);
            mx = vsel(x > mx, x, mx);
        }
        m = mx[0];
        for (int t = 1; t < 16; t++) m = mx[t] > m ? mx[t] : m;
    }
    v16 acc = {0};
    for (long j = 0; j < end; j += 16) {
        v16 e = vsel(lane + (float)j < (float)n, vexp(load16(s + j) - m), (v16){0});
        acc += e;
        store16(s + j, e);
    }
    if (!normalise) return lse;
    float sum = hsum16(acc), inv = 1.0f / sum;
    for (long j = 0; j < end; j += 16) store16(s + j, load16(s + j) * inv);
    return m + logf(sum);
}

/* bias (3·H·D floats, or NULL) is first added in place to qkv, head by head, so the
 * projection before this can be a plain matrix product; qkv then holds the biased
 * values the backward needs. */
int tl_attn_fwd(float *qkv, const float *bias, float *out, float *lse, long B, long C,
                long H, long D, float scale, int threads) {
    long ld = 3 * H * D, HD = H * D, Cp = round16(C);
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * (D * Cp + C * Cp));
        float *p = kt ? kt + D * Cp : NULL;
        if (!kt) {
            #pragma omp atomic write
            failed = TL_NOMEM;
        }
        #pragma omp for schedule(static)
        for (long bh = 0; bh < B * H; bh++) {
            if (!kt) continue;  /* out of memory: reported, this thread's share left */
            long b = bh / H, h = bh % H;
            float *q = qkv + b * C * ld + h * D, *k = q + HD, *v = q + 2 * HD;
            float *o = out + b * C * HD + h * D, *l = lse + bh * C;
            if (bias)  /* this head's slices of the q, k, v bias, added row by row */
                for (long t = 0; t < C; t++)
                    for (int part = 0; part < 3; part++)
                        for (long d = 0; d < D; d += 16) {
                            float *e = q + t * ld + part * HD + d;
                            store16(e, load16(e) + load16(bias + part * HD + h * D + d));
                        }
            transpose_head(k, ld, C, D, Cp, kt);
            causal_products(q, ld, kt, C, D, Cp, scale, p);  /* scores */
            for (long i = 0; i < C; i++) l[i] = causal_exp_row(p + i * Cp, i, 0.0f, 1);
            for (long i0 = 0; i0 < C; i0 += MK_R) {  /* O = P·V over keys j < i0 + R */
                int R = (int)(C - i0 < MK_R ? C - i0 : MK_R);
                mk_any(p + i0 * Cp, Cp, 1, v, ld, 0, i0 + R, o + i0 * HD, HD, 1.0f, R, D);
            }
        }
        free(kt);
    }
    return failed;
}

/* dqkv (B, C, 3, H, D) from dout (B, C, H, D) contiguous, with the forward's qkv, out
 * and lse. Every element of dqkv is written. dbias (3·H·D floats, or NULL) receives
 * dqkv summed over the B·C rows: the gradient of the projection's bias. */
int tl_attn_bwd(const float *qkv, const float *out, const float *dout, const float *lse,
                float *dqkv, float *dbias, long B, long C, long H, long D, float scale,
                int threads) {
    long ld = 3 * H * D, HD = H * D, Cp = round16(C);
    if (threads < 1) threads = 1;
    int rows_n = threads;
    float *rows = dbias ? colsums_begin(rows_n, ld, dbias) : NULL;
    if (dbias && !rows) threads = 1;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * (2 * D * Cp + 2 * C * Cp + C));
        float *vt = kt + D * Cp, *p = vt + D * Cp, *ds = p + C * Cp, *di = ds + C * Cp;
        float *db = dbias ? colsums_row(rows, omp_get_thread_num(), ld, dbias) : NULL;
        if (!kt) {
            #pragma omp atomic write
            failed = TL_NOMEM;
        }
        #pragma omp for schedule(static)
        for (long bh = 0; bh < B * H; bh++) {
            if (!kt) continue;  /* out of memory: reported, this thread's share left */
            long b = bh / H, h = bh % H;
            const float *q = qkv + b * C * ld + h * D, *k = q + HD, *v = q + 2 * HD;
            const float *o = out + b * C * HD + h * D, *go = dout + b * C * HD + h * D;
            const float *l = lse + bh * C;
            float *dq = dqkv + b * C * ld + h * D, *dk = dq + HD, *dv = dq + 2 * HD;
            transpose_head(k, ld, C, D, Cp, kt);
            transpose_head(v, ld, C, D, Cp, vt);
            causal_products(q, ld, kt, C, D, Cp, scale, p);  /* P, recomputed */
            for (long i = 0; i < C; i++) causal_exp_row(p + i * Cp, i, l[i], 0);
            causal_products(go, HD, vt, C, D, Cp, 1.0f, ds);  /* dP = dO·Vᵀ */
            for (long i = 0; i < C; i++) {  /* dS = P ∘ (dP - rowsum(dO ∘ O)) */
                di[i] = dot(go + i * HD, o + i * HD, D);
                float *dsr = ds + i * Cp, *pr = p + i * Cp;
                long j = 0, n = i + 1;
                for (; j + 16 <= n; j += 16)
                    store16(dsr + j, load16(pr + j) * (load16(dsr + j) - di[i]));
                for (; j < n; j++) dsr[j] = pr[j] * (dsr[j] - di[i]);
                for (; j < round16(n); j++) dsr[j] = 0.0f;
            }
            for (long j0 = 0; j0 < C; j0 += MK_R) {
                int R = (int)(C - j0 < MK_R ? C - j0 : MK_R);
                /* dV = Pᵀ·dO and dK = scale · dSᵀ·Q, over queries i >= j0 */
                mk_any(p + j0, 1, Cp, go, HD, j0, C, dv + j0 * ld, ld, 1.0f, R, D);
                mk_any(ds + j0, 1, Cp, q, ld, j0, C, dk + j0 * ld, ld, scale, R, D);
                /* dQ = scale · dS·K, over keys j < j0 + R */
                mk_any(ds + j0 * Cp, Cp, 1, k, ld, 0, j0 + R, dq + j0 * ld, ld, scale, R, D);
            }
            if (db)  /* this head's columns of dq, dk, dv, summed over its C rows */
                for (long t = 0; t < C; t++)
                    for (int part = 0; part < 3; part++)
                        for (long d = 0; d < D; d += 16) {
                            float *acc = db + part * HD + h * D + d;
                            store16(acc, load16(acc) + load16(dq + t * ld + part * HD + d));
                        }
        }
        free(kt);
    }
    if (dbias) colsums_finish(rows, rows_n, ld, dbias);
    return failed;
}
