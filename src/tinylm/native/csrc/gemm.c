/* The fp32 matrix products of CPU training: c (M, N) = a·b, or c += a·b.
 *
 * A training step multiplies rows of activations (a few hundred to a few thousand tokens)
 * by weights of 128..1536 features: skinny products where BLAS spends a good part of its
 * time outside its inner kernel (MKL on AMD CPUs takes its generic path, and its
 * transposed products Gᵀ·X, the weight gradients, run ~20 % below its others). This is
 * one register-blocked kernel for the three forms a linear layer needs:
 *
 *     x·Wᵀ   (forward)            a = x (M, K) rows,  b = Wᵀ: W (N, K) packed in panels
 *     G·W    (input gradient)     a = G (M, K) rows,  b = W (K, N) as stored
 *     Gᵀ·X   (weight gradient)    a = Gᵀ: G (K, M),   b = X (K, N) as stored
 *
 * a is read in place through two strides (element (m, k) at a[m·sam + k·sak]), one value
 * at a time, broadcast; b is read as rows of NR = CG·VL consecutive floats, so the
 * micro-kernel (MR rows × NR columns, MR·CG accumulators) does only broadcast FMAs, no
 * horizontal sums. b is used in place where its rows are contiguous (G·W, Gᵀ·X); W of x·Wᵀ
 * is first copied into panels of NR output features (k-major: packed[p][k][j] =
 * W[p·NR + j][k]), as is the last, partial panel of any b, zero-padded.
 *
 * Blocking: K in chunks of KC (a panel's KC·NR floats stay in L2 across the MC-row block
 * of a that reuses them), rows in blocks of MC. The threads (OpenMP) split the rows of c;
 * each computes whole rows, so no two write the same element and every element's sum
 * runs over k in order within a chunk, chunks in order: results do not depend on the
 * thread count.
 */
#include "tinylm.h"

#if VL == 16
#define CG 4   /* vectors per micro-kernel row: 64 columns, 24 zmm accumulators */
#else
#define CG 2   /* 16 registers (AVX2 ymm) or fewer: 12 accumulators */
#endif
#define MR 6
#define NR (CG * VL)
#define KC 256
#define MC 96

/* c[m][0..nc) (+)= Σ_k a(m, k)·b[k][0..NR) for mr <= MR rows; b rows ldb apart. */
static void tile(long mr, const float *a, long sam, long sak, const float *b, long ldb,
                 long K, float *c, long ldc, long nc, int acc) {
    vf s[MR][CG];
    for (int m = 0; m < MR; m++)
        for (int g = 0; g < CG; g++) s[m][g] = (vf){0};
    if (mr == MR) {  /* the common case: the row count is a constant */
        for (long k = 0; k < K; k++) {
            vf bv[CG];
            for (int g = 0; g < CG; g++) {
                bv[g] = loadv(b + k * ldb + g * VL);
                KEEP_IN_REGISTER(bv[g]);
            }
            for (int m = 0; m < MR; m++) {
                vf av = splat(a[m * sam + k * sak]);
                for (int g = 0; g < CG; g++) s[m][g] += av * bv[g];
            }
        }
    } else {
        for (long k = 0; k < K; k++) {
            vf bv[CG];
            for (int g = 0; g < CG; g++) bv[g] = loadv(b + k * ldb + g * VL);
            for (int m = 0; m < mr; m++) {
                vf av = splat(a[m * sam + k * sak]);
                for (int g = 0; g < CG; g++) s[m][g] += av * bv[g];
            }
        }
    }
    for (int m = 0; m < mr; m++) {
        float *row = c + m * ldc;
        if (nc == NR) {
            for (int g = 0; g < CG; g++)
                storev(row + g * VL, acc ? loadv(row + g * VL) + s[m][g] : s[m][g]);
        } else {
            float t[NR];
            for (int g = 0; g < CG; g++) storev(t + g * VL, s[m][g]);
            for (long j = 0; j < nc; j++) row[j] = acc ? row[j] + t[j] : t[j];
        }
    }
}

/* Columns [n0, n0 + nc) of b (K, ldb apart, or W (N, K) rows when wt) -> one k-major panel
 * of NR columns, zero past nc. */
static void pack_panel(const float *b, long ldb, int wt, long n0, long nc, long K,
                       float *out) {
    if (wt) {  /* W's rows are read whole, each into one column of the panel */
        for (long j = 0; j < nc; j++) {
            const float *w = b + (n0 + j) * ldb;
            for (long k = 0; k < K; k++) out[k * NR + j] = w[k];
        }
    } else {
        for (long k = 0; k < K; k++)
            for (long j = 0; j < nc; j++) out[k * NR + j] = b[k * ldb + n0 + j];
    }
    for (long k = 0; k < K; k++)
        for (long j = nc; j < NR; j++) out[k * NR + j] = 0.0f;
}

long tl_gemm_work(long N, long K, int wt) {
    long panels = (N + NR - 1) / NR;
    return wt ? panels * K * NR : (N % NR ? K * NR : 0);
}

/* Rows [m0, m1) of c, every panel: panel p's b at bp + p·pstride (rows ldb apart), the
 * last partial one (if any) at tail (rows NR apart). */
static void rows(long m0, long m1, long N, long K, const float *a, long sam, long sak,
                 const float *bp, long ldb, long pstride, const float *tail, float *c,
                 long ldc, int acc) {
    long full = N / NR, panels = (N + NR - 1) / NR;
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        for (long mb = m0; mb < m1; mb += MC) {
            long me = mb + MC < m1 ? mb + MC : m1;
            for (long p = 0; p < panels; p++) {
                const float *b = p < full ? bp + p * pstride + k0 * ldb : tail + k0 * NR;
                long lb = p < full ? ldb : NR, nc = p < full ? NR : N - full * NR;
                for (long m = mb; m < me; m += MR)
                    tile(me - m < MR ? me - m : MR, a + m * sam + k0 * sak, sam, sak, b, lb,
                         kc, c + m * ldc + p * NR, ldc, nc, acc || k0 > 0);
            }
        }
    }
}

/* c (M, N; rows ldc apart) = a·b, or += where accumulate. a: element (m, k) at
 * a[m·sam + k·sak]. b: wt = 0, b[k·ldb + n] (K rows of N); wt = 1, W (N, K) row-major
 * (ldb = its row stride) for a·Wᵀ. work: tl_gemm_work(N, K, wt) floats (NULL where that
 * is 0). */
void tl_gemm(long M, long N, long K, const float *a, long sam, long sak, const float *b,
             long ldb, int wt, float *c, long ldc, int accumulate, float *work, int threads) {
    long full = N / NR, panels = (N + NR - 1) / NR;
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {  /* an empty sum */
        for (long m = 0; m < M && !accumulate; m++) memset(c + m * ldc, 0, N * sizeof *c);
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        if (wt) {  /* every panel packed; the threads share the copying */
            #pragma omp for schedule(static)
            for (long p = 0; p < panels; p++) {
                long nc = N - p * NR < NR ? N - p * NR : NR;
                pack_panel(b, ldb, 1, p * NR, nc, K, work + p * K * NR);
            }
        } else if (full < panels) {
            #pragma omp single
            pack_panel(b, ldb, 0, full * NR, N - full * NR, K, work);
        }  /* the implied barriers: the panels are complete before any thread reads them */
        long m0 = M * t / T, m1 = M * (t + 1) / T;
        if (wt)
            rows(m0, m1, N, K, a, sam, sak, work, NR, K * NR, work + full * K * NR, c, ldc,
                 accumulate);
        else
            rows(m0, m1, N, K, a, sam, sak, b, ldb, NR, work, c, ldc, accumulate);
    }
}
