/* The products of weights packed sixteen rows a group (kq_pack.c) on AVX-512 VNNI: y[m, n_out] = x . W^T for any
   number of activation rows, each quantized to 8 bits as on the row road (ggml's Q8_0 for Q4_0 / Q8_0, Q8_K for
   the k-quants) and multiplied by vpdpbusd: one 64-byte load of weights is four quants of sixteen rows, and each
   instruction multiplies them by four activation quants broadcast from memory, the sixteen rows' sums in the
   vector's lanes. Weight bytes are unpacked once (a mask for each nibble) and used for up to four activation rows.

   The integer sums are ggml's: a block's (or sub-block's) sum of u * q in 32 bits, its offset taken from the
   activations' sums (Q4_0: 8 sum(q); Q8_0 stored as w + 128: 128 sum(q); Q6_K: 32 sum(q) per sixteen; Q4_K's mins
   by 16-bit pairs against sums of 32), times the 6-bit scales in 32 bits, then once per block in float: d_w d_x.
   High nibbles are taken as they lie (u * 16: one mask instead of a shift and a mask) and the sixteen folded into
   the scales. Every activation row is summed the same way whatever rows are beside it, so a row's result does
   not depend on how many rows are multiplied at once. */
#include <stdlib.h>
#include "kq_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
#define PR 16
#include "kq_pact.h"

INLINE __m512i bc32(const void* p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
INLINE __m512i ld(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
INLINE __m512 halves16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

/* Q4_K: per block, four pairs of sub-blocks; chunk 8k + l holds sub-block 2k's quants 4l..4l+3 in its low
   nibbles and 2k+1's in its high nibbles (times 16: the even sub-block's scale is taken times 16 instead) */
INLINE void q4k(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, __m512* out) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), mf0 = _mm512_set1_epi8((char)0xF0);
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / QKK; b++) {
        const uint8_t* M = grp + 2368 * b;
        const uint8_t* Q = M + 320;
        __m512i is[4], im[4];
        for (int r = 0; r < R; r++) is[r] = im[r] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            __m512i a0[4], a1[4];
            for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int l = 0; l < 8; l++) {
                const __m512i w = ld(Q + 64 * (8 * k + l));
                const __m512i lo = _mm512_and_si512(w, m0f), hi = _mm512_and_si512(w, mf0);
                for (int r = 0; r < R; r++) {
                    const int8_t* q = A->qs + (r0 + r) * n + QKK * b + 64 * k + 4 * l;
                    a0[r] = _mm512_dpbusd_epi32(a0[r], lo, bc32(q));
                    a1[r] = _mm512_dpbusd_epi32(a1[r], hi, bc32(q + 32));
                }
            }
            const __m512i s0 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(M + 64 + 32 * k))), 4);
            const __m512i s1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(M + 80 + 32 * k)));
            for (int r = 0; r < R; r++)
                is[r] = _mm512_add_epi32(is[r], _mm512_add_epi32(_mm512_mullo_epi32(a0[r], s0), _mm512_mullo_epi32(a1[r], s1)));
        }
        for (int p = 0; p < 4; p++) {
            const __m512i mins = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(M + 192 + 32 * p)));
            for (int r = 0; r < R; r++)
                im[r] = _mm512_dpwssd_epi32(im[r], mins, bc32(A->b2 + (r0 + r) * (n / 32) + 8 * b + 2 * p));
        }
        const __m512 dv = halves16(M), dm = halves16(M + 32);
        for (int r = 0; r < R; r++) {
            const float dx = A->d[(r0 + r) * (n / QKK) + b];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(dv, _mm512_set1_ps(dx * 0.0625f)), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im[r]), _mm512_mul_ps(dm, _mm512_set1_ps(dx)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* Q6_K: triple 8h + l (ql's quants 4l.. of the half's first and second 32, the two high bits of all four) makes
   the 6-bit quants of elements 4l.., 32 + 4l.., 64 + 4l.., 96 + 4l.. of half h; sixteen scales of sixteen each */
INLINE void q6k(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, __m512* out) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / QKK; b++) {
        const uint8_t* M = grp + 3392 * b;
        const uint8_t* Q = M + 320;
        __m512i is[4];
        for (int r = 0; r < R; r++) is[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            for (int s = 0; s < 2; s++) {
                __m512i e[4][4];
                for (int r = 0; r < R; r++) e[0][r] = e[1][r] = e[2][r] = e[3][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const int l = 4 * s + i;
                    const uint8_t* T = Q + 192 * (8 * h + l);
                    const __m512i a = ld(T), bq = ld(T + 64), hb = ld(T + 128);
                    __m512i u[4];  /* x | (y & 0x30): ternary logic 0xF8 */
                    u[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(a, m0f), _mm512_slli_epi16(hb, 4), m30, 0xF8);
                    u[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(bq, m0f), _mm512_slli_epi16(hb, 2), m30, 0xF8);
                    u[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(a, 4), m0f), hb, m30, 0xF8);
                    u[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(bq, 4), m0f),
                                                     _mm512_srli_epi16(hb, 2), m30, 0xF8);
                    for (int r = 0; r < R; r++) {
                        const int8_t* q = A->qs + (r0 + r) * n + QKK * b + 128 * h + 4 * l;
                        for (int c = 0; c < 4; c++) e[c][r] = _mm512_dpbusd_epi32(e[c][r], u[c], bc32(q + 32 * c));
                    }
                }
                for (int c = 0; c < 4; c++) {
                    const int g = 8 * h + 2 * c + s;
                    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(M + 32 + 16 * g)));
                    for (int r = 0; r < R; r++) {
                        const __m512i off = bc32(A->o + (r0 + r) * (n / 16) + 16 * b + g);
                        is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(_mm512_sub_epi32(e[c][r], off), sc));
                    }
                }
            }
        }
        const __m512 dv = halves16(M);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]),
                                     _mm512_mul_ps(dv, _mm512_set1_ps(A->d[(r0 + r) * (n / QKK) + b])), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* Q4_0 and NF4 (``lut``): steps of two blocks; four chunks a block (low nibbles elements 4c.., high 16 + 4c..).
   Q4_0's nibbles are multiplied as stored (the high ones x16, the sum shifted back), offset 8 sum(q); NF4's codes
   are looked up in the int8 table + 128 (unsigned 1..255: one vpshufb within each 128-bit lane), the offset 128
   sum(q) taken out as Q8_0's. ``lut`` is a constant at each call: the compiler makes two loops. */
INLINE void nibbles(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, __m512* out,
                    const int lut) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), mf0 = _mm512_set1_epi8((char)0xF0);
    const __m512i tb = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i*)kq_nf4_i8),
                                                            _mm_set1_epi8((char)0x80)));
    const int64_t nb = n / QK;
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* S = grp + 576 * (b / 2);
        const uint8_t* Q = S + 64 + 256 * (b % 2);
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i w = ld(Q + 64 * c);
            lo[c] = lut ? _mm512_shuffle_epi8(tb, _mm512_and_si512(w, m0f)) : _mm512_and_si512(w, m0f);
            hi[c] = lut ? _mm512_shuffle_epi8(tb, _mm512_and_si512(_mm512_srli_epi16(w, 4), m0f))
                        : _mm512_and_si512(w, mf0);
        }
        const __m512 dv = halves16(S + 32 * (b % 2));
        for (int r = 0; r < R; r++) {
            const int8_t* q = A->qs + (r0 + r) * n + QK * b;
            __m512i al = _mm512_setzero_si512(), ah = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                al = _mm512_dpbusd_epi32(al, lo[c], bc32(q + 4 * c));
                ah = _mm512_dpbusd_epi32(ah, hi[c], bc32(q + 16 + 4 * c));
            }
            const __m512i is = _mm512_sub_epi32(_mm512_add_epi32(al, lut ? ah : _mm512_srai_epi32(ah, 4)),
                                                bc32(A->o + (r0 + r) * nb + b));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is),
                                     _mm512_mul_ps(dv, _mm512_set1_ps(A->d[(r0 + r) * nb + b])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

INLINE void q40(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, __m512* out) {
    nibbles(grp, n, A, r0, R, out, 0);
}

INLINE void nf4(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, __m512* out) {
    nibbles(grp, n, A, r0, R, out, 1);
}

/* Q8_0: steps of two blocks; eight chunks a block, stored as w + 128, offset 128 sum(q) */
INLINE void q80(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, __m512* out) {
    const int64_t nb = n / QK;
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* S = grp + 1088 * (b / 2);
        const uint8_t* Q = S + 64 + 512 * (b % 2);
        __m512i w[8];
        for (int c = 0; c < 8; c++) w[c] = ld(Q + 64 * c);
        const __m512 dv = halves16(S + 32 * (b % 2));
        for (int r = 0; r < R; r++) {
            const int8_t* q = A->qs + (r0 + r) * n + QK * b;
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                a0 = _mm512_dpbusd_epi32(a0, w[c], bc32(q + 4 * c));
                a1 = _mm512_dpbusd_epi32(a1, w[c + 1], bc32(q + 4 * c + 4));
            }
            const __m512i is = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), bc32(A->o + (r0 + r) * nb + b));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is),
                                     _mm512_mul_ps(dv, _mm512_set1_ps(A->d[(r0 + r) * nb + b])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

#define KERNEL(NAME, FN) \
static void NAME(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, int R, float (*o16)[PR]) { \
    __m512 out[4]; \
    switch (R) { \
    case 4: FN(grp, n, A, r0, 4, out); break; \
    case 3: FN(grp, n, A, r0, 3, out); break; \
    case 2: FN(grp, n, A, r0, 2, out); break; \
    default: FN(grp, n, A, r0, 1, out); break; \
    } \
    for (int k = 0; k < R; k++) _mm512_storeu_ps(o16[k], out[k]); \
}
KERNEL(k_q4k, q4k) KERNEL(k_q6k, q6k) KERNEL(k_q40, q40) KERNEL(k_q80, q80) KERNEL(k_nf4, nf4)

static kfn kernel_for(int type) {
    switch (type) {
    case KQ_Q4_K: return k_q4k;
    case KQ_Q6_K: return k_q6k;
    case KQ_Q4_0: return k_q40;
    case KQ_Q8_0: return k_q80;
    case KQ_NF4: return k_nf4;
    default: return 0;
    }
}

/* y [m, n_out] (+ bias, output row o to column map[o]) = x [m, n] times the packed weight p (kq_pack).
   0 done; -1 bad arguments; -2 no memory */
int kq_packed_matmul(int type, const uint8_t* p, int64_t n_out, int64_t n, const float* x, int64_t m, int64_t ldx,
                     float* y, int64_t ldy, const float* bias, const int32_t* map, int threads) {
    return packed_matmul(kernel_for(type), type, p, n_out, n, x, m, ldx, y, ldy, bias, map, threads);
}
#elif !KQ_PACKED_AVX2  /* kq_packed_avx2.c's where it is built for AVX2 */
int kq_packed_matmul(int type, const uint8_t* p, int64_t n_out, int64_t n, const float* x, int64_t m, int64_t ldx,
                     float* y, int64_t ldy, const float* bias, const int32_t* map, int threads) {
    (void)type; (void)p; (void)n_out; (void)n; (void)x; (void)m; (void)ldx; (void)y; (void)ldy; (void)bias;
    (void)map; (void)threads;
    return -1;
}
#endif
