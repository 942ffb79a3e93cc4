/* The products the model's linears call: y[m, map(o)] = x[m, :] . W[o, :] (+ bias[o]) for a GGUF weight W kept
   as the file stores it (rows of blocks, row_bytes apart: the memory-mapped tensor itself), any number of rows m.

   Two roads (``road``):
   0  integer: each activation row quantized to 8-bit blocks (ggml's Q8_0 with sums for the 32-block types, Q8_K
      for the k-quants) and multiplied by integer dot products (kq_dot.c): llama.cpp's numerics and speed;
   1  float: each weight row dequantized to float32 once and multiplied by the float32 activations: the model
      dequantized by the gguf package, up to summation order (the reference road).
   F32 / F16 / BF16 weights always take the float road (widened in registers, summed in float32).

   Threads: the weight rows are shared among `threads` OpenMP threads in contiguous ranges (one pool: the
   libgomp torch loaded, under the same soname); the activation rows are quantized once, before. Rows of the
   output go through `map` (NULL: row o to column o): a GGUF's query and key rows are stored in another order than
   the model's (llama.cpp's permutation for its rotary layout), and the product writes them where the model
   wants them instead of the weights being copied into that order. */
#include <math.h>
#include <stdlib.h>
#include "kq_blocks.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* from this many rows the integer road takes the GEMM (kq_gemm.c) where it is built: sixteen rows fill its
   vectors; fewer are padded, and below 16 the row products waste less */
#define GEMM_MIN_ROWS 16

static int is_float(int type) { return type == KQ_F32 || type == KQ_F16 || type == KQ_BF16; }

typedef float v8 __attribute__((vector_size(32)));

/* x . w for n floats (n any): four vector accumulators, the tail in scalars */
static float dot_f32(const float* w, const float* x, int64_t n) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        v8 w0, w1, w2, w3, x0, x1, x2, x3;
        memcpy(&w0, w + i, 32); memcpy(&w1, w + i + 8, 32); memcpy(&w2, w + i + 16, 32); memcpy(&w3, w + i + 24, 32);
        memcpy(&x0, x + i, 32); memcpy(&x1, x + i + 8, 32); memcpy(&x2, x + i + 16, 32); memcpy(&x3, x + i + 24, 32);
        a0 += w0 * x0; a1 += w1 * x1; a2 += w2 * x2; a3 += w3 * x3;
    }
    v8 a = (a0 + a1) + (a2 + a3);
    float s = 0;
    for (int k = 0; k < 8; k++) s += a[k];
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

static void store(float* y, int64_t ldy, int64_t r, int64_t o, const int32_t* map, const float* bias, float v) {
    y[r * ldy + (map ? map[o] : o)] = v + (bias ? bias[o] : 0.f);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* sixteen weights of a float type as float32, widened in registers */
static inline __m512 load16(int type, const uint8_t* w, int64_t i) {
    if (type == KQ_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i*)(w + 2 * i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (type == KQ_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 2 * i)));
    return _mm512_loadu_ps((const float*)w + i);
}

/* one weight row of a float type times R (1..4) activation rows, the weights widened once for all R (a decode
   step's row: the weights stream from memory at 2 bytes a weight for BF16 / F16, no float32 copy of the row) */
static inline __attribute__((always_inline)) void float_row(int type, const uint8_t* wr, int64_t n, const float* x,
                                                           int64_t ldx, int R, float* out) {
    __m512 a0[4], a1[4];
    for (int r = 0; r < R; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 w0 = load16(type, wr, i), w1 = load16(type, wr, i + 16);
        for (int r = 0; r < R; r++) {
            a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + i), a0[r]);
            a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * ldx + i + 16), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
    if (i < n) {  /* a tail under 32: widened one at a time */
        float t[32];
        kq_dequant_row(type, wr + (type == KQ_F32 ? 4 : 2) * i, t, n - i);
        for (int r = 0; r < R; r++)
            for (int64_t k = 0; k < n - i; k++) out[r] += t[k] * x[r * ldx + i + k];
    }
}

static void float_rows(int type, const uint8_t* wr, int64_t n, const float* x, int64_t ldx, int64_t m, float* out4,
                       int64_t o, float* y, int64_t ldy, const float* bias, const int32_t* map) {
    for (int64_t r = 0; r < m; r += 4) {
        const int R = m - r < 4 ? (int)(m - r) : 4;
        switch (R) {
        case 4: float_row(type, wr, n, x + r * ldx, ldx, 4, out4); break;
        case 3: float_row(type, wr, n, x + r * ldx, ldx, 3, out4); break;
        case 2: float_row(type, wr, n, x + r * ldx, ldx, 2, out4); break;
        default: float_row(type, wr, n, x + r * ldx, ldx, 1, out4); break;
        }
        for (int k = 0; k < R; k++) store(y, ldy, r + k, o, map, bias, out4[k]);
    }
}
#endif

/* weight rows [o0, o1) on the float road; buf holds one dequantized row (n floats) */
static void rows_float(int type, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, int64_t n, const float* x,
                       int64_t m, int64_t ldx, float* y, int64_t ldy, const float* bias, const int32_t* map,
                       float* buf) {
#if defined(__AVX512F__)
    if (is_float(type)) {
        float out[4];
        for (int64_t o = o0; o < o1; o++) float_rows(type, w + o * rb, n, x, ldx, m, out, o, y, ldy, bias, map);
        return;
    }
#endif
    for (int64_t o = o0; o < o1; o++) {
        const float* wr = (const float*)(w + o * rb);
        if (type != KQ_F32) { kq_dequant_row(type, w + o * rb, buf, n); wr = buf; }
        for (int64_t r = 0; r < m; r++) store(y, ldy, r, o, map, bias, dot_f32(wr, x + r * ldx, n));
    }
}

/* weight rows [o0, o1) on the integer road, activation rows four at a time */
static void rows_int(kq_dot_fn dot, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, const kq_act* a,
                     int64_t m, float* y, int64_t ldy, const float* bias, const int32_t* map) {
    float out[4];
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t* row = w + o * rb;
        for (int64_t r = 0; r < m; r += 4) {
            const int R = m - r < 4 ? (int)(m - r) : 4;
            dot(row, a, r, R, out);
            for (int k = 0; k < R; k++) store(y, ldy, r + k, o, map, bias, out[k]);
        }
    }
}

/* swap the second and third quarter (q bytes each) of every whole 4q-byte chunk of a row's quants: the order the
   AVX-512 products read (kq_dot512.c: layout 2 with q = 32, layout 3 with q = 16) */
static void swap_quarters(int8_t* qs, int64_t n, int q) {
    int8_t t[32];
    for (int64_t c = 0; c + 4 * q <= n; c += 4 * q) {
        memcpy(t, qs + c + q, q);
        memcpy(qs + c + q, qs + c + 2 * q, q);
        memcpy(qs + c + 2 * q, t, q);
    }
}

static void quantize_rows(int kind, int layout, const float* x, int64_t ldx, int64_t r0, int64_t r1,
                          const kq_act* a) {
    for (int64_t r = r0; r < r1; r++) {
        int8_t* qs = a->qs + r * a->n;
        if (kind == 1)
            kq_quant_actk(x + r * ldx, a->n, qs, a->d + r * (a->n / QKK), a->bsums + r * (a->n / 16));
        else
            kq_quant_act32(x + r * ldx, a->n, qs, a->d + r * (a->n / QK), a->s + r * (a->n / QK));
        if (layout == 2) swap_quarters(qs, a->n, 32);
        if (layout == 3) swap_quarters(qs, a->n, 16);
    }
}

/* the share [*b0, *b1) of `total` items thread t of nt takes, in multiples of `align` */
static void share(int64_t total, int t, int nt, int64_t align, int64_t* b0, int64_t* b1) {
    const int64_t units = (total + align - 1) / align;
    const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
    *b0 = u0 * align < total ? u0 * align : total;
    *b1 = u1 * align < total ? u1 * align : total;
}

/* the float road (and float weights) from 16 rows: the activations packed once, the weight rows shared */
static int float_gemm(int type, const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, const float* x, int64_t m,
                      int64_t ldx, float* y, int64_t ldy, const float* bias, const int32_t* map, int road,
                      int threads) {
    const int pairs = kq_gemm_float_pairs(type, road);
    const int64_t tiles = (m + 15) / 16, tile_bytes = 16 * n * (pairs ? 2 : 4);
    uint8_t* xt = malloc((size_t)(tiles * tile_bytes));
    if (!xt) return -2;
    int rc = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(); nt = omp_get_num_threads();
#endif
        int64_t b0, b1;
        share(tiles, t, nt, 1, &b0, &b1);
        for (int64_t k = b0; k < b1; k++) kq_gemm_pack_float(x, ldx, n, 16 * k, m, pairs, xt + k * tile_bytes);
#pragma omp barrier
        share(n_out, t, nt, 8, &b0, &b1);
        if (kq_gemm_float_rows(type, pairs, w, rb, b0, b1, n, xt, m, y, ldy, bias, map) != 0) rc = -2;
    }
    free(xt);
    return rc;
}

/* 0 done; -1 bad arguments (an unknown type, n not a whole number of blocks, row_bytes too small); -2 no memory */
int kq_matmul(int type, const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, const float* x, int64_t m,
              int64_t ldx, float* y, int64_t ldy, const float* bias, const int32_t* map, int road, int threads) {
    const int64_t need = kq_row_bytes(type, n);
    if (need == 0 || rb < need || m < 1 || n_out < 1 || ldx < n) return -1;
    if (threads < 1) threads = 1;
    if (is_float(type) || road == 1 || kq_act_kind(type) < 0) {
        if (!is_float(type) && kq_act_kind(type) < 0) return -1;
        if (type == KQ_BF16 && m < GEMM_MIN_ROWS && kq_gemm_float_pairs(type, road))
            return kq_bf16_rows(w, rb, n_out, n, x, m, ldx, y, ldy, bias, map, threads);
        if (m >= GEMM_MIN_ROWS && kq_gemm_float() && (n % 2 == 0 || !kq_gemm_float_pairs(type, road)))
            return float_gemm(type, w, rb, n_out, n, x, m, ldx, y, ldy, bias, map, road, threads);
        int fail = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            int t = 0, nt = 1;
#ifdef _OPENMP
            t = omp_get_thread_num(); nt = omp_get_num_threads();
#endif
            int64_t o0, o1;
            share(n_out, t, nt, 4, &o0, &o1);
            float* buf = type == KQ_F32 ? NULL : malloc((size_t)n * sizeof(float));
            if (type != KQ_F32 && !buf) fail = 1;
            else rows_float(type, w, rb, o0, o1, n, x, m, ldx, y, ldy, bias, map, buf);
            free(buf);
        }
        return fail ? -2 : 0;
    }
    const int kind = kq_act_kind(type);
    const int64_t nd = n / (kind == 1 ? QKK : QK);
    const int G = m >= GEMM_MIN_ROWS ? kq_gemm_group(type) : 0;  /* 0: the row products */
    const int64_t tiles = (m + 15) / 16;
    kq_act a = {0};
    a.n = n;
    a.qs = malloc((size_t)(m * n));
    a.d = malloc((size_t)(m * nd) * sizeof(float));
    if (kind == 1) a.bsums = malloc((size_t)(m * (n / 16)) * sizeof(int16_t));
    else a.s = malloc((size_t)(m * nd) * sizeof(float));
    int32_t* qt = G ? malloc((size_t)(tiles * 16 * n)) : NULL;
    float* dx = G ? malloc((size_t)(2 * tiles * 16 * (n / (G ? G : 1))) * sizeof(float)) : NULL;
    int rc = 0;
    if (!a.qs || !a.d || (kind == 1 ? !a.bsums : !a.s) || (G && (!qt || !dx))) rc = -2;
    else {
        kq_dot_fn dot = kq_dot_for(type);
        float* xs = G ? dx + tiles * 16 * (n / G) : NULL;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            int t = 0, nt = 1;
#ifdef _OPENMP
            t = omp_get_thread_num(); nt = omp_get_num_threads();
#endif
            int64_t b0, b1;
            share(m, t, nt, 1, &b0, &b1);
            quantize_rows(kind, G ? 0 : kq_act_layout(type), x, ldx, b0, b1, &a);
#pragma omp barrier
            if (G) {
                share(tiles, t, nt, 1, &b0, &b1);
                for (int64_t k = b0; k < b1; k++)
                    kq_gemm_pack(&a, kind, G, 16 * k, m, qt + k * 4 * n, dx + k * 16 * (n / G), xs + k * 16 * (n / G));
#pragma omp barrier
                share(n_out, t, nt, 8, &b0, &b1);
                if (kq_gemm_rows(type, w, rb, b0, b1, n, qt, dx, xs, m, y, ldy, bias, map) != 0) rc = -2;
            } else {
                share(n_out, t, nt, 4, &b0, &b1);
                rows_int(dot, w, rb, b0, b1, &a, m, y, ldy, bias, map);
            }
        }
    }
    free(qt); free(dx);
    free(a.qs); free(a.d); free(a.s); free(a.bsums);
    return rc;
}

/* A weight as the model's linears hold it (built once per linear, so a call passes five arguments: ctypes
   converts each one, ~0.5 us apiece); `packed`: the same weight repacked sixteen rows a group (kq_pack.c), which
   the integer road multiplies instead of w where it is set */
typedef struct {
    int32_t type, road;
    const uint8_t* w;
    int64_t rb, n_out, n;
    const float* bias;
    const int32_t* map;
    const uint8_t* packed;
} kq_weight;

/* y [m, n_out] = x [m, n] times the weight (rows contiguous) */
int kq_linear(const kq_weight* W, const float* x, int64_t m, float* y, int threads) {
    if (W->packed && W->road == 0)
        return kq_packed_matmul(W->type, W->packed, W->n_out, W->n, x, m, W->n, y, W->n_out, W->bias, W->map, threads);
    return kq_matmul(W->type, W->w, W->rb, W->n_out, W->n, x, m, W->n, y, W->n_out, W->bias, W->map, W->road,
                     threads);
}

/* out[i, :] = row ids[i] of W dequantized (an embedding lookup); -1 when an id is outside [0, n_rows) (nothing
   read) or the type is unknown */
int kq_get_rows(int type, const uint8_t* w, int64_t rb, int64_t n_rows, int64_t n, const int64_t* ids,
                int64_t count, float* out) {
    if (kq_row_bytes(type, n) == 0 || rb < kq_row_bytes(type, n)) return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return -1;
    for (int64_t i = 0; i < count; i++) kq_dequant_row(type, w + ids[i] * rb, out + i * n, n);
    return 0;
}

/* rows [r0, r1) of W dequantized into out (r1 - r0 rows of n floats) */
int kq_dequant(int type, const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, int64_t n, float* out) {
    if (kq_row_bytes(type, n) == 0 || rb < kq_row_bytes(type, n) || r0 < 0 || r1 < r0) return -1;
    for (int64_t r = r0; r < r1; r++) kq_dequant_row(type, w + r * rb, out + (r - r0) * n, n);
    return 0;
}

int kq_act_kind_of(int type) { return kq_act_kind(type); }
int64_t kq_row_bytes_of(int type, int64_t n) { return kq_row_bytes(type, n); }
const char* kq_isa_name(void) { return kq_isa(); }
