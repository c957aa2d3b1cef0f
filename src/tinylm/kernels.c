/* tinylm's native CPU kernel: y = x·Wᵀ + b for the few rows of a decoding step.
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
 *
 * Built and loaded by kernels.py with the system C compiler; GCC vector extensions
 * compile to AVX-512, AVX2 or NEON depending on -march=native.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#define PW 32                 /* output features per panel: two 16-float vectors */
#define PREFETCH_AHEAD 2048   /* floats (8 KiB) ahead of the current panel row */

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* GELU with GPT-2's tanh approximation, as F.gelu(x, approximate="tanh"). */
static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

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

/* x (B, E) = tok[ids[b]] + pos[position]; returns 1 (and writes nothing) if an id is
 * outside [0, V). */
int tl_embed(const long *ids, const float *tok, const float *pos, long position, float *x,
             long B, long E, long V) {
    for (long b = 0; b < B; b++) if (ids[b] < 0 || ids[b] >= V) return 1;
    const float *p = pos + position * E;
    for (long b = 0; b < B; b++) {
        const float *t = tok + ids[b] * E;
        for (long i = 0; i < E; i++) x[b * E + i] = t[i] + p[i];
    }
    return 0;
}

/* Greedy decoding's argmax over each row of x (B, V): the first index of the row's
 * largest value, or of its first NaN (torch.argmax's convention). Two vectorised passes
 * over the row (max, then the first index holding it) instead of one scalar pass. */
typedef int i16 __attribute__((vector_size(64)));

static long row_argmax(const float *x, long V) {
    long i = 0;
    float best;
    if (V >= 16) {
        v16 m = load16(x);
        i16 nan = m != m;
        for (i = 16; i + 16 <= V; i += 16) {
            v16 v = load16(x + i);
            i16 gt = v > m;
            nan |= v != v;
            m = (v16)(((i16)v & gt) | ((i16)m & ~gt));
        }
        best = m[0];
        int any_nan = 0;
        for (int j = 0; j < 16; j++) {
            best = m[j] > best ? m[j] : best;
            any_nan |= nan[j];
        }
        for (; i < V; i++) { best = x[i] > best ? x[i] : best; any_nan |= x[i] != x[i]; }
        if (any_nan) {
            for (long k = 0; k < V; k++) if (x[k] != x[k]) return k;
        }
    } else {
        best = x[0];
        for (i = 1; i < V; i++) {
            if (x[i] != x[i]) return i;
            best = x[i] > best ? x[i] : best;
        }
        if (x[0] != x[0]) return 0;
    }
    for (long k = 0; k < V; k++) if (x[k] == best) return k;
    return 0;
}

void tl_argmax(const float *x, long B, long V, long ldx, long *out, int threads) {
    #pragma omp parallel for num_threads(B > 1 ? threads : 1) schedule(static)
    for (long b = 0; b < B; b++) out[b] = row_argmax(x + b * ldx, V);
}

/* One decoding step of attention for every (batch row, head): store the new key and
 * value at position `pos` of the cache, then
 *     out = softmax(q·Kᵀ · scale) · V      over cached positions 0..pos
 * reading each cached key and value once. q, k, v are (B, H, D) with strides (sb, sh, 1)
 * (views into the fused qkv projection, no copy); the cache layer is (B, H, max_len, D)
 * with strides (csb, csh, D, 1); out is (B, H, D) contiguous; scratch holds B·H·(pos+1)
 * floats. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum16(v16 a) {  /* a tree of halvings: 4 dependent adds, not 15 */
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline float dot(const float *a, const float *b, long D) {
    v16 acc = {0};
    long i = 0;
    for (; i + 16 <= D; i += 16) acc += load16(a + i) * load16(b + i);
    float s = hsum16(acc);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

/* o[0:D] += p · x[0:D] */
static inline void axpy(float *o, float p, const float *x, long D) {
    long i = 0;
    for (; i + 16 <= D; i += 16) store16(o + i, load16(o + i) + load16(x + i) * p);
    for (; i < D; i++) o[i] += p * x[i];
}

void tl_attend_one(const float *q, long qsb, long qsh, const float *k, long ksb, long ksh,
                   const float *v, long vsb, long vsh, float *kc, float *vc, long csb,
                   long csh, long B, long H, long D, long pos, float scale, float *out,
                   float *scratch, int threads) {
    long T = pos + 1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long bh = 0; bh < B * H; bh++) {
        long b = bh / H, h = bh % H;
        float *kcache = kc + b * csb + h * csh, *vcache = vc + b * csb + h * csh;
        memcpy(kcache + pos * D, k + b * ksb + h * ksh, D * sizeof(float));
        memcpy(vcache + pos * D, v + b * vsb + h * vsh, D * sizeof(float));
        const float *qv = q + b * qsb + h * qsh;
        float *s = scratch + bh * T, m = -__builtin_inff(), sum = 0.0f;
        for (long t = 0; t < T; t++) {
            s[t] = dot(qv, kcache + t * D, D) * scale;
            m = s[t] > m ? s[t] : m;
        }
        for (long t = 0; t < T; t++) { s[t] = __builtin_expf(s[t] - m); sum += s[t]; }
        float *o = out + bh * D, inv = 1.0f / sum;
        for (long i = 0; i < D; i++) o[i] = 0.0f;
        for (long t = 0; t < T; t++) axpy(o, s[t] * inv, vcache + t * D, D);
    }
}

/* --- GELU (tanh approximation) for training: the backward with the forward recomputed
 * in the same pass (here), and the FFN's bias add + GELU (tl_bias_gelu, below). torch's CPU gelu(approximate="tanh") runs ~5x slower
 * than a plain tanh here; these stream at close to memory speed. */

static inline v16 vsel(i16 mask, v16 a, v16 b) {  /* mask ? a : b, lane by lane */
    return (v16)(((i16)a & mask) | ((i16)b & ~mask));
}

/* exp(x), Cephes' single-precision polynomial after reduction by ln 2 (~1 ulp). */
static inline v16 vexp(v16 x) {
    const v16 hi = (v16){0} + 88.0f, lo = (v16){0} - 87.0f;
    x = vsel(x > hi, hi, x);
    x = vsel(x < lo, lo, x);
    v16 t = x * 1.44269504088896341f + 12582912.0f;  /* round(x / ln 2) in the low bits */
    v16 n = t - 12582912.0f;
    i16 ni = (i16)t - 0x4B400000;
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = (v16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v16)((i16)p + (ni << 23));  /* times 2^n */
}

#define GELU_C 0.7978845608028654f  /* sqrt(2 / pi) */
#define GELU_K 0.044715f

static inline v16 vtanh_inner(v16 x) {  /* tanh(sqrt(2/pi)·(x + 0.044715·x³)) */
    v16 u = GELU_C * (x + GELU_K * x * x * x);
    return 1.0f - 2.0f / (vexp(2.0f * u) + 1.0f);
}

static inline float tanh_inner(float x) { return tanhf(GELU_C * (x + GELU_K * x * x * x)); }

/* Column sums over rows shared out between threads: each thread adds into its own zeroed
 * row of n floats (colsums_row), and colsums_finish adds the rows into out and frees
 * them. If the rows cannot be allocated (NULL), out is zeroed here and the caller runs
 * one thread, which adds straight into out. */
static float *colsums_begin(int threads, long n, float *out) {
    float *rows = calloc((size_t)threads * (size_t)n, sizeof(float));
    if (!rows) memset(out, 0, sizeof(float) * (size_t)n);
    return rows;
}

static inline float *colsums_row(float *rows, int id, long n, float *out) {
    return rows ? rows + (long)id * n : out;
}

static void colsums_finish(float *rows, int threads, long n, float *out) {
    if (!rows) return;
    for (long i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int t = 0; t < threads; t++) sum += rows[(long)t * n + i];
        out[i] = sum;
    }
    free(rows);
}

/* dL/dx = grad · GELU'(x) for one row of n floats, in place in grad; y (if not NULL)
 * receives GELU(x) from the same tanh, and colsum (if not NULL) accumulates dL/dx. */
static inline void gelu_backward_row(const float *x, float *grad, float *y, float *colsum,
                                     long n) {
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 v = load16(x + i), t = vtanh_inner(v), right = 1.0f + t;
        v16 d = 0.5f * right
              + 0.5f * v * (1.0f - t * t) * (GELU_C * (1.0f + 3.0f * GELU_K * v * v));
        v16 gx = load16(grad + i) * d;
        if (y) store16(y + i, 0.5f * v * right);
        store16(grad + i, gx);
        if (colsum) store16(colsum + i, load16(colsum + i) + gx);
    }
    for (; i < n; i++) {
        float v = x[i], t = tanh_inner(v), right = 1.0f + t;
        float d = 0.5f * right
                + 0.5f * v * (1.0f - t * t) * (GELU_C * (1.0f + 3.0f * GELU_K * v * v));
        if (y) y[i] = 0.5f * v * right;
        grad[i] *= d;
        if (colsum) colsum[i] += grad[i];
    }
}

/* grad (M, N) holds dL/dGELU(x) and is overwritten with dL/dx; y (if not NULL) receives
 * GELU(x), the recomputed forward; colsum (N floats, if not NULL) receives dL/dx summed
 * over the M rows -- the gradient of a bias added before the GELU -- so no separate
 * pass re-reads dL/dx for it. */
void tl_gelu_backward(const float *x, float *grad, float *y, float *colsum, long M, long N,
                      int threads) {
    if (threads < 1) threads = 1;
    int rows_n = threads;
    float *rows = colsum ? colsums_begin(rows_n, N, colsum) : NULL;
    if (colsum && !rows) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float *acc = colsum ? colsums_row(rows, id, N, colsum) : NULL;
        long lo = M * id / nt, hi = M * (id + 1) / nt;
        for (long m = lo; m < hi; m++)
            gelu_backward_row(x + m * N, grad + m * N, y ? y + m * N : NULL, acc, N);
    }
    if (colsum) colsums_finish(rows, rows_n, N, colsum);
}

/* The FFN's middle in one pass: h = a + b (in place; b broadcast over the M rows, may be
 * NULL) and g = GELU(h), for a (M, N). Replaces a broadcast copy of the bias, the GEMM's
 * accumulate into it, and a separate GELU pass. */
void tl_bias_gelu(float *a, const float *b, float *g, long M, long N, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        float *h = a + m * N, *y = g + m * N;
        long i = 0;
        for (; i + 16 <= N; i += 16) {
            v16 v = load16(h + i);
            if (b) { v += load16(b + i); store16(h + i, v); }
            store16(y + i, 0.5f * v * (1.0f + vtanh_inner(v)));
        }
        for (; i < N; i++) {
            float v = h[i] + (b ? b[i] : 0.0f);
            h[i] = v;
            y[i] = 0.5f * v * (1.0f + tanh_inner(v));
        }
    }
}

/* --- Causal self-attention for training, straight from the fused QKV projection.
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

static inline long round16(long n) { return (n + 15) / 16 * 16; }

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
void tl_attn_fwd(float *qkv, const float *bias, float *out, float *lse, long B, long C,
                 long H, long D, float scale, int threads) {
    long ld = 3 * H * D, HD = H * D, Cp = round16(C);
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * (D * Cp + C * Cp));
        float *p = kt + D * Cp;
        #pragma omp for schedule(static)
        for (long bh = 0; bh < B * H; bh++) {
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
}

/* dqkv (B, C, 3, H, D) from dout (B, C, H, D) contiguous, with the forward's qkv, out
 * and lse. Every element of dqkv is written. dbias (3·H·D floats, or NULL) receives
 * dqkv summed over the B·C rows: the gradient of the projection's bias. */
void tl_attn_bwd(const float *qkv, const float *out, const float *dout, const float *lse,
                 float *dqkv, float *dbias, long B, long C, long H, long D, float scale,
                 int threads) {
    long ld = 3 * H * D, HD = H * D, Cp = round16(C);
    if (threads < 1) threads = 1;
    int rows_n = threads;
    float *rows = dbias ? colsums_begin(rows_n, ld, dbias) : NULL;
    if (dbias && !rows) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        float *kt = malloc(sizeof(float) * (2 * D * Cp + 2 * C * Cp + C));
        float *vt = kt + D * Cp, *p = vt + D * Cp, *ds = p + C * Cp, *di = ds + C * Cp;
        float *db = dbias ? colsums_row(rows, omp_get_thread_num(), ld, dbias) : NULL;
        #pragma omp for schedule(static)
        for (long bh = 0; bh < B * H; bh++) {
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
}

/* --- LayerNorm as F.layer_norm (biased variance, eps inside the square root; w and b may
 * be NULL): the forward keeps each row's mean and 1/std for the backward; both are
 * vectorised along the row and split over rows between threads. Decoding runs the
 * forward on its few rows with one thread.
 * dw and db are column sums over all rows: per-thread partial sums, added at the end
 * (kept interleaved per thread here: separate colsums_* rows ran slower). */

static inline float hsum_row(const float *x, long E) {
    v16 acc = {0};
    long i = 0;
    for (; i + 16 <= E; i += 16) acc += load16(x + i);
    float s = hsum16(acc);
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
        v16 acc = {0};
        long i = 0;
        for (; i + 16 <= E; i += 16) { v16 d = load16(xm + i) - mu; acc += d * d; }
        float var = hsum16(acc);
        for (; i < E; i++) { float d = xm[i] - mu; var += d * d; }
        float r = 1.0f / sqrtf(var / (float)E + eps);
        mean[m] = mu;
        rstd[m] = r;
        for (i = 0; i + 16 <= E; i += 16) {
            v16 v = (load16(xm + i) - mu) * r;
            if (w) v *= load16(w + i);
            if (b) v += load16(b + i);
            store16(ym + i, v);
        }
        for (; i < E; i++)
            ym[i] = (xm[i] - mu) * r * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
    }
}

/* dx = rstd · (g - mean(g) - x̂ · mean(g · x̂)) with g = dy · w and x̂ = (x - mean) · rstd;
 * dw = Σ_rows dy · x̂, db = Σ_rows dy (either may be NULL). */
void tl_ln_bwd(const float *x, const float *w, const float *mean, const float *rstd,
               const float *dy, float *dx, float *dw, float *db, long M, long E,
               int threads) {
    if (threads < 1) threads = 1;
    int sums = dw || db;
    float *partial = sums ? calloc((size_t)threads * 2 * (size_t)E, sizeof(float)) : NULL;
    float *row_g = NULL;
    #pragma omp parallel num_threads(threads) private(row_g)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float *pw = partial ? partial + (long)id * 2 * E : NULL, *pb = pw ? pw + E : NULL;
        float local[2 * 256];  /* per-row scratch when E is small; else heap */
        row_g = E <= 256 ? local : malloc(sizeof(float) * 2 * E);
        float *xh = row_g + E;
        long lo = M * id / nt, hi = M * (id + 1) / nt;
        for (long m = lo; m < hi; m++) {
            const float *xm = x + m * E, *dym = dy + m * E;
            float mu = mean[m], r = rstd[m];
            v16 sg = {0}, sgx = {0};
            long i = 0;
            for (; i + 16 <= E; i += 16) {
                v16 xhat = (load16(xm + i) - mu) * r, d = load16(dym + i);
                v16 g = w ? d * load16(w + i) : d;
                store16(row_g + i, g);
                store16(xh + i, xhat);
                sg += g;
                sgx += g * xhat;
                if (pw) {
                    store16(pw + i, load16(pw + i) + d * xhat);
                    store16(pb + i, load16(pb + i) + d);
                }
            }
            float s_g = hsum16(sg), s_gx = hsum16(sgx);
            for (; i < E; i++) {
                float xhat = (xm[i] - mu) * r, d = dym[i], g = w ? d * w[i] : d;
                row_g[i] = g;
                xh[i] = xhat;
                s_g += g;
                s_gx += g * xhat;
                if (pw) { pw[i] += d * xhat; pb[i] += d; }
            }
            float a = s_g / (float)E, c = s_gx / (float)E;
            float *dxm = dx + m * E;
            for (i = 0; i + 16 <= E; i += 16)
                store16(dxm + i, (load16(row_g + i) - a - load16(xh + i) * c) * r);
            for (; i < E; i++) dxm[i] = (row_g[i] - a - xh[i] * c) * r;
        }
        if (E > 256) free(row_g);
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
}
