/* The levels of a row of codes (the quantized pages' rows: 1, 2, 3, 4 or 8 bits a code) as float32, for the fused
   attention over quantized pages (kv_tq.c).

   x86 first: a row of 64 codes is turned into its 64 levels from the 2^bits levels held in a register: AVX-512 with one
   vpermps for sixteen codes, AVX2 for eight (4-bit codes: two and a blend), in ~20-30 instructions where the portable
   byte table takes 32-64 loads and stores. Measured on the SmolLM2 shape, a layer at 2,048 tokens on an AVX2 machine
   (AMD EPYC, one thread, 2026-12-04): tq4 0.82 -> 0.51 ms, tq3 0.75 -> 0.53. Then the portable reader, which calls
   them. */
#ifndef KVS_LEVELS_H
#define KVS_LEVELS_H
#include "kv_math.h"
#ifdef __AVX512F__
#include <immintrin.h>
/* AVX-512: the levels of 16 codes in one vpermps from the table held in a register (t: the 2^bits levels, padded
   to 16); codes come back grouped by their place in a byte and are interleaved into order with two-source permutes.
   A 64-code row in ~20 instructions, where the byte-table copy below takes 32-64 loads and stores. */
static const int32_t KVS_LO32[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const int32_t KVS_HI32[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static const int64_t KVS_LO64[8] = {0, 8, 1, 9, 2, 10, 3, 11};
static const int64_t KVS_HI64[8] = {4, 12, 5, 13, 6, 14, 7, 15};

/* 16 bytes of 4-codes-a-byte fields f0..f3 (lane k of fj: code 4k + j) → 64 levels in order */
static inline void interleave4(__m512 f0, __m512 f1, __m512 f2, __m512 f3, float *lv) {
    __m512i lo = _mm512_loadu_si512(KVS_LO32), hi = _mm512_loadu_si512(KVS_HI32);
    __m512i lo64 = _mm512_loadu_si512(KVS_LO64), hi64 = _mm512_loadu_si512(KVS_HI64);
    __m512d a0 = _mm512_castps_pd(_mm512_permutex2var_ps(f0, lo, f1));  /* codes 4k, 4k+1, k < 8 */
    __m512d a1 = _mm512_castps_pd(_mm512_permutex2var_ps(f0, hi, f1));
    __m512d b0 = _mm512_castps_pd(_mm512_permutex2var_ps(f2, lo, f3));  /* codes 4k+2, 4k+3 */
    __m512d b1 = _mm512_castps_pd(_mm512_permutex2var_ps(f2, hi, f3));
    _mm512_storeu_ps(lv, _mm512_castpd_ps(_mm512_permutex2var_pd(a0, lo64, b0)));
    _mm512_storeu_ps(lv + 16, _mm512_castpd_ps(_mm512_permutex2var_pd(a0, hi64, b0)));
    _mm512_storeu_ps(lv + 32, _mm512_castpd_ps(_mm512_permutex2var_pd(a1, lo64, b1)));
    _mm512_storeu_ps(lv + 48, _mm512_castpd_ps(_mm512_permutex2var_pd(a1, hi64, b1)));
}

static inline int levels_avx512(const uint8_t *src, int bits, int d, const float *tab16, float *lv) {
    __m512 t = _mm512_loadu_ps(tab16);
    __m512i m2 = _mm512_set1_epi32(3);
    if (bits == 1 && (d & 15) == 0) {  /* 16 signs a mask: level 1 where the bit is set, level 0 elsewhere */
        __m512 t0 = _mm512_set1_ps(tab16[0]), t1 = _mm512_set1_ps(tab16[1]);
        for (int j = 0; j < d / 8; j += 2)
            _mm512_storeu_ps(lv + 8 * j, _mm512_mask_blend_ps((__mmask16)(src[j] | (src[j + 1] << 8)), t0, t1));
        return 1;
    }
    if (bits == 4 && (d & 31) == 0) {
        __m512i lo = _mm512_loadu_si512(KVS_LO32), hi = _mm512_loadu_si512(KVS_HI32);
        for (int j = 0; j < d / 2; j += 16) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + j)));
            __m512 c0 = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), t);  /* codes 2k */
            __m512 c1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);  /* codes 2k + 1 */
            _mm512_storeu_ps(lv + 2 * j, _mm512_permutex2var_ps(c0, lo, c1));
            _mm512_storeu_ps(lv + 2 * j + 16, _mm512_permutex2var_ps(c0, hi, c1));
        }
        return 1;
    }
    if ((bits == 2 || bits == 3) && (d & 63) == 0) {
        const uint8_t *hb = src + d / 4;  /* 3 bits: the 1-bit plane after the 2-bit one */
        const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        for (int j = 0; j < d / 4; j += 16) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + j)));
            __m512i f[4];
            for (int k = 0; k < 4; k++) f[k] = _mm512_and_si512(_mm512_srli_epi32(b, 2 * k), m2);
            if (bits == 3) {  /* bit i of the 64-bit word: code i's high bit; lane k holds nibble k (codes 4k..4k+3) */
                uint32_t w[2];
                memcpy(w, hb + j / 2, 8);
                __m512i h = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32((int)w[0]), _mm512_set1_epi32((int)w[1]));
                __m512i nib = _mm512_srlv_epi32(h, shifts);
                for (int k = 0; k < 4; k++)
                    f[k] = _mm512_or_si512(f[k], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(nib, k),
                                                                                  _mm512_set1_epi32(1)), 2));
            }
            interleave4(_mm512_permutexvar_ps(f[0], t), _mm512_permutexvar_ps(f[1], t),
                        _mm512_permutexvar_ps(f[2], t), _mm512_permutexvar_ps(f[3], t), lv + 4 * j);
        }
        return 1;
    }
    return 0;
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
/* AVX2 without AVX-512: the levels of eight codes in one vpermps from the 8 levels held in a register (4-bit codes:
   two of them and a blend on the code's high bit); fields come back grouped by their place in a byte and are put in
   order by unpacks within 128-bit lanes, then across them. A 64-code row in ~30 instructions, where the byte-table
   copy below takes 32-64 loads and stores. */
static inline __m256 lut16(__m256 tlo, __m256 thi, __m256i c) {  /* eight 4-bit codes' levels */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, c), _mm256_permutevar8x32_ps(thi, c),
                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));  /* bit 3 → the sign bit */
}
/* four fields of eight bytes (lane l of fk: code 4l + k) → 32 levels in order */
static inline void interleave4_8(__m256 f0, __m256 f1, __m256 f2, __m256 f3, float *lv) {
    __m256d a0 = _mm256_castps_pd(_mm256_unpacklo_ps(f0, f1)), a1 = _mm256_castps_pd(_mm256_unpackhi_ps(f0, f1));
    __m256d b0 = _mm256_castps_pd(_mm256_unpacklo_ps(f2, f3)), b1 = _mm256_castps_pd(_mm256_unpackhi_ps(f2, f3));
    __m256 x0 = _mm256_castpd_ps(_mm256_unpacklo_pd(a0, b0)), x1 = _mm256_castpd_ps(_mm256_unpackhi_pd(a0, b0));
    __m256 x2 = _mm256_castpd_ps(_mm256_unpacklo_pd(a1, b1)), x3 = _mm256_castpd_ps(_mm256_unpackhi_pd(a1, b1));
    _mm256_storeu_ps(lv, _mm256_permute2f128_ps(x0, x1, 0x20));  /* codes 0-7 */
    _mm256_storeu_ps(lv + 8, _mm256_permute2f128_ps(x2, x3, 0x20));  /* 8-15 */
    _mm256_storeu_ps(lv + 16, _mm256_permute2f128_ps(x0, x1, 0x31));  /* 16-23 */
    _mm256_storeu_ps(lv + 24, _mm256_permute2f128_ps(x2, x3, 0x31));  /* 24-31 */
}
static inline int levels_avx2(const uint8_t *src, int bits, int d, const float *tab16, float *lv) {
    if (bits == 1 && (d & 7) == 0) {  /* 8 signs a byte: level 1 where the bit is set, level 0 elsewhere */
        const __m256 t0 = _mm256_set1_ps(tab16[0]), t1 = _mm256_set1_ps(tab16[1]);
        const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (int j = 0; j < d / 8; j++) {
            __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(src[j]), bit), bit);
            _mm256_storeu_ps(lv + 8 * j, _mm256_blendv_ps(t0, t1, _mm256_castsi256_ps(set)));
        }
        return 1;
    }
    if (bits == 4 && (d & 15) == 0) {
        const __m256 tlo = _mm256_loadu_ps(tab16), thi = _mm256_loadu_ps(tab16 + 8);
        for (int j = 0; j < d / 2; j += 8) {
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + j)));
            __m256 c0 = lut16(tlo, thi, _mm256_and_si256(b, _mm256_set1_epi32(15)));  /* codes 2k */
            __m256 c1 = lut16(tlo, thi, _mm256_srli_epi32(b, 4));  /* codes 2k + 1 */
            __m256 lo = _mm256_unpacklo_ps(c0, c1), hi = _mm256_unpackhi_ps(c0, c1);  /* 0-3, 8-11 | 4-7, 12-15 */
            _mm256_storeu_ps(lv + 2 * j, _mm256_permute2f128_ps(lo, hi, 0x20));
            _mm256_storeu_ps(lv + 2 * j + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
        return 1;
    }
    if ((bits == 2 || bits == 3) && (d & 31) == 0) {
        const __m256 t = _mm256_loadu_ps(tab16);
        const __m256i m2 = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const uint8_t *hb = src + d / 4;  /* 3 bits: the 1-bit plane after the 2-bit one */
        for (int j = 0; j < d / 4; j += 8) {
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + j)));
            __m256i f[4];
            for (int k = 0; k < 4; k++) f[k] = _mm256_and_si256(_mm256_srli_epi32(b, 2 * k), m2);
            if (bits == 3) {  /* bit i of the 32-bit word: code i's high bit; lane l holds nibble l (codes 4l..4l+3) */
                uint32_t w;
                memcpy(&w, hb + j / 2, 4);
                __m256i nib = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts);
                for (int k = 0; k < 4; k++)
                    f[k] = _mm256_or_si256(f[k],
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(nib, k), one), 2));
            }
            interleave4_8(_mm256_permutevar8x32_ps(t, f[0]), _mm256_permutevar8x32_ps(t, f[1]),
                          _mm256_permutevar8x32_ps(t, f[2]), _mm256_permutevar8x32_ps(t, f[3]), lv + 4 * j);
        }
        return 1;
    }
    return 0;
}
#endif

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

#endif
