/* The integer products on AVX-512 (F + BW + VL; VNNI's vpdpbusd where the CPU has it): 64 bytes of a weight row
   per instruction instead of AVX2's 32, for the types llama.cpp's quantizer writes most (Q4_K, Q5_K, Q6_K, Q8_0,
   Q4_0, Q5_0, Q4_1, Q5_1). Same sums as kq_dot.c up to float rounding order.

   Two activation layouts make every 64-byte activation load match the weight bytes it multiplies (the activations
   are quantized per call, so their order is free; the weights are the file's):
   - k-quants (Q4_K, Q5_K): in each 128 quants the second and third 32 swapped, so that one 64-byte load of packed
     nibbles (low nibbles: elements 0-31 and 64-95) meets its activations in one load (kq_act_layout 2);
   - 32-block nibble types (Q4_0, Q4_1, Q5_0, Q5_1): in each pair of blocks the second and third 16 swapped
     (low nibbles of both blocks, then the high ones: two blocks' 16 + 16 bytes of nibbles widened at once;
     kq_act_layout 3); an odd last block stays as it was and takes a 256-bit step.
   Q6_K and Q8_0 read the activations in their natural order. */
#include "kq_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
#define ACT_Q(a, r) ((a)->qs + (r) * (a)->n)
#define ACT_D32(a, r) ((a)->d + (r) * ((a)->n / QK))
#define ACT_S32(a, r) ((a)->s + (r) * ((a)->n / QK))
#define ACT_DK(a, r) ((a)->d + (r) * ((a)->n / QKK))
#define ACT_BS(a, r) ((a)->bsums + (r) * ((a)->n / 16))

/* u (unsigned bytes, at most 127 without VNNI) times q (signed bytes): sums of four in 32 bits */
INLINE __m512i dot_us512(__m512i u, __m512i q) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1));
#endif
}
INLINE __m256i dot_us256(__m256i u, __m256i q) {
#if defined(__AVX512VNNI__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}
INLINE float hsum4(__m128 r) {
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
INLINE float hsum8(__m256 x) { return hsum4(_mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x))); }

/* the sixteen 6-bit scales and mins of a Q4_K / Q5_K block as sixteen bytes: scales 0-7, then mins 0-7 */
INLINE __m128i scales_mins(const uint8_t* s12) {
    uint32_t u[4];
    memcpy(u, s12, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t aux = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = aux;
    u[0] &= 0x3f3f3f3f;
    return _mm_loadu_si128((const __m128i*)u);
}

/* 32 16-bit lanes: the first sixteen take lane a of v, the others lane b (a sub-block's scale per 16 pairs) */
static const int16_t IDX_HALVES[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6},
    {5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7},
};
/* four scales of sixteen quants each over 32 16-bit lanes (Q6_K: eight pairs per scale), quarter k of 16 */
static const int16_t IDX_QUARTERS[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15,
     15, 15, 15},
};

/* Q4_K / Q5_K, activations in layout 2. Per block: 128 bytes of nibbles in two loads, four 64-quant vectors
   (low / high nibbles of each), each times its two sub-blocks' scales in 32 bits; the mins through the sums of
   sixteen (ggml's bsums). Q5 adds the fifth bit from qh (bit 2j for sub-block 2j). */
INLINE void k45_512(const void* row, const kq_act* a, int64_t r0, int R, float* out, int q5) {
    const int64_t nb = a->n / QKK;
    const size_t bsz = q5 ? sizeof(blk_q5_K) : sizeof(blk_q4_K);
    const __m512i m4 = _mm512_set1_epi8(0xF), sixteen = _mm512_set1_epi8(16);
    const __m512i B01 = _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(4), 1);
    const __m512i B23 = _mm512_inserti64x4(_mm512_set1_epi8(2), _mm256_set1_epi8(8), 1);
    const __m512i B45 = _mm512_inserti64x4(_mm512_set1_epi8(16), _mm256_set1_epi8(64), 1);
    const __m512i B67 = _mm512_inserti64x4(_mm512_set1_epi8(32), _mm256_set1_epi8((char)128), 1);
    const __m512i i0 = _mm512_loadu_si512(IDX_HALVES[0]), i1 = _mm512_loadu_si512(IDX_HALVES[1]);
    const __m512i i2 = _mm512_loadu_si512(IDX_HALVES[2]), i3 = _mm512_loadu_si512(IDX_HALVES[3]);
    __m512 acc[4];
    __m128 accm[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); accm[r] = _mm_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = (const uint8_t*)row + b * bsz;
        const blk_q4_K* x4 = (const blk_q4_K*)blk;  /* d, dmin, scales: the same bytes in Q5_K */
        const uint8_t* qs = q5 ? ((const blk_q5_K*)blk)->qs : x4->qs;
        const float d = kq_h2f(x4->d), dmin = kq_h2f(x4->dmin);
        const __m256i s16 = _mm256_cvtepu8_epi16(scales_mins(x4->scales));  /* scales 0-7, mins 0-7 */
        const __m128i mins = _mm256_extracti128_si256(s16, 1);
        const __m512i sz = _mm512_castsi256_si512(s16);
        const __m512i S0 = _mm512_permutexvar_epi16(i0, sz), S1 = _mm512_permutexvar_epi16(i1, sz);
        const __m512i S2 = _mm512_permutexvar_epi16(i2, sz), S3 = _mm512_permutexvar_epi16(i3, sz);
        const __m512i z0 = _mm512_loadu_si512(qs), z1 = _mm512_loadu_si512(qs + 64);
        __m512i l0 = _mm512_and_si512(z0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(z0, 4), m4);
        __m512i l1 = _mm512_and_si512(z1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(z1, 4), m4);
        if (q5) {  /* bit 2j of qh[l]: element l of sub-block 2j (0 | 2 in l0, 1 | 3 in h0, ...); +16 sets it */
            const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)((const blk_q5_K*)blk)->qh));
            l0 = _mm512_mask_add_epi8(l0, _mm512_test_epi8_mask(hb, B01), l0, sixteen);
            h0 = _mm512_mask_add_epi8(h0, _mm512_test_epi8_mask(hb, B23), h0, sixteen);
            l1 = _mm512_mask_add_epi8(l1, _mm512_test_epi8_mask(hb, B45), l1, sixteen);
            h1 = _mm512_mask_add_epi8(h1, _mm512_test_epi8_mask(hb, B67), h1, sixteen);
        }
        for (int r = 0; r < R; r++) {
            const int8_t* q = ACT_Q(a, r0 + r) + b * QKK;
            __m512i p = _mm512_madd_epi16(S0, _mm512_maddubs_epi16(l0, _mm512_loadu_si512(q)));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(S1, _mm512_maddubs_epi16(h0, _mm512_loadu_si512(q + 64))));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(S2, _mm512_maddubs_epi16(l1, _mm512_loadu_si512(q + 128))));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(S3, _mm512_maddubs_epi16(h1, _mm512_loadu_si512(q + 192))));
            const float dx = ACT_DK(a, r0 + r)[b];
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(p), acc[r]);
            const __m256i bs = _mm256_loadu_si256((const __m256i*)(ACT_BS(a, r0 + r) + 16 * b));
            const __m128i s32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * dx), _mm_cvtepi32_ps(_mm_madd_epi16(mins, s32)), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) - hsum4(accm[r]);
}

/* Q6_K, natural activations: per half block 64 bytes of low nibbles (elements 0-63 low, 64-127 high) and 32 of
   high bit pairs, widened with per-lane shifts; sixteen signed 8-bit scales; the offset 32 through the sums. */
INLINE void q6k_512(const void* row, const kq_act* a, int64_t r0, int R, float* out) {
    const blk_q6_K* x = row;
    const int64_t nb = a->n / QKK;
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m512i iq[4];
    for (int k = 0; k < 4; k++) iq[k] = _mm512_loadu_si512(IDX_QUARTERS[k]);
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const float d = kq_h2f(x[b].d);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x[b].scales));
        const __m512i sz = _mm512_castsi256_si512(s16);
        __m512i u[4], S[4];
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(x[b].ql + 64 * h);
            const __m512i hz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(x[b].qh + 32 * h)));
            u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(hz, shl), m30));
            u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi16(hz, shr), m30));
            S[2 * h] = _mm512_permutexvar_epi16(iq[2 * h], sz);
            S[2 * h + 1] = _mm512_permutexvar_epi16(iq[2 * h + 1], sz);
        }
        for (int r = 0; r < R; r++) {
            const int8_t* q = ACT_Q(a, r0 + r) + b * QKK;
            __m512i p = _mm512_madd_epi16(S[0], _mm512_maddubs_epi16(u[0], _mm512_loadu_si512(q)));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(S[1], _mm512_maddubs_epi16(u[1], _mm512_loadu_si512(q + 64))));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(S[2], _mm512_maddubs_epi16(u[2], _mm512_loadu_si512(q + 128))));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(S[3], _mm512_maddubs_epi16(u[3], _mm512_loadu_si512(q + 192))));
            const __m256i bs = _mm256_loadu_si256((const __m256i*)(ACT_BS(a, r0 + r) + 16 * b));
            const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(s16, bs), 5);  /* 32 sum_g sc_g bsums_g */
            p = _mm512_sub_epi32(p, _mm512_zextsi256_si512(off));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * ACT_DK(a, r0 + r)[b]), _mm512_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* The 32-block types, two blocks per step. NIB: nibble types (activations in layout 3; lanes 0-3 / 8-11 are the
   first block, 4-7 / 12-15 the second: blend mask 0xF0F0); Q8_0 (natural: lanes 8-15 the second, 0xFF00). */
#define BT_OF(T) T == KQ_Q4_0 ? sizeof(blk_q4_0) : T == KQ_Q4_1 ? sizeof(blk_q4_1) : T == KQ_Q5_0 ? sizeof(blk_q5_0) \
                 : T == KQ_Q5_1 ? sizeof(blk_q5_1) : sizeof(blk_q8_0)

INLINE const uint8_t* qs_of(int T, const uint8_t* blk) {
    switch (T) {
    case KQ_Q4_0: return ((const blk_q4_0*)blk)->qs;
    case KQ_Q4_1: return ((const blk_q4_1*)blk)->qs;
    case KQ_Q5_0: return ((const blk_q5_0*)blk)->qs;
    case KQ_Q5_1: return ((const blk_q5_1*)blk)->qs;
    default: return (const uint8_t*)((const blk_q8_0*)blk)->qs;
    }
}
INLINE uint32_t qh_of(int T, const uint8_t* blk) {
    uint32_t h = 0;
    if (T == KQ_Q5_0) memcpy(&h, ((const blk_q5_0*)blk)->qh, 4);
    if (T == KQ_Q5_1) memcpy(&h, ((const blk_q5_1*)blk)->qh, 4);
    return h;
}
/* the value the offset term multiplies: d for the symmetric types, the block's min for Q4_1 / Q5_1 */
INLINE float min_of(int T, const uint8_t* blk, float d) {
    if (T == KQ_Q4_1) return kq_h2f(((const blk_q4_1*)blk)->m);
    if (T == KQ_Q5_1) return kq_h2f(((const blk_q5_1*)blk)->m);
    return d;
}

INLINE void b32_512(int T, const void* row, const kq_act* a, int64_t r0, int R, float* out) {
    const int64_t nb = a->n / QK;
    const size_t bsz = BT_OF(T);
    const int nib = T != KQ_Q8_0;
    const float z = T == KQ_Q4_0 ? -8.f : T == KQ_Q5_0 ? -16.f : T == KQ_Q8_0 ? -128.f : 1.f;
    const __m512i m4 = _mm512_set1_epi8(0xF), sixteen = _mm512_set1_epi8(16);
    const __mmask16 second = nib ? 0xF0F0 : 0xFF00;
#if defined(__AVX512VNNI__)
    const int with_off = 1;  /* Q8_0 as w + 128: offset 128 */
#else
    const int with_off = nib;  /* Q8_0 by the sign trick: no offset */
#endif
    __m512 acc[4];
    float off[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); off[r] = 0; }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t* x0 = (const uint8_t*)row + b * bsz;
        const uint8_t* x1 = x0 + bsz;
        uint16_t h0, h1;
        memcpy(&h0, x0, 2); memcpy(&h1, x1, 2);
        const float d0 = kq_h2f(h0), d1 = kq_h2f(h1);
        const float n0 = min_of(T, x0, d0), n1 = min_of(T, x1, d1);
        __m512i u;
        if (nib) {
            const __m128i n0 = _mm_loadu_si128((const __m128i*)qs_of(T, x0));
            const __m128i n1 = _mm_loadu_si128((const __m128i*)qs_of(T, x1));
            const __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(n0), n1, 1);
            u = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1), m4);
            if (T == KQ_Q5_0 || T == KQ_Q5_1) {
                const uint64_t a0 = qh_of(T, x0), a1 = qh_of(T, x1);
                const __mmask64 k = (a0 & 0xFFFF) | (a1 & 0xFFFF) << 16 | (a0 >> 16) << 32 | (a1 >> 16) << 48;
                u = _mm512_mask_add_epi8(u, k, u, sixteen);
            }
        } else {
            const __m256i w0 = _mm256_loadu_si256((const __m256i*)qs_of(T, x0));
            const __m256i w1 = _mm256_loadu_si256((const __m256i*)qs_of(T, x1));
            const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
            u = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
        }
        for (int r = 0; r < R; r++) {
            const float* dx = ACT_D32(a, r0 + r) + b;
            const float* sx = ACT_S32(a, r0 + r) + b;
            const __m512i q = _mm512_loadu_si512(ACT_Q(a, r0 + r) + b * QK);
            __m512i s;
#if defined(__AVX512VNNI__)
            s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q);
#else
            if (nib) s = dot_us512(u, q);
            else {  /* no VNNI: |w| times q with w's sign (u = w + 128 would overflow maddubs' pairs) */
                const __m512i w = _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));
                const __m512i qs = _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(w), _mm512_setzero_si512(), q);
                s = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), qs), _mm512_set1_epi16(1));
            }
#endif
            const __m512 sc = _mm512_mask_blend_ps(second, _mm512_set1_ps(d0 * dx[0]), _mm512_set1_ps(d1 * dx[1]));
            acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(s), acc[r]);
            if (with_off) off[r] += n0 * sx[0] + n1 * sx[1];
        }
    }
    if (b < nb) {  /* an odd last block: 256 bits, natural order */
        const uint8_t* x0 = (const uint8_t*)row + b * bsz;
        uint16_t h0;
        memcpy(&h0, x0, 2);
        const float d0 = kq_h2f(h0), n0 = min_of(T, x0, d0);
        for (int r = 0; r < R; r++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(ACT_Q(a, r0 + r) + b * QK));
            __m256i s;
            if (nib) {
                const __m128i t = _mm_loadu_si128((const __m128i*)qs_of(T, x0));
                const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
                __m256i v = _mm256_and_si256(both, _mm256_set1_epi8(0xF));
                if (T == KQ_Q5_0 || T == KQ_Q5_1)
                    v = _mm256_mask_add_epi8(v, (__mmask32)qh_of(T, x0), v, _mm256_set1_epi8(16));
                s = dot_us256(v, q);
                off[r] += n0 * ACT_S32(a, r0 + r)[b];
            } else {
                const __m256i w = _mm256_loadu_si256((const __m256i*)qs_of(T, x0));
                s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w)),
                                      _mm256_set1_epi16(1));
            }
            const __m256 f = _mm256_mul_ps(_mm256_set1_ps(d0 * ACT_D32(a, r0 + r)[b]), _mm256_cvtepi32_ps(s));
            acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(f));
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + z * off[r];
}

#define ENTRY(NAME, CALL) \
static void NAME(const void* row, const kq_act* a, int64_t r0, int R, float* out) { \
    switch (R) { \
    case 4: CALL(4); break; \
    case 3: CALL(3); break; \
    case 2: CALL(2); break; \
    default: CALL(1); break; \
    } \
}
#define C_Q4K(R) k45_512(row, a, r0, R, out, 0)
#define C_Q5K(R) k45_512(row, a, r0, R, out, 1)
#define C_Q6K(R) q6k_512(row, a, r0, R, out)
#define C_Q40(R) b32_512(KQ_Q4_0, row, a, r0, R, out)
#define C_Q41(R) b32_512(KQ_Q4_1, row, a, r0, R, out)
#define C_Q50(R) b32_512(KQ_Q5_0, row, a, r0, R, out)
#define C_Q51(R) b32_512(KQ_Q5_1, row, a, r0, R, out)
#define C_Q80(R) b32_512(KQ_Q8_0, row, a, r0, R, out)
ENTRY(q4_K_512, C_Q4K) ENTRY(q5_K_512, C_Q5K) ENTRY(q6_K_512, C_Q6K) ENTRY(q4_0_512, C_Q40)
ENTRY(q4_1_512, C_Q41) ENTRY(q5_0_512, C_Q50) ENTRY(q5_1_512, C_Q51) ENTRY(q8_0_512, C_Q80)

kq_dot_fn kq_dot512_for(int type) {
    switch (type) {
    case KQ_Q4_K: return q4_K_512;
    case KQ_Q5_K: return q5_K_512;
    case KQ_Q6_K: return q6_K_512;
    case KQ_Q4_0: return q4_0_512;
    case KQ_Q4_1: return q4_1_512;
    case KQ_Q5_0: return q5_0_512;
    case KQ_Q5_1: return q5_1_512;
    case KQ_Q8_0: return q8_0_512;
    default: return 0;
    }
}

int kq_act_layout(int type) {
    switch (type) {
    case KQ_Q4_K: case KQ_Q5_K: return 2;
    case KQ_Q4_0: case KQ_Q4_1: case KQ_Q5_0: case KQ_Q5_1: return 3;
    default: return 0;
    }
}
#else
kq_dot_fn kq_dot512_for(int type) { (void)type; return 0; }
int kq_act_layout(int type) { (void)type; return 0; }
#endif
