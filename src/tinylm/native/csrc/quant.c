/* y = x·(q·s)ᵀ + b for the few rows of a decoding step, from int8 weights.
 *
 * q (O, I) int8 and s (O, ceil(I / G)) float32 are tinylm.quantize's QuantizedLinear:
 * row o's input features are cut into consecutive groups of G (the last may be shorter)
 * and W[o, i] = q[o, i]·s[o, i / G]. A decoding step reads each
 * int8 row once from memory (a quarter of the fp32 bytes) and reuses it from L1 for all
 * M <= 16 rows of x; each group's scale multiplies the converted weights once, as the
 * reference dequantizes them, and serves every row:
 *
 *     y[m, o] = act(Σ_i x[m, i]·(q[o, i]·s[o, i / G]) + b[o]) (+ res[m, o])
 *
 * The inner loop converts VL int8 weights to floats (sign-extend + convert: AVX-512,
 * AVX2, SSE4.1; lane by lane elsewhere), scales them (per-channel scales: once, on the
 * finished dot product) and adds them times VL floats of x
 * into vector accumulators: a tile of OT output features × up to QR rows of x, at most
 * 8 accumulators (with one or two rows, CH independent chains per pair hide the FMA
 * latency); one horizontal sum per output feature and row at the end. Tiles of output
 * features are split among the threads. y may be res (a residual stream updated in
 * place), never x.
 */
#include "tinylm.h"

#define QR 4 /* at most this many rows of x accumulated together */

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

/* dots[o][m] = Σ_i x[m·ldx + i]·q[o·I + i]·s[o·groups + i / G] for o < OT, m < MR: OT
 * consecutive output features (their int8 rows q and scales s), MR rows of x, CH chains
 * per pair (OT·MR·CH <= 8 accumulators). */
static inline __attribute__((always_inline)) void q8_dots(
        const float *x, long ldx, const signed char *q, const float *s, long groups, long G,
        long I, float dots[4][QR], const int OT, const int MR, const int CH) {
    vf acc[4][QR][2];
    float tail[4][QR];
    for (int o = 0; o < OT; o++)
        for (int m = 0; m < MR; m++) {
            tail[o][m] = 0.0f;
            for (int h = 0; h < CH; h++) acc[o][m][h] = (vf){0};
        }
    /* One group per row (per-channel scales, the default): Σ_i x_i·q_i·s = s·Σ_i x_i·q_i,
     * so the scale multiplies the finished dot product instead of every weight vector
     * (one multiply fewer per VL weights; the rounding differs from the reference's
     * dequantize-then-multiply by a few ulps). */
    if (groups == 1) {
        long i = 0;
        for (; i + CH * VL <= I; i += CH * VL)
            for (int h = 0; h < CH; h++)
                for (int o = 0; o < OT; o++) {
                    vf w = load_q(q + o * I + i + h * VL);
                    for (int m = 0; m < MR; m++)
                        acc[o][m][h] += w * loadv(x + m * ldx + i + h * VL);
                }
        for (; i + VL <= I; i += VL)
            for (int o = 0; o < OT; o++) {
                vf w = load_q(q + o * I + i);
                for (int m = 0; m < MR; m++) acc[o][m][0] += w * loadv(x + m * ldx + i);
            }
        for (; i < I; i++)
            for (int o = 0; o < OT; o++)
                for (int m = 0; m < MR; m++) tail[o][m] += (float)q[o * I + i] * x[m * ldx + i];
        for (int o = 0; o < OT; o++)
            for (int m = 0; m < MR; m++) {
                vf sum = acc[o][m][0];
                for (int h = 1; h < CH; h++) sum += acc[o][m][h];
                dots[o][m] = (hsum(sum) + tail[o][m]) * s[o];
            }
        return;
    }
    for (long i0 = 0, g = 0; i0 < I; i0 += G, g++) {
        long i1 = i0 + G < I ? i0 + G : I, i = i0;
        vf sg[4];
        for (int o = 0; o < OT; o++) sg[o] = splat(s[o * groups + g]);
        for (; i + CH * VL <= i1; i += CH * VL)
            for (int h = 0; h < CH; h++)
                for (int o = 0; o < OT; o++) {
                    vf w = load_q(q + o * I + i + h * VL) * sg[o];
                    for (int m = 0; m < MR; m++)
                        acc[o][m][h] += w * loadv(x + m * ldx + i + h * VL);
                }
        for (; i + VL <= i1; i += VL)
            for (int o = 0; o < OT; o++) {
                vf w = load_q(q + o * I + i) * sg[o];
                for (int m = 0; m < MR; m++) acc[o][m][0] += w * loadv(x + m * ldx + i);
            }
        for (; i < i1; i++)
            for (int o = 0; o < OT; o++) {
                float w = (float)q[o * I + i] * s[o * groups + g];
                for (int m = 0; m < MR; m++) tail[o][m] += w * x[m * ldx + i];
            }
    }
    for (int o = 0; o < OT; o++)
        for (int m = 0; m < MR; m++) {
            vf sum = acc[o][m][0];
            for (int h = 1; h < CH; h++) sum += acc[o][m][h];
            dots[o][m] = hsum(sum) + tail[o][m];
        }
}

/* dots[o][m] for the OT (1, 2 or 4) output features from q times the mr <= RB(OT) rows
 * of x: each blocking keeps <= 8 accumulators. */
static void q8_tile(const float *x, long ldx, const signed char *q, const float *scale,
                    long groups, long G, long I, float dots[4][QR], long mr, int OT) {
#define Q8(OT_, MR_, CH_) q8_dots(x, ldx, q, scale, groups, G, I, dots, OT_, MR_, CH_)
    switch (OT * 16 + (int)mr) {
        case 4 * 16 + 1: Q8(4, 1, 2); break;
        case 4 * 16 + 2: Q8(4, 2, 1); break;
        case 2 * 16 + 1: Q8(2, 1, 2); break;
        case 2 * 16 + 2: Q8(2, 2, 2); break;
        case 2 * 16 + 3: Q8(2, 3, 1); break;
        case 2 * 16 + 4: Q8(2, 4, 1); break;
        case 1 * 16 + 1: Q8(1, 1, 2); break;
        case 1 * 16 + 2: Q8(1, 2, 2); break;
        case 1 * 16 + 3: Q8(1, 3, 2); break;
        default: Q8(1, 4, 2); break;
    }
#undef Q8
}

/* Output features in tiles of OT and rows of x in blocks of RB: OT = 4 for one or two
 * rows (one x vector then serves four weight rows), else 2 × blocks of 4 rows (each
 * converted weight vector serves 4 rows, each x vector 2 weight rows); a last partial
 * tile goes one feature at a time. */
void tl_linear_q8(const float *x, long ldx, const signed char *q, const float *scale,
                  long G, const float *b, float *y, long M, long I, long O,
                  int threads, int act, const float *res) {
    long groups = (I + G - 1) / G;
    int OT = M <= 2 ? 4 : 2;
    long RB = M <= 2 ? 2 : 4, tiles = (O + OT - 1) / OT;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tiles; t++) {
        long o0 = t * OT, ot = O - o0 < OT ? O - o0 : OT;
        for (long m0 = 0; m0 < M; m0 += RB) {
            long mr = M - m0 < RB ? M - m0 : RB;
            float dots[4][QR];
            for (long o = 0; o < ot; o += (ot == OT ? OT : 1))
                q8_tile(x + m0 * ldx, ldx, q + (o0 + o) * I, scale + (o0 + o) * groups,
                        groups, G, I, dots + o, mr, ot == OT ? OT : 1);
            for (long o = 0; o < ot; o++)
                for (long m = 0; m < mr; m++) {
                    float v = dots[o][m] + (b ? b[o0 + o] : 0.0f);
                    if (act) v = gelu_tanh(v);
                    if (res) v += res[(m0 + m) * O + o0 + o];
                    y[(m0 + m) * O + o0 + o] = v;
                }
        }
    }
}
