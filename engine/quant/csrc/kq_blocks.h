/* GGUF weight blocks as llama.cpp's ggml stores them (ggml-common.h), and the 8-bit activation rows the
   integer products read. Derived from ggml (MIT licence, (c) 2023-2026 The ggml authors): the block layouts must
   match the file byte for byte; the kernels in this folder are written for this library.

   Types are ggml's enum numbers, so a GGUF tensor's type is passed through unchanged. */
#ifndef KQ_BLOCKS_H
#define KQ_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum {
    KQ_F32 = 0, KQ_F16 = 1, KQ_Q4_0 = 2, KQ_Q4_1 = 3, KQ_Q5_0 = 6, KQ_Q5_1 = 7, KQ_Q8_0 = 8,
    KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14, KQ_BF16 = 30,
    KQ_NF4 = 100  /* ours, no ggml type (ggml's run to 39): bitsandbytes' NF4 codes in Q4_0's layout (below) */
};

#define QK 32    /* elements of a 32-block (Q4_0 .. Q8_0) */
#define QKK 256  /* elements of a super-block (the k-quants) */

typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;                      /* 18 bytes */
typedef struct { uint16_t d, m; uint8_t qs[16]; } blk_q4_1;                   /* 20 */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;       /* 22 */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;    /* 24 */
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;                       /* 34 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;              /* 144 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K; /* 176 */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;     /* 210 */

/* KQ_NF4: a block of 32 of bitsandbytes' NF4 weights (value NF4[code] * absmax) as Q4_0 lays it out: qs[j]'s low
   nibble is element j's code, its high nibble element j + 16's; d = absmax / 127 in half precision. The value is
   kq_nf4_i8[code] * d: the codebook times 127 rounded to int8 (llama.cpp's IQ4_NL reads a 16-entry int8 table the
   same way), off NF4's float levels by at most 0.5 / 127 of the block's absmax. The codes stay bitsandbytes'. */
typedef blk_q4_0 blk_nf4;
static const int8_t kq_nf4_i8[16] = {-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127};

_Static_assert(sizeof(blk_q4_0) == 18 && sizeof(blk_q4_1) == 20 && sizeof(blk_q5_0) == 22, "block size");
_Static_assert(sizeof(blk_q5_1) == 24 && sizeof(blk_q8_0) == 34, "block size");
_Static_assert(sizeof(blk_q4_K) == 144 && sizeof(blk_q5_K) == 176 && sizeof(blk_q6_K) == 210, "block size");

/* IEEE half to float, exact (subnormals, infinities and NaN included), without F16C */
static inline float kq_h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) u = sign | 0x7f800000 | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else {  /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f; memcpy(&f, &u, 4); return f;
#endif
}

/* float to IEEE half, rounded to nearest even (what ggml stores an activation block's scale in) */
static inline uint16_t kq_f2h(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000 ? 0x200 : 0));
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  /* rounds past the largest half */
    if (a < 0x38800000) {  /* a half subnormal (or zero) */
        float v; memcpy(&v, &a, 4);
        return (uint16_t)(sign | (uint32_t)__builtin_lrintf(v * 16777216.0f));  /* units of 2^-24 */
    }
    uint32_t r = a + 0xfff + ((a >> 13) & 1) - (112u << 23);
    return (uint16_t)(sign | (r >> 13));
#endif
}

static inline float kq_bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* a k-quant's j-th 6-bit scale and min out of its twelve packed bytes (ggml's get_scale_min_k4) */
static inline void kq_scale_min(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* Activation rows quantized to 8 bits, planar: qs [rows][n] int8; for the 32-block types (ACT32) d [rows][n/32]
   the block's scale (rounded through half precision, as ggml's Q8_0 / Q8_1 keep it) and s [rows][n/32] = d times
   the block's sum of quants (Q8_1's s); for the k-quants (ACTK, ggml's Q8_K) d [rows][n/256] a float and
   bsums [rows][n/16] int16 sums of sixteen quants. */
typedef struct {
    int8_t* qs;
    float* d;
    float* s;         /* ACT32 */
    int16_t* bsums;   /* ACTK */
    int64_t n;        /* elements a row */
} kq_act;

/* bytes one row of n elements of `type` takes (0: n does not fit the type's blocks, or an unknown type) */
int64_t kq_row_bytes(int type, int64_t n);
/* does `type`'s product read ACTK (1) or ACT32 (0) activations; -1 for the float types */
int kq_act_kind(int type);

void kq_dequant_row(int type, const void* row, float* out, int64_t n);
void kq_quant_act32(const float* x, int64_t n, int8_t* qs, float* d, float* s);
void kq_quant_actk(const float* x, int64_t n, int8_t* qs, float* d, int16_t* bsums);

/* dot products of one weight row with R (1..4) quantized activation rows: out[r] = row . act_r */
typedef void (*kq_dot_fn)(const void* row, const kq_act* a, int64_t r0, int R, float* out);
kq_dot_fn kq_dot_for(int type);
/* the AVX-512 products (NULL: not built for AVX-512, or not this type) and the activation layout they read:
   0 natural, 2 k-quant quarters swapped, 3 32-block pairs' quarters swapped (kq_dot512.c) */
kq_dot_fn kq_dot512_for(int type);
int kq_act_layout(int type);
/* many rows on AVX-512 VNNI (kq_gemm.c): the group size of a type's scales there (0: no GEMM for it here), the
   activations packed sixteen rows a tile, weight rows [o0, o1) times them */
int kq_gemm_group(int type);
void kq_gemm_pack(const kq_act* a, int kind, int G, int64_t r0, int64_t m, int32_t* qt, float* dx, float* xs);
int kq_gemm_rows(int type, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, int64_t n, const int32_t* qt,
                 const float* dx, const float* xs, int64_t m, float* y, int64_t ldy, const float* bias,
                 const int32_t* map);
/* the float types' GEMM (kq_gemm.c): built (1) or not; BF16 by bfloat16 pairs on this road (1) or float32 */
int kq_gemm_float(void);
int kq_gemm_float_pairs(int type, int road);
void kq_gemm_pack_float(const float* x, int64_t ldx, int64_t n, int64_t r0, int64_t m, int pairs, void* xt);
int kq_gemm_float_rows(int type, int pairs, const uint8_t* w, int64_t rb, int64_t o0, int64_t o1, int64_t n,
                       const void* xt, int64_t m, float* y, int64_t ldy, const float* bias, const int32_t* map);
/* weights repacked sixteen rows a group for AVX-512 VNNI (kq_pack.c, kq_packed.c): the bytes a packed weight
   takes (0: no packed layout for the type in this build), the packing, and the product (any number of rows) */
int64_t kq_pack_bytes(int type, int64_t n_out, int64_t n);
int kq_pack(int type, const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, uint8_t* out, int threads);
int kq_packed_matmul(int type, const uint8_t* p, int64_t n_out, int64_t n, const float* x, int64_t m, int64_t ldx,
                     float* y, int64_t ldy, const float* bias, const int32_t* map, int threads);
/* BF16 weights times fewer than sixteen rows by bfloat16 pairs (kq_bf16.c; -1 where not built for AVX512_BF16) */
int kq_bf16_rows(const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, const float* x, int64_t m, int64_t ldx,
                 float* y, int64_t ldy, const float* bias, const int32_t* map, int threads);
/* the packed products' builds (kq_pack.c's layout): AVX-512 VNNI (kq_packed.c), else AVX2 with FMA and F16C
   (kq_packed_avx2.c); neither: the row products read the file's layout */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KQ_PACKED_512 1
#else
#define KQ_PACKED_512 0
#endif
#if !KQ_PACKED_512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_PACKED_AVX2 1
#else
#define KQ_PACKED_AVX2 0
#endif
/* which instruction set the integer products were built for, in words */
const char* kq_isa(void);

#endif
