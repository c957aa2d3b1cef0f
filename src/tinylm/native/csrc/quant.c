/* y = x·(q·s)ᵀ + b for the few rows of a decoding step, from int8 weights.
 *
 * q (O, I) int8 and s (O, ceil(I / G)) float32 are tinylm.quantize's QuantizedLinear:
 * row o's input features are cut into consecutive groups of G (the last may be shorter)
 * and W[o, i] = q[o, i]·s[o, i / G]. Activations stay float32:
 *
 *     y[m, o] = act(Σ_g s[o, g]·Σ_{i in g} x[m, i]·q[o, i] + b[o]) (+ res[m, o])
 *
 * The integers are packed once (tl_q8_pack, when a decoder is built; the checkpoint keeps
 * q and s as they are) into panels of QPW = 32 output features, as linear.c packs fp32:
 *     qp[p][i][j] = q[p·QPW + j][i]        sp[p][g][j] = s[p·QPW + j][g]
 * (zero past O), so a panel is one contiguous (I, QPW) block of bytes that a step streams
 * once, front to back. For each input feature i the kernel converts VL consecutive bytes
 * to floats (one sign-extending 64-bit load + convert with AVX2) and adds them times the
 * broadcast x[m, i] into VL accumulators of output features, for every row m of a block
 * of up to QMB = 4 rows: each converted weight vector serves all those rows, each
 * broadcast all the vectors of the column group, and there are no horizontal sums. A
 * block of QKB input features is read from memory once (software prefetch ahead) and
 * reread from L1 by the other column groups; a batch past 4 rows rereads the panel
 * (I·QPW bytes) from cache per further block of 4. The integer sums of a
 * group are scaled once per group with a vector of its QPW scales (per-channel scales:
 * once, at the end). Panels are split among the threads. y may be res (a residual stream
 * updated in place), never x.
 */
#include "tinylm.h"

#define QPW 32              /* output features per panel */
#define QPV (QPW / VL)      /* vectors per panel row: 2 (AVX-512), 4 (AVX2), 8 */
#define QKB 256             /* input features per block: QKB·QPW bytes (8 KiB) stay in L1 */
#define QMB 4               /* rows of x per pass over a panel block */
#define QPF 4096            /* prefetch distance, bytes: 128 panel rows ahead */

/* VL int8 -> VL floats. GCC lowers a vector-extension conversion from chars lane by lane,
 * so the sign-extending loads are spelled out where the target has them. */
#if VL == 16
#include <immintrin.h>
static inline vf load_q(const signed char *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
}
#elif VL == 8 && defined(__AVX2__)
#include <immintrin.h>
static inline vf load_q(const signed char *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p)));
}
#elif VL == 4 && defined(__SSE4_1__)
#include <immintrin.h>
static inline vf load_q(const signed char *p) {
    int bytes;
    memcpy(&bytes, p, sizeof bytes);
    return (vf)_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(bytes)));
}
#else
static inline vf load_q(const signed char *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = (float)p[i];
    return v;
}
#endif

long tl_q8_packed_size(long O, long I) { return (O + QPW - 1) / QPW * I * QPW; }

long tl_q8_scales_size(long O, long I, long G) {
    return (O + QPW - 1) / QPW * ((I + G - 1) / G) * QPW;
}

/* q (O, I), s (O, groups) -> qp (panels, I, QPW) bytes, sp (panels, groups, QPW) floats. */
void tl_q8_pack(const signed char *q, const float *s, long G, signed char *qp, float *sp,
                long O, long I, int threads) {
    long panels = (O + QPW - 1) / QPW, groups = (I + G - 1) / G;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < panels; p++) {
        signed char *panel = qp + p * I * QPW;
        float *sc = sp + p * groups * QPW;
        for (long j = 0; j < QPW; j++) {
            long o = p * QPW + j;
            for (long i = 0; i < I; i++) panel[i * QPW + j] = o < O ? q[o * I + i] : 0;
            for (long g = 0; g < groups; g++)
                sc[g * QPW + j] = o < O ? s[o * groups + g] : 0.0f;
        }
    }
}

/* t[m][c·VL .. (c + NV)·VL) (+)= Σ_{i < n} x[m·ldx + i]·w[i·QPW + c·VL ..] for m < MR:
 * NV vectors of one column group, CH independent chains over consecutive i (MR·NV·CH
 * accumulators hide the FMA latency; add: start from t, else from zero). */
static inline __attribute__((always_inline)) void q8_cols(
        const float *x, long ldx, const signed char *w, long n, float *t, int add,
        const int MR, const int NV, const int CH) {
    vf acc[2][QMB][4];
    for (int h = 0; h < CH; h++)
        for (int m = 0; m < MR; m++)
            for (int v = 0; v < NV; v++)
                acc[h][m][v] = add && !h ? loadv(t + m * QPW + v * VL) : (vf){0};
    long i = 0;
    for (; i + CH <= n; i += CH)
        for (int h = 0; h < CH; h++) {
            const signed char *wi = w + (i + h) * QPW;
            if (((i + h) & 1) == 0) __builtin_prefetch(wi + QPF);  /* a line per 2 i */
            vf wv[4];
            for (int v = 0; v < NV; v++) wv[v] = load_q(wi + v * VL);
            for (int m = 0; m < MR; m++) {
                float xv = x[m * ldx + i + h];
                for (int v = 0; v < NV; v++) acc[h][m][v] += wv[v] * xv;
            }
        }
    for (; i < n; i++) {
        vf wv[4];
        for (int v = 0; v < NV; v++) wv[v] = load_q(w + i * QPW + v * VL);
        for (int m = 0; m < MR; m++) {
            float xv = x[m * ldx + i];
            for (int v = 0; v < NV; v++) acc[0][m][v] += wv[v] * xv;
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) {
            vf sum = acc[0][m][v];
            for (int h = 1; h < CH; h++) sum += acc[h][m][v];
            storev(t + m * QPW + v * VL, sum);
        }
}

/* The whole panel row block (QPV vectors) for MR rows, NV vectors at a time. */
static inline __attribute__((always_inline)) void q8_block_rows(
        const float *x, long ldx, const signed char *w, long n, float *t, int add,
        const int MR, const int NV, const int CH) {
    for (int c = 0; c < QPV; c += NV)
        q8_cols(x, ldx, w + c * VL, n, t + c * VL, add, MR, NV, CH);
}

/* The register blocking of mr <= QMB rows: (rows, vectors per column group, chains), at
 * most 12 accumulators plus the weight vectors and a broadcast in 16 registers. (Eight
 * rows in one pass, 8 × 1 vectors, measured slower on Zen 3 than two passes of 4 × 2:
 * a broadcast per FMA.) */
#define NVC(n) ((n) < QPV ? (n) : QPV)
static void q8_block(const float *x, long ldx, const signed char *w, long n, float *t,
                     int add, long mr) {
#define QB(MR_, NV_, CH_) q8_block_rows(x, ldx, w, n, t, add, MR_, NVC(NV_), CH_)
    switch (mr) {
        case 1: QB(1, 4, 2); break;
        case 2: QB(2, 4, 1); break;
        case 3: QB(3, 2, 2); break;
        default: QB(4, 2, 1); break;
    }
#undef QB
}

/* One panel (nc <= QPW output features) for mr <= QMB rows of x. */
static void q8_panel(const float *x, long ldx, const signed char *qp, const float *sp,
                     long G, long I, long mr, float *y, long ldy, long nc, const float *b,
                     int act, const float *res) {
    float part[QMB][QPW], tot[QMB][QPW];
    for (long i0 = 0, g = 0; i0 < I; i0 += G, g++) {
        long i1 = i0 + G < I ? i0 + G : I;
        for (long k = i0; k < i1; k += QKB)
            q8_block(x + k, ldx, qp + k * QPW, (i1 - k < QKB ? i1 - k : QKB), part[0], k > i0,
                     mr);
        vf s[QPV];
        for (int c = 0; c < QPV; c++) s[c] = loadv(sp + g * QPW + c * VL);
        for (long m = 0; m < mr; m++)
            for (int c = 0; c < QPV; c++) {
                vf v = loadv(part[m] + c * VL) * s[c];
                storev(tot[m] + c * VL, g ? loadv(tot[m] + c * VL) + v : v);
            }
    }
    for (long m = 0; m < mr; m++)
        for (long j = 0; j < nc; j++) {
            float v = tot[m][j] + (b ? b[j] : 0.0f);
            if (act) v = gelu_tanh(v);
            if (res) v += res[m * ldy + j];
            y[m * ldy + j] = v;
        }
}

/* y (M, O) = act(x (M, I; row stride ldx)·(q·s)ᵀ + b) (+ res), q and s packed by
 * tl_q8_pack with the same G; b and res may be NULL, res may be y. */
void tl_linear_q8(const float *x, long ldx, const signed char *qp, const float *sp, long G,
                  const float *b, float *y, long M, long I, long O, int threads, int act,
                  const float *res) {
    long panels = (O + QPW - 1) / QPW, groups = (I + G - 1) / G;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < panels; p++) {
        long o0 = p * QPW, nc = O - o0 < QPW ? O - o0 : QPW;
        for (long m0 = 0; m0 < M; m0 += QMB) {
            long mr = M - m0 < QMB ? M - m0 : QMB;
            q8_panel(x + m0 * ldx, ldx, qp + p * I * QPW, sp + p * groups * QPW, G, I, mr,
                     y + m0 * O + o0, O, nc, b ? b + o0 : 0, act, res ? res + m0 * O + o0 : 0);
        }
    }
}
