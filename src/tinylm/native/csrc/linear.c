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

#define PW 32                 /* output features per panel: two 16-float vectors */
#define PREFETCH_AHEAD 2048   /* floats (8 KiB) ahead of the current panel row */

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
#define PANEL_KERNEL(MR)                                                                 \
static void panel_##MR(const float *x, long ldx, const float *pw, long I, float *y,     \
                       long ldy, long nc, const float *b, int act, const float *res) {  \
    v16 lo[MR], hi[MR];                                                                  \
    for (int m = 0; m < MR; m++) { lo[m] = (v16){0}; hi[m] = (v16){0}; }                 \
    for (long i = 0; i < I; i++) {                                                       \
        const float *w = pw + i * PW;                                                    \
        __builtin_prefetch(w + PREFETCH_AHEAD);                                          \
        __builtin_prefetch(w + PREFETCH_AHEAD + 16);                                     \
        v16 w0 = load16(w), w1 = load16(w + 16);                                         \
        for (int m = 0; m < MR; m++) {                                                   \
            float xv = x[m * ldx + i];                                                   \
            lo[m] += w0 * xv;                                                            \
            hi[m] += w1 * xv;                                                            \
        }                                                                                \
    }                                                                                    \
    for (int m = 0; m < MR; m++) {                                                       \
        float t[PW];                                                                     \
        store16(t, lo[m]);                                                               \
        store16(t + 16, hi[m]);                                                          \
        epilogue(t, y + m * ldy, nc, b, act, res ? res + m * ldy : 0);                 \
    }                                                                                    \
}
PANEL_KERNEL(2) PANEL_KERNEL(3) PANEL_KERNEL(4) PANEL_KERNEL(5)
PANEL_KERNEL(6) PANEL_KERNEL(7) PANEL_KERNEL(8)

/* One row: two independent accumulator pairs (even and odd i) hide the FMA latency. */
static void panel_1(const float *x, long ldx, const float *pw, long I, float *y, long ldy,
                    long nc, const float *b, int act, const float *res) {
    (void)ldx; (void)ldy;
    v16 a0 = {0}, a1 = {0}, c0 = {0}, c1 = {0};
    long i = 0;
    for (; i + 2 <= I; i += 2) {
        const float *w = pw + i * PW;
        __builtin_prefetch(w + PREFETCH_AHEAD);
        __builtin_prefetch(w + PREFETCH_AHEAD + 16);
        __builtin_prefetch(w + PREFETCH_AHEAD + 32);
        __builtin_prefetch(w + PREFETCH_AHEAD + 48);
        float x0 = x[i], x1 = x[i + 1];
        a0 += load16(w) * x0;
        a1 += load16(w + 16) * x0;
        c0 += load16(w + PW) * x1;
        c1 += load16(w + PW + 16) * x1;
    }
    for (; i < I; i++) {
        const float *w = pw + i * PW;
        a0 += load16(w) * x[i];
        a1 += load16(w + 16) * x[i];
    }
    float t[PW];
    store16(t, a0 + c0);
    store16(t + 16, a1 + c1);
    epilogue(t, y, nc, b, act, res);
}

typedef void (*panel_fn)(const float *, long, const float *, long, float *, long, long,
                         const float *, int, const float *);
static const panel_fn PANEL[9] = {0, panel_1, panel_2, panel_3, panel_4,
                                  panel_5, panel_6, panel_7, panel_8};

/* y (M, O) = x (M, I; row stride ldx) · Wᵀ + b, W given packed by tl_pack; b may be NULL.
 * act = 1 applies GELU (tanh) to the result; res (M, O), if not NULL, is added last (a
 * residual connection; res may be y itself: each element is read before it is written). */
void tl_linear(const float *x, long ldx, const float *packed, const float *b, float *y,
               long M, long I, long O, int threads, int act, const float *res) {
    long panels = (O + PW - 1) / PW;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < panels; p++) {
        long nc = O - p * PW < PW ? O - p * PW : PW;
        for (long m0 = 0; m0 < M; m0 += 8) {
            long mr = M - m0 < 8 ? M - m0 : 8;
            PANEL[mr](x + m0 * ldx, ldx, packed + p * I * PW, I, y + m0 * O + p * PW, O, nc,
                      b ? b + p * PW : 0, act, res ? res + m0 * O + p * PW : 0);
        }
    }
}
