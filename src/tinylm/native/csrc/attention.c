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
 * per-thread buffer (rows of Cp = C rounded up to 16, plus 16), so the context is kept short (the
 * caller uses torch's SDPA beyond a limit). Every product is one register-blocked
 * micro-kernel (mk): MK_R output rows × MK_C vectors of VL columns of accumulators, one
 * broadcast coefficient times a VL-float vector per FMA -- no horizontal sums. */

#include "tinylm.h"

/* The register blocking: MK_R·MK_C accumulators, MK_C loaded vectors and a broadcast must
 * fit the vector registers (32 zmm with AVX-512: 4 × 4; 16 ymm/xmm otherwise: 6 × 2, the
 * classic 6 × 16 AVX2 GEMM kernel); widths are multiples of VL (of 16, in fact). */
#if VL == 16
#define MK_R 4   /* rows per micro-kernel call */
#define MK_C 4   /* column vectors per call (64 columns) */
#else
#define MK_R 6
#define MK_C 2   /* 16 columns with AVX2, 8 with 4-float vectors */
#endif

/* y[r][0 : VL·NC) = alpha · Σ_{k0 <= k < k1} a[r·sr + k·sk] · x[k·ldx + 0 : VL·NC), r < R */
static inline __attribute__((always_inline)) void mk(
        const float *a, long sr, long sk, const float *x, long ldx, long k0, long k1,
        float *y, long ldy, float alpha, const int R, const int NC) {
    vf acc[MK_R][MK_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = (vf){0};
    for (long k = k0; k < k1; k++) {
        const float *xr = x + k * ldx;
        vf xv[MK_C];
        for (int c = 0; c < NC; c++) {
            xv[c] = loadv(xr + VL * c);
            KEEP_IN_REGISTER(xv[c]);
        }
        for (int r = 0; r < R; r++) {
            float av = a[r * sr + k * sk];
            for (int c = 0; c < NC; c++) acc[r][c] += xv[c] * av;
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) storev(y + r * ldy + VL * c, acc[r][c] * alpha);
}

#define MK_CASE(R, NC) \
    case (R) * 8 + (NC): mk(a, sr, sk, xc, ldx, k0, k1, yc, ldy, alpha, R, NC); break;
#if MK_C == 4
#define MK_ROW(R) MK_CASE(R, 1) MK_CASE(R, 2) MK_CASE(R, 3) MK_CASE(R, 4)
#else
#define MK_ROW(R) MK_CASE(R, 1) MK_CASE(R, 2)
#endif
#if MK_R == 4
#define MK_ROWS MK_ROW(1) MK_ROW(2) MK_ROW(3) MK_ROW(4)
#else
#define MK_ROWS MK_ROW(1) MK_ROW(2) MK_ROW(3) MK_ROW(4) MK_ROW(5) MK_ROW(6)
#endif

/* mk for any R <= MK_R and any width that is a multiple of VL (in groups of VL·MK_C
 * columns). */
static void mk_any(const float *a, long sr, long sk, const float *x, long ldx, long k0,
                   long k1, float *y, long ldy, float alpha, int R, long width) {
    for (long c0 = 0; c0 < width; c0 += VL * MK_C) {
        int nc = (int)((width - c0) / VL < MK_C ? (width - c0) / VL : MK_C);
        const float *xc = x + c0;
        float *yc = y + c0;
        switch (R * 8 + nc) {
            MK_ROWS
            default: break;
        }
    }
}

/* The row tiles: MK_R rows each (fewer in the last). Tile i0's products of the causal
 * part reach its last row's keys, so row i is computed up to row_width(i): the keys up to
 * its tile's end, rounded up to 16 (whole column vectors); past the diagonal the entries
 * are made zero, so the products over keys can run to the end of each tile. */
static inline long block_rows(long i0, long C) { return C - i0 < MK_R ? C - i0 : MK_R; }

static inline long row_width(long i, long C) {
    long end = i / MK_R * MK_R + MK_R;
    return round16(end < C ? end : C);
}

/* The columns of the products in groups of G = VL·MK_C (one micro-kernel call). Where
 * the right-hand operand of a product is larger than L1_PART bytes (long contexts), one
 * group goes across all row tiles before the next, so that the group's panel is read
 * from L1 by every tile; smaller operands stay in L1 anyway, and each tile then goes
 * across all groups, keeping its own rows of the left-hand operand in L1 instead. */
#define G (VL * MK_C)
#define L1_PART (16 * 1024)

/* A head's per-thread row stride: round16(C) plus one cache line, so that walking down
 * a column does not map every row to the same few L1 sets (a 1 KiB stride at C = 256
 * does: a power of two). */
static inline long padded(long C) { return round16(C) + 16; }

/* A VL×VL block transposed in registers: log2(VL) rounds of interleaving row i with row
 * i + VL/2 (a perfect shuffle of the index bits; after log2(VL), rows and columns swap). */
static inline void transpose_block(vf r[VL]) {
    for (int round = 1; round < VL; round *= 2) {
        vf n[VL];
        for (int i = 0; i < VL / 2; i++) {
            n[2 * i] = ILO(r[i], r[i + VL / 2]);
            n[2 * i + 1] = IHI(r[i], r[i + VL / 2]);
        }
        for (int i = 0; i < VL; i++) r[i] = n[i];
    }
}

/* t (D, Cp) = first C rows of m (row stride ld) transposed; columns C..Cp zero. D is a
 * multiple of 16 (so of VL): whole VL×VL blocks go through registers, the last C % VL
 * rows one float at a time. */
static void transpose_head(const float *m, long ld, long C, long D, long Cp, float *t) {
    long CV = C / VL * VL;
    for (long j0 = 0; j0 < CV; j0 += VL)
        for (long d0 = 0; d0 < D; d0 += VL) {
            vf r[VL];
            for (int i = 0; i < VL; i++) r[i] = loadv(m + (j0 + i) * ld + d0);
            transpose_block(r);
            for (int i = 0; i < VL; i++) storev(t + (d0 + i) * Cp + j0, r[i]);
        }
    for (long j = CV; j < C; j++) {
        const float *row = m + j * ld;
        for (long d = 0; d < D; d++) t[d * Cp + j] = row[d];
    }
    for (long d = 0; d < D; d++)
        for (long j = C; j < Cp; j++) t[d * Cp + j] = 0.0f;
}

/* s (C, Cp) = alpha · A·Tᵀ, only the causal part: row i gets columns up to
 * row_width(i) (the entries past the diagonal are computed too, and zeroed later).
 * A is (C, D) with row stride lda; T is (D, Cp), the other operand transposed. */
static void causal_products(const float *A, long lda, const float *T, long C, long D,
                            long Cp, float alpha, float *s) {
    long step = (long)sizeof(float) * D * Cp > L1_PART ? G : round16(C);
    for (long c0 = 0; c0 < round16(C); c0 += step)
        for (long i0 = 0, R; i0 < C; i0 += R) {
            R = block_rows(i0, C);
            long width = row_width(i0, C) - c0;
            if (width > 0)
                mk_any(A + i0 * lda, lda, 1, T + c0, Cp, 0, D, s + i0 * Cp + c0, Cp, alpha,
                       (int)R, width < step ? width : step);
        }
}

/* m's first C rows (row stride ld, D columns) as column panels of G: panel c0 / G is a
 * contiguous (C, w) block, w = min(G, D - c0), at out + c0·C. A head's rows in qkv are
 * 3·H·D floats apart, a stride that maps them to a few L1 sets: the products read the
 * packed panels instead, one sequential stream per tile. */
static void pack_panels(const float *m, long ld, long C, long D, float *out) {
    for (long c0 = 0; c0 < D; c0 += G) {
        long w = D - c0 < G ? D - c0 : G;
        for (long k = 0; k < C; k++)
            for (long c = 0; c < w; c += VL) storev(out + c0 * C + k * w + c,
                                                    loadv(m + k * ld + c0 + c));
    }
}

/* y (C, D) = alpha · (a·x), x (C, D) with row stride ldx, the rows in tiles: tile i0
 * sums over the keys k < i0 + R (prefix: P·V, dS·K) or the queries k >= i0 (suffix:
 * Pᵀ·dO, dSᵀ·Q); a is addressed as in mk (a[r·sr + k·sk] for the tile's row r), from
 * the tile's first row on. A large x is first copied into panels (C·D floats at buf)
 * and taken group by group. */
static void tiled_products(const float *a, long sr, long sk, const float *x, long ldx,
                           float *buf, float *y, long ldy, float alpha, long C, long D,
                           int prefix) {
    int packed = (long)sizeof(float) * C * D > L1_PART;
    if (packed) pack_panels(x, ldx, C, D, buf);
    for (long c0 = 0; c0 < D; c0 += packed ? G : D) {
        long w = packed && D - c0 > G ? G : D - c0;
        for (long i0 = 0, R; i0 < C; i0 += R) {
            R = block_rows(i0, C);
            mk_any(a + i0 * sr, sr, sk, packed ? buf + c0 * C : x + c0, packed ? w : ldx,
                   prefix ? 0 : i0, prefix ? i0 + R : C, y + i0 * ldy + c0, ldy, alpha,
                   (int)R, w);
        }
    }
}

/* Row i of s in place: exp(s[i][j] - m) for j <= i (m = the row max, or the given lse),
 * zero for i < j < end = row_width(i); every entry up to there is finite on entry
 * (computed by causal_products). With normalise, the weights are divided by their sum
 * and the row's log-sum-exp is returned; without, lse is returned. */
static float causal_exp_row(float *s, long i, long end, float lse, int normalise) {
    const vf lane = lane_index(), neg_inf = splat(-__builtin_inff());
    long n = i + 1;
    float m = lse;
    if (normalise) {
        vf mx = neg_inf;
        for (long j = 0; j < end; j += VL) {
            vf x = vsel(lane + (float)j < (float)n, loadv(s + j), neg_inf);
            mx = vsel(x > mx, x, mx);
        }
        m = hmax(mx);
    }
    vf acc = {0};
    for (long j = 0; j < end; j += VL) {
        vf e = vsel(lane + (float)j < (float)n, vexp(loadv(s + j) - m), (vf){0});
        acc += e;
        storev(s + j, e);
    }
    if (!normalise) return lse;
    float sum = hsum(acc), inv = 1.0f / sum;
    for (long j = 0; j < end; j += VL) storev(s + j, loadv(s + j) * inv);
    return m + logf(sum);
}

/* bias (3·H·D floats, or NULL) is first added in place to qkv, head by head, so the
 * projection before this can be a plain matrix product; qkv then holds the biased
 * values the backward needs. */
int tl_attn_fwd(float *qkv, const float *bias, float *out, float *lse, long B, long C,
                long H, long D, float scale, int threads) {
    long ld = 3 * H * D, HD = H * D, Cp = padded(C);
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * (D * Cp + C * Cp + C * D));
        float *p = kt ? kt + D * Cp : NULL, *panels = kt ? p + C * Cp : NULL;
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
                        for (long d = 0; d < D; d += VL) {
                            float *e = q + t * ld + part * HD + d;
                            storev(e, loadv(e) + loadv(bias + part * HD + h * D + d));
                        }
            transpose_head(k, ld, C, D, Cp, kt);
            causal_products(q, ld, kt, C, D, Cp, scale, p);  /* scores */
            for (long i = 0; i < C; i++)
                l[i] = causal_exp_row(p + i * Cp, i, row_width(i, C), 0.0f, 1);
            tiled_products(p, Cp, 1, v, ld, panels, o, HD, 1.0f, C, D, 1);  /* O = P·V */
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
    long ld = 3 * H * D, HD = H * D, Cp = padded(C);
    if (threads < 1) threads = 1;
    int rows_n = threads;
    float *rows = dbias ? colsums_begin(rows_n, ld, dbias) : NULL;
    if (dbias && !rows) threads = 1;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * (2 * D * Cp + 2 * C * Cp + C + C * D));
        float *vt = kt + D * Cp, *p = vt + D * Cp, *ds = p + C * Cp, *di = ds + C * Cp;
        float *panels = di + C;
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
            for (long i = 0; i < C; i++)
                causal_exp_row(p + i * Cp, i, row_width(i, C), l[i], 0);
            causal_products(go, HD, vt, C, D, Cp, 1.0f, ds);  /* dP = dO·Vᵀ */
            for (long i = 0; i < C; i++) {  /* dS = P ∘ (dP - rowsum(dO ∘ O)) */
                di[i] = dot(go + i * HD, o + i * HD, D);
                float *dsr = ds + i * Cp, *pr = p + i * Cp;
                long j = 0, n = i + 1;
                for (; j + VL <= n; j += VL)
                    storev(dsr + j, loadv(pr + j) * (loadv(dsr + j) - di[i]));
                for (; j < n; j++) dsr[j] = pr[j] * (dsr[j] - di[i]);
                for (; j < row_width(i, C); j++) dsr[j] = 0.0f;
            }
            tiled_products(p, 1, Cp, go, HD, panels, dv, ld, 1.0f, C, D, 0);  /* dV = Pᵀ·dO */
            tiled_products(ds, 1, Cp, q, ld, panels, dk, ld, scale, C, D, 0);  /* dSᵀ·Q */
            tiled_products(ds, Cp, 1, k, ld, panels, dq, ld, scale, C, D, 1);  /* dS·K */
            if (db)  /* this head's columns of dq, dk, dv, summed over its C rows */
                for (long t = 0; t < C; t++)
                    for (int part = 0; part < 3; part++)
                        for (long d = 0; d < D; d += VL) {
                            float *acc = db + part * HD + h * D + d;
                            storev(acc, loadv(acc) + loadv(dq + t * ld + part * HD + d));
                        }
        }
        free(kt);
    }
    if (dbias) colsums_finish(rows, rows_n, ld, dbias);
    return failed;
}
