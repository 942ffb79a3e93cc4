/* The products of weights packed sixteen rows a group (kq_pack.c) on AVX2 machines without AVX-512 VNNI: the same
   layout and integer sums as kq_packed.c, a group's sixteen lanes held as two 256-bit halves (rows 0-7, 8-15), and
   vpdpbusd's four products a lane made of maddubs (unsigned weight byte times signed activation byte, pairs summed
   in 16 bits) then madd by ones (pairs summed in 32 bits), as ggml-cpu's AVX2 dot products and repacked GEMVs do.
   Where the 16-bit sums have room (the 4-bit types, Q6_K) a run of maddubs is added in 16 bits before one madd, by
   the scale where there is one: a 128-row prompt through the 1B shape's linears, one thread, this EPYC (Zen 3):
   Q4_K 1.55 -> 1.26 s, Q6_K 0.92 -> 0.70, Q4_0 2.50 -> 1.93 (the same sums: the multiply ports did the madds).

   maddubs saturates past 32,767, so no pair may exceed it: the 4-bit quants are taken as 0..15 (the high nibbles
   shifted down; the sixteen kq_packed.c's Q4_K sums keep put back by the scales), Q6_K's are 0..63 (63 * 127 * 2 = 16,002), NF4's signed table
   values and Q8_0's signed bytes take ggml's sign trick (nf4, q80 below). Every sum is the one kq_packed.c makes,
   so the two builds give the same results bit for bit. The 1B shape's linears of one decode token, one thread,
   AVX2 build on the project's EPYC (shared, load ~4.6; min of 12): Q4_K_M 33-40 ms against 52-78 in the file's
   layout, Q4_0 27 against 45. */
#include "kq_blocks.h"

#if KQ_PACKED_AVX2
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
#define PR 16
#include "kq_pact.h"

typedef struct { __m256i l, h; } v16i;  /* sixteen int32 (or 64 bytes): rows 0-7, rows 8-15 */
typedef struct { __m256 l, h; } v16f;

INLINE v16i ld(const uint8_t* p) {
    return (v16i){_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
}
INLINE v16i zi(void) { return (v16i){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
INLINE v16f zf(void) { return (v16f){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INLINE __m256i bc32(const void* p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
INLINE v16i and_(v16i a, __m256i m) { return (v16i){_mm256_and_si256(a.l, m), _mm256_and_si256(a.h, m)}; }
INLINE v16i or_(v16i a, v16i b) { return (v16i){_mm256_or_si256(a.l, b.l), _mm256_or_si256(a.h, b.h)}; }
INLINE v16i add(v16i a, v16i b) { return (v16i){_mm256_add_epi32(a.l, b.l), _mm256_add_epi32(a.h, b.h)}; }
INLINE v16i mul(v16i a, v16i b) { return (v16i){_mm256_mullo_epi32(a.l, b.l), _mm256_mullo_epi32(a.h, b.h)}; }
INLINE v16i sub(v16i a, v16i b) { return (v16i){_mm256_sub_epi32(a.l, b.l), _mm256_sub_epi32(a.h, b.h)}; }
INLINE v16i sub1(v16i a, __m256i b) { return (v16i){_mm256_sub_epi32(a.l, b), _mm256_sub_epi32(a.h, b)}; }
INLINE v16i srl16(v16i a, int k) { return (v16i){_mm256_srli_epi16(a.l, k), _mm256_srli_epi16(a.h, k)}; }
INLINE v16i sll16(v16i a, int k) { return (v16i){_mm256_slli_epi16(a.l, k), _mm256_slli_epi16(a.h, k)}; }
INLINE v16i sll32(v16i a, int k) { return (v16i){_mm256_slli_epi32(a.l, k), _mm256_slli_epi32(a.h, k)}; }

/* acc + each lane's four u8 * s8 products (w's bytes 0..127 at most twice: no saturation) */
INLINE v16i dp(v16i acc, v16i w, __m256i a) {
    const __m256i one = _mm256_set1_epi16(1);
    return (v16i){_mm256_add_epi32(acc.l, _mm256_madd_epi16(_mm256_maddubs_epi16(w.l, a), one)),
                  _mm256_add_epi32(acc.h, _mm256_madd_epi16(_mm256_maddubs_epi16(w.h, a), one))};
}
INLINE v16i u8x16(const uint8_t* p) {  /* sixteen bytes widened to int32 lanes */
    return (v16i){_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)))};
}
INLINE v16i s8x16(const uint8_t* p) {
    return (v16i){_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)),
                  _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)))};
}
INLINE v16f halves16(const uint8_t* p) {
    return (v16f){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
}
INLINE v16f fma_(v16i i, v16f d, float s, v16f acc) {  /* acc + i * (d * s) */
    const __m256 sv = _mm256_set1_ps(s);
    return (v16f){_mm256_fmadd_ps(_mm256_cvtepi32_ps(i.l), _mm256_mul_ps(d.l, sv), acc.l),
                  _mm256_fmadd_ps(_mm256_cvtepi32_ps(i.h), _mm256_mul_ps(d.h, sv), acc.h)};
}
INLINE v16f fnma_(v16i i, v16f d, float s, v16f acc) {  /* acc - i * (d * s) */
    const __m256 sv = _mm256_set1_ps(s);
    return (v16f){_mm256_fnmadd_ps(_mm256_cvtepi32_ps(i.l), _mm256_mul_ps(d.l, sv), acc.l),
                  _mm256_fnmadd_ps(_mm256_cvtepi32_ps(i.h), _mm256_mul_ps(d.h, sv), acc.h)};
}

/* acc + each 16-bit lane's pair of u8 * s8 products, summed in 16 bits: eight 4-bit pairs (15 * 128 * 2 * 8 =
   30,720) or two of Q6_K's (63 * 128 * 2 * 2 = 32,256) stay below 32,767, so a run of them takes one madd at its end
   instead of one each (the multiply ports: maddubs and madd share them) */
INLINE v16i dpb(v16i acc, v16i w, __m256i a) {
    return (v16i){_mm256_add_epi16(acc.l, _mm256_maddubs_epi16(w.l, a)),
                  _mm256_add_epi16(acc.h, _mm256_maddubs_epi16(w.h, a))};
}
INLINE v16i madd_(v16i a, v16i s) { return (v16i){_mm256_madd_epi16(a.l, s.l), _mm256_madd_epi16(a.h, s.h)}; }
INLINE v16i pair16(v16i v) {  /* int32 lanes within int16's range as two int16 halves (signed or not) */
    return (v16i){_mm256_blend_epi16(v.l, _mm256_slli_epi32(v.l, 16), 0xAA),
                  _mm256_blend_epi16(v.h, _mm256_slli_epi32(v.h, 16), 0xAA)};
}

/* Q4_K (kq_packed.c's q4k): low nibbles sub-block 2k, high 2k + 1 (shifted down; times 16 in the scales). A half's
   eight chunks are summed in 16 bits and multiplied by the sub-block's scale in one madd; for three or four rows the
   low and high halves are two passes over the same 512 bytes (L1), so a pass's rows' sums stay in registers. */
INLINE void q4k(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, v16f* out) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    const int H = R <= 2 ? 2 : 1;  /* halves a pass: both for one or two rows (their sums fit the registers) */
    v16f acc[4];
    for (int r = 0; r < R; r++) acc[r] = zf();
    for (int64_t b = 0; b < n / QKK; b++) {
        const uint8_t* M = grp + 2368 * b;
        const uint8_t* Q = M + 320;
        v16i is[4], im[4];
        for (int r = 0; r < R; r++) is[r] = im[r] = zi();
        for (int k = 0; k < 4; k++) {
            for (int h0 = 0; h0 < 2; h0 += H) {
                v16i a[2][4];
                for (int hh = 0; hh < H; hh++)
                    for (int r = 0; r < R; r++) a[hh][r] = zi();
                for (int l = 0; l < 8; l++) {
                    const v16i w = ld(Q + 64 * (8 * k + l));
                    for (int hh = 0; hh < H; hh++) {
                        const int h = h0 + hh;
                        const v16i x = and_(h ? srl16(w, 4) : w, m0f);
                        for (int r = 0; r < R; r++)
                            a[hh][r] = dpb(a[hh][r], x, bc32(A->qs + (r0 + r) * n + QKK * b + 64 * k + 32 * h + 4 * l));
                    }
                }
                for (int hh = 0; hh < H; hh++) {
                    const v16i sc = pair16(sll32(u8x16(M + 64 + 16 * (h0 + hh) + 32 * k), 4));
                    for (int r = 0; r < R; r++) is[r] = add(is[r], madd_(a[hh][r], sc));
                }
            }
        }
        for (int p = 0; p < 4; p++) {
            const uint8_t* mp = M + 192 + 32 * p;  /* rows' min pairs as bytes */
            const __m256i ml = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)mp));
            const __m256i mh = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(mp + 16)));
            for (int r = 0; r < R; r++) {
                const __m256i s = bc32(A->b2 + (r0 + r) * (n / 32) + 8 * b + 2 * p);
                im[r] = add(im[r], (v16i){_mm256_madd_epi16(ml, s), _mm256_madd_epi16(mh, s)});
            }
        }
        const v16f dv = halves16(M), dm = halves16(M + 32);
        for (int r = 0; r < R; r++) {
            const float dx = A->d[(r0 + r) * (n / QKK) + b];
            acc[r] = fma_(is[r], dv, dx * 0.0625f, acc[r]);
            acc[r] = fnma_(im[r], dm, dx, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* Q6_K (kq_packed.c's q6k): chunk c of a sixteen's four quants rebuilt from its low-nibble byte (a: c 0, 2; bq: c 1,
   3) and its two high bits; two such chunks' products summed in 16 bits, then times the sub-block's scale in one
   madd, the offset's product (32 sum(q) times the scale) taken out once: (e - o) s as e s - o s, the same integers */
INLINE v16i q6u(const uint8_t* T, const int c, __m256i m0f, __m256i m30) {
    const v16i x = ld(T + 64 * (c & 1)), hb = ld(T + 128);
    const v16i hi = c == 0 ? sll16(hb, 4) : c == 1 ? sll16(hb, 2) : c == 2 ? hb : srl16(hb, 2);
    return or_(and_(c >= 2 ? srl16(x, 4) : x, m0f), and_(hi, m30));
}
INLINE void q6k(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, v16f* out) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    v16f acc[4];
    for (int r = 0; r < R; r++) acc[r] = zf();
    for (int64_t b = 0; b < n / QKK; b++) {
        const uint8_t* M = grp + 3392 * b;
        const uint8_t* Q = M + 320;
        v16i is[4];
        for (int r = 0; r < R; r++) is[r] = zi();
        for (int h = 0; h < 2; h++) {
            for (int s = 0; s < 2; s++) {
#pragma GCC unroll 4  /* c a constant in each copy: q6u's choices made at compile time (R = 1 ran 1.5x slower) */
                for (int c = 0; c < 4; c++) {
                    const int g = 8 * h + 2 * c + s;
                    const v16i sc = s8x16(M + 32 + 16 * g), sc16 = pair16(sc);
                    for (int i2 = 0; i2 < 4; i2 += 2) {
                        v16i e[4];
                        for (int r = 0; r < R; r++) e[r] = zi();
                        for (int i = i2; i < i2 + 2; i++) {
                            const int l = 4 * s + i;
                            const v16i u = q6u(Q + 192 * (8 * h + l), c, m0f, m30);
                            for (int r = 0; r < R; r++)
                                e[r] = dpb(e[r], u, bc32(A->qs + (r0 + r) * n + QKK * b + 128 * h + 4 * l + 32 * c));
                        }
                        for (int r = 0; r < R; r++) is[r] = add(is[r], madd_(e[r], sc16));
                    }
                    for (int r = 0; r < R; r++) {
                        const __m256i off = bc32(A->o + (r0 + r) * (n / 16) + 16 * b + g);
                        is[r] = sub(is[r], mul(sc, (v16i){off, off}));
                    }
                }
            }
        }
        const v16f dv = halves16(M);
        for (int r = 0; r < R; r++) acc[r] = fma_(is[r], dv, A->d[(r0 + r) * (n / QKK) + b], acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* Q4_0 (kq_packed.c's q40): offset 8 sum(q); a block's eight chunks summed in 16 bits, one madd a row */
INLINE void q40(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, v16f* out) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
    const int64_t nb = n / QK;
    v16f acc[4];
    for (int r = 0; r < R; r++) acc[r] = zf();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* S = grp + 576 * (b / 2);
        const uint8_t* Q = S + 64 + 256 * (b % 2);
        v16i a[4];
        for (int r = 0; r < R; r++) a[r] = zi();
        for (int c = 0; c < 4; c++) {
            const v16i w = ld(Q + 64 * c), lo = and_(w, m0f), hi = and_(srl16(w, 4), m0f);
            for (int r = 0; r < R; r++) {
                const int8_t* q = A->qs + (r0 + r) * n + QK * b;
                a[r] = dpb(dpb(a[r], lo, bc32(q + 4 * c)), hi, bc32(q + 16 + 4 * c));
            }
        }
        const v16f dv = halves16(S + 32 * (b % 2));
        for (int r = 0; r < R; r++) {
            const v16i is = sub1(madd_(a[r], (v16i){one, one}), bc32(A->o + (r0 + r) * nb + b));
            acc[r] = fma_(is, dv, A->d[(r0 + r) * nb + b], acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

/* NF4 (kq_packed.c's nf4: the same integer sums): its codes looked up in the int8 table (vpshufb within each
   128-bit lane), signed, so each product is maddubs of |w| with the activation given w's sign (ggml-cpu's AVX2 sign
   trick: 127 * 127 * 2 a pair at most, no saturation), no offset to take out. A chunk's weights are made once for
   the R activation rows (chunk outer, rows inner: the sixteen 256-bit registers hold a chunk and the rows' sums).
   The 1B shape's linears (16 layers), one thread, AVX2 build on the project's EPYC: a decode token 40 ms packed
   against 64 in the rows' layout, a 128-token prompt 3.2 s against 5.1. */
INLINE v16i dps(v16i acc, v16i aw, v16i w, __m256i a) {  /* acc + each lane's four |w| * (a with w's sign) */
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i pl = _mm256_maddubs_epi16(aw.l, _mm256_sign_epi8(a, w.l));
    const __m256i ph = _mm256_maddubs_epi16(aw.h, _mm256_sign_epi8(a, w.h));
    return (v16i){_mm256_add_epi32(acc.l, _mm256_madd_epi16(pl, one)),
                  _mm256_add_epi32(acc.h, _mm256_madd_epi16(ph, one))};
}
INLINE v16i lut_(__m256i tb, v16i i) { return (v16i){_mm256_shuffle_epi8(tb, i.l), _mm256_shuffle_epi8(tb, i.h)}; }
INLINE v16i abs_(v16i a) { return (v16i){_mm256_abs_epi8(a.l), _mm256_abs_epi8(a.h)}; }

/* NF4 and Q8_0 (``q8`` a constant at each call: the compiler makes two loops). A chunk c of 0..7 is four quants of
   sixteen rows for activation bytes 4c..4c+3: Q8_0's eighth chunk of a block, or NF4's low nibbles of its chunk c
   (c < 4) and high nibbles of chunk c - 4 (activations 16 + 4 (c - 4) = 4c). */
INLINE void signed_bytes(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, v16f* out,
                         const int q8) {
    const __m256i m0f = _mm256_set1_epi8(0x0F), x80 = _mm256_set1_epi8((char)0x80);
    const __m256i tb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kq_nf4_i8));
    const int64_t nb = n / QK, step = q8 ? 1088 : 576;
    v16f acc[4];
    for (int r = 0; r < R; r++) acc[r] = zf();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* S = grp + step * (b / 2);
        const uint8_t* Q = S + 64 + (step - 64) / 2 * (b % 2);
        v16i is[4];
        for (int r = 0; r < R; r++) is[r] = zi();
        for (int c = 0; c < 8; c++) {
            const v16i u = ld(Q + 64 * (q8 ? c : c % 4));
            const v16i w = q8 ? (v16i){_mm256_xor_si256(u.l, x80), _mm256_xor_si256(u.h, x80)}
                              : lut_(tb, and_(c < 4 ? u : srl16(u, 4), m0f));
            const v16i aw = abs_(w);
            for (int r = 0; r < R; r++) is[r] = dps(is[r], aw, w, bc32(A->qs + (r0 + r) * n + QK * b + 4 * c));
        }
        const v16f dv = halves16(S + 32 * (b % 2));
        for (int r = 0; r < R; r++) acc[r] = fma_(is[r], dv, A->d[(r0 + r) * nb + b], acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

INLINE void nf4(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, v16f* out) {
    signed_bytes(grp, n, A, r0, R, out, 0);
}

/* Q8_0 (kq_packed.c's q80: the same sums): stored as w + 128, the sign bit flipped back, then as NF4's. The 1B
   shape's linears (16 layers), one thread, this EPYC beside a test run, min of 10 interleaved: a decode token
   78 ms packed against 91 in the file's layout, four rows 99 against 143, a 128-token prompt 2.4 s against 4.4
   (the row products convert and scale each block's sum per row; here sixteen rows' sums at once). */
INLINE void q80(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, const int R, v16f* out) {
    signed_bytes(grp, n, A, r0, R, out, 1);
}

#define KERNEL(NAME, FN) \
static void NAME(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, int R, float (*o16)[PR]) { \
    v16f out[4]; \
    switch (R) { \
    case 4: FN(grp, n, A, r0, 4, out); break; \
    case 3: FN(grp, n, A, r0, 3, out); break; \
    case 2: FN(grp, n, A, r0, 2, out); break; \
    default: FN(grp, n, A, r0, 1, out); break; \
    } \
    for (int k = 0; k < R; k++) { \
        _mm256_storeu_ps(o16[k], out[k].l); \
        _mm256_storeu_ps(o16[k] + 8, out[k].h); \
    } \
}
KERNEL(k_q4k, q4k) KERNEL(k_q6k, q6k) KERNEL(k_q40, q40) KERNEL(k_nf4, nf4) KERNEL(k_q80, q80)

static kfn kernel_for(int type) {
    switch (type) {
    case KQ_Q4_K: return k_q4k;
    case KQ_Q6_K: return k_q6k;
    case KQ_Q4_0: return k_q40;
    case KQ_NF4: return k_nf4;
    case KQ_Q8_0: return k_q80;
    default: return 0;
    }
}

/* y [m, n_out] (+ bias, output row o to column map[o]) = x [m, n] times the packed weight p (kq_pack).
   0 done; -1 bad arguments; -2 no memory (kq_packed.c's, for AVX2) */
int kq_packed_matmul(int type, const uint8_t* p, int64_t n_out, int64_t n, const float* x, int64_t m, int64_t ldx,
                     float* y, int64_t ldy, const float* bias, const int32_t* map, int threads) {
    return packed_matmul(kernel_for(type), type, p, n_out, n, x, m, ldx, y, ldy, bias, map, threads);
}
#endif
