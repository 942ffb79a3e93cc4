/* Integer dot products of one GGUF weight row with 1-4 activation rows quantized to 8 bits (kq_act): llama.cpp's
   road (ggml-cpu's arch/x86/quants.c, ggml_vec_dot_*_q8_*), here with several activation rows per weight row, so
   a prompt's rows share the unpacking of each block (ggml unpacks a block again for every activation row).

   A block's quants are unpacked to unsigned bytes u (Q4_0 nibbles 0..15, Q5_0 0..31, Q6_K 0..63, Q8_0 w + 128)
   and multiplied by the signed activation bytes q (maddubs: u * q summed by pairs into 16 bits, then madd into
   32; with VNNI one vpdpbusd). The offsets come back through the activations' block sums: for Q4_0,
   sum d (u - 8) q = d (u.q) - 8 d sum(q), and sum(q) was counted when the activations were quantized (ggml's Q8_1
   trick, here for every 32-block type; for the k-quants ggml's Q8_K bsums). No 16-bit sum can overflow: a pair
   is at most 2 * 63 * 127 for the types that use maddubs, and Q8_0 takes VNNI or the sign trick (|w| * q).

   Paths: AVX2 (+ AVX-512 VNNI's or AVX-VNNI's 256-bit vpdpbusd where the CPU has it, as ggml does on x86), and
   portable C for every other CPU (the same sums in the same integer arithmetic). */
#include "kq_blocks.h"

#define ACT_Q(a, r) ((a)->qs + (r) * (a)->n)
#define ACT_D32(a, r) ((a)->d + (r) * ((a)->n / QK))
#define ACT_S32(a, r) ((a)->s + (r) * ((a)->n / QK))
#define ACT_DK(a, r) ((a)->d + (r) * ((a)->n / QKK))
#define ACT_BS(a, r) ((a)->bsums + (r) * ((a)->n / 16))
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KQ_AVX2 1

INLINE float hsum8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* u (unsigned bytes, each at most 127) times q (signed bytes), sums of four adjacent products in 32 bits */
INLINE __m256i dot_us(__m256i u, __m256i q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}

/* 32 nibbles of 16 bytes: low nibbles first (elements 0-15), then the high ones (16-31) */
INLINE __m256i nibbles32(const uint8_t* p) {
    const __m128i t = _mm_loadu_si128((const __m128i*)p);
    const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(0xF));
}

/* 32 bits to 32 bytes 0x00 / 0xFF (ggml's bytes_from_bits_32) */
INLINE __m256i bits32(const uint8_t* x) {
    uint32_t x32; memcpy(&x32, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

/* The 32-block types: u per block (UNPACK), then per row acc += d_w d_x (u.q) and off += d_w s_x (M: the block's
   min m instead of d_w, for Q4_1 / Q5_1); out = sum(acc) + Z * off, Z the offset's sign and size. */
#define DOT32(NAME, BT, UNPACK, MIN, Z) \
INLINE void NAME##_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { \
    const BT* x = row; \
    const int64_t nb = a->n / QK; \
    __m256 acc[4]; float off[4]; \
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0; } \
    for (int64_t b = 0; b < nb; b++) { \
        const float dw = kq_h2f(x[b].d); \
        const float mw = MIN; \
        const __m256i u = UNPACK; \
        for (int r = 0; r < R; r++) { \
            const __m256i q = _mm256_loadu_si256((const __m256i*)(ACT_Q(a, r0 + r) + b * QK)); \
            const __m256 p = _mm256_cvtepi32_ps(dot_us(u, q)); \
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ACT_D32(a, r0 + r)[b]), p, acc[r]); \
            off[r] += mw * ACT_S32(a, r0 + r)[b]; \
        } \
    } \
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + (Z) * off[r]; \
}

DOT32(q4_0, blk_q4_0, nibbles32(x[b].qs), dw, -8.f)
DOT32(q4_1, blk_q4_1, nibbles32(x[b].qs), kq_h2f(x[b].m), 1.f)
DOT32(q5_0, blk_q5_0, _mm256_or_si256(nibbles32(x[b].qs), _mm256_and_si256(bits32(x[b].qh), _mm256_set1_epi8(0x10))),
      dw, -16.f)
DOT32(q5_1, blk_q5_1, _mm256_or_si256(nibbles32(x[b].qs), _mm256_and_si256(bits32(x[b].qh), _mm256_set1_epi8(0x10))),
      kq_h2f(x[b].m), 1.f)

/* The signed-byte types: Q8_0's weights as stored, NF4's looked up in its int8 table (one vpshufb for 32 nibbles,
   llama.cpp's IQ4_NL). With VNNI, w + 128 (a flipped sign bit) and the offset 128; without, ggml's sign trick
   (|w| times q with w's sign), whose pairs stay within 16 bits. */
INLINE __m256i signed32(int type, const uint8_t* blk) {
    if (type == KQ_NF4)
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kq_nf4_i8)),
                                   nibbles32(((const blk_nf4*)blk)->qs));
    return _mm256_loadu_si256((const __m256i*)((const blk_q8_0*)blk)->qs);
}

INLINE void s8_r(int type, const void* row, const kq_act* a, int64_t r0, int R, float* out) {
    const size_t bsz = type == KQ_NF4 ? sizeof(blk_nf4) : sizeof(blk_q8_0);
    const int64_t nb = a->n / QK;
    __m256 acc[4]; float off[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0; }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = (const uint8_t*)row + b * bsz;
        uint16_t h; memcpy(&h, blk, 2);
        const float dw = kq_h2f(h);
        const __m256i w = signed32(type, blk);
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
        const __m256i u = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        for (int r = 0; r < R; r++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(ACT_Q(a, r0 + r) + b * QK));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#else
            const __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ACT_D32(a, r0 + r)[b]), _mm256_cvtepi32_ps(s), acc[r]);
            off[r] += dw * ACT_S32(a, r0 + r)[b];
        }
#else
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; r++) {
            const __m256i q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(ACT_Q(a, r0 + r) + b * QK)), w);
            const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, q), _mm256_set1_epi16(1));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ACT_D32(a, r0 + r)[b]), _mm256_cvtepi32_ps(s), acc[r]);
        }
#endif
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) - 128.f * off[r];
}
INLINE void q8_0_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { s8_r(KQ_Q8_0, row, a, r0, R, out); }
INLINE void nf4_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { s8_r(KQ_NF4, row, a, r0, R, out); }

/* the eight 6-bit scales (bytes 0-7) and mins (8-15) of a Q4_K / Q5_K block (ggml's utmp shuffle) */
INLINE void scales_k4(const uint8_t* s12, uint8_t* sc, uint8_t* mn) {
    uint32_t u[4];
    memcpy(u, s12, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t aux = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = aux;
    u[0] &= 0x3f3f3f3f;
    memcpy(sc, u, 8);
    memcpy(mn, u + 2, 8);
}

/* sum_j mins[j] * (bsums[2j] + bsums[2j+1]) for the eight 32-element sub-blocks */
INLINE int mins_dot(const uint8_t* mn, const int16_t* bs) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
    return s;
}

/* Q4_K and Q5_K: 64 elements at a time (32 bytes of nibbles: sub-block 2j low, 2j+1 high), each product scaled by
   its sub-block's 6-bit scale in 32 bits (madd), summed over the block, then times d_w d_x once. HI adds Q5_K's
   fifth bit. */
#define DOTK45(NAME, BT, HI) \
INLINE void NAME##_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { \
    const BT* x = row; \
    const int64_t nb = a->n / QKK; \
    const __m256i m4 = _mm256_set1_epi8(0xF); \
    __m256 acc[4]; float off[4]; \
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); off[r] = 0; } \
    for (int64_t b = 0; b < nb; b++) { \
        uint8_t sc[8], mn[8]; \
        scales_k4(x[b].scales, sc, mn); \
        const float d = kq_h2f(x[b].d), dmin = kq_h2f(x[b].dmin); \
        __m256i sum[4]; \
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256(); \
        const uint8_t* q4 = x[b].qs; \
        (void)m4; HI(decl) \
        for (int j = 0; j < 4; j++, q4 += 32) { \
            const __m256i bits = _mm256_loadu_si256((const __m256i*)q4); \
            __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4); \
            HI(add) \
            const __m256i sl = _mm256_set1_epi16(sc[2 * j]), sh = _mm256_set1_epi16(sc[2 * j + 1]); \
            for (int r = 0; r < R; r++) { \
                const int8_t* q8 = ACT_Q(a, r0 + r) + b * QKK + 64 * j; \
                const __m256i ql8 = _mm256_loadu_si256((const __m256i*)q8); \
                const __m256i qh8 = _mm256_loadu_si256((const __m256i*)(q8 + 32)); \
                const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, ql8)); \
                const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, qh8)); \
                sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(pl, ph)); \
            } \
        } \
        for (int r = 0; r < R; r++) { \
            const float dx = ACT_DK(a, r0 + r)[b]; \
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sum[r]), acc[r]); \
            off[r] += dmin * dx * (float)mins_dot(mn, ACT_BS(a, r0 + r) + 16 * b); \
        } \
    } \
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) - off[r]; \
}
#define HI_NONE(what)
#define HI_Q5(what) HI_Q5_##what
#define HI_Q5_decl const __m256i hb = _mm256_loadu_si256((const __m256i*)x[b].qh);
#define HI_Q5_add { \
        const __m256i ml = _mm256_set1_epi8((char)(1 << (2 * j))), mh = _mm256_set1_epi8((char)(2 << (2 * j))); \
        const __m256i s16 = _mm256_set1_epi8(16); \
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, ml), ml), s16)); \
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, mh), mh), s16)); \
    }
DOTK45(q4_K, blk_q4_K, HI_NONE)
DOTK45(q5_K, blk_q5_K, HI_Q5)

/* Q6_K: 128 elements per half block (64 bytes of low nibbles, 32 of high bit pairs), sixteen 16-element sub-blocks
   with signed 8-bit scales; u in 0..63, offset 32 taken out through the activations' sums of sixteen. */
INLINE void q6_K_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) {
    const blk_q6_K* x = row;
    const int64_t nb = a->n / QKK;
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(0x30);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const float d = kq_h2f(x[b].d);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x[b].scales));
        __m256i sum[4];
        for (int r = 0; r < R; r++)  /* -32 sum_g sc_g bsums_g, in the 32-bit lanes the products add to */
            sum[r] = _mm256_slli_epi32(_mm256_madd_epi16(sc16,
                         _mm256_loadu_si256((const __m256i*)(ACT_BS(a, r0 + r) + 16 * b))), 5),
            sum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), sum[r]);
        const uint8_t* ql = x[b].ql;
        const uint8_t* qh = x[b].qh;
        const int8_t* s = x[b].scales;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, s += 8) {
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)ql);
            const __m256i l2 = _mm256_loadu_si256((const __m256i*)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i*)qh);
            __m256i u[4], sv[4];
            u[0] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2));
            u[1] = _mm256_or_si256(_mm256_and_si256(l2, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2));
            u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(hb, m2));
            u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2));
            for (int k = 0; k < 4; k++)
                sv[k] = _mm256_insertf128_si256(_mm256_castsi128_si256(_mm_set1_epi16(s[2 * k])),
                                                _mm_set1_epi16(s[2 * k + 1]), 1);
            for (int r = 0; r < R; r++) {
                const int8_t* q8 = ACT_Q(a, r0 + r) + b * QKK + 128 * h;
                for (int k = 0; k < 4; k++) {
                    const __m256i p = _mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i*)(q8 + 32 * k)));
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(sv[k], p));
                }
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * ACT_DK(a, r0 + r)[b]), _mm256_cvtepi32_ps(sum[r]), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

const char* kq_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "AVX-512 + VNNI";
#elif defined(__AVX512BW__) && defined(__AVX512VL__)
    return "AVX-512";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "AVX2 + AVX512-VNNI";
#elif defined(__AVXVNNI__)
    return "AVX2 + AVX-VNNI";
#else
    return "AVX2";
#endif
}

#else  /* portable C: the same integer sums */

INLINE void unpack32(int type, const void* blk, uint8_t* u) {
    const uint8_t* qs; uint32_t qh = 0;
    switch (type) {
    case KQ_Q4_0: qs = ((const blk_q4_0*)blk)->qs; break;
    case KQ_Q4_1: qs = ((const blk_q4_1*)blk)->qs; break;
    case KQ_Q5_0: qs = ((const blk_q5_0*)blk)->qs; memcpy(&qh, ((const blk_q5_0*)blk)->qh, 4); break;
    default: qs = ((const blk_q5_1*)blk)->qs; memcpy(&qh, ((const blk_q5_1*)blk)->qh, 4); break;
    }
    for (int j = 0; j < 16; j++) {
        u[j] = (uint8_t)((qs[j] & 0xF) | (((qh >> j) & 1) << 4));
        u[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}

#define DOT32(NAME, TYPE, BT, MIN, Z) \
INLINE void NAME##_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { \
    const BT* x = row; \
    const int64_t nb = a->n / QK; \
    float acc[4] = {0}, off[4] = {0}; \
    uint8_t u[32]; \
    for (int64_t b = 0; b < nb; b++) { \
        const float dw = kq_h2f(x[b].d), mw = MIN; \
        unpack32(TYPE, x + b, u); \
        for (int r = 0; r < R; r++) { \
            const int8_t* q = ACT_Q(a, r0 + r) + b * QK; \
            int s = 0; \
            for (int j = 0; j < 32; j++) s += u[j] * q[j]; \
            acc[r] += dw * ACT_D32(a, r0 + r)[b] * (float)s; \
            off[r] += mw * ACT_S32(a, r0 + r)[b]; \
        } \
    } \
    for (int r = 0; r < R; r++) out[r] = acc[r] + (Z) * off[r]; \
}
DOT32(q4_0, KQ_Q4_0, blk_q4_0, dw, -8.f)
DOT32(q4_1, KQ_Q4_1, blk_q4_1, kq_h2f(x[b].m), 1.f)
DOT32(q5_0, KQ_Q5_0, blk_q5_0, dw, -16.f)
DOT32(q5_1, KQ_Q5_1, blk_q5_1, kq_h2f(x[b].m), 1.f)

/* the signed-byte types: Q8_0 as stored, NF4 through its int8 table */
INLINE void s8_r(int type, const void* row, const kq_act* a, int64_t r0, int R, float* out) {
    const size_t bsz = type == KQ_NF4 ? sizeof(blk_nf4) : sizeof(blk_q8_0);
    const int64_t nb = a->n / QK;
    float acc[4] = {0};
    int8_t w[32];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = (const uint8_t*)row + b * bsz;
        uint16_t h; memcpy(&h, blk, 2);
        const float dw = kq_h2f(h);
        if (type == KQ_NF4)
            for (int j = 0; j < 16; j++) {
                w[j] = kq_nf4_i8[blk[2 + j] & 0xF];
                w[j + 16] = kq_nf4_i8[blk[2 + j] >> 4];
            }
        else memcpy(w, blk + 2, 32);
        for (int r = 0; r < R; r++) {
            const int8_t* q = ACT_Q(a, r0 + r) + b * QK;
            int s = 0;
            for (int j = 0; j < 32; j++) s += w[j] * q[j];
            acc[r] += dw * ACT_D32(a, r0 + r)[b] * (float)s;
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}
INLINE void q8_0_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { s8_r(KQ_Q8_0, row, a, r0, R, out); }
INLINE void nf4_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { s8_r(KQ_NF4, row, a, r0, R, out); }

#define DOTK45(NAME, BT, Q5) \
INLINE void NAME##_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) { \
    const BT* x = row; \
    const int64_t nb = a->n / QKK; \
    float acc[4] = {0}; \
    uint8_t u[QKK]; \
    for (int64_t b = 0; b < nb; b++) { \
        const float d = kq_h2f(x[b].d), dmin = kq_h2f(x[b].dmin); \
        for (int j = 0; j < 4; j++) \
            for (int l = 0; l < 32; l++) { \
                const uint8_t v = x[b].qs[32 * j + l]; \
                int h0 = 0, h1 = 0; \
                if (Q5) { const uint8_t* qh = (const uint8_t*)x[b].scales + 12; \
                          h0 = (qh[l] >> (2 * j) & 1) << 4; h1 = (qh[l] >> (2 * j + 1) & 1) << 4; } \
                u[64 * j + l] = (uint8_t)((v & 0xF) | h0); \
                u[64 * j + 32 + l] = (uint8_t)((v >> 4) | h1); \
            } \
        for (int r = 0; r < R; r++) { \
            const int8_t* q = ACT_Q(a, r0 + r) + b * QKK; \
            const int16_t* bs = ACT_BS(a, r0 + r) + 16 * b; \
            int si = 0, mi = 0; \
            for (int j = 0; j < 8; j++) { \
                uint8_t sc, m; kq_scale_min(j, x[b].scales, &sc, &m); \
                int s = 0; \
                for (int l = 0; l < 32; l++) s += u[32 * j + l] * q[32 * j + l]; \
                si += sc * s; mi += m * (bs[2 * j] + bs[2 * j + 1]); \
            } \
            const float dx = ACT_DK(a, r0 + r)[b]; \
            acc[r] += d * dx * (float)si - dmin * dx * (float)mi; \
        } \
    } \
    for (int r = 0; r < R; r++) out[r] = acc[r]; \
}
DOTK45(q4_K, blk_q4_K, 0)
DOTK45(q5_K, blk_q5_K, 1)

INLINE void q6_K_r(const void* row, const kq_act* a, int64_t r0, int R, float* out) {
    const blk_q6_K* x = row;
    const int64_t nb = a->n / QKK;
    float acc[4] = {0};
    int8_t v[QKK];
    for (int64_t b = 0; b < nb; b++) {
        const float d = kq_h2f(x[b].d);
        const uint8_t* ql = x[b].ql;
        const uint8_t* qh = x[b].qh;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                v[128 * h + l] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                v[128 * h + l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                v[128 * h + l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                v[128 * h + l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        for (int r = 0; r < R; r++) {
            const int8_t* q = ACT_Q(a, r0 + r) + b * QKK;
            int si = 0;
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int l = 0; l < 16; l++) s += v[16 * g + l] * q[16 * g + l];
                si += x[b].scales[g] * s;
            }
            acc[r] += d * ACT_DK(a, r0 + r)[b] * (float)si;
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

const char* kq_isa(void) { return "portable C"; }
#endif

/* one entry per type; R a constant in each call below, so the loops over rows unroll */
#define ENTRY(NAME) \
static void NAME(const void* row, const kq_act* a, int64_t r0, int R, float* out) { \
    switch (R) { \
    case 4: NAME##_r(row, a, r0, 4, out); break; \
    case 3: NAME##_r(row, a, r0, 3, out); break; \
    case 2: NAME##_r(row, a, r0, 2, out); break; \
    default: NAME##_r(row, a, r0, 1, out); break; \
    } \
}
ENTRY(q4_0) ENTRY(q4_1) ENTRY(q5_0) ENTRY(q5_1) ENTRY(q8_0) ENTRY(q4_K) ENTRY(q5_K) ENTRY(q6_K) ENTRY(nf4)

kq_dot_fn kq_dot_for(int type) {
    if (kq_dot512_for(type)) return kq_dot512_for(type);
    switch (type) {
    case KQ_Q4_0: return q4_0;
    case KQ_Q4_1: return q4_1;
    case KQ_Q5_0: return q5_0;
    case KQ_Q5_1: return q5_1;
    case KQ_Q8_0: return q8_0;
    case KQ_NF4: return nf4;
    case KQ_Q4_K: return q4_K;
    case KQ_Q5_K: return q5_K;
    case KQ_Q6_K: return q6_K;
    default: return 0;
    }
}
