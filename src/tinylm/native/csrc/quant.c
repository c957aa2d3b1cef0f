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
 * broadcast x[m, i] into VL accumulators of output features, for every row m of a tile
 * of up to QMB = 4 rows: each converted weight vector serves all those rows, each
 * broadcast all the vectors of the column group, and there are no horizontal sums.
 * A panel is read in blocks of QKB input features, software prefetch ahead; each block
 * is read from memory once and reread from L1 by its other passes: the other column
 * groups, and for 5-8 rows the second tile of rows (up to QSB = 8 rows share one walk
 * over the panel, block by block; more rows walk it again, from cache). The integer
 * sums of a group are scaled once per group with a vector of its QPW scales
 * (per-channel scales: once, at the end); the bias, GELU (the vector form of GPT-2's
 * tanh approximation, x·σ(2u)) and residual are added a vector at a time. Panels are
 * split among the threads. y may be res (a residual stream updated in place), never x.
 */
#include "tinylm.h"

#define QPW 32              /* output features per panel */
#define QPV (QPW / VL)      /* vectors per panel row: 2 (AVX-512), 4 (AVX2), 8 */
#define QKB 256             /* input features per block: QKB·QPW bytes (8 KiB) stay in L1 */
#define QMB 4               /* rows of x per register tile */
#define QSB (2 * QMB)       /* rows of x per walk over a panel */
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

/* The register blocking of mr <= QMB rows: (rows, vectors per column group, chains), at
 * most 12 accumulators plus the weight vectors and a broadcast in 16 registers. (On Zen 3
 * eight rows in one tile, 8 × 1 vectors, measured slower than two tiles of 4 × 2: a
 * broadcast per FMA; 6 × 2 and 4 × 3 tiles, 24-feature panels, measured no faster; a
 * dot-product layout, 8 features of 8 outputs per 64-byte chunk with 8 features of each
 * row loaded instead of one broadcast, measured 0.9×.) */
#define NVC(n) ((n) < QPV ? (n) : QPV)
#define Q8_TILES(X) \
    X(1, 4, 2) X(2, 4, 1) X(3, 2, 2) X(4, 2, 1)

/* The whole panel row block (QPV vectors) for mr <= QMB rows, one pass per column group. */
static void q8_block(const float *x, long ldx, const signed char *w, long n, float *t,
                     int add, long mr) {
#define Q8_CASE(MR_, NV_, CH_)                                                           \
    case MR_:                                                                            \
        for (int c = 0; c < QPV; c += NVC(NV_))                                          \
            q8_cols(x, ldx, w + c * VL, n, t + c * VL, add, MR_, NVC(NV_), CH_);         \
        break;
    switch (mr) { Q8_TILES(Q8_CASE) }
#undef Q8_CASE
}

/* GELU (tanh approximation) of VL values: x·σ(2u) = x / (1 + e^(-2u)). */
static inline vf q8_gelu(vf x) {
    return x / (1.0f + vexp(x * (-2.0f * GELU_C) * (1.0f + GELU_K * x * x)));
}

/* The end of a panel for one row: y = act(tot + b) (+ res), nc <= QPW values. */
static void q8_epilogue(const float *tot, float *y, long nc, const float *b, int act,
                        const float *res) {
    long j = 0;
    if (nc == QPW)
        for (; j < QPW; j += VL) {
            vf v = loadv(tot + j);
            if (b) v += loadv(b + j);
            if (act) v = q8_gelu(v);
            if (res) v += loadv(res + j);
            storev(y + j, v);
        }
    for (; j < nc; j++) {
        float v = tot[j] + (b ? b[j] : 0.0f);
        if (act) v = gelu_tanh(v);
        if (res) v += res[j];
        y[j] = v;
    }
}

/* One panel (nc <= QPW output features) for mr <= QSB rows of x: for each block of input
 * features, every tile of rows (the block is read from memory once, by the first). */
static void q8_panel(const float *x, long ldx, const signed char *qp, const float *sp,
                     long G, long I, long mr, float *y, long ldy, long nc, const float *b,
                     int act, const float *res) {
    float part[QSB][QPW], tot[QSB][QPW];
    for (long i0 = 0, g = 0; i0 < I; i0 += G, g++) {
        long i1 = i0 + G < I ? i0 + G : I;
        for (long k = i0; k < i1; k += QKB)
            for (long m0 = 0; m0 < mr; m0 += QMB)
                q8_block(x + m0 * ldx + k, ldx, qp + k * QPW, (i1 - k < QKB ? i1 - k : QKB),
                         part[m0], k > i0, mr - m0 < QMB ? mr - m0 : QMB);
        vf s[QPV];
        for (int c = 0; c < QPV; c++) s[c] = loadv(sp + g * QPW + c * VL);
        for (long m = 0; m < mr; m++)
            for (int c = 0; c < QPV; c++) {
                vf v = loadv(part[m] + c * VL) * s[c];
                storev(tot[m] + c * VL, g ? loadv(tot[m] + c * VL) + v : v);
            }
    }
    for (long m = 0; m < mr; m++)
        q8_epilogue(tot[m], y + m * ldy, nc, b, act, res ? res + m * ldy : 0);
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
        for (long m0 = 0; m0 < M; m0 += QSB) {
            long mr = M - m0 < QSB ? M - m0 : QSB;
            q8_panel(x + m0 * ldx, ldx, qp + p * I * QPW, sp + p * groups * QPW, G, I, mr,
                     y + m0 * O + o0, O, nc, b ? b + o0 : 0, act, res ? res + m0 * O + o0 : 0);
        }
    }
}
