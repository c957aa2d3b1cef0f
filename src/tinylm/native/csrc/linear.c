/* y = x·Wᵀ + b for the few rows of a decoding step.
 *
 * A cached decoding step multiplies 1..16 rows by every weight matrix once, so its
 * speed is how fast the weights stream from memory. BLAS GEMV/GEMM kernels are tuned
 * for other shapes; this one reads each weight exactly once, sequentially, with
 * software prefetch, and keeps the few input rows in registers/L1.
 *
 * Weights are packed once into panels of PW = 32 output features:
 *     packed[p][i][j] = W[p·PW + j][i]      (zero for p·PW + j >= O)
 * so a panel is one contiguous (I, PW) block: for each input feature i, PW weights
 * that update PW accumulators per row with broadcast FMAs (no horizontal sums).
 * Threads (OpenMP) split the panels.
 */
#include "tinylm.h"

#define PW 32                 /* output features per panel */
#define PV (PW / VL)          /* vectors per panel row: 2 (AVX-512), 4 (AVX2), 8 */
#define PREFETCH_AHEAD 2048   /* floats (8 KiB) ahead of the current panel row */

/* The register blocking of MR rows: MR·CG accumulators, CG weight vectors and a broadcast
 * must fit the vector registers. AVX-512 (32 zmm): a whole panel row (CG = PV = 2) for up
 * to 8 rows. 16 registers (AVX2 ymm, SSE/NEON-sized xmm): columns in groups of CG = 2
 * vectors, up to 6 rows (12 accumulators) -- over KB panel rows at a time, so the panel
 * rows of one block are read from L1 once per group, and from memory once. */
#define CG 2
#if VL == 16
#define MR_MAX 8
#else
#define MR_MAX 6
#endif
#define KB 128                /* panel rows per block (KB·PW·4 = 16 KiB) */

/* The end of every panel: y = acc + b, then GELU (act) or + res (a residual stream). */
static inline void epilogue(const float *t, float *y, long nc, const float *b, int act,
                            const float *res) {
    for (long j = 0; j < nc; j++) {
        float val = t[j] + (b ? b[j] : 0.0f);
        if (act) val = gelu_tanh(val);
        if (res) val += res[j];
        y[j] = val;
    }
}

long tl_packed_size(long O, long I) { return (O + PW - 1) / PW * I * PW; }

/* W (O, I) row-major -> panels (ceil(O/PW), I, PW). */
void tl_pack(const float *W, float *out, long O, long I, int threads) {
    long panels = (O + PW - 1) / PW;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < panels; p++) {
        float *panel = out + p * I * PW;
        for (long j = 0; j < PW; j++) {
            long o = p * PW + j;
            if (o < O) {
                const float *row = W + o * I;
                for (long i = 0; i < I; i++) panel[i * PW + j] = row[i];
            } else {
                for (long i = 0; i < I; i++) panel[i * PW + j] = 0.0f;
            }
        }
    }
}

/* One panel times MR rows of x: y[m][0:nc] = Σ_i x[m][i]·panel[i][0:nc] + b[0:nc]. */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, long ldx, const float *pw, long I, float *y, long ldy, long nc,
        const float *b, int act, const float *res, const int MR) {
    float t[MR_MAX][PW];  /* the accumulators between blocks, then the epilogue's input */
    for (long i0 = 0; i0 < I; i0 += KB) {
        long i1 = i0 + KB < I ? i0 + KB : I;
        for (int g = 0; g < PV; g += CG) {
            vf acc[MR_MAX][CG];
            for (int m = 0; m < MR; m++)
                for (int c = 0; c < CG; c++)
                    acc[m][c] = i0 ? loadv(t[m] + (g + c) * VL) : (vf){0};
            for (long i = i0; i < i1; i++) {
                const float *w = pw + i * PW + g * VL;
                for (int c = 0; c < CG * VL; c += 16) __builtin_prefetch(w + PREFETCH_AHEAD + c);
                vf wv[CG];
                for (int c = 0; c < CG; c++) {
                    wv[c] = loadv(w + c * VL);
                    KEEP_IN_REGISTER(wv[c]);
                }
                for (int m = 0; m < MR; m++) {
                    float xv = x[m * ldx + i];
                    for (int c = 0; c < CG; c++) acc[m][c] += wv[c] * xv;
                }
            }
            for (int m = 0; m < MR; m++)
                for (int c = 0; c < CG; c++) storev(t[m] + (g + c) * VL, acc[m][c]);
        }
    }
    for (int m = 0; m < MR; m++)
        epilogue(t[m], y + m * ldy, nc, b, act, res ? res + m * ldy : 0);
}

#define PANEL_KERNEL(MR)                                                                 \
static void panel_##MR(const float *x, long ldx, const float *pw, long I, float *y,     \
                       long ldy, long nc, const float *b, int act, const float *res) {  \
    panel_rows(x, ldx, pw, I, y, ldy, nc, b, act, res, MR);                             \
}
PANEL_KERNEL(2) PANEL_KERNEL(3) PANEL_KERNEL(4) PANEL_KERNEL(5) PANEL_KERNEL(6)
#if MR_MAX == 8
PANEL_KERNEL(7) PANEL_KERNEL(8)
#endif

/* One row: independent accumulators for CH consecutive i (even and odd) hide the FMA
 * latency, as many as the registers hold (CH·PV accumulators). */
#define CH (PV <= 4 ? 2 : 1)
static void panel_1(const float *x, long ldx, const float *pw, long I, float *y, long ldy,
                    long nc, const float *b, int act, const float *res) {
    (void)ldx; (void)ldy;
    vf a[CH][PV];
    for (int h = 0; h < CH; h++)
        for (int c = 0; c < PV; c++) a[h][c] = (vf){0};
    long i = 0;
    for (; i + CH <= I; i += CH) {
        const float *w = pw + i * PW;
        for (int c = 0; c < CH * PW; c += 16) __builtin_prefetch(w + PREFETCH_AHEAD + c);
        for (int h = 0; h < CH; h++) {
            float xv = x[i + h];
            for (int c = 0; c < PV; c++) a[h][c] += loadv(w + h * PW + c * VL) * xv;
        }
    }
    for (; i < I; i++) {
        const float *w = pw + i * PW;
        for (int c = 0; c < PV; c++) a[0][c] += loadv(w + c * VL) * x[i];
    }
    float t[PW];
    for (int c = 0; c < PV; c++) {
        vf sum = a[0][c];
        for (int h = 1; h < CH; h++) sum += a[h][c];
        storev(t + c * VL, sum);
    }
    epilogue(t, y, nc, b, act, res);
}

typedef void (*panel_fn)(const float *, long, const float *, long, float *, long, long,
                         const float *, int, const float *);
static const panel_fn PANEL[MR_MAX + 1] = {0, panel_1, panel_2, panel_3, panel_4, panel_5,
                                       panel_6,
#if MR_MAX == 8
                                       panel_7, panel_8
#endif
};

/* y (M, O) = x (M, I; row stride ldx) · Wᵀ + b, W given packed by tl_pack; b may be NULL.
 * act = 1 applies GELU (tanh) to the result; res (M, O), if not NULL, is added last (a
 * residual connection; res may be y itself: each element is read before it is written). */
void tl_linear(const float *x, long ldx, const float *packed, const float *b, float *y,
               long M, long I, long O, int threads, int act, const float *res) {
    long panels = (O + PW - 1) / PW;
    long passes = (M + MR_MAX - 1) / MR_MAX, step = passes ? (M + passes - 1) / passes : 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < panels; p++) {
        long nc = O - p * PW < PW ? O - p * PW : PW;
        for (long m0 = 0; m0 < M; m0 += step) {
            long mr = M - m0 < step ? M - m0 : step;
            PANEL[mr](x + m0 * ldx, ldx, packed + p * I * PW, I, y + m0 * O + p * PW, O, nc,
                      b ? b + p * PW : 0, act, res ? res + m0 * O + p * PW : 0);
        }
    }
}
