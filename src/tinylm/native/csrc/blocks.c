/* y = x·Wᵀ + b for the few rows of a decoding step, W stored as GGUF's blocks, read as
 * they are (tinylm.layers.blocks.BlockLinear holds the bytes of a GGUF tensor, or what
 * tinylm quantize wrote with the same arithmetic).
 *
 * A row of W is ceil(I / 32) blocks of 32 weights (the last one zero-padded past I):
 *     Q4_0 (type 2, 18 bytes): fp16 d, 16 bytes of codes   w = d·(q − 8)
 *     Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, 16 bytes    w = d·q + m
 *     Q8_0 (type 8, 34 bytes): fp16 d, 32 int8 codes       w = d·q
 * where a 4-bit block's byte j holds code j in its low nibble and code 16 + j in its high.
 *
 * The activations are quantized as llama.cpp quantizes them (its Q8_0/Q8_1 activations):
 * each row of x is cut into blocks of 32 (zeros past I), and a block with largest
 * magnitude a gets dx = a / 127 and integers qx = rint(x / dx) (round half to even;
 * tinylm.layers.blocks.quantize_activations is the same in torch). Each product of a
 * weight block with an activation block is then an integer dot product, scaled once:
 *
 *     y[m, o] = Σ_b d[o,b]·dx[m,b]·Σ_j c[o,b,j]·qx[m,b,j]  (− 8·d·dx·Σ_j qx for Q4_0,
 *                                                           + m·dx·Σ_j qx for Q4_1)
 *
 * with c the unsigned nibbles (Q4) or the int8 codes (Q8_0). The only error against the
 * float32 product is the activations' rounding, |x − dx·qx| <= dx / 2 per element
 * (tests/test_blocks.py holds the kernel to that bound and, within float rounding, to
 * the torch form of the same integer arithmetic).
 *
 * The integer dot products: AVX-512 VNNI (vpdpbusd on 256-bit vectors: unsigned codes
 * times signed activations, the Q8_0 codes offset by 128), AVX2 (vpmaddubsw + vpmaddwd,
 * the Q8_0 codes' signs moved onto the activations as llama.cpp does), or portable C.
 * Output features are split among the threads; each thread walks its rows of W once per
 * tile of up to TB rows of x, every unpacked weight block serving all rows of the tile.
 * y may be res (a residual stream updated in place), never x.
 */
#include "tinylm.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32  /* weights per block */
#define TB 4   /* rows of x per tile */

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 };

long tl_block_bytes(long type) {
    return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q8_0 ? 34 : 0;
}

/* An IEEE half (its bits) as a float. */
static inline float half_to_float(const unsigned char *p) {
    unsigned short h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    unsigned sign = (unsigned)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, f = h & 0x3FF, bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | (f << 13);  /* inf, NaN */
    } else if (e) {
        bits = sign | ((e + 112) << 23) | (f << 13);
    } else if (!f) {
        bits = sign;
    } else {  /* subnormal: normalise */
        e = 113;
        while (!(f & 0x400)) { f <<= 1; e--; }
        bits = sign | (e << 23) | ((f & 0x3FF) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* One row of x (I floats) -> nb blocks of 32 int8 (zeros past I), dx[b] = a / 127 and
 * sx[b] = dx[b]·Σ qx (the term of the codes' offsets and minimums). */
static void quantize_row(const float *x, long I, long nb, signed char *q, float *dx,
                         float *sx) {
    for (long b = 0; b < nb; b++) {
        float v[QK] = {0}, amax = 0.0f;
        long n = I - b * QK < QK ? I - b * QK : QK;
        memcpy(v, x + b * QK, (size_t)n * sizeof(float));
        for (int j = 0; j < QK; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int c = (int)rintf(v[j] * id);
            q[b * QK + j] = (signed char)c;
            sum += c;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

#if defined(__AVX2__)
typedef __m256i block_t;  /* 32 codes as bytes, in element order */

/* Σ over 8 lanes of 4 products each: unsigned codes u (<= 255) times signed a. */
static inline __m256i dot_us(__m256i u, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}

static inline block_t unpack4(const unsigned char *qs) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* Σ_j c_j·a_j over one block as 8 int32 lanes; Q8_0's codes are signed. */
static inline __m256i block_dot(block_t c, const signed char *a, int q8) {
    __m256i av = _mm256_loadu_si256((const __m256i *)a);
    if (!q8) return dot_us(c, av);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return dot_us(_mm256_xor_si256(c, _mm256_set1_epi8((char)0x80)), av);  /* c + 128 */
#else
    return dot_us(_mm256_sign_epi8(c, c), _mm256_sign_epi8(av, c));  /* |c|·(a·sign c) */
#endif
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* The offset of Q8_0's codes in the integer sums (128 where VNNI adds it), else 0. */
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_OFFSET 128.0f
#else
#define Q8_OFFSET 0.0f
#endif

/* out[m] = Σ_b (row o of W)·(row m of x) for mr <= TB quantized rows (row stride nb·32). */
static void row_dot(const unsigned char *w, long type, long nb, const signed char *q,
                    const float *dx, const float *sx, long mr, float *out) {
    long bs = tl_block_bytes(type);
    int q8 = type == T_Q8_0;
    float off = type == T_Q4_0 ? -8.0f : q8 ? -Q8_OFFSET : 0.0f, corr[TB] = {0};
#if defined(__AVX2__)
    __m256 acc[TB];
    for (int m = 0; m < TB; m++) acc[m] = _mm256_setzero_ps();
#else
    float acc[TB] = {0};
#endif
    for (long b = 0; b < nb; b++) {
        const unsigned char *blk = w + b * bs;
        float d = half_to_float(blk), mn = type == T_Q4_1 ? half_to_float(blk + 2) : 0.0f;
        const unsigned char *codes = blk + (type == T_Q4_1 ? 4 : 2);
        float k = type == T_Q4_1 ? mn : d * off;  /* times dx·Σqx */
#if defined(__AVX2__)
        block_t c = q8 ? _mm256_loadu_si256((const __m256i *)codes) : unpack4(codes);
        for (long m = 0; m < mr; m++) {
            __m256i p = block_dot(c, q + m * nb * QK + b * QK, q8);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[m * nb + b]),
                                     acc[m]);
            corr[m] += k * sx[m * nb + b];
        }
#else
        int c[QK];
        for (int j = 0; j < QK; j++)
            c[j] = q8 ? (int)(signed char)codes[j] : (codes[j & 15] >> (j < 16 ? 0 : 4)) & 15;
        for (long m = 0; m < mr; m++) {
            const signed char *a = q + m * nb * QK + b * QK;
            int s = 0;
            for (int j = 0; j < QK; j++) s += c[j] * a[j];
            acc[m] += (float)s * (d * dx[m * nb + b]);
            corr[m] += k * sx[m * nb + b];
        }
#endif
    }
    for (long m = 0; m < mr; m++) {
#if defined(__AVX2__)
        out[m] = sum8(acc[m]) + corr[m];
#else
        out[m] = acc[m] + corr[m];
#endif
    }
}

/* y (M, O) = act(x (M, I; row stride ldx)·Wᵀ + b) (+ res), W (O, ceil(I/32) blocks of
 * `type`) as GGUF stores it; b and res may be NULL, res may be y. */
void tl_linear_blocks(const float *x, long ldx, const unsigned char *w, long type,
                      const float *b, float *y, long M, long I, long O, int threads, int act,
                      const float *res) {
    long nb = (I + QK - 1) / QK, bs = tl_block_bytes(type);
    if (!bs || M <= 0 || O <= 0 || I <= 0) return;
    signed char q[TB * nb * QK];
    float dx[TB * nb], sx[TB * nb];
    #pragma omp parallel num_threads(threads)
    for (long m0 = 0; m0 < M; m0 += TB) {
        long mr = M - m0 < TB ? M - m0 : TB;
        #pragma omp single
        for (long m = 0; m < mr; m++)
            quantize_row(x + (m0 + m) * ldx, I, nb, q + m * nb * QK, dx + m * nb, sx + m * nb);
        #pragma omp for schedule(static)
        for (long o = 0; o < O; o++) {
            float out[TB];
            row_dot(w + o * nb * bs, type, nb, q, dx, sx, mr, out);
            for (long m = 0; m < mr; m++) {
                float v = out[m] + (b ? b[o] : 0.0f);
                if (act) v = gelu_tanh(v);
                long at = (m0 + m) * O + o;
                y[at] = res ? v + res[at] : v;
            }
        }
    }
}
