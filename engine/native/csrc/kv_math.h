/* The arithmetic the decode attention kernels share (kv_tq.c, kv_plain.c): a branch-free exp, sixteen-lane vectors
   (GCC / clang vector extensions), dot products, axpy and an in-place softmax. Plain C99 with intrinsics only where a
   CPU's own instructions pay (AVX2's 256-bit dot and axpy); the loops are written so a compiler vectorizes them
   (16-lane accumulators, a branch-free exp), and the same file builds on x86 and ARM. The scores are exact float32
   dot products up to summation order; fast_exp is within 2 ulp of expf over the softmax's range (x <= 0). */
#ifndef KVS_MATH_H
#define KVS_MATH_H
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

/* the largest of n floats (n a multiple of 16, >= 16): sixteen lanes (a scalar running maximum waits ~3 cycles a
   score); NaN-free input assumed, as scores are */
static inline KVS_HOT float max16(const float *x, int64_t n) {
    v16 m = *(const v16u *)x;
    for (int64_t j = 16; j < n; j += 16) {
        const v16 y = *(const v16u *)(x + j);
        kvs_i16 gt = y > m, yi, mi;
        memcpy(&yi, &y, 64);
        memcpy(&mi, &m, 64);
        mi = (gt & yi) | (~gt & mi);
        memcpy(&m, &mi, 64);
    }
    float mx = m[0];
    for (int l = 1; l < 16; l++) mx = m[l] > mx ? m[l] : mx;
    return mx;
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
static __attribute__((unused)) void softmax(float *x, int64_t len) {
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

#endif
