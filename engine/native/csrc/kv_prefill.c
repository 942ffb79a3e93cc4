/* Attention of a few query rows over many cached keys (``kvs_prefill_attend``; called by
   engine/kv/store/prefill_attend.py): a suffix prefill after a prefix-cache hit (an agent loop's step: ~80 new tokens
   over ~4,600 cached), a chunk of a chunked prefill, a decode token.

   torch's CPU flash attention runs such a call at ~55 GFLOP/s on one core here (SmolLM2 shape, 80 queries over 4,680
   keys: 15 ms a layer, 60% of the suffix prefill), where the model's linears run at ~90. Flash-style here: the keys in
   blocks of KB, a running maximum and sum per query (online softmax), the outputs rescaled as the maximum grows.
   For each KV head its query heads' rows together are one block of queries (GQA: the K/V rows are read once for all
   of them, never copied per query head), walked four query vectors at a time against a block of keys transposed once
   (scores: four queries x PF_CW keys of running sums in registers, a key column and a broadcast query element a
   multiply-add), then the block's values (four queries x PF_CW output columns in registers, a value row and a
   broadcast probability a multiply-add). A block of keys and values (2 x 32 KB) stays in L2 while every query of
   the head passes over it; the outputs (rows x head_dim floats) live in L2 between blocks.

   The causal mask is the prefill's: query row i sees keys 0 .. causal + i (``causal`` = keys - rows for new rows
   at the end of the K/V; -1: every key). Key blocks no row sees are never read; rows that see none of a block skip
   it. Scores and sums in float32; exp is fast_exp (within 2 ulp of expf); the result matches torch's SDPA up to
   float32 summation order (~1e-6 relative).

   Vector widths: AVX-512 (16 lanes, 4 x 4 accumulators of 64 keys or columns), AVX2 (8 lanes, 4 x 2: its 16
   registers), else 4 lanes (SSE2, NEON); any head_dim that is not a multiple of the pass width (and a compiler
   without vector extensions) takes the plain loops below, which compilers vectorize as they can. */
#include "kv_math.h"
#include <stdlib.h>

#define PF_TQ 4  /* query vectors a tile */

/* The plain path: any head_dim. One query vector at a time over a block of keys. */
static void prefill_plain(int h, int rep, int nq, int64_t n, int d, int dv, const float *q, int64_t q_sh,
                          int64_t q_sr, const float *k, int64_t k_sh, int64_t k_sr, const float *v, int64_t v_sh,
                          int64_t v_sr, float scale, int64_t causal, float *out, int64_t o_sr, float *s, int kbmax,
                          float *acc) {
    for (int i = 0; i < nq; i++) {
        const int64_t see = causal < 0 ? n : (causal + i + 1 < n ? causal + i + 1 : n);  /* keys row i sees */
        for (int r = 0; r < rep; r++) {
            const float *qv = q + (int64_t)(h * rep + r) * q_sh + i * q_sr;
            float m = -INFINITY, l = 0.0f;
            memset(acc, 0, sizeof(float) * dv);
            for (int64_t j0 = 0; j0 < see; j0 += kbmax) {
                const int kb = see - j0 < kbmax ? (int)(see - j0) : kbmax;
                float mx = -INFINITY;
                for (int j = 0; j < kb; j++) {
                    s[j] = dot(qv, k + h * k_sh + (j0 + j) * k_sr, d) * scale;
                    mx = s[j] > mx ? s[j] : mx;
                }
                const float mn = mx > m ? mx : m, alpha = fast_exp(m - mn);
                float sum = 0.0f;
                for (int j = 0; j < kb; j++) {
                    s[j] = fast_exp(s[j] - mn);
                    sum += s[j];
                }
                for (int c = 0; c < dv; c++) acc[c] *= alpha;
                for (int j = 0; j < kb; j++) axpy(s[j], v + h * v_sh + (j0 + j) * v_sr, acc, dv);
                l = l * alpha + sum;
                m = mn;
            }
            float *o = out + i * o_sr + (int64_t)(h * rep + r) * dv;
            for (int c = 0; c < dv; c++) o[c] = see > 0 ? acc[c] / l : 0.0f;
        }
    }
}

#ifdef KVS_VECTORS
#if defined(__AVX512F__)
#define PF_VW 16
#define PF_NV 4
#elif defined(__AVX2__)
#define PF_VW 8
#define PF_NV 2
#else
#define PF_VW 4
#define PF_NV 2
#endif
#define PF_CW (PF_VW * PF_NV)  /* keys (scores) or output columns (values) a pass: 64 AVX-512, 16 AVX2, 8 else */
typedef float pf_v __attribute__((vector_size(PF_VW * 4)));
typedef float pf_va __attribute__((vector_size(PF_VW * 4), aligned(4)));

#if defined(__AVX512F__)
#include <immintrin.h>
/* The two passes in AVX-512 registers, sixteen sums each: a key (value) vector is loaded once for the four queries
   (the vector-extension loops below had every multiply-add load its vector again: 20 loads for 16 multiply-adds). */
/* the four vectors in registers from here on: GCC otherwise folds each load into every multiply-add using it */
#define PF_IN_REGS(a, b, c, e) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(e))
static inline void pf_scores(const float *qs, int d, const float *kt, int ldk, int c0, float *s, int lds) {
    __m512 a[4][4];
    for (int t = 0; t < 4; t++)
        for (int u = 0; u < 4; u++) a[t][u] = _mm512_setzero_ps();
    const float *kp = kt + c0;
    for (int x = 0; x < d; x++, kp += ldk) {
        __m512 k0 = _mm512_load_ps(kp), k1 = _mm512_load_ps(kp + 16), k2 = _mm512_load_ps(kp + 32),
               k3 = _mm512_load_ps(kp + 48);
        PF_IN_REGS(k0, k1, k2, k3);
        for (int t = 0; t < 4; t++) {
            const __m512 b = _mm512_set1_ps(qs[t * d + x]);
            a[t][0] = _mm512_fmadd_ps(b, k0, a[t][0]);
            a[t][1] = _mm512_fmadd_ps(b, k1, a[t][1]);
            a[t][2] = _mm512_fmadd_ps(b, k2, a[t][2]);
            a[t][3] = _mm512_fmadd_ps(b, k3, a[t][3]);
        }
    }
    for (int t = 0; t < 4; t++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(s + t * lds + c0 + 16 * u, a[t][u]);
}

static inline void pf_values(const float *p, int lds, int rows, const float *vb, int64_t v_sr, int c0, float *o,
                             int dv, const float *alpha) {
    __m512 a[4][4];
    for (int t = 0; t < 4; t++) {
        const __m512 b = _mm512_set1_ps(alpha[t]);
        for (int u = 0; u < 4; u++) a[t][u] = _mm512_mul_ps(b, _mm512_loadu_ps(o + t * dv + c0 + 16 * u));
    }
    const float *vr = vb + c0;
    for (int j = 0; j < rows; j++, vr += v_sr) {
        __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
               v3 = _mm512_loadu_ps(vr + 48);
        PF_IN_REGS(v0, v1, v2, v3);
        for (int t = 0; t < 4; t++) {
            const __m512 b = _mm512_set1_ps(p[t * lds + j]);
            a[t][0] = _mm512_fmadd_ps(b, v0, a[t][0]);
            a[t][1] = _mm512_fmadd_ps(b, v1, a[t][1]);
            a[t][2] = _mm512_fmadd_ps(b, v2, a[t][2]);
            a[t][3] = _mm512_fmadd_ps(b, v3, a[t][3]);
        }
    }
    for (int t = 0; t < 4; t++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(o + t * dv + c0 + 16 * u, a[t][u]);
}
#else
/* s[t][c0 ..] (t < PF_TQ, PF_CW keys): the dot products of query vectors qs + t d with the block's transposed keys
   kt [d][ldk] from column c0 */
static inline void pf_scores(const float *qs, int d, const float *kt, int ldk, int c0, float *s, int lds) {
    pf_v acc[PF_TQ][PF_NV];
    for (int t = 0; t < PF_TQ; t++)
        for (int u = 0; u < PF_NV; u++) acc[t][u] = (pf_v){0};
    for (int x = 0; x < d; x++) {
        pf_v kv[PF_NV];
        for (int u = 0; u < PF_NV; u++) kv[u] = *(const pf_v *)(kt + (int64_t)x * ldk + c0 + u * PF_VW);
        for (int t = 0; t < PF_TQ; t++) {
            const pf_v qb = qs[t * d + x] - (pf_v){0};  /* a splat (x + 0 is not x for -0: an add)  */
            for (int u = 0; u < PF_NV; u++) acc[t][u] += qb * kv[u];
        }
    }
    for (int t = 0; t < PF_TQ; t++)
        for (int u = 0; u < PF_NV; u++) *(pf_va *)(s + t * lds + c0 + u * PF_VW) = acc[t][u];
}

/* o[t][c0 .. c0 + PF_CW) = alpha[t] o[t] + sum over the block's rows j < rows of p[t][j] v_j (t < PF_TQ) */
static inline void pf_values(const float *p, int lds, int rows, const float *vb, int64_t v_sr, int c0, float *o,
                             int dv, const float *alpha) {
    pf_v acc[PF_TQ][PF_NV];
    for (int t = 0; t < PF_TQ; t++) {
        const pf_v a = alpha[t] - (pf_v){0};
        for (int u = 0; u < PF_NV; u++) acc[t][u] = *(const pf_va *)(o + t * dv + c0 + u * PF_VW) * a;
    }
    for (int j = 0; j < rows; j++) {
        pf_v vv[PF_NV];
        const float *vr = vb + j * v_sr + c0;
        for (int u = 0; u < PF_NV; u++) vv[u] = *(const pf_va *)(vr + u * PF_VW);
        for (int t = 0; t < PF_TQ; t++) {
            const pf_v pb = p[t * lds + j] - (pf_v){0};
            for (int u = 0; u < PF_NV; u++) acc[t][u] += pb * vv[u];
        }
    }
    for (int t = 0; t < PF_TQ; t++)
        for (int u = 0; u < PF_NV; u++) *(pf_va *)(o + t * dv + c0 + u * PF_VW) = acc[t][u];
}

#endif

/* exp(x - m) over n floats in place (n a multiple of 16), their sum returned */
static inline float pf_exp_sum(float *x, int n, float m) {
    v16 sum = {0};
    for (int j = 0; j < n; j += 16) {
        const v16 e = fast_exp16(*(const v16u *)(x + j) - m);
        *(v16u *)(x + j) = e;
        sum += e;
    }
    return hsum(sum);
}

/* Scratch of one call: queries (scaled, row m = i rep + r), outputs, running maxima and sums, a block's transposed
   keys and a tile's scores. */
typedef struct {
    float *qs, *o, *m, *l, *kt, *s;
} pf_scratch;

/* KV head h by tiles (see the top of the file). mp: the query vectors rounded up to PF_TQ; kbmax keys a block. */
static void prefill_head(int h, int rep, int nq, int64_t n, int d, int dv, const float *q, int64_t q_sh, int64_t q_sr,
                         const float *k, int64_t k_sh, int64_t k_sr, const float *v, int64_t v_sh, int64_t v_sr,
                         float scale, int64_t causal, float *out, int64_t o_sr, const pf_scratch *w, int mp,
                         int kbmax) {
    const int mq = rep * nq;
    for (int m = 0; m < mp; m++) {
        const int i = m / rep, r = m % rep;
        float *qd = w->qs + (int64_t)m * d;
        if (m < mq) {
            const float *qv = q + (int64_t)(h * rep + r) * q_sh + i * q_sr;
            for (int x = 0; x < d; x++) qd[x] = qv[x] * scale;
        } else {
            memset(qd, 0, sizeof(float) * d);
        }
        w->m[m] = -INFINITY;
        w->l[m] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * mp * dv);
    const float *kh = k + h * k_sh, *vh = v + h * v_sh;
    const int64_t last = causal < 0 ? n : (causal + nq < n ? causal + nq : n);  /* keys the last row sees */
    for (int64_t j0 = 0; j0 < last; j0 += kbmax) {
        const int kb = last - j0 < kbmax ? (int)(last - j0) : kbmax;
        const int kbp = (kb + PF_CW - 1) / PF_CW * PF_CW;
        for (int j = 0; j < kb; j++) {  /* the block's keys transposed: kt [d][kbmax] */
            const float *kr = kh + (j0 + j) * k_sr;
            for (int x = 0; x < d; x++) w->kt[(int64_t)x * kbmax + j] = kr[x];
        }
        for (int x = 0; x < d; x++)
            for (int j = kb; j < kbp; j++) w->kt[(int64_t)x * kbmax + j] = 0.0f;
        for (int m0 = 0; m0 < mp; m0 += PF_TQ) {
            int vis[PF_TQ], most = 0;  /* keys of this block each query vector sees */
            for (int t = 0; t < PF_TQ; t++) {
                const int m = m0 + t;
                int64_t see = m >= mq ? 0 : causal < 0 ? kb : causal + m / rep + 1 - j0;
                vis[t] = see < 0 ? 0 : see > kb ? kb : (int)see;
                most = vis[t] > most ? vis[t] : most;
            }
            if (!most) continue;
            const int mostp = (most + PF_CW - 1) / PF_CW * PF_CW;
            for (int c0 = 0; c0 < mostp; c0 += PF_CW)
                pf_scores(w->qs + (int64_t)m0 * d, d, w->kt, kbmax, c0, w->s, kbmax);
            float alpha[PF_TQ];
            for (int t = 0; t < PF_TQ; t++) {
                float *st = w->s + t * kbmax;
                const int m = m0 + t;
                if (!vis[t]) {
                    alpha[t] = 1.0f;
                    memset(st, 0, sizeof(float) * mostp);
                    continue;
                }
                const int vp = (vis[t] + 15) / 16 * 16;
                for (int j = vis[t]; j < vp; j++) st[j] = -INFINITY;
                const float mx = max16(st, vp), mn = mx > w->m[m] ? mx : w->m[m];
                float sum = pf_exp_sum(st, vp, mn);
                for (int j = vis[t]; j < mostp; j++) {  /* masked and padding: no weight (fast_exp's floor is not 0) */
                    if (j < vp) sum -= st[j];
                    st[j] = 0.0f;
                }
                alpha[t] = fast_exp(w->m[m] - mn);
                w->l[m] = w->l[m] * alpha[t] + sum;
                w->m[m] = mn;
            }
            for (int c0 = 0; c0 < dv; c0 += PF_CW)
                pf_values(w->s, kbmax, most, vh + j0 * v_sr, v_sr, c0, w->o + (int64_t)m0 * dv, dv, alpha);
        }
    }
    for (int m = 0; m < mq; m++) {
        const int i = m / rep, r = m % rep;
        const float inv = w->l[m] > 0.0f ? 1.0f / w->l[m] : 0.0f;
        float *dst = out + i * o_sr + (int64_t)(h * rep + r) * dv;
        const float *src = w->o + (int64_t)m * dv;
        for (int c = 0; c < dv; c++) dst[c] = src[c] * inv;
    }
}
#endif

/* KV heads h0 .. h1 - 1: query head h rep + r (r < rep), row i (i < nq) at q + (h rep + r) q_sh + i q_sr attends to
   keys j < n at k + h k_sh + j k_sr (values likewise), each row d (dv) contiguous floats, scaled by ``scale``;
   ``causal`` >= 0: row i sees keys j <= causal + i only (a row that sees none gets zeros), < 0: every key. Output
   row i, head g at out + i o_sr + g dv. float32 throughout. Returns -1 where memory runs out or a size is out of
   range (nothing written then). */
int kvs_prefill_attend(int h0, int h1, int rep, int nq, int64_t n, int d, int dv, const float *q, int64_t q_sh,
                       int64_t q_sr, const float *k, int64_t k_sh, int64_t k_sr, const float *v, int64_t v_sh,
                       int64_t v_sr, float scale, int64_t causal, float *out, int64_t o_sr) {
    if (rep < 1 || nq < 1 || n < 0 || d < 1 || dv < 1 || d > 1024 || dv > 1024 || h0 < 0 || h1 < h0) return -1;
    if (n == 0) {
        for (int i = 0; i < nq; i++)
            for (int g = h0 * rep; g < h1 * rep; g++) memset(out + i * o_sr + (int64_t)g * dv, 0, sizeof(float) * dv);
        return 0;
    }
    /* a block of keys and values ~32 KB each: 128 keys at head_dim 64, 64 at 128 */
    int kbmax = 8192 / (d > dv ? d : dv);
    kbmax = kbmax < 16 ? 16 : kbmax > 512 ? 512 : kbmax / 16 * 16;
#ifdef KVS_VECTORS
    if (d % PF_CW == 0 && dv % PF_CW == 0) {
        kbmax = (kbmax + PF_CW - 1) / PF_CW * PF_CW;
        const int mp = (rep * nq + PF_TQ - 1) / PF_TQ * PF_TQ;
        pf_scratch w;
        const size_t floats[6] = {(size_t)mp * d, (size_t)mp * dv, (size_t)mp, (size_t)mp, (size_t)d * kbmax,
                                  (size_t)PF_TQ * kbmax};
        size_t total = 0;
        for (int x = 0; x < 6; x++) total += (floats[x] + 15) / 16 * 16;
        float *base = (float *)aligned_alloc(64, total * sizeof(float));
        if (!base) return -1;
        float **parts[6] = {&w.qs, &w.o, &w.m, &w.l, &w.kt, &w.s};
        float *at = base;
        for (int x = 0; x < 6; x++) {
            *parts[x] = at;
            at += (floats[x] + 15) / 16 * 16;
        }
        for (int h = h0; h < h1; h++)
            prefill_head(h, rep, nq, n, d, dv, q, q_sh, q_sr, k, k_sh, k_sr, v, v_sh, v_sr, scale, causal, out, o_sr,
                         &w, mp, kbmax);
        free(base);
        return 0;
    }
#endif
    float *s = (float *)malloc(sizeof(float) * ((size_t)kbmax + (size_t)dv));
    if (!s) return -1;
    for (int h = h0; h < h1; h++)
        prefill_plain(h, rep, nq, n, d, dv, q, q_sh, q_sr, k, k_sh, k_sr, v, v_sh, v_sr, scale, causal, out, o_sr, s,
                      kbmax, s + kbmax);
    free(s);
    return 0;
}

/* The vector width the kernel was built with (16: AVX-512, 8: AVX2, 4: SSE2 / NEON, 1: none): the caller takes it
   only where it beats torch's SDPA (measured with AVX-512). */
int kvs_prefill_width(void) {
#ifdef KVS_VECTORS
    return PF_VW;
#else
    return 1;
#endif
}
