/* y = x·Wᵀ + b for the few rows of a decoding step, W stored as GGUF's blocks
 * (tinylm.layers.blocks.BlockLinear holds the bytes of a GGUF tensor as they are, or what
 * tinylm quantize wrote with the same arithmetic).
 *
 * A row of W is ceil(I / 32) blocks of 32 weights (the last one zero-padded past I):
 *     Q4_0 (type 2, 18 bytes): fp16 d, 16 bytes of codes   w = d·(q − 8)
 *     Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, 16 bytes    w = d·q + m
 *     Q8_0 (type 8, 34 bytes): fp16 d, 32 int8 codes       w = d·q
 * where a 4-bit block's byte j holds code j in its low nibble and code 16 + j in its high.
 * tl_blocks_pack moves the codes and scales once (when a decoder is built; the model keeps
 * the GGUF bytes) into panels of 16 rows, the same bytes per weight (layout below).
 *
 * The activations are quantized as llama.cpp quantizes them (its Q8_0/Q8_1 activations):
 * each row of x is cut into blocks of 32 (zeros past I), and a block with largest
 * magnitude a gets dx = a / 127 and integers qx = rint(x / dx) (round half to even;
 * tinylm.layers.blocks.quantize_activations is the same in torch). Each product of a
 * weight block with an activation block is then an exact integer dot product, scaled once:
 *
 *     y[m, o] = Σ_b d[o,b]·dx[m,b]·(Σ_j c[o,b,j]·qx[m,b,j] − off·Σ_j qx[m,b,j])
 *               (+ m[o,b]·dx[m,b]·Σ_j qx[m,b,j] for Q4_1)
 *
 * with c the unsigned nibbles (off = 8 for Q4_0, 0 for Q4_1) or Q8_0's codes (read
 * unsigned, + 128, off = 128; or signed with AVX2, off = 0). The only error against the
 * float32 product is the activations' rounding, |x − dx·qx| <= dx / 2 per element
 * (tests/test_blocks.py holds the kernel to that bound and, within float rounding, to the
 * torch form of the same integer arithmetic).
 *
 * The integer dot products: AVX-512 VNNI (vpdpbusd: one 64-byte chunk of a panel times
 * four activations broadcast gives the 16 rows' sums), AVX2 (vpmaddubsw + vpmaddwd, half
 * a chunk per vector; Q8_0's signs moved onto the activations as llama.cpp does), or
 * portable C. Panels are split among the threads; each walks its panels once per tile of
 * up to TB rows of x, every chunk of codes serving all rows of the tile. y may be res (a
 * residual stream updated in place), never x.
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

/* One row of x (I floats) -> nb blocks of 32 int8 (zeros past I), ix[b] = Σ qx (the term
 * of the codes' offsets), dx[b] = a / 127 and sx[b] = dx[b]·Σ qx (of Q4_1's minimums). */
static void quantize_row(const float *x, long I, long nb, signed char *q, int *ix, float *dx,
                         float *sx) {
    for (long b = 0; b < nb; b++) {
        float v[QK] = {0}, amax = 0.0f;
        long n = I - b * QK < QK ? I - b * QK : QK;
        memcpy(v, x + b * QK, (size_t)n * sizeof(float));
        int finite = 1;
        for (int j = 0; j < QK; j++) {
            amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
            finite &= fabsf(v[j]) <= 3.4028235e38f;  /* false for inf and NaN */
        }
        float d = finite ? amax / 127.0f : __builtin_nanf("");  /* NaN reaches y */
        float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int c = (int)rintf(v[j] * id);
            q[b * QK + j] = (signed char)c;
            sum += c;
        }
        ix[b] = sum;
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

/* --- the panels: tl_blocks_pack's layout, read by the kernel ------------------------------
 *
 * PW = 16 rows of W (output features; zero rows past O) make a panel, and each block of
 * 32 input features of a panel is one record of
 *     codes: Q4: 4 chunks of 64 bytes; byte 4j + k of chunk c holds, in its low nibble,
 *                code 4c + k of row j's block and in its high nibble code 4(c + 4) + k;
 *            Q8_0: 8 chunks of 64 bytes; byte 4j + k of chunk t holds code 4t + k of row
 *                j, plus 128 (unsigned);
 *     d: the 16 rows' fp16 scales (32 bytes), and for Q4_1 their fp16 minimums (32 bytes)
 * so one 64-byte chunk times four activations broadcast is one vpdpbusd: lane j gets the
 * four products of row j. A block record is 288 bytes for 16·32 Q4_0 weights, the 18 bytes
 * per 32 of GGUF (Q4_1 320, Q8_0 544); the codes and scales are GGUF's, moved. */
#define PW 16

static long codes_bytes(long type) { return type == T_Q8_0 ? 8 * 64 : 4 * 64; }
static long record_bytes(long type) {
    return codes_bytes(type) + 2 * PW * (type == T_Q4_1 ? 2 : 1);
}

long tl_blocks_packed_size(long type, long O, long I) {
    if (!tl_block_bytes(type)) return 0;
    return (O + PW - 1) / PW * ((I + QK - 1) / QK) * record_bytes(type);
}

/* Code e (0..31) of a GGUF block as the panel stores it: a nibble, or Q8_0's int8 + 128. */
static inline unsigned char gguf_code(const unsigned char *blk, long type, int e) {
    if (type == T_Q8_0) return (unsigned char)(blk[2 + e] ^ 0x80);
    const unsigned char *qs = blk + (type == T_Q4_1 ? 4 : 2);
    return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
}

void tl_blocks_pack(const unsigned char *w, long type, unsigned char *out, long O, long I,
                    int threads) {
    long nb = (I + QK - 1) / QK, bs = tl_block_bytes(type), rb = record_bytes(type);
    long cb = codes_bytes(type), panels = (O + PW - 1) / PW;
    if (!bs) return;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < panels; p++)
        for (long b = 0; b < nb; b++) {
            unsigned char *rec = out + (p * nb + b) * rb;
            memset(rec, 0, (size_t)rb);
            for (long j = 0; j < PW && p * PW + j < O; j++) {
                const unsigned char *blk = w + (p * PW + j) * nb * bs + b * bs;
                for (int e = 0; e < QK; e++) {
                    int t = e / 4, k = e % 4;
                    unsigned char c = gguf_code(blk, type, e);
                    if (type == T_Q8_0) rec[64 * t + 4 * j + k] = c;
                    else rec[64 * (t & 3) + 4 * j + k] |= (unsigned char)(c << (t < 4 ? 0 : 4));
                }
                memcpy(rec + cb + 2 * j, blk, 2);  /* d */
                if (type == T_Q4_1) memcpy(rec + cb + 2 * PW + 2 * j, blk + 2, 2);  /* m */
            }
        }
}

/* The offset of the codes in the integer sums: Q4_0's 8; Q8_0's 128 where the codes are
 * read unsigned (VNNI, portable), 0 where AVX2 reads them signed. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_OFFSET 128
#elif defined(__AVX2__)
#define Q8_OFFSET 0
#else
#define Q8_OFFSET 128
#endif

/* out[m][0..PW) = the panel's rows times row m of x, for MR <= TB rows (qx as int32 words:
 * 8 per block, ldq per row; ix = Σqx, dx, sx = dx·Σqx per block, nb per row). */
static inline __attribute__((always_inline)) void panel_t(
        const unsigned char *pp, const int TYPE, long nb, const int *qx, long ldq,
        const int *ix, const float *dx, const float *sx, const int MR, float out[][PW]) {
    const long cb = TYPE == T_Q8_0 ? 512 : 256;
    const long rb = cb + (TYPE == T_Q4_1 ? 64 : 32);
    const int off = TYPE == T_Q4_0 ? 8 : TYPE == T_Q8_0 ? Q8_OFFSET : 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 accf[TB];
    for (int m = 0; m < MR; m++) accf[m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (long b = 0; b < nb; b++) {
        const unsigned char *rec = pp + b * rb;
        __m512i a0[TB], a1[TB];
        for (int m = 0; m < MR; m++) a0[m] = a1[m] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const int *xw = qx + 8 * b + c;
            if (TYPE == T_Q8_0) {
                __m512i u0 = _mm512_loadu_si512(rec + 64 * c);
                __m512i u1 = _mm512_loadu_si512(rec + 64 * (c + 4));
                for (int m = 0; m < MR; m++) {
                    a0[m] = _mm512_dpbusd_epi32(a0[m], u0, _mm512_set1_epi32(xw[m * ldq]));
                    a1[m] = _mm512_dpbusd_epi32(a1[m], u1, _mm512_set1_epi32(xw[m * ldq + 4]));
                }
            } else {
                __m512i v = _mm512_loadu_si512(rec + 64 * c);
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int m = 0; m < MR; m++) {
                    a0[m] = _mm512_dpbusd_epi32(a0[m], lo, _mm512_set1_epi32(xw[m * ldq]));
                    a1[m] = _mm512_dpbusd_epi32(a1[m], hi, _mm512_set1_epi32(xw[m * ldq + 4]));
                }
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));
        __m512 mn = TYPE == T_Q4_1
            ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb + 32)))
            : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) {
            __m512i i = _mm512_add_epi32(a0[m], a1[m]);
            if (off) i = _mm512_sub_epi32(i, _mm512_set1_epi32(off * ix[m * nb + b]));
            accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i),
                                      _mm512_mul_ps(d, _mm512_set1_ps(dx[m * nb + b])), accf[m]);
            if (TYPE == T_Q4_1)
                accf[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[m * nb + b]), accf[m]);
        }
    }
    for (int m = 0; m < MR; m++) _mm512_storeu_ps(out[m], accf[m]);
#elif defined(__AVX2__)
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {  /* rows 8h .. 8h + 7: bytes 32h .. 32h + 31 of a chunk */
        __m256 accf[TB];
        for (int m = 0; m < MR; m++) accf[m] = _mm256_setzero_ps();
        for (long b = 0; b < nb; b++) {
            const unsigned char *rec = pp + b * rb + 32 * h;
            __m256i a0[TB], a1[TB];
            for (int m = 0; m < MR; m++) a0[m] = a1[m] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const int *xw = qx + 8 * b + c;
                __m256i u0, u1;
                if (TYPE == T_Q8_0) {
                    u0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + 64 * c)),
                                          _mm256_set1_epi8((char)0x80));  /* signed codes */
                    u1 = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(rec + 64 * (c + 4))),
                        _mm256_set1_epi8((char)0x80));
                } else {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * c));
                    u0 = _mm256_and_si256(v, low);
                    u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                for (int m = 0; m < MR; m++) {
                    __m256i x0 = _mm256_set1_epi32(xw[m * ldq]);
                    __m256i x1 = _mm256_set1_epi32(xw[m * ldq + 4]);
                    if (TYPE == T_Q8_0) {  /* |q|·(x·sign q): vpmaddubsw cannot overflow */
                        x0 = _mm256_sign_epi8(x0, u0), x1 = _mm256_sign_epi8(x1, u1);
                        a0[m] = _mm256_add_epi32(a0[m], _mm256_madd_epi16(_mm256_maddubs_epi16(
                            _mm256_sign_epi8(u0, u0), x0), ones));
                        a1[m] = _mm256_add_epi32(a1[m], _mm256_madd_epi16(_mm256_maddubs_epi16(
                            _mm256_sign_epi8(u1, u1), x1), ones));
                    } else {
                        a0[m] = _mm256_add_epi32(a0[m], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(u0, x0), ones));
                        a1[m] = _mm256_add_epi32(a1[m], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(u1, x1), ones));
                    }
                }
            }
            const unsigned char *sc = pp + b * rb + cb + 16 * h;
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
            __m256 mn = TYPE == T_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)))
                                       : _mm256_setzero_ps();
            for (int m = 0; m < MR; m++) {
                __m256i i = _mm256_add_epi32(a0[m], a1[m]);
                if (off) i = _mm256_sub_epi32(i, _mm256_set1_epi32(off * ix[m * nb + b]));
                accf[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i),
                                          _mm256_mul_ps(d, _mm256_set1_ps(dx[m * nb + b])),
                                          accf[m]);
                if (TYPE == T_Q4_1)
                    accf[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[m * nb + b]), accf[m]);
            }
        }
        for (int m = 0; m < MR; m++) _mm256_storeu_ps(out[m] + 8 * h, accf[m]);
    }
#else
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < PW; j++) out[m][j] = 0.0f;
    for (long b = 0; b < nb; b++) {
        const unsigned char *rec = pp + b * rb;
        for (int j = 0; j < PW; j++) {
            float d = half_to_float(rec + cb + 2 * j);
            float mn = TYPE == T_Q4_1 ? half_to_float(rec + cb + 2 * PW + 2 * j) : 0.0f;
            for (int m = 0; m < MR; m++) {
                const signed char *a = (const signed char *)(qx + m * ldq + 8 * b);
                int s = 0;
                for (int e = 0; e < QK; e++) {
                    int t = e / 4, k = e % 4;
                    int c = TYPE == T_Q8_0 ? rec[64 * t + 4 * j + k]
                          : (rec[64 * (t & 3) + 4 * j + k] >> (t < 4 ? 0 : 4)) & 15;
                    s += c * a[e];
                }
                s -= off * ix[m * nb + b];
                out[m][j] += (float)s * (d * dx[m * nb + b]);
                if (TYPE == T_Q4_1) out[m][j] += mn * sx[m * nb + b];
            }
        }
    }
#endif
}

static void panel(const unsigned char *pp, long type, long nb, const int *qx, long ldq,
                  const int *ix, const float *dx, const float *sx, long mr, float out[][PW]) {
#define PANEL_CASE(T_, MR_) \
    case T_ * TB + MR_: panel_t(pp, T_, nb, qx, ldq, ix, dx, sx, MR_, out); break;
#define PANEL_TYPE(T_) PANEL_CASE(T_, 1) PANEL_CASE(T_, 2) PANEL_CASE(T_, 3) PANEL_CASE(T_, 4)
    switch (type * TB + mr) { PANEL_TYPE(T_Q4_0) PANEL_TYPE(T_Q4_1) PANEL_TYPE(T_Q8_0) }
#undef PANEL_TYPE
#undef PANEL_CASE
}

/* y (M, O) = act(x (M, I; row stride ldx)·Wᵀ + b) (+ res), W (O, ceil(I/32) blocks of
 * `type`) packed by tl_blocks_pack; b and res may be NULL, res may be y. */
void tl_linear_blocks(const float *x, long ldx, const unsigned char *packed, long type,
                      const float *b, float *y, long M, long I, long O, int threads, int act,
                      const float *res) {
    long nb = (I + QK - 1) / QK, rb = record_bytes(type), panels = (O + PW - 1) / PW;
    if (!tl_block_bytes(type) || M <= 0 || O <= 0 || I <= 0) return;
    int q[TB * nb * 8], ix[TB * nb];  /* int32 words: 4 activations each */
    float dx[TB * nb], sx[TB * nb];
    #pragma omp parallel num_threads(threads)
    for (long m0 = 0; m0 < M; m0 += TB) {
        long mr = M - m0 < TB ? M - m0 : TB;
        #pragma omp single
        for (long m = 0; m < mr; m++)
            quantize_row(x + (m0 + m) * ldx, I, nb, (signed char *)(q + m * nb * 8),
                         ix + m * nb, dx + m * nb, sx + m * nb);
        #pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) {
            float out[TB][PW];
            panel(packed + p * nb * rb, type, nb, q, nb * 8, ix, dx, sx, mr, out);
            for (long m = 0; m < mr; m++)
                for (long j = 0; j < PW && p * PW + j < O; j++) {
                    long o = p * PW + j, at = (m0 + m) * O + o;
                    float v = out[m][j] + (b ? b[o] : 0.0f);
                    if (act) v = gelu_tanh(v);
                    y[at] = res ? v + res[at] : v;
                }
        }
    }
}
