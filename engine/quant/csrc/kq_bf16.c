/* BF16 weights times a few activation rows (under the GEMM's sixteen: a decode step, a small batch) by bfloat16
   pairs: AVX512_BF16's vdpbf16ps multiplies 32 weights by 32 activations a instruction, summing in float32, where
   widening the weights to float32 first took four instructions per 32. The activations are rounded to bfloat16
   once per call (to nearest even, as the GEMM's tiles and llama.cpp's bf16 products round them); the weights are
   read as the file stores them, four rows at a time against up to four activation rows (one load of each row's
   32 weights serves every activation row). */
#include <stdlib.h>
#include "kq_blocks.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
/* each weight row read 16 KiB ahead into L2: the rows are the file's mapping in 4 KiB pages, where the hardware
   prefetchers stop at every page (1B shape, one thread: 118 -> 98 ms a token for the linears; 4 KiB into L1: no
   gain, 64 KiB: no more) */
#define AHEAD 16384

/* x's n floats rounded to bfloat16 (NaN stays NaN) into out (n rounded up to 32, the rest zeros) */
static void round_row(const float* x, int64_t n, uint16_t* out) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), quiet = _mm512_set1_epi32(0x40);
    const int64_t np = (n + 31) / 32 * 32;
    for (int64_t i = 0; i < np; i += 16) {
        const __mmask16 k = i + 16 <= n ? 0xFFFF : i < n ? (__mmask16)((1u << (n - i)) - 1) : 0;
        const __m512i u = _mm512_maskz_loadu_epi32(k, x + i);
        const __m512i even = _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        __m512i b = _mm512_srli_epi32(even, 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), inf);
        b = _mm512_mask_or_epi32(b, nan, _mm512_srli_epi32(u, 16), quiet);
        _mm256_storeu_si256((__m256i*)(out + i), _mm512_cvtepi32_epi16(b));
    }
}

/* W (1..4) weight rows times R (1..4) bfloat16 activation rows (xb, np apart): out[k][r] */
INLINE void rows(const uint8_t* w, int64_t rb, const int W, int64_t n, const uint16_t* xb, int64_t np, const int R,
                 float out[4][4]) {
    __m512 acc[4][4];
    for (int k = 0; k < W; k++)
        for (int r = 0; r < R; r++) acc[k][r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512bh xv[4];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512(xb + r * np + i);
        for (int k = 0; k < W; k++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k * rb + 2 * i);
            _mm_prefetch((const char*)(w + k * rb + 2 * i + AHEAD), _MM_HINT_T1);
            for (int r = 0; r < R; r++) acc[k][r] = _mm512_dpbf16_ps(acc[k][r], wv, xv[r]);
        }
    }
    if (i < n) {  /* the last n - i (< 32) weights, the rest of the vector zeros */
        const __mmask32 m = (__mmask32)((1ull << (n - i)) - 1);
        __m512bh xv[4];
        for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512(xb + r * np + i);
        for (int k = 0; k < W; k++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k * rb + 2 * i);
            for (int r = 0; r < R; r++) acc[k][r] = _mm512_dpbf16_ps(acc[k][r], wv, xv[r]);
        }
    }
    for (int k = 0; k < W; k++)
        for (int r = 0; r < R; r++) out[k][r] = _mm512_reduce_add_ps(acc[k][r]);
}

static void rows_any(const uint8_t* w, int64_t rb, int W, int64_t n, const uint16_t* xb, int64_t np, int R,
                     float out[4][4]) {
#define CASE_R(WW) \
    switch (R) { \
    case 4: rows(w, rb, WW, n, xb, np, 4, out); break; \
    case 3: rows(w, rb, WW, n, xb, np, 3, out); break; \
    case 2: rows(w, rb, WW, n, xb, np, 2, out); break; \
    default: rows(w, rb, WW, n, xb, np, 1, out); break; \
    }
    switch (W) {
    case 4: CASE_R(4) break;
    case 3: CASE_R(3) break;
    case 2: CASE_R(2) break;
    default: CASE_R(1) break;
    }
#undef CASE_R
}

/* y [m, n_out] = x [m, n] (rounded to bfloat16) times the BF16 weight w [n_out rows, rb bytes apart];
   0 done, -2 no memory */
int kq_bf16_rows(const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, const float* x, int64_t m, int64_t ldx,
                 float* y, int64_t ldy, const float* bias, const int32_t* map, int threads) {
    const int64_t np = (n + 31) / 32 * 32;
    uint16_t* xb = malloc((size_t)(m * np) * sizeof(uint16_t));
    if (!xb) return -2;
    for (int64_t r = 0; r < m; r++) round_row(x + r * ldx, n, xb + r * np);
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(); nt = omp_get_num_threads();
#endif
        const int64_t units = (n_out + 3) / 4;
        const int64_t o0 = 4 * (units * t / nt), o1e = 4 * (units * (t + 1) / nt), o1 = o1e < n_out ? o1e : n_out;
        float out[4][4];
        for (int64_t o = o0; o < o1; o += 4) {
            const int W = o1 - o < 4 ? (int)(o1 - o) : 4;
            for (int64_t r = 0; r < m; r += 4) {
                const int R = m - r < 4 ? (int)(m - r) : 4;
                rows_any(w + o * rb, rb, W, n, xb + r * np, np, R, out);
                for (int k = 0; k < W; k++)
                    for (int j = 0; j < R; j++)
                        y[(r + j) * ldy + (map ? map[o + k] : o + k)] = out[k][j] + (bias ? bias[o + k] : 0.f);
            }
        }
    }
    free(xb);
    return 0;
}
#else
int kq_bf16_rows(const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, const float* x, int64_t m, int64_t ldx,
                 float* y, int64_t ldy, const float* bias, const int32_t* map, int threads) {
    (void)w; (void)rb; (void)n_out; (void)n; (void)x; (void)m; (void)ldx; (void)y; (void)ldy; (void)bias; (void)map;
    (void)threads;
    return -1;
}
#endif
