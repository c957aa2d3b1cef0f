/* A GPT-2 block's training step in one call each way, every product on gemm.c's kernel:
 *
 *     x1 = x + Attention(LN1(x))          y = x1 + FFN(LN2(x1))
 *
 * the same kernels, in the same order, as tinylm/native/functions.py's block_forward and
 * block_backward call them one by one from Python (see there for the math, step by
 * step); here no Python runs between them. A small block's step is ~20 kernel calls of
 * tens to hundreds of microseconds each, and the Python around each call (its checks,
 * the product's routing, the tensors it allocates) cost ~3.5 ms of a 4×128 B=12 training
 * step (32 ms).
 *
 * The tensors come as one array of addresses (int64), in the order of the BT_* slots
 * (tinylm.h); 0 marks an absent one (a bias or norm weight the block does not have, a
 * gradient that is not needed). The caller (ops.py's Library.block_forward/_backward)
 * checked every tensor's dtype, layout and shape against the sizes passed here. Rows:
 * N = B·C tokens; E the model width, HD = H·D the heads' width, F the FFN's. */
#include "tinylm.h"

#include <stdint.h>

static inline float *slot(const long *t, int i) { return (float *)(intptr_t)t[i]; }

/* c = a·Wᵀ (+ c where acc): a (M, K) rows, W (N, K). */
static void xwt(long M, long N, long K, const float *a, const float *w, float *c, int acc,
                float *work, int threads) {
    tl_gemm(M, N, K, a, K, 1, w, K, 1, c, N, acc, work, threads);
}

/* c = g·W: g (M, K), W (K, N) as stored. */
static void xw(long M, long N, long K, const float *g, const float *w, float *c,
               float *work, int threads) {
    tl_gemm(M, N, K, g, K, 1, w, N, 0, c, N, 0, work, threads);
}

/* c = gᵀ·x, a weight's gradient: g (K, M), x (K, N); nothing where c is NULL. */
static void gtx(long M, long N, long K, const float *g, const float *x, float *c,
                float *work, int threads) {
    if (c) tl_gemm(M, N, K, g, 1, M, x, N, 0, c, N, 0, work, threads);
}

long tl_block_work(long N, long E, long HD, long F) {
    const long weights[4][2] = {{3 * HD, E}, {E, HD}, {F, E}, {E, F}};  /* W (O, I) */
    long most = 0;
    for (int i = 0; i < 4; i++) {
        long O = weights[i][0], I = weights[i][1];
        long sizes[3] = {tl_gemm_work(O, I, 1),   /* x·Wᵀ */
                         tl_gemm_work(I, O, 0),   /* G·W */
                         tl_gemm_work(I, N, 0)};  /* Gᵀ·X: I columns, N tokens */
        for (int k = 0; k < 3; k++) most = sizes[k] > most ? sizes[k] : most;
    }
    return most;
}

int tl_block_fwd(const long *t, long B, long C, long E, long H, long D, long F, float eps1,
                 float eps2, float scale, int threads) {
    long N = B * C, HD = H * D;
    float *work = slot(t, BT_WORK), *x1 = slot(t, BT_X1), *y = slot(t, BT_Y);
    float *a_in = slot(t, BT_A_IN), *qkv = slot(t, BT_QKV), *r = slot(t, BT_R);
    float *f_in = slot(t, BT_F_IN), *h = slot(t, BT_H), *g = slot(t, BT_S_ACT);
    /* LN1, and x1 = x + b_out in the same pass */
    tl_ln_fwd_res(slot(t, BT_X), slot(t, BT_LN1_W), slot(t, BT_LN1_B), a_in,
                  slot(t, BT_MU1), slot(t, BT_RS1), slot(t, BT_B_OUT), x1, N, E, eps1,
                  threads);
    xwt(N, 3 * HD, E, a_in, slot(t, BT_W_QKV), qkv, 0, work, threads);
    if (tl_attn_fwd(qkv, slot(t, BT_B_QKV), r, slot(t, BT_LSE), B, C, H, D, scale, threads))
        return TL_NOMEM;  /* qkv += b_qkv in place, then the heads */
    xwt(N, E, HD, r, slot(t, BT_W_OUT), x1, 1, work, threads);  /* x1 += R·W_outᵀ */
    tl_ln_fwd_res(x1, slot(t, BT_LN2_W), slot(t, BT_LN2_B), f_in, slot(t, BT_MU2),
                  slot(t, BT_RS2), slot(t, BT_B_DOWN), y, N, E, eps2, threads);
    xwt(N, F, E, f_in, slot(t, BT_W_UP), h, 0, work, threads);
    tl_bias_gelu(h, slot(t, BT_B_UP), g, N, F, threads);  /* h += b_up; g = GELU(h) */
    xwt(N, E, F, g, slot(t, BT_W_DOWN), y, 1, work, threads);  /* y += g·W_downᵀ */
    return 0;
}

int tl_block_bwd(const long *t, long B, long C, long E, long H, long D, long F, float scale,
                 int threads) {
    long N = B * C, HD = H * D;
    float *work = slot(t, BT_WORK), *gy = slot(t, BT_GY), *gx1 = slot(t, BT_S_GX1);
    float *gh = slot(t, BT_S_GRAD), *g = slot(t, BT_S_ACT), *t1 = slot(t, BT_S_T1);
    float *gr = slot(t, BT_S_ATTN), *gqkv = slot(t, BT_S_QKV);
    /* FFN: y = x1 + GELU(h)·W_downᵀ + b_down, h = f_in·W_upᵀ + b_up */
    xw(N, F, E, gy, slot(t, BT_W_DOWN), gh, work, threads);  /* dL/dGELU(h) */
    tl_gelu_backward(slot(t, BT_H), gh, g, slot(t, BT_G_B_UP), N, F, threads);  /* -> dL/dh */
    gtx(E, F, N, gy, g, slot(t, BT_G_W_DOWN), work, threads);
    gtx(F, E, N, gh, slot(t, BT_F_IN), slot(t, BT_G_W_UP), work, threads);
    xw(N, E, F, gh, slot(t, BT_W_UP), t1, work, threads);  /* dL/df_in */
    /* LN2's backward + gy (the residual path), b_down's gradient (gy summed) with it */
    if (tl_ln_bwd(slot(t, BT_X1), slot(t, BT_LN2_W), slot(t, BT_MU2), slot(t, BT_RS2), t1, gy,
                  gx1, slot(t, BT_G_LN2_W), slot(t, BT_G_LN2_B), slot(t, BT_G_B_DOWN), N, E,
                  threads))
        return TL_NOMEM;
    /* attention: x1 = x + R·W_outᵀ + b_out, R = attention(LN1(x)·W_qkvᵀ + b_qkv) */
    gtx(E, HD, N, gx1, slot(t, BT_R), slot(t, BT_G_W_OUT), work, threads);
    xw(N, HD, E, gx1, slot(t, BT_W_OUT), gr, work, threads);  /* dL/dR */
    if (tl_attn_bwd(slot(t, BT_QKV), slot(t, BT_R), gr, slot(t, BT_LSE), gqkv,
                    slot(t, BT_G_B_QKV), B, C, H, D, scale, threads))
        return TL_NOMEM;
    gtx(3 * HD, E, N, gqkv, slot(t, BT_A_IN), slot(t, BT_G_W_QKV), work, threads);
    xw(N, E, 3 * HD, gqkv, slot(t, BT_W_QKV), t1, work, threads);  /* dL/da_in */
    /* LN1's backward + dL/dx1 (the residual path), b_out's gradient with it */
    if (tl_ln_bwd(slot(t, BT_X), slot(t, BT_LN1_W), slot(t, BT_MU1), slot(t, BT_RS1), t1, gx1,
                  slot(t, BT_GX), slot(t, BT_G_LN1_W), slot(t, BT_G_LN1_B),
                  slot(t, BT_G_B_OUT), N, E, threads))
        return TL_NOMEM;
    return 0;
}
