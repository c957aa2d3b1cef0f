/* The rest of a decoding step: the embedding lookup, greedy decoding's argmax, and the
 * attention of one new token over the KV cache. */
#include "tinylm.h"

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

/* One decoding step of attention for every (batch row, head): store the new key and
 * value at position `pos` of the cache, then
 *     out = softmax(q·Kᵀ · scale) · V      over cached positions 0..pos
 * reading each cached key and value once: the scores 4 keys at a time (independent
 * chains), the exponentials a vector at a time, the weighted sum of values with the
 * output in registers. q, k, v are (B, H, D) with strides (sb, sh, 1) (views into the
 * fused qkv projection, no copy); the cache layer is (B, H, max_len, D) with strides
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
        const float *qv = q + b * qsb + h * qsh;
        float *s = scratch + bh * T, m = -__builtin_inff(), sum = 0.0f;
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
        weighted_values(s, vcache, T, D, out + bh * D);
    }
}
