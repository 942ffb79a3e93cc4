/* The fused decode attention over plain (float32 or bfloat16) pages (``kvs_plain_decode``; called by
   engine/kv/store/paged_decode.py, and by the operators of torch_ops.cpp).

   A compiled decode step read a sequence's cached K/V by gathering them through their slots into a new tensor,
   appending the new token's row, turning bfloat16 into float32 (its decode attention runs in float32) and calling
   torch's flash attention: per layer a copy of the whole context twice over, and a kernel whose fixed cost (~20 us a
   call here at 128 tokens) is larger than its work for one query. Here each cached row is read in place through its
   slot, dotted with the ``rep`` query heads of its KV head, and after the softmax summed into their outputs: nothing of
   the size of the cache is written. Scores and sums are float32; bfloat16 rows are widened exactly. */
#include "kv_math.h"
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
        const float mx = max16(x, ls);
        v16 sum = {0};
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
   (AMD EPYC, one thread, 2026-12-04). Here in 256-bit registers, the loops' sizes fixed so that the compiler keeps the
   sums in registers (an array sized by a parameter lived in memory: every multiply-add stored):
   - scores: four rows' eight-lane partial dot products with two query heads at a time (eight sums, each row's and
     query's eight floats loaded once for two or four multiply-adds), eight rows' sums reduced together (sums8);
   - values: two query heads' outputs thirty-two columns at a time over a block of KVS_VROWS rows (eight sums, each
     row's eight floats loaded once for two multiply-adds), the outputs kept in ``acc`` between blocks;
   - the softmax in 256-bit registers (the sixteen-wide one above, split in two, spent 30% of the time).
   A row comes from memory once, not once per query head (the heads after the first read it from L1), asked for
   KVS_AHEAD rows ahead. Scores and outputs are summed in the order one query head alone would sum them.
   Against the code before (one query head and eight rows at a time, the row pointers reloaded at every step),
   one thread, 3 KV heads x 3 query heads x 64: a layer of 2,048 tokens in L3 0.61 of the time; 8 sequences x 30
   layers from memory: 256 tokens 0.79, 2,048 0.93 float32 and 0.77 bfloat16 (memory-bound: ~8 GB/s of K/V,
   where one core's sum streams ~19; the core's outstanding misses, not the arithmetic, bound it). */
#define KVS_HEAD8_MAX 4096  /* rep * head_dim the queries and outputs are kept for (rep 32 at head_dim 128) */
#define KVS_VROWS 32  /* value rows a block: 8 KB of float32 at head_dim 64 */
#define KVS_AHEAD 32  /* rows ahead: ~300 cycles of a row's products, one memory latency */
#define KVS_AI static inline __attribute__((always_inline))
/* eight elements at p as float32: in place, or bfloat16 widened (exact: the top half) */
KVS_AI __m256 ld8(const char *p, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void plain_prefetch(const char *p, int bytes) {
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch(p + c);
}
/* lane t of the result: the sum of x[t]'s eight lanes */
static inline __m256 sums8(const __m256 *x) {
    __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));  /* x0..x3: low | high */
    __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
/* fast_exp16's steps on eight lanes (NaN stays NaN) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
    __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(0.00138888892f), _mm256_set1_ps(0.00833333377f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.0416666679f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.166666672f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
/* plain_softmax on eight lanes */
static void plain_softmax8(float *s, int rep, int64_t len, int64_t ls, float *sums) {
    for (int r = 0; r < rep; r++) {
        float *x = s + r * ls;
        for (int64_t i = len; i < ls; i++) x[i] = -INFINITY;
        __m256 m = _mm256_loadu_ps(x), sum = _mm256_setzero_ps();
        for (int64_t i = 8; i < ls; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
        float l[8], mx;
        _mm256_storeu_ps(l, m);
        mx = l[0];
        for (int k = 1; k < 8; k++) mx = l[k] > mx ? l[k] : mx;
        const __m256 mv = _mm256_set1_ps(mx);
        for (int64_t i = 0; i < ls; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
            _mm256_storeu_ps(x + i, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(l, sum);
        sums[r] = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
    }
}
/* acc[4 r + t]: the eight partial dot products of row kr[t] (t < 4) with query head q + r dk (r < R) */
KVS_AI void dots4(const int R, const int BF, const float *q, int dk, const char *const *kr, __m256 *acc) {
    for (int k = 0; k < 4 * R; k++) acc[k] = _mm256_setzero_ps();
    for (int c = 0; c < dk; c += 8) {
        __m256 kv[4];
        for (int t = 0; t < 4; t++) kv[t] = ld8(kr[t] + c * (BF ? 2 : 4), BF);
        for (int r = 0; r < R; r++) {
            const __m256 qv = _mm256_load_ps(q + r * dk + c);
            for (int t = 0; t < 4; t++) acc[4 * r + t] = _mm256_fmadd_ps(qv, kv[t], acc[4 * r + t]);
        }
    }
}
/* scores s[r ls + i0 + t] (t < 8) of rows kr[t] for query heads q + r dk (r < R) */
KVS_AI void scores8(const int R, const int BF, const float *q, int dk, const char *const *kr, float *s, int64_t ls) {
    __m256 a[2][8], x[8];  /* fixed sizes: an array sized by R would live in memory */
    dots4(R, BF, q, dk, kr, a[0]);
    dots4(R, BF, q, dk, kr + 4, a[1]);
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < 8; t++) x[t] = a[t / 4][4 * r + t % 4];
        _mm256_storeu_ps(s + r * ls, sums8(x));
    }
}
/* out[r dv + c] += p[r ls + i] v[i][c] for the block's rows i (vr[i]), query heads r < R, columns c0 .. c0 + 31 */
KVS_AI void values32(const int R, const int BF, const float *p, int64_t ls, int rows, const char *const *vr, int c0,
                     float *out, int dv) {
    __m256 o[2][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) o[r][j] = _mm256_loadu_ps(out + r * dv + c0 + 8 * j);
    for (int i = 0; i < rows; i++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = ld8(vr[i] + (c0 + 8 * j) * (BF ? 2 : 4), BF);
        for (int r = 0; r < R; r++) {
            const __m256 w = _mm256_broadcast_ss(p + r * ls + i);
            for (int j = 0; j < 4; j++) o[r][j] = _mm256_fmadd_ps(w, v[j], o[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + r * dv + c0 + 8 * j, o[r][j]);
}
KVS_AI void head8(const int BF, int h, int rep, int64_t n, int dk, int dv, const char *kp, int64_t k_head,
                  const char *vp, int64_t v_head, const int64_t *slots, const char *nk, const char *nv, const float *qf,
                  float *s, int64_t ls, float *acc) {
    const int es = BF ? 2 : 4;
    const int64_t len = n + 1;
    const char *kh = kp + h * k_head * es, *vh = vp + h * v_head * es;
    for (int64_t i0 = 0; i0 < len; i0 += 8) {
        const char *kr[8];
        for (int t = 0; t < 8; t++) {
            const int64_t i = i0 + t < len ? i0 + t : len - 1;  /* past the end: a row again, its score unused */
            kr[t] = i < n ? kh + slots[i] * dk * es : nk + (int64_t)h * dk * es;
        }
        for (int64_t i = i0 + KVS_AHEAD; i < i0 + KVS_AHEAD + 8 && i < n; i++)
            plain_prefetch(kh + slots[i] * dk * es, dk * es);
        int r = 0;
        for (; r + 2 <= rep; r += 2) scores8(2, BF, qf + r * dk, dk, kr, s + r * ls + i0, ls);
        if (r < rep) scores8(1, BF, qf + r * dk, dk, kr, s + r * ls + i0, ls);
    }
    plain_softmax8(s, rep, len, ls, acc + rep * dv);  /* the sums after the outputs */
    for (int64_t i0 = 0; i0 < len; i0 += KVS_VROWS) {
        const int rows = i0 + KVS_VROWS < len ? KVS_VROWS : (int)(len - i0);
        const char *vr[KVS_VROWS];
        for (int t = 0; t < rows; t++) {
            const int64_t i = i0 + t;
            vr[t] = i < n ? vh + slots[i] * dv * es : nv + (int64_t)h * dv * es;
        }
        for (int64_t i = i0 + KVS_AHEAD; i < i0 + rows + KVS_AHEAD && i < n; i++)
            plain_prefetch(vh + slots[i] * dv * es, dv * es);
        for (int c0 = 0; c0 < dv; c0 += 32) {
            int r = 0;
            for (; r + 2 <= rep; r += 2) values32(2, BF, s + r * ls + i0, ls, rows, vr, c0, acc + r * dv, dv);
            if (r < rep) values32(1, BF, s + r * ls + i0, ls, rows, vr, c0, acc + r * dv, dv);
        }
    }
}
static int plain_head8(int h, int rep, int64_t n, int dk, int dv, int bf16, const void *kp, int64_t k_head,
                       const void *vp, int64_t v_head, const int64_t *slots, const void *q, const void *nk,
                       const void *nv, float scale, float *s, int64_t ls, void *out) {
    float qf[KVS_HEAD8_MAX] __attribute__((aligned(32))), acc[KVS_HEAD8_MAX + KVS_HEAD8_MAX / 8], buf[1024];
    if (dk > 1024 || dv > 1024 || rep * dk > KVS_HEAD8_MAX || rep * dv > KVS_HEAD8_MAX || dk % 8 || dv % 32) return -1;
    for (int r = 0; r < rep; r++) {
        const float *qr = plain_row(q, ((int64_t)h * rep + r) * dk, dk, bf16, buf);
        for (int c = 0; c < dk; c++) qf[r * dk + c] = qr[c] * scale;
    }
    memset(acc, 0, sizeof(float) * rep * dv);
    if (bf16) head8(1, h, rep, n, dk, dv, kp, k_head, vp, v_head, slots, nk, nv, qf, s, ls, acc);
    else head8(0, h, rep, n, dk, dv, kp, k_head, vp, v_head, slots, nk, nv, qf, s, ls, acc);
    const float *sums = acc + rep * dv;
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
        if (dk % 8 == 0 && dv % 32 == 0 && rep * dk <= KVS_HEAD8_MAX && rep * dv <= KVS_HEAD8_MAX) {
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
