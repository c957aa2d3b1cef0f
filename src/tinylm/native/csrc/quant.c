/* y = x·(q·s)ᵀ + b for the few rows of a decoding step, from int8 weights.
 *
 * q (O, I) int8 and s (O, ceil(I / G)) float32 are tinylm.quantize's QuantizedLinear:
 * row o's input features are cut into consecutive groups of G (the last may be shorter)
 * and W[o, i] = q[o, i]·s[o, i / G]. A decoding step reads each
 * int8 row once from memory (a quarter of the fp32 bytes) and reuses it from L1 for all
 * M <= 16 rows of x; the scale is applied once per group in the accumulation:
 *
 *     y[m, o] = act(Σ_g s[o, g]·Σ_{i in g} x[m, i]·q[o, i] + b[o]) (+ res[m, o])
 *
 * The inner dot product is a plain loop that the compiler vectorises for the CPU it is
 * built for (-march=native: AVX-512 or AVX2 sign-extend + convert + FMA, NEON on ARM);
 * without vector units it is the same loop, scalar. Output features are split among
 * the threads. y may be res (a residual stream updated in place), never x.
 */
#include "tinylm.h"

#define QROWS 16 /* rows of x accumulated together */

void tl_linear_q8(const float *x, long ldx, const signed char *q, const float *scale,
                  long G, const float *b, float *y, long M, long I, long O,
                  int threads, int act, const float *res) {
    long groups = (I + G - 1) / G;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < O; o++) {
        const signed char *qo = q + o * I;
        const float *so = scale + o * groups;
        for (long m0 = 0; m0 < M; m0 += QROWS) {
            long mr = M - m0 < QROWS ? M - m0 : QROWS;
            float acc[QROWS] = {0};
            for (long g = 0; g < groups; g++) {
                long i0 = g * G, i1 = i0 + G < I ? i0 + G : I;
                for (long m = 0; m < mr; m++) {
                    const float *xm = x + (m0 + m) * ldx;
                    float dot = 0.0f;
                    #pragma omp simd reduction(+ : dot)
                    for (long i = i0; i < i1; i++) dot += xm[i] * (float)qo[i];
                    acc[m] += so[g] * dot;
                }
            }
            for (long m = 0; m < mr; m++) {
                float v = acc[m] + (b ? b[o] : 0.0f);
                if (act) v = gelu_tanh(v);
                if (res) v += res[(m0 + m) * O + o];
                y[(m0 + m) * O + o] = v;
            }
        }
    }
}
