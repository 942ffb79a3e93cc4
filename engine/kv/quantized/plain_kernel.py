"""The C source of the fused decode attention over plain (float32 or bfloat16) pages, appended to the tq kernels'
(``engine.kv.quantized.tq_kernel``: it uses their ``dot``, ``axpy`` and ``softmax``) and built into the same library
(``engine.kv.quantized.native``).

A compiled decode step read a sequence's cached K/V by gathering them through their slots into a new tensor, appending
the new token's row, turning bfloat16 into float32 (its decode attention runs in float32) and calling torch's flash
attention: per layer a copy of the whole context twice over, and a kernel whose fixed cost (~20 us a call here at 128
tokens) is larger than its work for one query. Here each cached row is read in place through its slot, dotted with the
``rep`` query heads of its KV head, and after the softmax summed into their outputs: nothing of the size of the cache is
written (``engine.kv.store.paged_decode`` calls it). Scores and sums are float32; bfloat16 rows are widened exactly.
"""

SOURCE = r"""
#include <stdlib.h>

/* A cached row of `d` elements at element offset `off` of `base` as float32: in place for float32, widened into buf
   for bfloat16 (a bfloat16 is the top half of a float32: exact). */
static inline const float *plain_row(const void *base, int64_t off, int d, int bf16, float *buf) {
    if (!bf16) return (const float *)base + off;
    const uint16_t *h = (const uint16_t *)base + off;
    for (int j = 0; j < d; j++) {
        uint32_t u = (uint32_t)h[j] << 16;
        memcpy(buf + j, &u, 4);
    }
    return buf;
}

#ifdef KVS_VECTORS
/* Scores [rep, ls] (ls: n + 1 rounded up to 16; the padding is -inf) into probabilities, each row in place; their
   sums are not taken out (the output is divided by them: ``sums``). */
static void plain_softmax(float *s, int rep, int64_t len, int64_t ls, float *sums) {
    for (int r = 0; r < rep; r++) {
        float *x = s + r * ls;
        for (int64_t i = len; i < ls; i++) x[i] = -INFINITY;
        v16 m = *(const v16u *)x, sum = {0};
        for (int64_t i = 16; i < ls; i += 16) {
            v16 v = *(const v16u *)(x + i);
            kvs_i16 gt = v > m, vi, mi;
            memcpy(&vi, &v, 64);
            memcpy(&mi, &m, 64);
            mi = (gt & vi) | (~gt & mi);
            memcpy(&m, &mi, 64);
        }
        float mx = m[0];
        for (int l = 1; l < 16; l++) mx = m[l] > mx ? m[l] : mx;
        /* the padding's exp is e^-87 (fast_exp's floor), 15 of them below a float32 ulp of the sum (>= 1) */
        for (int64_t i = 0; i < ls; i += 16) {
            v16 e = fast_exp16(*(const v16u *)(x + i) - mx);
            *(v16u *)(x + i) = e;
            sum += e;
        }
        sums[r] = hsum(sum);
    }
}
#else
/* Scores [rep, ls] (ls: n + 1 rounded up to 16; the padding is -inf) into probabilities, each row in place; their
   sums are not taken out (the output is divided by them: ``sums``). */
static void plain_softmax(float *s, int rep, int64_t len, int64_t ls, float *sums) {
    for (int r = 0; r < rep; r++) {
        float *x = s + r * ls;
        for (int64_t i = len; i < ls; i++) x[i] = -INFINITY;
        float m[16], sum[16] = {0}, mx = -INFINITY;  /* sixteen lanes: the loops vectorize without fast-math */
        for (int l = 0; l < 16; l++) m[l] = -INFINITY;
        for (int64_t i = 0; i < ls; i++) m[i & 15] = x[i] > m[i & 15] ? x[i] : m[i & 15];
        for (int l = 0; l < 16; l++) mx = m[l] > mx ? m[l] : mx;
        /* the padding's exp is e^-87 (fast_exp's floor), 15 of them below a float32 ulp of the sum (>= 1) */
        for (int64_t i = 0; i < ls; i++) x[i] = fast_exp(x[i] - mx);
        for (int64_t i = 0; i < ls; i++) sum[i & 15] += x[i];
        float total = 0.0f;
        for (int l = 0; l < 16; l++) total += sum[l];
        sums[r] = total;
    }
}
#endif

/* float32 n elements into dst as float32 or bfloat16 (rounded to nearest even, as torch rounds; NaN stays NaN) */
static inline void plain_store(void *dst, int64_t off, const float *x, int n, int bf16) {
    if (!bf16) {
        memcpy((float *)dst + off, x, sizeof(float) * n);
        return;
    }
    uint16_t *h = (uint16_t *)dst + off;
    for (int j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, x + j, 4);
        h[j] = (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

/* Any head_dim, any rep: the tq kernels' dot and axpy. */
static int plain_head(int h, int rep, int64_t n, int dk, int dv, int bf16, const void *kp, int64_t k_head,
                      const void *vp, int64_t v_head, const int64_t *slots, const void *q, const void *nk,
                      const void *nv, float scale, float *s, int64_t ls, void *out) {
    float buf[1024] __attribute__((aligned(64))), acc[1024], qf[1024], sums[1024];
    if (dk > 1024 || dv > 1024 || rep > 1024) return -1;
    const int64_t len = n + 1;
    for (int r = 0; r < rep; r++) {
        memcpy(qf, plain_row(q, ((int64_t)h * rep + r) * dk, dk, bf16, buf), sizeof(float) * dk);
        for (int64_t i = 0; i < len; i++) {
            const float *kr = plain_row(i < n ? kp : nk, i < n ? h * k_head + slots[i] * dk : (int64_t)h * dk, dk,
                                        bf16, buf);
            s[r * ls + i] = dot(qf, kr, dk) * scale;
        }
    }
    plain_softmax(s, rep, len, ls, sums);
    for (int r = 0; r < rep; r++) {
        memset(acc, 0, sizeof(float) * dv);
        for (int64_t i = 0; i < len; i++) {
            const float *vr = plain_row(i < n ? vp : nv, i < n ? h * v_head + slots[i] * dv : (int64_t)h * dv, dv,
                                        bf16, buf);
            axpy(s[r * ls + i], vr, acc, dv);
        }
        for (int j = 0; j < dv; j++) acc[j] /= sums[r];
        plain_store(out, ((int64_t)h * rep + r) * dv, acc, dv, bf16);
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && defined(KVS_VECTORS)
#include <immintrin.h>
#define KVS_AVX2_HEAD 1
/* CPUs with AVX2 but no AVX-512. The sixteen-wide paths above split into pairs of 256-bit registers there, and their
   sixteen rows' partial sums (256 floats) no longer fit: a layer of the SmolLM2 shape at 512 tokens took 270-380 us
   (AMD EPYC, one thread, 2026-12-04). Here eight rows at a time, in 256-bit registers: each query head's eight dot
   products as eight partial sums reduced together (sums8), then each query head's output accumulated over the rows
   sixty-four columns at a time (eight registers). Every query head of the KV head is served from a block of rows
   while it is in L1 (eight keys; KVS_VROWS values, the outputs kept in ``acc`` between blocks), so a row comes
   from memory once, not once per query head; the rows are asked for KVS_AHEAD ahead. The sums are taken in the
   same order as one head at a time would: the same values. */
#define KVS_HEAD8_MAX 4096  /* rep * head_dim the queries and outputs are kept for (rep 32 at head_dim 128) */
#define KVS_VROWS 32  /* value rows a block: 8 KB of float32 at head_dim 64 */
static inline __m256 ld8(const void *base, int64_t off, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + off);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  /* exact: the top half */
}
/* a cached row's cache lines asked for ahead of its use: a sequence's rows lie in pages of their own (16 rows, 4 KB of
   one head's float32 keys at head_dim 64), where the hardware's prefetchers stop at each page's end */
#define KVS_AHEAD 32  /* rows ahead: ~300 cycles of a row's products, one memory latency */
static inline void plain_prefetch(const void *base, int64_t off, int d, int bf16) {
    const char *p = (const char *)base + off * (bf16 ? 2 : 4);
    for (int c = 0; c < d * (bf16 ? 2 : 4); c += 64) __builtin_prefetch(p + c);
}
/* lane t of the result: the sum of x[t]'s eight lanes */
static inline __m256 sums8(const __m256 *x) {
    __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));  /* x0..x3: low | high */
    __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
static int plain_head8(int h, int rep, int64_t n, int dk, int dv, int bf16, const void *kp, int64_t k_head,
                       const void *vp, int64_t v_head, const int64_t *slots, const void *q, const void *nk,
                       const void *nv, float scale, float *s, int64_t ls, void *out) {
    float qf[KVS_HEAD8_MAX] __attribute__((aligned(32))), acc[KVS_HEAD8_MAX], sums[KVS_HEAD8_MAX / 8], buf[1024];
    if (dk > 1024 || dv > 1024 || rep * dk > KVS_HEAD8_MAX || rep * dv > KVS_HEAD8_MAX || dk % 8 || dv % 64) return -1;
    const int64_t len = n + 1;
    for (int r = 0; r < rep; r++) {
        const float *qr = plain_row(q, ((int64_t)h * rep + r) * dk, dk, bf16, buf);
        for (int c = 0; c < dk; c++) qf[r * dk + c] = qr[c] * scale;
    }
    for (int64_t i0 = 0; i0 < len; i0 += 8) {
        const void *kb[8];
        int64_t ko[8];
        for (int t = 0; t < 8; t++) {
            const int64_t i = i0 + t < len ? i0 + t : len - 1;  /* past the end: a row again, its score unused */
            kb[t] = i < n ? kp : nk;
            ko[t] = i < n ? h * k_head + slots[i] * dk : (int64_t)h * dk;
        }
        for (int64_t i = i0 + KVS_AHEAD; i < i0 + KVS_AHEAD + 8 && i < n; i++)
            plain_prefetch(kp, h * k_head + slots[i] * dk, dk, bf16);
        for (int r = 0; r < rep; r++) {  /* the eight rows from memory once, from L1 for the heads after the first */
            const float *qr = qf + r * dk;
            __m256 part[8];
            for (int t = 0; t < 8; t++) part[t] = _mm256_mul_ps(_mm256_load_ps(qr), ld8(kb[t], ko[t], bf16));
            for (int c = 8; c < dk; c += 8) {  /* eight independent chains of multiply-adds, one a row */
                const __m256 qv = _mm256_load_ps(qr + c);
                for (int t = 0; t < 8; t++) part[t] = _mm256_fmadd_ps(qv, ld8(kb[t], ko[t] + c, bf16), part[t]);
            }
            _mm256_storeu_ps(s + r * ls + i0, sums8(part));  /* ls >= len rounded up to 16 */
        }
    }
    plain_softmax(s, rep, len, ls, sums);
    memset(acc, 0, sizeof(float) * rep * dv);
    for (int64_t i0 = 0; i0 < len; i0 += KVS_VROWS) {
        const int64_t i1 = i0 + KVS_VROWS < len ? i0 + KVS_VROWS : len;
        for (int64_t i = i0 + KVS_AHEAD; i < i1 + KVS_AHEAD && i < n; i++)
            plain_prefetch(vp, h * v_head + slots[i] * dv, dv, bf16);
        for (int r = 0; r < rep; r++) {  /* the block's rows from memory once, from L1 for the heads after the first */
            const float *p = s + r * ls;
            for (int c0 = 0; c0 < dv; c0 += 64) {
                float *a = acc + r * dv + c0;
                __m256 o[8];
                for (int j = 0; j < 8; j++) o[j] = _mm256_loadu_ps(a + 8 * j);
                for (int64_t i = i0; i < i1; i++) {
                    const void *base = i < n ? vp : nv;
                    const int64_t off = (i < n ? h * v_head + slots[i] * dv : (int64_t)h * dv) + c0;
                    const __m256 w = _mm256_set1_ps(p[i]);
                    for (int j = 0; j < 8; j++) o[j] = _mm256_fmadd_ps(w, ld8(base, off + 8 * j, bf16), o[j]);
                }
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(a + 8 * j, o[j]);
            }
        }
    }
    for (int r = 0; r < rep; r++) {
        const __m256 inv = _mm256_set1_ps(1.0f / sums[r]);
        float *a = acc + r * dv;
        for (int c = 0; c < dv; c += 8) _mm256_storeu_ps(a + c, _mm256_mul_ps(_mm256_loadu_ps(a + c), inv));
        plain_store(out, ((int64_t)h * rep + r) * dv, a, dv, bf16);
    }
    return 0;
}
#endif

#ifdef KVS_WIDE
typedef uint16_t kvs_h16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t kvs_u16 __attribute__((vector_size(64)));

/* sixteen elements of a row as float32 (bfloat16 widened in registers) */
static inline v16 plain_ld(const void *base, int64_t off, int bf16) {
    if (!bf16) return *(const v16u *)((const float *)base + off);
    kvs_u16 u = __builtin_convertvector(*(const kvs_h16 *)((const uint16_t *)base + off), kvs_u16) << 16;
    v16 v;
    memcpy(&v, &u, 64);
    return v;
}

/* R query heads (first .. first + R - 1) of KV head h, head_dim 16 C (keys and values), R and C constants once
   inlined: the queries and outputs stay in registers; sixteen keys' scores are summed at once (sums16). s: their
   scores [R, ls]. */
static inline __attribute__((always_inline)) void plain_head_rc(
        const int R, const int C, int h, int64_t first, int64_t n, int bf16, const void *kp, int64_t k_head, const void *vp,
        int64_t v_head, const int64_t *slots, const void *q, const void *nk, const void *nv, float scale,
        float *s, int64_t ls, void *out) {
    const int d = 16 * C;
    const int64_t len = n + 1;
    v16 qv[8][8], acc[8][16], o[8][8];
    float sums[8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) qv[r][c] = plain_ld(q, ((first + r) * C + c) * 16, bf16);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int cnt = len - j0 < 16 ? (int)(len - j0) : 16;
#pragma GCC unroll 1
        for (int t = 0; t < 16; t++) {  /* not unrolled: 16 x R x C multiply-adds of code per case, for no gain */
            if (t >= cnt) {
                for (int r = 0; r < R; r++) acc[r][t] = (v16){0};
                continue;
            }
            const int64_t j = j0 + t;
            v16 row[8];
            for (int c = 0; c < C; c++)
                row[c] = plain_ld(j < n ? kp : nk, j < n ? h * k_head + slots[j] * d + 16 * c : (int64_t)h * d + 16 * c,
                                  bf16);
            for (int r = 0; r < R; r++) {
                v16 a = qv[r][0] * row[0];
                for (int c = 1; c < C; c++) a += qv[r][c] * row[c];
                acc[r][t] = a;
            }
        }
        for (int r = 0; r < R; r++) *(v16u *)(s + r * ls + j0) = sums16(acc[r]) * scale;
    }
    plain_softmax(s, R, len, ls, sums);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) o[r][c] = (v16){0};
    for (int64_t j = 0; j < len; j++) {
        v16 row[8];
        for (int c = 0; c < C; c++)
            row[c] = plain_ld(j < n ? vp : nv, j < n ? h * v_head + slots[j] * d + 16 * c : (int64_t)h * d + 16 * c,
                              bf16);
        for (int r = 0; r < R; r++) {
            const float p = s[r * ls + j];
            for (int c = 0; c < C; c++) o[r][c] += p * row[c];
        }
    }
    for (int r = 0; r < R; r++) {
        float res[128] __attribute__((aligned(64)));
        for (int c = 0; c < C; c++) *(v16 *)(res + 16 * c) = o[r][c] / sums[r];
        plain_store(out, (first + r) * d, res, d, bf16);
    }
}

#define KVS_RC(R, C) case (R) * 16 + (C): plain_head_rc(R, C, h, first, n, bf16, kp, k_head, vp, v_head, slots, q, \
                                                        nk, nv, scale, s + g * ls, ls, out); break;
#endif

/* KV heads h0 .. h1 - 1 of one new token's attention: query heads h * rep .. h * rep + rep - 1 attend to the n cached
   rows of KV head h (kp: [hk, S, dk] page rows, k_head elements between heads; row i at slot slots[i]) and then to the
   token's own row (nk [hk, dk]); likewise the values. q [hk * rep, dk], nk, nv and out [hk * rep, dv] in the pages'
   type (float32, or bfloat16: bf16 = 1). Scores and sums are float32, in scratch the kernel allocates. Returns -1 for
   a head_dim over 1024 or more than 1024 query heads a KV head, or where memory runs out. */
int kvs_plain_decode(int h0, int h1, int rep, int64_t n, int dk, int dv, int bf16, const void *kp, int64_t k_head,
                     const void *vp, int64_t v_head, const int64_t *slots, const void *q, const void *nk,
                     const void *nv, float scale, void *out) {
    if (dk > 1024 || dv > 1024 || rep > 1024) return -1;
    const int64_t ls = (n + 16) / 16 * 16;  /* a query head's scores: n + 1, rounded up (sixteen are scored at once) */
    float *s = (float *)malloc(sizeof(float) * rep * ls);
    if (!s) return -1;
    int rc = 0;
    for (int h = h0; h < h1 && !rc; h++) {
#ifdef KVS_AVX2_HEAD
        if (dk % 8 == 0 && dv % 64 == 0 && rep * dk <= KVS_HEAD8_MAX && rep * dv <= KVS_HEAD8_MAX) {
            rc = plain_head8(h, rep, n, dk, dv, bf16, kp, k_head, vp, v_head, slots, q, nk, nv, scale, s, ls, out);
            continue;
        }
#endif
#ifdef KVS_WIDE
        if (dk == dv && (dk == 64 || dk == 128)) {  /* the query heads four at a time (rep 7: 4 + 3) */
            for (int g = 0; g < rep; g += 4) {
                const int64_t first = (int64_t)h * rep + g;
                switch ((rep - g < 4 ? rep - g : 4) * 16 + dk / 16) {
                KVS_RC(1, 4) KVS_RC(2, 4) KVS_RC(3, 4) KVS_RC(4, 4) KVS_RC(1, 8) KVS_RC(2, 8) KVS_RC(3, 8) KVS_RC(4, 8)
                }
            }
            continue;
        }
#endif
        rc = plain_head(h, rep, n, dk, dv, bf16, kp, k_head, vp, v_head, slots, q, nk, nv, scale, s, ls, out);
    }
    free(s);
    return rc;
}
"""
