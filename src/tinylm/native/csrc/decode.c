/* The rest of a decoding step: the embedding lookup, greedy decoding's argmax, and the
 * attention of one new token over the KV cache. */
#include "tinylm.h"

/* x (B, E) = tok[ids[b]] + pos[at[b · at_stride]]; returns 1 (and writes nothing) if an
 * id is outside [0, V). */
static int embed(const long *ids, const float *tok, const float *pos, const long *at,
                 long at_stride, float *x, long B, long E, long V) {
    for (long b = 0; b < B; b++) if (ids[b] < 0 || ids[b] >= V) return 1;
    for (long b = 0; b < B; b++) {
        const float *t = tok + ids[b] * E, *p = pos + at[b * at_stride] * E;
        for (long i = 0; i < E; i++) x[b * E + i] = t[i] + p[i];
    }
    return 0;
}

/* Every row at one position (a batch that started together). */
int tl_embed(const long *ids, const float *tok, const float *pos, long position, float *x,
             long B, long E, long V) {
    return embed(ids, tok, pos, &position, 0, x, B, E, V);
}

/* Row b at its own position positions[b] (a ragged batch: continuous batching). */
int tl_embed_rows(const long *ids, const float *tok, const float *pos, const long *positions,
                  float *x, long B, long E, long V) {
    return embed(ids, tok, pos, positions, 1, x, B, E, V);
}

/* Greedy decoding's argmax over each row of x (B, V): the first index of the row's
 * largest value, or of its first NaN (torch.argmax's convention). Two vectorised passes
 * over the row (max, then the first index holding it) instead of one scalar pass. */
static long row_argmax(const float *x, long V) {
    long i = 0;
    float best;
    if (V >= VL) {
        vf m = loadv(x);
        vi nan = m != m;
        for (i = VL; i + VL <= V; i += VL) {
            vf v = loadv(x + i);
            vi gt = v > m;
            nan |= v != v;
            m = (vf)(((vi)v & gt) | ((vi)m & ~gt));
        }
        best = m[0];
        int any_nan = 0;
        for (int j = 0; j < VL; j++) {
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

/* q·k for 4 consecutive cached keys at once: 4 independent chains over D. */
static inline void dot4(const float *q, const float *k, long D, float *out) {
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + VL <= D; i += VL) {
        vf qv = loadv(q + i);
        a0 += qv * loadv(k + i);
        a1 += qv * loadv(k + D + i);
        a2 += qv * loadv(k + 2 * D + i);
        a3 += qv * loadv(k + 3 * D + i);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; i < D; i++) {
        s0 += q[i] * k[i];
        s1 += q[i] * k[D + i];
        s2 += q[i] * k[2 * D + i];
        s3 += q[i] * k[3 * D + i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

#define AV 8  /* vectors of the output held in registers while the cached values stream */

/* o[0:D] = Σ_t p[t]·vc[t·D ..], t < T: AV·VL features at a time in registers. */
static void weighted_values(const float *p, const float *vc, long T, long D, float *o) {
    for (long i0 = 0; i0 < D; i0 += AV * VL) {
        long n = D - i0 < AV * VL ? D - i0 : AV * VL, nv = n / VL;
        vf acc[AV];
        float rest[AV * VL] = {0};
        for (int j = 0; j < AV; j++) acc[j] = (vf){0};
        for (long t = 0; t < T; t++) {
            const float *vt = vc + t * D + i0;
            vf pt = splat(p[t]);
            for (int j = 0; j < AV; j++)
                if (j < nv) acc[j] += pt * loadv(vt + j * VL);
            for (long i = nv * VL; i < n; i++) rest[i] += p[t] * vt[i];
        }
        for (int j = 0; j < AV; j++)
            if (j < nv) storev(o + i0 + j * VL, acc[j]);
        for (long i = nv * VL; i < n; i++) o[i0 + i] = rest[i];
    }
}

/* out (D) = softmax(q·Kᵀ · scale) · V over the T cached keys and values of one head
 * (kcache, vcache: (T, D) rows), reading each once: the scores 4 keys at a time
 * (independent chains), the exponentials a vector at a time, the weighted sum of values
 * with the output in registers. s: T floats of scratch. */
static void attend_head(const float *qv, const float *kcache, const float *vcache, long T,
                        long D, float scale, float *s, float *out) {
    float m = -__builtin_inff(), sum = 0.0f;
    long t = 0;
    for (; t + 4 <= T; t += 4) dot4(qv, kcache + t * D, D, s + t);
    for (; t < T; t++) s[t] = dot(qv, kcache + t * D, D);
    for (t = 0; t < T; t++) {
        s[t] *= scale;
        m = s[t] > m ? s[t] : m;
    }
    vf vsum = {0};
    for (t = 0; t + VL <= T; t += VL) {
        vf e = vexp(loadv(s + t) - m);
        storev(s + t, e);
        vsum += e;
    }
    for (; t < T; t++) { s[t] = __builtin_expf(s[t] - m); sum += s[t]; }
    float inv = 1.0f / (sum + hsum(vsum));
    for (t = 0; t < T; t++) s[t] *= inv;
    weighted_values(s, vcache, T, D, out);
}

/* One decoding step of attention for every (batch row, head): store the new key and
 * value at position `pos` of the cache, then
 *     out = softmax(q·Kᵀ · scale) · V      over cached positions 0..pos
 * (attend_head). q, k, v are (B, H, D) with strides (sb, sh, 1) (views into the fused
 * qkv projection, no copy); the cache layer is (B, H, max_len, D) with strides
 * (csb, csh, D, 1); out is (B, H, D) contiguous; scratch holds B·H·(pos+1) floats. */
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
        attend_head(q + b * qsb + h * qsh, kcache, vcache, T, D, scale, scratch + bh * T,
                    out + bh * D);
    }
}

/* The same for a ragged batch (continuous batching): row b at its own position pos[b],
 * and grouped-query attention -- Hkv key/value heads, query head h reading head
 * h / (H / Hkv). qkv rows of stride ld hold [q (H·D) | k (Hkv·D) | v (Hkv·D)]; the
 * cache layer is (B, Hkv, max_len, D) with strides (csb, csh, D, 1); out is (B, H·D);
 * scratch holds B·H·ls floats, ls > every pos[b]. Every new key and value is written
 * first, then each (row, query head) attends over its row's positions 0..pos[b]. */
void tl_attend_rows(const float *qkv, long ld, float *kc, float *vc, long csb, long csh,
                    long B, long H, long Hkv, long D, const long *pos, float scale,
                    float *out, float *scratch, long ls, int threads) {
    long rep = H / Hkv;
    for (long b = 0; b < B; b++)
        for (long j = 0; j < Hkv; j++) {
            const float *row = qkv + b * ld;
            long at = b * csb + j * csh + pos[b] * D;
            memcpy(kc + at, row + (H + j) * D, D * sizeof(float));
            memcpy(vc + at, row + (H + Hkv + j) * D, D * sizeof(float));
        }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long bh = 0; bh < B * H; bh++) {
        long b = bh / H, h = bh % H, j = h / rep;
        attend_head(qkv + b * ld + h * D, kc + b * csb + j * csh, vc + b * csb + j * csh,
                    pos[b] + 1, D, scale, scratch + bh * ls, out + bh * D);
    }
}

/* y = act(x·Wᵀ + b) (+ res) by the plan's linear entry L (PLAN_LINEAR longs: packed
 * weights or GGUF blocks, int8 scales, int8 group size (0: not int8), bias, I, O, GGUF
 * block type (0: none)). */
_Static_assert(PLAN_LAYER == 4 + 4 * PLAN_LINEAR, "a layer: 2 norms of 2, 4 linears");

static void plan_linear(const long *L, const float *x, float *y, long M, int threads,
                        int act, const float *res) {
    const float *b = (const float *)L[3];
    if (L[6])
        tl_linear_blocks(x, L[4], (const unsigned char *)L[0], L[6], b, y, M, L[4], L[5],
                         threads, act, res);
    else if (L[2])
        tl_linear_q8(x, L[4], (const signed char *)L[0], (const float *)L[1], L[2], b, y, M,
                     L[4], L[5], threads, act, res);
    else
        tl_linear(x, L[4], (const float *)L[0], b, y, M, L[4], L[5], threads, act, res);
}

/* Every block of a standard GPT for one token per row (B rows, row b at position pos[b])
 * through the cache, the loop that _FusedStep ran in Python: per layer (PLAN_LAYER longs of plan: LN1 weight,
 * bias, the qkv, out, up and down linears, LN2 weight, bias)
 *     h = LN1(x); [q | k | v] = h·W_qkvᵀ + b; r = softmax(q·Kᵀ/√D)·V (k, v cached at pos[b]);
 *     x += r·W_outᵀ + b; h = LN2(x); u = GELU(h·W_upᵀ + b); x += u·W_downᵀ + b.
 * kc, vc: layer 0's cache (B, H, max_len, D) of strides (csb, csh, D, 1); layer l's is
 * cl floats further. stats: 2·B floats for LayerNorm's mean and 1/std (unused); scratch:
 * B·H·ls floats, ls > every pos[b]. */
void tl_decode_layers(const long *plan, long n_layer, float *x, float *h, float *qkv,
                      float *r, float *u, float *stats, float *kc, float *vc, long cl,
                      long csb, long csh, long B, long E, long H, long D, const long *pos,
                      float eps, float scale, float *scratch, long ls, int threads) {
    long HD = H * D;
    for (long l = 0; l < n_layer; l++) {
        const long *p = plan + l * PLAN_LAYER;
        tl_ln_fwd(x, (const float *)p[0], (const float *)p[1], h, stats, stats + B, B, E,
                  eps, 1);
        plan_linear(p + 2, h, qkv, B, threads, 0, 0);
        tl_attend_rows(qkv, 3 * HD, kc + l * cl, vc + l * cl, csb, csh, B, H, H, D, pos,
                       scale, r, scratch, ls, threads);
        plan_linear(p + 2 + PLAN_LINEAR, r, x, B, threads, 0, x);
        tl_ln_fwd(x, (const float *)p[2 + 2 * PLAN_LINEAR],
                  (const float *)p[3 + 2 * PLAN_LINEAR], h, stats, stats + B, B, E, eps, 1);
        plan_linear(p + 4 + 2 * PLAN_LINEAR, h, u, B, threads, 1, 0);
        plan_linear(p + 4 + 3 * PLAN_LINEAR, u, x, B, threads, 0, x);
    }
}
