/* tinylm's native CPU kernels: the one header every source file includes.
 *
 * It holds the shared vector helpers (GCC vector extensions of the target's own width,
 * VL floats: AVX-512, AVX2 or NEON/SSE depending on -march=native) and, marked TL_API, the declaration of every
 * exported function. tinylm/native/ops.py reads its ctypes signatures from these
 * declarations, so a signature is written once, here.
 *
 * Functions that allocate return int: 0 on success, TL_NOMEM when memory ran out (the
 * outputs are then incomplete and the caller raises MemoryError).
 */
#ifndef TINYLM_H
#define TINYLM_H

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#define TL_API __attribute__((visibility("default")))
#define TL_NOMEM 1

/* The native vector: VL floats, the widest the target computes in one register (GCC
 * vector extensions of any other width are split or spilled). Every vector loop steps by
 * VL; the sizes the kernels pad to (round16, head sizes that are multiples of 16, panels
 * of 32 output features) stay multiples of VL. */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else  /* SSE, NEON, AltiVec, ...: 16-byte registers (scalar code where there are none) */
#define VL 4
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int vi __attribute__((vector_size(VL * 4)));

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }

/* A loaded vector that serves several FMAs of a register-blocked micro-kernel stays in a
 * register: without this GCC folds the load into every FMA (a memory operand per FMA),
 * which makes the kernel load-bound where a 512-bit load issues at one per cycle (AMD
 * Zen 4): attention.c's products ran 1.9× slower so. */
#if defined(__x86_64__) && defined(__AVX__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif
static inline long round16(long n) { return (n + 15) / 16 * 16; }

/* The lanes' indices {0, 1, ..., VL - 1} (constant-folded). */
static inline vf lane_index(void) {
    vf l;
    for (int i = 0; i < VL; i++) l[i] = (float)i;
    return l;
}

/* Interleave the low (ILO) or high (IHI) halves of a and b lane by lane: a0 b0 a1 b1 ... */
#if VL == 16
#define ILO(a, b) __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, \
                                          4, 20, 5, 21, 6, 22, 7, 23)
#define IHI(a, b) __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, \
                                          12, 28, 13, 29, 14, 30, 15, 31)
#elif VL == 8
#define ILO(a, b) __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11)
#define IHI(a, b) __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15)
#else
#define ILO(a, b) __builtin_shufflevector(a, b, 0, 4, 1, 5)
#define IHI(a, b) __builtin_shufflevector(a, b, 2, 6, 3, 7)
#endif

typedef float v4 __attribute__((vector_size(16)));

static inline v4 low4(vf a) {  /* the sum of a's VL / 4 quarters: a tree of halvings */
#if VL == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
#elif VL == 8
    return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
    return a;
#endif
}

static inline float hsum(vf a) {  /* log2(VL) dependent adds, not VL - 1 */
    v4 c = low4(a);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline float hmax(vf a) {  /* the largest lane (no NaN handling) */
    float m = a[0];
    for (int t = 1; t < VL; t++) m = a[t] > m ? a[t] : m;
    return m;
}

static inline float dot(const float *a, const float *b, long D) {
    vf acc = {0};
    long i = 0;
    for (; i + VL <= D; i += VL) acc += loadv(a + i) * loadv(b + i);
    float s = hsum(acc);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

/* o[0:D] += p · x[0:D] */
static inline void axpy(float *o, float p, const float *x, long D) {
    long i = 0;
    for (; i + VL <= D; i += VL) storev(o + i, loadv(o + i) + loadv(x + i) * p);
    for (; i < D; i++) o[i] += p * x[i];
}

static inline vf vsel(vi mask, vf a, vf b) {  /* mask ? a : b, lane by lane */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp(x), Cephes' single-precision polynomial after reduction by ln 2 (~1 ulp). */
static inline vf vexp(vf x) {
    const vf hi = splat(88.0f), lo = splat(-87.0f);
    x = vsel(x > hi, hi, x);
    x = vsel(x < lo, lo, x);
    vf t = x * 1.44269504088896341f + 12582912.0f;  /* round(x / ln 2) in the low bits */
    vf n = t - 12582912.0f;
    vi ni = (vi)t - 0x4B400000;
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (vf)((vi)p + (ni << 23));  /* times 2^n */
}

#define GELU_C 0.7978845608028654f  /* sqrt(2 / pi) */
#define GELU_K 0.044715f

static inline vf vtanh_inner(vf x) {  /* tanh(sqrt(2/pi)·(x + 0.044715·x³)) */
    vf u = GELU_C * (x + GELU_K * x * x * x);
    return 1.0f - 2.0f / (vexp(2.0f * u) + 1.0f);
}

static inline float tanh_inner(float x) { return tanhf(GELU_C * (x + GELU_K * x * x * x)); }

/* Column sums over rows shared out between threads: each thread adds into its own zeroed
 * row of n floats (colsums_row), and colsums_finish adds the rows into out and frees
 * them. If the rows cannot be allocated (NULL), out is zeroed here and the caller runs
 * one thread, which adds straight into out. */
static inline float *colsums_begin(int threads, long n, float *out) {
    float *rows = calloc((size_t)threads * (size_t)n, sizeof(float));
    if (!rows) memset(out, 0, sizeof(float) * (size_t)n);
    return rows;
}

static inline float *colsums_row(float *rows, int id, long n, float *out) {
    return rows ? rows + (long)id * n : out;
}

static inline void colsums_finish(float *rows, int threads, long n, float *out) {
    if (!rows) return;
    for (long i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int t = 0; t < threads; t++) sum += rows[(long)t * n + i];
        out[i] = sum;
    }
    free(rows);
}

/* GELU with GPT-2's tanh approximation, as F.gelu(x, approximate="tanh"). */
static inline float gelu_tanh(float x) { return 0.5f * x * (1.0f + tanh_inner(x)); }

/* --- exported functions (one line of documentation each; details in the .c files) --- */

/* gemm.c: c (M, N) = a·b or c += a·b for training's products (x·Wᵀ, G·W, Gᵀ·X); a through
 * two strides, b as stored (wt = 0) or a weight W (N, K) used transposed (wt = 1). */
TL_API long tl_gemm_work(long N, long K, int wt);
TL_API void tl_gemm(long M, long N, long K, const float *a, long sam, long sak,
                    const float *b, long ldb, int wt, float *c, long ldc, int accumulate,
                    float *work, int threads);

/* train_block.c: a GPT-2 block's training step, forward and backward, one call each, every
 * product on gemm.c's kernel. The tensors' addresses come in one int64 array, slot BT_*
 * (0: absent): the block's input and parameters; the activations the forward writes
 * and the backward reads; dL/dy, and the gradients the backward writes; scratch
 * (S_ACT, S_GRAD: N·F floats; S_ATTN: N·HD; S_QKV: N·3·HD; S_T1, S_GX1: N·E) and the
 * products' work (tl_block_work floats). */
#define BT_X 0
#define BT_LN1_W 1
#define BT_LN1_B 2
#define BT_W_QKV 3
#define BT_B_QKV 4
#define BT_W_OUT 5
#define BT_B_OUT 6
#define BT_LN2_W 7
#define BT_LN2_B 8
#define BT_W_UP 9
#define BT_B_UP 10
#define BT_W_DOWN 11
#define BT_B_DOWN 12
#define BT_Y 13
#define BT_MU1 14
#define BT_RS1 15
#define BT_A_IN 16
#define BT_QKV 17
#define BT_R 18
#define BT_LSE 19
#define BT_X1 20
#define BT_MU2 21
#define BT_RS2 22
#define BT_F_IN 23
#define BT_H 24
#define BT_GY 25
#define BT_GX 26
#define BT_G_LN1_W 27
#define BT_G_LN1_B 28
#define BT_G_W_QKV 29
#define BT_G_B_QKV 30
#define BT_G_W_OUT 31
#define BT_G_B_OUT 32
#define BT_G_LN2_W 33
#define BT_G_LN2_B 34
#define BT_G_W_UP 35
#define BT_G_B_UP 36
#define BT_G_W_DOWN 37
#define BT_G_B_DOWN 38
#define BT_S_ACT 39
#define BT_S_GRAD 40
#define BT_S_ATTN 41
#define BT_S_QKV 42
#define BT_S_T1 43
#define BT_S_GX1 44
#define BT_WORK 45
#define BT_SLOTS 46
TL_API long tl_block_work(long N, long E, long HD, long F);
TL_API int tl_block_fwd(const long *t, long B, long C, long E, long H, long D, long F,
                        float eps1, float eps2, float scale, int threads);
TL_API int tl_block_bwd(const long *t, long B, long C, long E, long H, long D, long F,
                        float scale, int threads);

/* linear.c: y = x·Wᵀ + b for the few rows of a decoding step, from a packed W. */
TL_API long tl_packed_size(long O, long I);
TL_API void tl_pack(const float *W, float *out, long O, long I, int threads);
TL_API void tl_linear(const float *x, long ldx, const float *packed, const float *b,
                      float *y, long M, long I, long O, int threads, int act,
                      const float *res);

/* quant.c: y = x·(q·s)ᵀ + b for a decoding step, q int8 (O, I), s (O, ceil(I/G)) fp32,
 * both packed once into panels by tl_q8_pack. */
TL_API long tl_q8_packed_size(long O, long I);
TL_API long tl_q8_scales_size(long O, long I, long G);
TL_API void tl_q8_pack(const signed char *q, const float *s, long G, signed char *qp,
                       float *sp, long O, long I, int threads);
TL_API void tl_linear_q8(const float *x, long ldx, const signed char *qp, const float *sp,
                         long G, const float *b, float *y, long M, long I, long O,
                         int threads, int act, const float *res);

/* blocks.c: y = x·Wᵀ + b for a decoding step, W as GGUF's Q4_0 / Q4_1 / Q8_0 blocks (type
 * 2, 3, 8; ceil(I/32) blocks per row), moved once into panels of 16 rows by tl_blocks_pack;
 * x quantized per block of 32. */
TL_API long tl_block_bytes(long type);
TL_API long tl_blocks_packed_size(long type, long O, long I);
TL_API void tl_blocks_pack(const unsigned char *w, long type, unsigned char *out, long O,
                           long I, int threads);
TL_API void tl_linear_blocks(const float *x, long ldx, const unsigned char *packed, long type,
                             const float *b, float *y, long M, long I, long O, int threads,
                             int act, const float *res);

/* decode.c: the other pieces of a decoding step. */
TL_API int tl_embed(const long *ids, const float *tok, const float *pos, long position,
                    float *x, long B, long E, long V);
TL_API int tl_embed_rows(const long *ids, const float *tok, const float *pos,
                         const long *positions, float *x, long B, long E, long V);
TL_API void tl_argmax(const float *x, long B, long V, long ldx, long *out, int threads);
TL_API void tl_attend_one(const float *q, long qsb, long qsh, const float *k, long ksb,
                          long ksh, const float *v, long vsb, long vsh, float *kc,
                          float *vc, long csb, long csh, long B, long H, long D, long pos,
                          float scale, float *out, float *scratch, int threads);
TL_API void tl_attend_rows(const float *qkv, long ld, float *kc, float *vc, long csb, long csh,
                           long B, long H, long Hkv, long D, const long *pos, float scale,
                           float *out, float *scratch, long ls, int threads);
/* Every block of a standard GPT for one decoding step, from a plan of PLAN_LAYER longs
 * per layer (pointers and sizes, built once by tinylm.native.decoding). */
#define PLAN_LINEAR 7   /* packed weights or blocks, int8 scales, int8 group (0: not int8),
                           bias, I, O, GGUF block type (0: none) */
#define PLAN_LAYER 32   /* LN1 weight, bias, 4 linears (qkv, out, up, down) between LN2's */
TL_API void tl_decode_layers(const long *plan, long n_layer, float *x, float *h, float *qkv,
                             float *r, float *u, float *stats, float *kc, float *vc, long cl,
                             long csb, long csh, long B, long E, long H, long D,
                             const long *pos, float eps, float scale, float *scratch, long ls,
                             int threads);

/* gelu.c: the FFN's bias add + GELU, and its backward with GELU recomputed. */
TL_API void tl_bias_gelu(float *a, const float *b, float *g, long M, long N, int threads);
TL_API void tl_gelu_backward(const float *x, float *grad, float *y, float *colsum, long M,
                             long N, int threads);

/* attention.c: causal attention for training, straight from the fused QKV projection. */
TL_API int tl_attn_fwd(float *qkv, const float *bias, float *out, float *lse, long B, long C,
                       long H, long D, float scale, int threads);
TL_API int tl_attn_bwd(const float *qkv, const float *out, const float *dout,
                       const float *lse, float *dqkv, float *dbias, long B, long C, long H,
                       long D, float scale, int threads);

/* layernorm.c: LayerNorm forward (keeping mean and 1/std) and backward. */
TL_API void tl_ln_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                      float *rstd, long M, long E, float eps, int threads);
TL_API void tl_ln_fwd_res(const float *x, const float *w, const float *b, float *y,
                          float *mean, float *rstd, const float *rb, float *rout, long M,
                          long E, float eps, int threads);
TL_API int tl_ln_bwd(const float *x, const float *w, const float *mean, const float *rstd,
                     const float *dy, const float *res, float *dx, float *dw, float *db,
                     float *dres, long M, long E, int threads);

/* variants.c: RMSNorm, QK-norm + rotary positions (with the grouped-query repeat into
 * the attention kernel's layout), ReLU²; forward and backward. */
TL_API void tl_rms_fwd(const float *x, const float *w, float *y, float *rs, long M, long E,
                       float eps, int threads);
TL_API void tl_rms_bwd(const float *x, const float *w, const float *rs, const float *dy,
                       const float *res, float *dx, float *dw, long M, long E, int threads);
TL_API int tl_qk_fwd(const float *qkv, const float *qw, const float *kw, const float *cos,
                     const float *sinpm, float *out, float *rs, long N, long C, long H,
                     long Hkv, long D, float eps, int norm, int threads);
TL_API int tl_qk_bwd(const float *dout, const float *qkv, const float *qw, const float *kw,
                     const float *rs, const float *cos, const float *sinpm, float *dqkv,
                     float *dw, long N, long C, long H, long Hkv, long D, int norm,
                     int threads);
TL_API void tl_rope_heads(float *x, long ld, long B, long n, long D, const float *w,
                          const float *c, const float *s, float eps, int norm, float *tmp);
TL_API void tl_rope_rows(float *x, long ld, long B, long n, long D, const float *w,
                         const float *c, const float *s, const long *pos, float eps, int norm,
                         float *tmp);
TL_API void tl_relu2(const float *h, float *g, long n, int threads);
TL_API void tl_relu2_backward(const float *h, float *grad, float *y, long n, int threads);

/* bpe.c: byte-level BPE encoding (GPT-2's pre-tokenization, merges by rank, a word cache);
 * merges holds (left id, right id, merged id) per rank, classes one byte per code point
 * (0 other, 1 letter, 2 number, 3 whitespace). tl_bpe_new returns NULL when out of memory,
 * tl_bpe_encode -1. */
TL_API void *tl_bpe_new(const unsigned *merges, long n_merges, const unsigned *byte_ids,
                        const unsigned char *classes);
TL_API void tl_bpe_free(void *bpe);
TL_API long tl_bpe_encode(void *bpe, const char *text, const long *ends, long n,
                          unsigned *out, long *lengths);
TL_API long tl_bpe_split(void *bpe, const char *text, long len, long *ends);

#endif
