/* The product of the blocked linears (engine/model/packed_linear.py, through engine/model/linear_kernel.py): any
   number of rows times weights held sixteen outputs side by side for each input ([out/16, in, 16]).

   torch multiplies rows by that layout as one small matrix product per block (bmm): MKL's per-block overhead makes
   four rows cost 2.5x one (46-61 ms for the SmolLM2 shape's linears at 4 rows), and its bfloat16 bmm reads 5 GB/s.
   Here one sixteen-wide accumulator per row (four for a single row, so the adds overlap), block by block, each
   block's weights read from memory once for all rows, eight rows at a time from the core's caches: one row of those
   linears in 19-21 ms float32 (18-21 GB/s, a sum reads 25 here), four rows in 20-29 ms, 128 rows in 281 ms
   (~97 GFLOP/s). bfloat16 is summed in float32 and rounded once: by pairs of inputs where the CPU has AVX512_BF16
   (vdpbf16ps: one row 8 ms, 128 rows 149 ms), else widened in registers (one row 10-12 ms). Results differ from
   torch's only in summation order. torch_ops.cpp shares a product's blocks among torch's threads (b0, b1). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16 __attribute__((vector_size(64)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
/* sixteen bfloat16 weights as float32: a bfloat16 is the top half of a float32 */
static inline v16 ldh(const uint16_t* p) {
    h16 h; memcpy(&h, p, 32);
    u16 u = __builtin_convertvector(h, u16) << 16;
    v16 v; memcpy(&v, &u, 64); return v;
}

/* a bfloat16 scalar as float32, and sixteen float32 rounded to bfloat16 (to nearest even, as torch rounds; NaN
   stays NaN) */
static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float xf32(const float* p) { return *p; }
static inline float xbf(const uint16_t* p) { return bf(*p); }
static inline void st(float* y, v16 o) { memcpy(y, &o, 64); }
static inline void sth(uint16_t* y, v16 o) {
    u16 u; memcpy(&u, &o, 64);
    u16 nan = (u & 0x7fffffff) > 0x7f800000;
    u16 r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    r = (r & ~nan) | (((u >> 16) | 0x40) & nan);
    h16 h = __builtin_convertvector(r, h16);
    memcpy(y, &h, 32);
}

/* y[r0 + r, b*16 + j] = sum_i x[r0 + r, i] * wb[b, i, j] (+ bias[b*16 + j]) for R rows of block b: the block's
   weights are read once for the R rows. x: [rows, n_in] rows n_in apart; y: rows ldy apart. T: the weights' (and
   weights' type, LD their vector loader; X the rows' scalar loader (the rows' type is x's own: float32 rows may
   meet bfloat16 weights); LB / ST the bias's loader and the output's store. */
#define KVS_GROUP(R, T, LD, X, LB, ST) { \
        const T* w = wb + b * (int64_t)n_in * 16; \
        const __typeof__(*x)* xr = x + (int64_t)r0 * n_in; \
        v16 acc[R]; \
        for (int r = 0; r < R; r++) acc[r] = (v16){0}; \
        for (int i = 0; i < n_in; i++) { \
            v16 wv = LD(w + (int64_t)i * 16); \
            __builtin_prefetch(w + (int64_t)(i + 16) * 16); /* 2-8 rows float32: ~10% faster with it */ \
            for (int r = 0; r < R; r++) acc[r] += X(xr + (int64_t)r * n_in + i) * wv; \
        } \
        for (int r = 0; r < R; r++) { \
            v16 o = acc[r]; \
            if (bias) o += LB(bias + b * 16); \
            ST(y + (int64_t)(r0 + r) * ldy + b * 16, o); \
        } \
    }

/* Any number of rows: block by block, all rows eight at a time, so a block's weights (18-98 KB for the SmolLM2
   shape) come from memory once and from the core's caches for the other groups (128 rows float32: 281 ms for the
   shape's linears, against 332 reading them again per eight rows and 469 for oneDNN on the plain layout). G is
   the group macro (KVS_GROUP, or KVS_PAIRS below). */
#define KVS_MANY(G, ...) \
    for (int64_t b = b0; b < b1; b++) { \
        int r0 = 0; \
        for (; r0 + 8 <= rows; r0 += 8) G(8, __VA_ARGS__) \
        switch (rows - r0) { \
        case 1: G(1, __VA_ARGS__) break; \
        case 2: G(2, __VA_ARGS__) break; \
        case 3: G(3, __VA_ARGS__) break; \
        case 4: G(4, __VA_ARGS__) break; \
        case 5: G(5, __VA_ARGS__) break; \
        case 6: G(6, __VA_ARGS__) break; \
        case 7: G(7, __VA_ARGS__) break; \
        } \
    }

/* One row (a chat's decode step): four accumulators, so the adds do not wait on each other's latency; no
   prefetch hint (the hardware's streams it: a hint 16-128 rows ahead read 12-17 GB/s where none reads 17-21). */
#define KVS_ONE(T, LD, X, LB, ST) \
    for (int64_t b = b0; b < b1; b++) { \
        const T* w = wb + b * (int64_t)n_in * 16; \
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}; \
        int i = 0; \
        for (; i + 4 <= n_in; i += 4) { \
            a0 += X(x + i) * LD(w + (int64_t)i * 16); \
            a1 += X(x + i + 1) * LD(w + (int64_t)(i + 1) * 16); \
            a2 += X(x + i + 2) * LD(w + (int64_t)(i + 2) * 16); \
            a3 += X(x + i + 3) * LD(w + (int64_t)(i + 3) * 16); \
        } \
        for (; i < n_in; i++) a0 += X(x + i) * LD(w + (int64_t)i * 16); \
        v16 o = (a0 + a1) + (a2 + a3); \
        if (bias) o += LB(bias + b * 16); \
        ST(y + b * 16, o); \
    }

#ifdef __AVX512BF16__
#include <immintrin.h>
/* bfloat16 by pairs of inputs (AVX512_BF16's vdpbf16ps): acc += x[i] w[i] + x[i+1] w[i+1], sixteen outputs, in
   one instruction — twice the products of a float32 multiply-add, and no widening. Inputs i and i+1 of a block
   are 64 adjacent bytes (two rows of sixteen); one permute interleaves them into the pairs the instruction reads.
   The products are exact in float32 and the sums float32 (denormal inputs read as zero). SmolLM2 shape's linears,
   one thread: 1 row 8.0 ms (26 GB/s) against 10.6 widened, 4 rows 9.0 against 18.2, 128 rows 149 ms against 218
   for oneDNN on the plain layout. An odd last input is widened as above. LB / ST: the bias's loader and the
   output's store (bfloat16, or float32 for kvs_blocked_mm_xh). */
#define KVS_PAIRS(R, LB, ST) { \
        const uint16_t* w = wb + b * (int64_t)n_in * 16; \
        const uint16_t* xr = x + (int64_t)r0 * n_in; \
        __m512 acc[R]; \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(); \
        int i = 0; \
        for (; i + 2 <= n_in; i += 2) { \
            __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(w + (int64_t)i * 16)); \
            for (int r = 0; r < R; r++) { \
                uint32_t xx; memcpy(&xx, xr + (int64_t)r * n_in + i, 4); \
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)xx), wv); \
            } \
        } \
        for (int r = 0; r < R; r++) { \
            v16 o; memcpy(&o, &acc[r], 64); \
            if (i < n_in) o += xbf(xr + (int64_t)r * n_in + i) * ldh(w + (int64_t)i * 16); \
            if (bias) o += LB(bias + b * 16); \
            ST(y + (int64_t)(r0 + r) * ldy + b * 16, o); \
        } \
    }
/* the pairs' order: input i's output j, then input i+1's */
#define KVS_PAIRS_ORDER \
    short order[32]; \
    for (int j = 0; j < 16; j++) { order[2 * j] = (short)j; order[2 * j + 1] = (short)(16 + j); } \
    const __m512i pairs = _mm512_loadu_si512(order);
int kvs_bf16_pairs(void) { return 1; }
#else
int kvs_bf16_pairs(void) { return 0; }
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
/* CPUs with AVX2 but no AVX-512 (many AMD EPYC / Ryzen, Intel before Ice Lake). GCC splits the sixteen-wide
   vectors above into two 256-bit halves, and there the rows' accumulators of a group of eight no longer fit the
   sixteen registers: every add went through memory. Written with the 256-bit registers instead (AMD EPYC, one
   thread, 2026-12-04; a ``sum`` reads 16.7 GB/s there): one row reads float32 at 17.4 GB/s (11.7 before) and
   bfloat16 at 13.3 (6.3) with eight accumulators; six rows at a time multiply at 95 GFLOP/s (7 before: 128 rows
   of the SmolLM2 shape's linears 13x faster). bfloat16 weights are widened by interleaving them with zeros:
   outputs 0-3 and 8-11 in the low half, 4-7 and 12-15 in the high one, put back in order once at the end. */
static inline void w8f(const float* p, __m256* lo, __m256* hi) {
    *lo = _mm256_loadu_ps(p); *hi = _mm256_loadu_ps(p + 8);
}
static inline void w8h(const uint16_t* p, __m256* lo, __m256* hi) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h)); *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}
static inline v16 join(__m256 lo, __m256 hi) { v16 o; memcpy(&o, &lo, 32); memcpy((char*)&o + 32, &hi, 32); return o; }
static inline v16 joinh(__m256 lo, __m256 hi) {
    return join(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#define A2_ONE(T, W8, FIX, X, LB, ST) \
    for (int64_t b = b0; b < b1; b++) { \
        const T* w = wb + b * (int64_t)n_in * 16; \
        __m256 a[8], wl, wh; \
        for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps(); \
        int i = 0; \
        for (; i + 4 <= n_in; i += 4) \
            for (int k = 0; k < 4; k++) { \
                __m256 xv = _mm256_set1_ps(X(x + i + k)); \
                W8(w + (int64_t)(i + k) * 16, &wl, &wh); \
                a[2 * k] = _mm256_fmadd_ps(xv, wl, a[2 * k]); \
                a[2 * k + 1] = _mm256_fmadd_ps(xv, wh, a[2 * k + 1]); \
            } \
        for (; i < n_in; i++) { \
            __m256 xv = _mm256_set1_ps(X(x + i)); \
            W8(w + (int64_t)i * 16, &wl, &wh); \
            a[0] = _mm256_fmadd_ps(xv, wl, a[0]); a[1] = _mm256_fmadd_ps(xv, wh, a[1]); \
        } \
        v16 o = FIX(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6])), \
                    _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7]))); \
        if (bias) o += LB(bias + b * 16); \
        ST(y + b * 16, o); \
    }
#define A2_GROUP(R, T, W8, FIX, X, LB, ST) { \
        const T* w = wb + b * (int64_t)n_in * 16; \
        const float* xr = xs + (int64_t)r0 * n_in; \
        __m256 lo[R], hi[R], wl, wh; \
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps(); \
        for (int i = 0; i < n_in; i++) { \
            W8(w + (int64_t)i * 16, &wl, &wh); \
            __builtin_prefetch(w + (int64_t)(i + 16) * 16); \
            for (int r = 0; r < R; r++) { \
                __m256 xv = _mm256_broadcast_ss(xr + (int64_t)r * n_in + i); \
                lo[r] = _mm256_fmadd_ps(xv, wl, lo[r]); hi[r] = _mm256_fmadd_ps(xv, wh, hi[r]); \
            } \
        } \
        for (int r = 0; r < R; r++) { \
            v16 o = FIX(lo[r], hi[r]); \
            if (bias) o += LB(bias + b * 16); \
            ST(y + (int64_t)(r0 + r) * ldy + b * 16, o); \
        } \
    }
/* all rows six at a time (twelve accumulators, two weight halves and a broadcast: fifteen registers); the rows
   are read as float32 from ``xs`` (bfloat16 rows widened once per call: a broadcast from memory is one instruction,
   a bfloat16 one four, six rows of them per weight vector). The weights are asked for sixteen inputs ahead: the
   multiply-adds of six rows leave the hardware's prefetcher behind (2-16 rows of the SmolLM2 shape's linears,
   float32: 0.80-0.94 of the time without it; evening the groups out, 4 + 4 for eight rows, and two inputs a pass
   for two or three rows were measured too, and were slower) */
#define A2_MANY(...) \
    for (int64_t b = b0; b < b1; b++) { \
        int r0 = 0; \
        for (; r0 + 6 <= rows; r0 += 6) A2_GROUP(6, __VA_ARGS__) \
        switch (rows - r0) { \
        case 1: A2_GROUP(1, __VA_ARGS__) break; \
        case 2: A2_GROUP(2, __VA_ARGS__) break; \
        case 3: A2_GROUP(3, __VA_ARGS__) break; \
        case 4: A2_GROUP(4, __VA_ARGS__) break; \
        case 5: A2_GROUP(5, __VA_ARGS__) break; \
        } \
    }
#define KVS_AVX2 1
#endif

int kvs_blocked_mm(int rows, int n_in, int64_t b0, int64_t b1, const float* x, const float* wb, const float* bias,
                   float* y, int64_t ldy)
{
    if (rows < 1) return -1;
#ifdef KVS_AVX2
    const float* xs = x;
    if (rows == 1) { A2_ONE(float, w8f, join, xf32, ld, st) }
    else { A2_MANY(float, w8f, join, xf32, ld, st) }
#else
    if (rows == 1) { KVS_ONE(float, ld, xf32, ld, st) }
    else { KVS_MANY(KVS_GROUP, float, ld, xf32, ld, st) }
#endif
    return 0;
}

/* the same in bfloat16 (x, weights, bias and y; the sums float32, rounded once) */
int kvs_blocked_mm_h(int rows, int n_in, int64_t b0, int64_t b1, const uint16_t* x, const uint16_t* wb,
                     const uint16_t* bias, uint16_t* y, int64_t ldy)
{
    if (rows < 1) return -1;
#ifdef __AVX512BF16__
    KVS_PAIRS_ORDER
    KVS_MANY(KVS_PAIRS, ldh, sth)
#elif defined(KVS_AVX2)
    if (rows == 1) { A2_ONE(uint16_t, w8h, joinh, xbf, ldh, sth) }
    else {
        float* xs = (float*)malloc((size_t)rows * n_in * sizeof(float));
        if (!xs) { KVS_MANY(KVS_GROUP, uint16_t, ldh, xbf, ldh, sth) return 0; }  /* slower, same sums */
        for (int64_t k = 0; k < (int64_t)rows * n_in; k++) xs[k] = bf(x[k]);
        A2_MANY(uint16_t, w8h, joinh, xbf, ldh, sth)
        free(xs);
    }
#else
    if (rows == 1) { KVS_ONE(uint16_t, ldh, xbf, ldh, sth) }
    else { KVS_MANY(KVS_GROUP, uint16_t, ldh, xbf, ldh, sth) }
#endif
    return 0;
}

/* Float32 rows times bfloat16 weights -> float32 (bias float32): a BF16 GGUF's linears computed in float32
   (engine/model/packed_linear.py, BF16_BLOCKED_F32), whose rows' product (engine/quant/csrc) this replaces with
   the same numerics. ``xb`` null: the float32 rows ``xf`` times the weights widened in registers as above (exact: a
   bfloat16 is the top half of a float32), the sums float32 — the float32 model the gguf package dequantizes, in
   another order (the GGUF float road, and every road on a CPU without AVX512_BF16). ``xb`` given: the same rows
   rounded to bfloat16 by the caller (once, not per thread's share), multiplied by pairs where the CPU has
   AVX512_BF16, else widened — the GGUF default road's numerics on such a CPU (kq_bf16_rows and its GEMM round the
   activations so). 8192x2048, one row, one thread, weights from memory in 2 MiB pages (packed_linear's): 1.14-1.24
   ms widened, 1.2-1.25 by pairs (28-30 GB/s), the rows' product 1.8-2.0 float, 1.57-1.71 rounded; two threads
   1.0-1.27 against 1.11-1.42; 256 rows of 2048x2048: 19.4 ms widened, 9.8 by pairs (rows: 22 / 12). */
int kvs_blocked_mm_xh(int rows, int n_in, int64_t b0, int64_t b1, const float* xf, const uint16_t* xb,
                      const uint16_t* wb, const float* bias, float* y, int64_t ldy)
{
    if (rows < 1) return -1;
    if (!xb) {
        const float* x = xf;
#ifdef KVS_AVX2
        const float* xs = x;
        if (rows == 1) { A2_ONE(uint16_t, w8h, joinh, xf32, ld, st) }
        else { A2_MANY(uint16_t, w8h, joinh, xf32, ld, st) }
#else
        if (rows == 1) { KVS_ONE(uint16_t, ldh, xf32, ld, st) }
        else { KVS_MANY(KVS_GROUP, uint16_t, ldh, xf32, ld, st) }
#endif
        return 0;
    }
    const uint16_t* x = xb;
#ifdef __AVX512BF16__
    KVS_PAIRS_ORDER
    KVS_MANY(KVS_PAIRS, ld, st)
#elif defined(KVS_AVX2)
    if (rows == 1) { A2_ONE(uint16_t, w8h, joinh, xbf, ld, st) }
    else {
        float* xs = (float*)malloc((size_t)rows * n_in * sizeof(float));
        if (!xs) { KVS_MANY(KVS_GROUP, uint16_t, ldh, xbf, ld, st) return 0; }  /* slower, same sums */
        for (int64_t k = 0; k < (int64_t)rows * n_in; k++) xs[k] = bf(x[k]);
        A2_MANY(uint16_t, w8h, joinh, xbf, ld, st)
        free(xs);
    }
#else
    if (rows == 1) { KVS_ONE(uint16_t, ldh, xbf, ld, st) }
    else { KVS_MANY(KVS_GROUP, uint16_t, ldh, xbf, ld, st) }
#endif
    (void)xf;
    return 0;
}

/* The layout itself: w [rows, cols] (row stride ld elements, elem 2 or 4 bytes) -> wb [rows/16, cols, 16], rows a
   multiple of 16. Sixteen rows' streams read side by side, 64 columns at a time, the blocks written in order: a
   1B model's 2 GB of bfloat16 linears at ~4 GB/s, where torch's transposing copy read ~1 GB/s (2 s of a 5 s load).
   0 done, -1 bad arguments. */
#define BLOCK16(T) \
    for (int64_t g = 0; g < rows / 16; g++) { \
        const T* s = (const T*)src + g * 16 * ld; \
        T* d = (T*)dst + g * cols * 16; \
        for (int64_t c0 = 0; c0 < cols; c0 += 64) { \
            const int64_t c1 = c0 + 64 < cols ? c0 + 64 : cols; \
            for (int k = 0; k < 16; k++) \
                for (int64_t c = c0; c < c1; c++) d[c * 16 + k] = s[k * ld + c]; \
        } \
    }

int kvs_block16(const void* src, int64_t rows, int64_t cols, int64_t ld, int elem, void* dst)
{
    if (rows < 0 || rows % 16 || cols < 1 || ld < cols) return -1;
    if (elem == 2) { BLOCK16(uint16_t) }
    else if (elem == 4) { BLOCK16(uint32_t) }
    else return -1;
    return 0;
}
