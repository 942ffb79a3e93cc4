/* Many activation rows at once (a prompt, a batch of decodes, a speculation's verification): the product as a
   small GEMM on AVX-512 VNNI, for every quantized type.

   Why: the row products (kq_dot*.c) multiply one weight row by one to four activation rows, and every 64
   multiply-adds cost an unpacking of the weights' nibbles, a multiply by the sub-block scale and an add (maddubs,
   madd, add). Here the weights of W rows are unpacked once per call into plain unsigned bytes with a scale and an
   offset per group of G quants (u, s, o: the weight is s u + o), and the activations are packed sixteen rows to a
   vector, four quants per 32-bit lane (row-major per lane: lanes are activation rows). Then each VNNI vpdpbusd
   is an outer product: four quants of one weight row, broadcast, against four quants of sixteen activation rows:
   64 multiply-adds into sixteen rows' sums, one instruction. The scale and offset are applied once per group:
   y[a] += d_a s_g dot_g(u, q_a) + o_g (d_a sum_g(q_a)). Same activation blocks as the row products (ggml's Q8_0 /
   Q8_K), so a prompt's rows and a decode's row are multiplied with the same numerics.

   Used from 16 rows on (kq_matmul.c); the tail of a tile is padded with zero rows, never written back. */
#include <stdlib.h>
#include "kq_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LANES 16
#define WROWS 8  /* weight rows per pass: 8 int32 and 8 float accumulators, the activations' vector, its scales */
#define INLINE static inline __attribute__((always_inline))

int kq_gemm_group(int type) {
    switch (type) {
    case KQ_Q4_0: case KQ_Q4_1: case KQ_Q5_0: case KQ_Q5_1: case KQ_Q8_0: case KQ_NF4: case KQ_Q4_K: case KQ_Q5_K:
        return 32;
    case KQ_Q6_K: return 16;
    default: return 0;
    }
}

/* One weight row to u (n bytes), s and o (n / G floats each): the weight is s[g] u[i] + o[g] for i in group g. */
static void unpack_row(int type, const uint8_t* row, int64_t n, uint8_t* u, float* s, float* o) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    switch (type) {
    case KQ_Q4_0: case KQ_Q4_1: case KQ_Q5_0: case KQ_Q5_1: {
        const size_t bsz = type == KQ_Q4_0 ? 18 : type == KQ_Q4_1 ? 20 : type == KQ_Q5_0 ? 22 : 24;
        for (int64_t b = 0; b < n / QK; b++, row += bsz, u += QK) {
            uint16_t h; memcpy(&h, row, 2);
            const float d = kq_h2f(h);
            const int has_m = type == KQ_Q4_1 || type == KQ_Q5_1, five = type == KQ_Q5_0 || type == KQ_Q5_1;
            uint16_t mh; memcpy(&mh, row + 2, 2);
            s[b] = d;
            o[b] = has_m ? kq_h2f(mh) : (five ? -16.f : -8.f) * d;
            const uint8_t* qs = row + 2 + 2 * has_m + 4 * five;
            const __m128i t = _mm_loadu_si128((const __m128i*)qs);
            const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
            __m256i v = _mm256_and_si256(both, m4);
            if (five) {
                uint32_t qh; memcpy(&qh, row + 2 + 2 * has_m, 4);
                v = _mm256_mask_add_epi8(v, (__mmask32)qh, v, _mm256_set1_epi8(16));
            }
            _mm256_storeu_si256((__m256i*)u, v);
        }
        break;
    }
    case KQ_Q8_0:
        for (int64_t b = 0; b < n / QK; b++, row += 34, u += QK) {
            uint16_t h; memcpy(&h, row, 2);
            s[b] = kq_h2f(h);
            o[b] = -128.f * s[b];
            _mm256_storeu_si256((__m256i*)u, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(row + 2)),
                                                              _mm256_set1_epi8((char)0x80)));
        }
        break;
    case KQ_NF4: {  /* the int8 table + 128 (one vpshufb for 32 nibbles), offset 128 as Q8_0's */
        const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kq_nf4_i8));
        for (int64_t b = 0; b < n / QK; b++, row += 18, u += QK) {
            uint16_t h; memcpy(&h, row, 2);
            s[b] = kq_h2f(h);
            o[b] = -128.f * s[b];
            const __m128i t = _mm_loadu_si128((const __m128i*)(row + 2));
            const __m256i c = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1), m4);
            _mm256_storeu_si256((__m256i*)u, _mm256_xor_si256(_mm256_shuffle_epi8(tbl, c), _mm256_set1_epi8((char)0x80)));
        }
        break;
    }
    case KQ_Q4_K: case KQ_Q5_K: {
        const int q5 = type == KQ_Q5_K;
        const size_t bsz = q5 ? 176 : 144;
        for (int64_t b = 0; b < n / QKK; b++, row += bsz, u += QKK, s += 8, o += 8) {
            const blk_q4_K* x = (const blk_q4_K*)row;
            const float d = kq_h2f(x->d), dmin = kq_h2f(x->dmin);
            for (int j = 0; j < 8; j++) {
                uint8_t sc, m;
                kq_scale_min(j, x->scales, &sc, &m);
                s[j] = d * sc;
                o[j] = -dmin * m;
            }
            const uint8_t* qs = row + 16 + 32 * q5;
            const __m256i hb = q5 ? _mm256_loadu_si256((const __m256i*)(row + 16)) : _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i bits = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
                __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                if (q5) {
                    lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(1 << 2 * j))), lo,
                                              _mm256_set1_epi8(16));
                    hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(2 << 2 * j))), hi,
                                              _mm256_set1_epi8(16));
                }
                _mm256_storeu_si256((__m256i*)(u + 64 * j), lo);
                _mm256_storeu_si256((__m256i*)(u + 64 * j + 32), hi);
            }
        }
        break;
    }
    case KQ_Q6_K:
        for (int64_t b = 0; b < n / QKK; b++, row += 210, u += QKK, s += 16, o += 16) {
            const blk_q6_K* x = (const blk_q6_K*)row;
            const float d = kq_h2f(x->d);
            for (int g = 0; g < 16; g++) { s[g] = d * x->scales[g]; o[g] = -32.f * s[g]; }
            const __m256i m30 = _mm256_set1_epi8(0x30);
            for (int h = 0; h < 2; h++) {
                const __m256i l1 = _mm256_loadu_si256((const __m256i*)(x->ql + 64 * h));
                const __m256i l2 = _mm256_loadu_si256((const __m256i*)(x->ql + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i*)(x->qh + 32 * h));
                uint8_t* uh = u + 128 * h;
                const __m256i h01 = _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30);  /* bits 0-1 to 4-5 */
                const __m256i h23 = _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30);
                const __m256i h45 = _mm256_and_si256(hb, m30);
                const __m256i h67 = _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30);
                _mm256_storeu_si256((__m256i*)uh, _mm256_or_si256(_mm256_and_si256(l1, m4), h01));
                _mm256_storeu_si256((__m256i*)(uh + 32), _mm256_or_si256(_mm256_and_si256(l2, m4), h23));
                const __m256i n1 = _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4);
                const __m256i n2 = _mm256_and_si256(_mm256_srli_epi16(l2, 4), m4);
                _mm256_storeu_si256((__m256i*)(uh + 64), _mm256_or_si256(n1, h45));
                _mm256_storeu_si256((__m256i*)(uh + 96), _mm256_or_si256(n2, h67));
            }
        }
        break;
    default:
        break;
    }
}

/* Activation rows [r0, r0 + 16) of the quantized rows a (natural layout) packed for the kernel: qt[c][lane] = the
   four quants 4c..4c+3 of row lane; dx[g][lane] the row's block scale for group g, xs[g][lane] = dx times the
   group's sum of quants. Rows past m are zeros. */
void kq_gemm_pack(const kq_act* a, int kind, int G, int64_t r0, int64_t m, int32_t* qt, float* dx, float* xs) {
    const int64_t n = a->n, ng = n / G, blk = kind == 1 ? QKK : QK;
    for (int lane = 0; lane < LANES; lane++) {
        const int64_t r = r0 + lane;
        if (r >= m) {
            for (int64_t c = 0; c < n / 4; c++) qt[c * LANES + lane] = 0;
            for (int64_t g = 0; g < ng; g++) dx[g * LANES + lane] = xs[g * LANES + lane] = 0;
            continue;
        }
        const int8_t* q = a->qs + r * n;
        const float* d = a->d + r * (n / blk);
        for (int64_t c = 0; c < n / 4; c++) memcpy(qt + c * LANES + lane, q + 4 * c, 4);
        for (int64_t g = 0; g < ng; g++) {
            int sum = 0;
            for (int i = 0; i < G; i++) sum += q[g * G + i];
            const float db = d[g * G / blk];
            dx[g * LANES + lane] = db;
            xs[g * LANES + lane] = db * (float)sum;
        }
    }
}

/* W weight rows (unpacked: u rows n apart, s / o rows n / G apart) times one packed tile of 16 activation rows:
   out[w][lane] */
INLINE void tile(int W, int G, int64_t n, const uint8_t* u, const float* s, const float* o, const int32_t* qt,
                 const float* dx, const float* xs, float out[WROWS][LANES]) {
    __m512 accf[WROWS];
    for (int w = 0; w < W; w++) accf[w] = _mm512_setzero_ps();
    const int64_t ng = n / G;
    for (int64_t g = 0; g < ng; g++) {
        __m512i acc[WROWS];
        for (int w = 0; w < W; w++) acc[w] = _mm512_setzero_si512();
        const int32_t* qg = qt + g * (G / 4) * LANES;
        for (int c = 0; c < G / 4; c++) {
            const __m512i av = _mm512_loadu_si512(qg + c * LANES);
            for (int w = 0; w < W; w++) {
                int32_t four;
                memcpy(&four, u + w * n + g * G + 4 * c, 4);
                acc[w] = _mm512_dpbusd_epi32(acc[w], _mm512_set1_epi32(four), av);
            }
        }
        const __m512 dv = _mm512_loadu_ps(dx + g * LANES), sv = _mm512_loadu_ps(xs + g * LANES);
        for (int w = 0; w < W; w++) {
            accf[w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[w]), _mm512_mul_ps(dv, _mm512_set1_ps(s[w * ng + g])),
                                      accf[w]);
            accf[w] = _mm512_fmadd_ps(_mm512_set1_ps(o[w * ng + g]), sv, accf[w]);
        }
    }
    for (int w = 0; w < W; w++) _mm512_storeu_ps(out[w], accf[w]);
}

/* Weight rows [o0, o1) times all m activation rows (packed: tiles of qt / dx / xs, ``tiles`` of them), into y. */
int kq_gemm_rows(int type, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, int64_t n, const int32_t* qt,
                 const float* dx, const float* xs, int64_t m, float* y, int64_t ldy, const float* bias,
                 const int32_t* map) {
    const int G = kq_gemm_group(type);
    const int64_t ng = n / G, tiles = (m + LANES - 1) / LANES;
    uint8_t* u = malloc((size_t)(WROWS * n));
    float* so = malloc((size_t)(2 * WROWS * ng) * sizeof(float));
    if (!u || !so) { free(u); free(so); return -2; }
    float* s = so;
    float* o = so + WROWS * ng;
    float out[WROWS][LANES];
    for (int64_t ob = o0; ob < o1; ob += WROWS) {
        const int W = o1 - ob < WROWS ? (int)(o1 - ob) : WROWS;
        for (int k = 0; k < W; k++) unpack_row(type, w + (ob + k) * rb, n, u + k * n, s + k * ng, o + k * ng);
        for (int64_t t = 0; t < tiles; t++) {
            const int32_t* qtt = qt + t * (n / 4) * LANES;
            const float* dxt = dx + t * ng * LANES;
            const float* xst = xs + t * ng * LANES;
            if (W == WROWS) tile(WROWS, G, n, u, s, o, qtt, dxt, xst, out);
            else for (int k = 0; k < W; k++) tile(1, G, n, u + k * n, s + k * ng, o + k * ng, qtt, dxt, xst, out + k);
            const int rows = m - t * LANES < LANES ? (int)(m - t * LANES) : LANES;
            for (int k = 0; k < W; k++) {
                const int64_t col = map ? map[ob + k] : ob + k;
                const float bv = bias ? bias[ob + k] : 0.f;
                for (int lane = 0; lane < rows; lane++) y[(t * LANES + lane) * ldy + col] = out[k][lane] + bv;
            }
        }
    }
    free(u);
    free(so);
    return 0;
}

/* -- float weights (F32, F16, BF16) --------------------------------------------------------------------------
   The same outer products in floating point. BF16 weights on the default road take bfloat16 activations (rounded
   to nearest even, as llama.cpp rounds them for its bf16 products) and AVX512_BF16's vdpbf16ps: two multiply-adds
   per lane, 32 an instruction; the float road (and F32 / F16 weights) widen the weights to float32 once per pass
   and take float32 activations: 16 an instruction. */

/* x rows [r0, r0 + 16) transposed: xt[k][lane] float32 (pairs = 0), or xt[k / 2][lane] two bfloat16 (pairs = 1) */
void kq_gemm_pack_float(const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t m, int pairs, void* xt) {
    for (int lane = 0; lane < LANES; lane++) {
        const int64_t r = r0 + lane;
        const float* xr = x + r * ldx;
        if (!pairs) {
            float* t = xt;
            for (int64_t k = 0; k < n; k++) t[k * LANES + lane] = r < m ? xr[k] : 0.f;
            continue;
        }
        uint32_t* t = xt;
        for (int64_t k = 0; k < n / 2; k++) {
            uint32_t pair = 0;
            if (r < m)
                for (int h = 0; h < 2; h++) {
                    uint32_t u; memcpy(&u, xr + 2 * k + h, 4);
                    const int nan = (u & 0x7fffffff) > 0x7f800000;  /* NaN stays NaN; else to nearest even */
                    const uint32_t b = nan ? (u >> 16) | 0x40 : (u + 0x7fff + ((u >> 16) & 1)) >> 16;
                    pair |= (b & 0xffff) << (16 * h);
                }
            t[k * LANES + lane] = pair;
        }
    }
}

INLINE void tile_f32(int W, int64_t n, const float* wf, const float* xt, float out[WROWS][LANES]) {
    __m512 acc[WROWS];
    for (int w = 0; w < W; w++) acc[w] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k++) {
        const __m512 xv = _mm512_loadu_ps(xt + k * LANES);
        for (int w = 0; w < W; w++) acc[w] = _mm512_fmadd_ps(_mm512_set1_ps(wf[w * n + k]), xv, acc[w]);
    }
    for (int w = 0; w < W; w++) _mm512_storeu_ps(out[w], acc[w]);
}

#if defined(__AVX512BF16__)
INLINE void tile_bf16(int W, int64_t n, const uint8_t* w, int64_t rb, const uint32_t* xt, float out[WROWS][LANES]) {
    __m512 acc[WROWS];
    for (int k = 0; k < W; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t c = 0; c < n / 2; c++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xt + c * LANES);
        for (int k = 0; k < W; k++) {
            int32_t pair;
            memcpy(&pair, w + k * rb + 4 * c, 4);
            acc[k] = _mm512_dpbf16_ps(acc[k], xv, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    for (int k = 0; k < W; k++) _mm512_storeu_ps(out[k], acc[k]);
}
#endif

int kq_gemm_float_pairs(int type, int road) {
#if defined(__AVX512BF16__)
    return type == KQ_BF16 && road == 0;
#else
    (void)type; (void)road;
    return 0;
#endif
}

/* weight rows [o0, o1) of a float type times the packed activation tiles (kq_gemm_pack_float) into y */
int kq_gemm_float_rows(int type, int pairs, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, int64_t n,
                       const void* xt, int64_t m, float* y, int64_t ldy, const float* bias, const int32_t* map) {
    const int64_t tiles = (m + LANES - 1) / LANES;
    float* wf = pairs ? NULL : malloc((size_t)(WROWS * n) * sizeof(float));
    if (!pairs && !wf) return -2;
    float out[WROWS][LANES];
    for (int64_t ob = o0; ob < o1; ob += WROWS) {
        const int W = o1 - ob < WROWS ? (int)(o1 - ob) : WROWS;
        if (!pairs)
            for (int k = 0; k < W; k++) kq_dequant_row(type, w + (ob + k) * rb, wf + k * n, n);
        for (int64_t t = 0; t < tiles; t++) {
#if defined(__AVX512BF16__)
            if (pairs) {
                const uint32_t* xtt = (const uint32_t*)xt + t * (n / 2) * LANES;
                if (W == WROWS) tile_bf16(WROWS, n, w + ob * rb, rb, xtt, out);
                else for (int k = 0; k < W; k++) tile_bf16(1, n, w + (ob + k) * rb, rb, xtt, out + k);
            } else
#endif
            {
                const float* xtt = (const float*)xt + t * n * LANES;
                if (W == WROWS) tile_f32(WROWS, n, wf, xtt, out);
                else for (int k = 0; k < W; k++) tile_f32(1, n, wf + k * n, xtt, out + k);
            }
            const int rows = m - t * LANES < LANES ? (int)(m - t * LANES) : LANES;
            for (int k = 0; k < W; k++) {
                const int64_t col = map ? map[ob + k] : ob + k;
                const float bv = bias ? bias[ob + k] : 0.f;
                for (int lane = 0; lane < rows; lane++) y[(t * LANES + lane) * ldy + col] = out[k][lane] + bv;
            }
        }
    }
    free(wf);
    return 0;
}
int kq_gemm_float(void) { return 1; }
#else
int kq_gemm_float(void) { return 0; }
int kq_gemm_float_pairs(int type, int road) { (void)type; (void)road; return 0; }
void kq_gemm_pack_float(const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t m, int pairs, void* xt) {
    (void)x; (void)ldx; (void)n; (void)r0; (void)m; (void)pairs; (void)xt;
}
int kq_gemm_float_rows(int type, int pairs, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, int64_t n,
                       const void* xt, int64_t m, float* y, int64_t ldy, const float* bias, const int32_t* map) {
    (void)type; (void)pairs; (void)w; (void)rb; (void)o0; (void)o1; (void)n; (void)xt; (void)m; (void)y; (void)ldy;
    (void)bias; (void)map;
    return -1;
}
int kq_gemm_group(int type) { (void)type; return 0; }
void kq_gemm_pack(const kq_act* a, int kind, int G, int64_t r0, int64_t m, int32_t* qt, float* dx, float* xs) {
    (void)a; (void)kind; (void)G; (void)r0; (void)m; (void)qt; (void)dx; (void)xs;
}
int kq_gemm_rows(int type, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, int64_t n, const int32_t* qt,
                 const float* dx, const float* xs, int64_t m, float* y, int64_t ldy, const float* bias,
                 const int32_t* map) {
    (void)type; (void)w; (void)rb; (void)o0; (void)o1; (void)n; (void)qt; (void)dx; (void)xs; (void)m; (void)y;
    (void)ldy; (void)bias; (void)map;
    return -1;
}
#endif
