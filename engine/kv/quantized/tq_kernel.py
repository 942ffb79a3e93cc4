"""The C source of the fused decode attention over tq, int4 and int8 pages (built by ``engine.kv.quantized.native``).

One new query token per sequence attends to its cached tokens straight from their codes: each cached row is turned
into its levels once (a byte → levels table, in L1), dotted with the ``rep`` query heads that share its KV head
(scores), and after the softmax summed into their outputs (values), so nothing of the size of the cache is written.
The materialized read it replaces wrote [H, n, D] float32 twice a layer (3 MB at 2,048 tokens × 3 heads × 64) and
then ran SDPA over it: on the SmolLM2-135M shape that read was ~0.8 ms a layer, the fused pass ~0.1–0.2 ms.

Plain C99, intrinsics only where a CPU's own instructions pay (x86 levels; AVX2's 256-bit dot and axpy): the loops
are written so a compiler vectorizes them (16-lane accumulators, a branch-free exp), and the same file builds on x86
and ARM. The scores are exact float32 dot products up to summation order;
``fast_exp`` is within 2 ulp of ``expf`` over the softmax's range (x ≤ 0). The x86 code-to-level readers are in
``engine.kv.quantized.levels_x86``.
"""

from engine.kv.quantized import levels_x86

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* exp(x) for x <= 0 (softmax after the max is taken out): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
   p the degree-6 Taylor polynomial (relative error < 2e-7); x < -87 gives 0. Branch-free, so loops vectorize. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f
              + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

""" + levels_x86.SOURCE + r"""
/* The levels of one row of codes into lv[d] (tab16: the 2^bits levels; tab: the byte tables below). Eight bits:
   a byte's level from tab[256]. One bit plane
   (4 or 2 bits): a byte's g = 8 / bits codes from tab[byte * g]. Three bits: a 2-bit plane (d/4 bytes) then a 1-bit
   plane (d/8 bytes); four codes at once from tab[(low byte | high nibble << 8) * 4]. */
static inline void levels(const uint8_t *src, int bits, int d, const float *tab16, const float *tab, float *lv) {
    if (bits == 8) {  /* int8: one code a byte, its level from tab[256] (signed or unsigned: the table says) */
        for (int j = 0; j < d; j++) lv[j] = tab[src[j]];
        return;
    }
#ifdef __AVX512F__
    if (levels_avx512(src, bits, d, tab16, lv)) return;
#elif defined(__AVX2__)
    if (levels_avx2(src, bits, d, tab16, lv)) return;
#endif
    if (bits == 1) {  /* QJL signs, [256, 8]: 32 bytes a byte */
        for (int j = 0; j < d / 8; j++) memcpy(lv + 8 * j, tab + 8 * src[j], 32);
    } else if (bits == 4) {  /* [256, 2]: 8 bytes of levels a byte of codes */
        for (int j = 0; j < d / 2; j++) memcpy(lv + 2 * j, tab + 2 * src[j], 8);
    } else if (bits == 2) {  /* [256, 4]: 16 bytes a byte */
        for (int j = 0; j < d / 4; j++) memcpy(lv + 4 * j, tab + 4 * src[j], 16);
    } else {  /* 3 bits, [4096, 4] */
        const uint8_t *hi = src + d / 4;
        for (int j = 0; j < d / 4; j++) {
            int idx = src[j] | (((hi[j >> 1] >> ((j & 1) * 4)) & 15) << 8);
            memcpy(lv + 4 * j, tab + 4 * idx, 16);
        }
    }
}

#if defined(__GNUC__) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KVS_VECTORS 1
#endif
#endif

#ifdef KVS_VECTORS
/* 16 floats a vector (GCC / clang vector extensions: AVX-512, 2 x AVX2 or 4 x NEON registers); the _u types may
   sit at any float's address. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

typedef int32_t kvs_i16 __attribute__((vector_size(64)));

/* AVX2 without AVX-512: GCC left these two out of line, passing sixteen-wide vectors through memory at every call
   (the int8 pages' fused attention, a SmolLM2-shape layer at 2,048 tokens, two runs each on a noisy host: 1.1-1.4
   ms out of line, 0.69-0.72 inlined; AMD EPYC); elsewhere the compiler's own choice stands. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define KVS_HOT __attribute__((always_inline))
#else
#define KVS_HOT
#endif

/* fast_exp on sixteen lanes, the same steps (compilers leave the scalar loop unvectorized: floorf and the int
   conversion) */
static inline KVS_HOT v16 fast_exp16(v16 x) {
    const v16 lo = (v16){0} - 87.0f;
    kvs_i16 small = x < lo, xi, li;
    memcpy(&xi, &x, 64);
    memcpy(&li, &lo, 64);
    xi = (small & li) | (~small & xi);
    memcpy(&x, &xi, 64);
    v16 y = x * 1.44269504f + 0.5f;
    kvs_i16 t = __builtin_convertvector(y, kvs_i16);  /* toward zero; one less where that rounded up: the floor */
    t += __builtin_convertvector(t, v16) > y;
    v16 n = __builtin_convertvector(t, v16);
    v16 r = x - n * 0.693145752f - n * 1.42860677e-6f;
    v16 p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f
            + r * (0.00833333377f + r * 0.00138888892f)))));
    kvs_i16 bits = (t + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, 64);
    return p * scale;
}

static inline KVS_HOT float hsum(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13,
                                                                                             14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif

/* The paths that hold sixteen rows' partial sums (here and in the plain pages' kernel) where vectors are wide
   (AVX-512, NEON): built for a plain x86-64 (SSE2) their sixteen-lane vectors split into many small ones and the
   compiler takes minutes over them; with AVX2 they split into register pairs and spill (a layer of the SmolLM2
   shape at 2,048 tq3 tokens: 1.85 ms with them, 0.75 without and the 256-bit dot and axpy above; AMD EPYC). */
#if defined(KVS_VECTORS) && (defined(__AVX512F__) || defined(__ARM_NEON))
#define KVS_WIDE 1
#endif

#ifdef KVS_WIDE
/* lane k of the result: the sum of x[k]'s lanes (a 16 x 16 transpose and add in 30 shuffles, where sixteen
   separate sums take ~100 instructions) */
static inline v16 sums16(const v16 *x) {
    v16 a[8], b[4], c[2];
    for (int k = 0; k < 8; k++)
        a[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[2 * k], x[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int k = 0; k < 4; k++)
        b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                       30, 31);
    for (int k = 0; k < 2; k++)
        c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(b[2 * k], b[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                                       30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* a . b as sixteen partial sums (d a multiple of 16), reduced later sixteen rows at a time (sums16) */
static inline v16 dotv(const float *a, const float *b, int d) {
    v16 acc = *(const v16u *)a * *(const v16u *)b;
    for (int i = 16; i < d; i += 16) acc += *(const v16u *)(a + i) * *(const v16u *)(b + i);
    return acc;
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define KVS_AVX2_ROWS 1
/* AVX2 without AVX-512: the sixteen-wide vectors below split into register pairs and their horizontal sums went
   through memory; these keep to 256-bit registers. */
static inline float dot8(const float *a, const float *b, int d) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)), a1 = _mm256_setzero_ps();
    int i = 8;
    for (; i + 16 <= d; i += 16) {
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a1);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a0);
    }
    if (i < d) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a1);
    __m256 x = _mm256_add_ps(a0, a1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

static inline float dot(const float *a, const float *b, int d) {
#ifdef KVS_AVX2_ROWS
    if ((d & 7) == 0) return dot8(a, b, d);
#endif
#ifdef KVS_VECTORS
    if ((d & 15) == 0) {
        v16 acc = {0};
        for (int i = 0; i < d; i += 16) acc += *(const v16u *)(a + i) * *(const v16u *)(b + i);
        return hsum(acc);
    }
#endif
    float s = 0.0f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float w, const float *x, float *y, int d) {
#ifdef KVS_AVX2_ROWS
    if ((d & 7) == 0) {
        const __m256 wv = _mm256_set1_ps(w);
        for (int i = 0; i < d; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        return;
    }
#endif
#ifdef KVS_VECTORS
    if ((d & 15) == 0) {
        for (int i = 0; i < d; i += 16) *(v16u *)(y + i) += w * *(const v16u *)(x + i);
        return;
    }
#endif
    for (int i = 0; i < d; i++) y[i] += w * x[i];
}

static inline void axpyb(float a, const float *x, float b, float *y, int d) {  /* y += a x + b */
#ifdef KVS_VECTORS
    if ((d & 15) == 0) {
        for (int i = 0; i < d; i += 16) *(v16u *)(y + i) += a * *(const v16u *)(x + i) + b;
        return;
    }
#endif
    for (int i = 0; i < d; i++) y[i] += a * x[i] + b;
}

/* In place. Sixteen running maxima and sums (one per lane) so the loops vectorize without reassociation flags. */
static void softmax(float *x, int64_t len) {
    float m[16], sum[16];
    for (int l = 0; l < 16; l++) { m[l] = -INFINITY; sum[l] = 0.0f; }
    for (int64_t i = 0; i < len; i++) m[i & 15] = x[i] > m[i & 15] ? x[i] : m[i & 15];
    float mx = m[0];
    for (int l = 1; l < 16; l++) mx = m[l] > mx ? m[l] : mx;
    int64_t i = 0;
#ifdef KVS_VECTORS
    for (; i + 16 <= len; i += 16) *(v16u *)(x + i) = fast_exp16(*(const v16u *)(x + i) - mx);
#endif
    for (; i < len; i++) x[i] = fast_exp(x[i] - mx);
    for (int64_t i = 0; i < len; i++) sum[i & 15] += x[i];
    float total = 0.0f;
    for (int l = 0; l < 16; l++) total += sum[l];
    float inv = 1.0f / total;
    for (int64_t i = 0; i < len; i++) x[i] *= inv;
}

/* One role's pages of one layer, every KV head (head h's rows start at codes + h * head_stride bytes). */
typedef struct {
    const uint8_t *codes;
    int64_t head_stride;
    int row_bytes, bits, dim, width;  /* codes a row; a row's width in the read basis (QJL keys: 2 dim) */
    const float *norms;  /* [hk, n] */
    const float *levels;  /* [16]: the 2^bits levels, zero-padded */
    const float *table;  /* the byte table of ``levels`` */
    const float *tail;  /* [hk, nt, width]: the page being filled, rotated, exact */
    const uint8_t *signs;  /* QJL keys: the residual's signs, a 1-bit plane (else NULL) */
    int64_t sign_head_stride;
    int sign_row_bytes;
    const float *sign_norms;  /* [hk, n]: ||r|| sqrt(pi/2) / dim */
    const float *sign_levels;  /* {-1, +1, 0, ...} */
    const float *sign_table;  /* [256, 8] */
    int mode;  /* 0: level x norm (tq); 1: code x scale + zero per page and channel (int4 keys, KIVI);
                  2: code x scale + zero per token and group of channels (int4 values) */
    int page_size, group;
    const float *scale, *zero;  /* mode 1: [hk, n / page_size, dim]; mode 2: [hk, n, dim / group] */
} kvs_role;

#ifdef KVS_WIDE
/* The quantized rows' scores of KV head h, sixteen rows at a time: each row's levels dotted with the rep queries as
   sixteen partial sums, the sixteen rows' sums reduced at once (sums16: a tenth of the shuffles of one sum each).
   Scratch as head()'s. */
static void scores16(int h, int rep, const float *q, int64_t n, const kvs_role *k, const uint8_t *kc, const float *kn,
                     float *s, int64_t len, float *lv, float *zv, float *qs, float *cst) {
    const int dk = k->dim, wk = k->width;
    v16 part[16][16];
    float add[16][16], res[16] __attribute__((aligned(64)));
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        for (int t = 0; t < 16; t++) {
            const int64_t i = i0 + t;
            if (t >= cnt) {
                for (int r = 0; r < rep; r++) part[r][t] = (v16){0}, add[r][t] = 0.0f;
                continue;
            }
            levels(kc + i * k->row_bytes, k->bits, dk, k->levels, k->table, lv);
            if (k->mode == 1) {  /* q . (code s + z) = (q s) . code + q . z, s and z the page's */
                if (i % k->page_size == 0) {
                    const int64_t pg = h * (n / k->page_size) + i / k->page_size;
                    const float *sc = k->scale + pg * dk, *zr = k->zero + pg * dk;
                    for (int r = 0; r < rep; r++) {
                        for (int c = 0; c < dk; c++) qs[r * dk + c] = q[r * wk + c] * sc[c];
                        cst[r] = dot(q + r * wk, zr, dk);
                    }
                }
                for (int r = 0; r < rep; r++) part[r][t] = dotv(qs + r * dk, lv, dk), add[r][t] = cst[r];
                continue;
            }
            for (int r = 0; r < rep; r++) part[r][t] = dotv(q + r * wk, lv, dk) * kn[i], add[r][t] = 0.0f;
            if (k->signs) {  /* QJL: + q_proj . (alpha ||r|| z) */
                levels(k->signs + h * k->sign_head_stride + i * k->sign_row_bytes, 1, dk, k->sign_levels,
                       k->sign_table, zv);
                const float a = k->sign_norms[h * n + i];
                for (int r = 0; r < rep; r++) part[r][t] += dotv(q + r * wk + dk, zv, dk) * a;
            }
        }
        for (int r = 0; r < rep; r++) {
            *(v16 *)res = sums16(part[r]);
            for (int t = 0; t < cnt; t++) s[r * len + i0 + t] = res[t] + add[r][t];
        }
    }
}
#endif

/* One KV head h of one decode step. q [rep, k->width] (rotated, scaled), out [rep, v->dim] (rotated; zeroed here).
   Quantized rows first, then the exact tail rows. s: scratch [rep, n + nt]. */
static int head(int h, int rep, const float *q, int64_t n, int64_t nt, const kvs_role *k, const kvs_role *v,
                float *s, float *out) {
    float lv[1024] __attribute__((aligned(64))), zv[1024] __attribute__((aligned(64)));
    float qs[4096] __attribute__((aligned(64))), cst[64];  /* int4 keys: the queries times the page's scales */
    const int dk = k->dim, wk = k->width, dv = v->dim;
    const int64_t len = n + nt;
    if (dk > 1024 || dv > 1024 || (k->mode == 1 && (rep * dk > 4096 || rep > 64))) return -1;
    const uint8_t *kc = k->codes + h * k->head_stride, *vc = v->codes + h * v->head_stride;
    const float *kn = k->mode == 0 ? k->norms + h * n : 0, *vn = v->mode == 0 ? v->norms + h * n : 0;
    const float *kt = k->tail + h * nt * wk, *vt = v->tail + h * nt * dv;
    int64_t n_done = 0;
#ifdef KVS_WIDE
    if ((dk & 15) == 0 && rep <= 16) {
        scores16(h, rep, q, n, k, kc, kn, s, len, lv, zv, qs, cst);
        n_done = n;
    }
#endif
    for (int64_t i = n_done; i < n; i++) {
        levels(kc + i * k->row_bytes, k->bits, dk, k->levels, k->table, lv);
        if (k->mode == 1) {  /* q . (code s + z) = (q s) . code + q . z, s and z the page's */
            if (i % k->page_size == 0) {
                const int64_t pg = h * (n / k->page_size) + i / k->page_size;
                const float *sc = k->scale + pg * dk, *zr = k->zero + pg * dk;
                for (int r = 0; r < rep; r++) {
                    for (int c = 0; c < dk; c++) qs[r * dk + c] = q[r * wk + c] * sc[c];
                    cst[r] = dot(q + r * wk, zr, dk);
                }
            }
            for (int r = 0; r < rep; r++) s[r * len + i] = dot(qs + r * dk, lv, dk) + cst[r];
            continue;
        }
        for (int r = 0; r < rep; r++) s[r * len + i] = dot(q + r * wk, lv, dk) * kn[i];
        if (k->signs) {  /* QJL: + q_proj . (alpha ||r|| z) */
            levels(k->signs + h * k->sign_head_stride + i * k->sign_row_bytes, 1, dk, k->sign_levels, k->sign_table,
                   zv);
            const float a = k->sign_norms[h * n + i];
            for (int r = 0; r < rep; r++) s[r * len + i] += dot(q + r * wk + dk, zv, dk) * a;
        }
    }
    for (int64_t i = 0; i < nt; i++)
        for (int r = 0; r < rep; r++) s[r * len + n + i] = dot(q + r * wk, kt + i * wk, wk);
    for (int r = 0; r < rep; r++) softmax(s + r * len, len);
    memset(out, 0, sizeof(float) * rep * dv);
    for (int64_t i = 0; i < n; i++) {
        levels(vc + i * v->row_bytes, v->bits, dv, v->levels, v->table, lv);
        if (v->mode == 2) {  /* p (code s + z), s and z the token's group's */
            const int ng = dv / v->group;
            const float *sc = v->scale + (h * n + i) * ng, *zr = v->zero + (h * n + i) * ng;
            for (int r = 0; r < rep; r++) {
                const float p = s[r * len + i];
                for (int g = 0; g < ng; g++)
                    axpyb(p * sc[g], lv + g * v->group, p * zr[g], out + r * dv + g * v->group, v->group);
            }
            continue;
        }
        for (int r = 0; r < rep; r++) axpy(s[r * len + i] * vn[i], lv, out + r * dv, dv);
    }
    for (int64_t i = 0; i < nt; i++)
        for (int r = 0; r < rep; r++) axpy(s[r * len + n + i], vt + i * dv, out + r * dv, dv);
    return 0;
}

/* Every KV head; the query heads of KV head h are h * rep .. h * rep + rep - 1: q [hk * rep, k->width],
   out [hk * rep, v->dim]. Returns 0, or -1 for a head_dim over 1024. */
int kvs_tq_decode(int hk, int rep, const float *q, int64_t n, int64_t nt, const kvs_role *k, const kvs_role *v,
                  float *s, float *out) {
    for (int h = 0; h < hk; h++) {
        int rc = head(h, rep, q + (int64_t)h * rep * k->width, n, nt, k, v, s, out + (int64_t)h * rep * v->dim);
        if (rc) return rc;
    }
    return 0;
}

/* KV heads h0 .. h1 - 1 only, with scratch of their own (so threads may split the heads: ``engine.model.linear_op``
   shares them among torch's threads). Returns -1 as kvs_tq_decode does, or where memory runs out. */
int kvs_tq_decode_heads(int h0, int h1, int rep, const float *q, int64_t n, int64_t nt, const kvs_role *k,
                        const kvs_role *v, float *out) {
    float *s = (float *)malloc(sizeof(float) * rep * (n + nt));
    if (!s) return -1;
    int rc = 0;
    for (int h = h0; h < h1 && !rc; h++)
        rc = head(h, rep, q + (int64_t)h * rep * k->width, n, nt, k, v, s, out + (int64_t)h * rep * v->dim);
    free(s);
    return rc;
}
"""
