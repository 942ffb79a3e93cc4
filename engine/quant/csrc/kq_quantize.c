/* Float weights to Q8_0 blocks, as a model folder's linears are read (``--quantize int8`` on a CPU:
   engine/model/q8_load.py). The arithmetic is ggml's quantize_row_q8_0_ref (ggml-quants.c): per block of 32,
   d = max|x| / 127, q = roundf(x / d) (half away from zero), d stored as IEEE half (kq_f2h: to nearest even); the
   blocks are bit for bit those of the gguf package's Q8_0 quantize. The source rows are float32 or bfloat16 (a
   folder's own dtype: no float32 copy of the weight is made first).

   Why C: the same in torch's elementwise ops took ~0.29 s for an 8192x2048 weight on one thread (a dozen passes
   over the float copy), 24 s of a 1B model's 36 s load; this reads each weight once. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kq_blocks.h"

/* 1 / d, and 0 for a zero block; also 0 where 1 / d overflows (a block under 2e-36 at most: ggml's reference
   code then casts infinities to int8, undefined; zeros are what the gguf package writes) */
static inline float kq_inverse(float d) {
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    return id <= 3.4e38f ? id : 0.0f;
}

/* one row: per block the scale, then the 32 rounded weights (roundf as t = trunc(q), plus sign(q) where
   |q - t| >= 0.5: q - t is exact, so it is roundf bit for bit, without a branch) */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 kq_load16(const void* src, int bf16, int64_t k) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)src + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float*)src + k);
}

static inline __m128i kq_round16(__m512 v, __m512 id) {
    const __m512 q = _mm512_mul_ps(v, id), t = _mm512_roundscale_ps(q, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512 sign = _mm512_and_ps(q, _mm512_set1_ps(-0.0f));
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(q, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 r = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(_mm512_set1_ps(1.0f), sign));
    return _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r));
}

static void q8_0_row(const void* src, int bf16, int64_t n, blk_q8_0* y) {
    for (int64_t i = 0; i < n / QK; i++) {
        const __m512 a = kq_load16(src, bf16, i * QK), b = kq_load16(src, bf16, i * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.0f, id = kq_inverse(d);
        y[i].d = kq_f2h(d);
        _mm_storeu_si128((__m128i*)y[i].qs, kq_round16(a, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i*)(y[i].qs + 16), kq_round16(b, _mm512_set1_ps(id)));
    }
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline __m256 kq_load8(const void* src, int bf16, int64_t k) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)src + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float*)src + k);
}

static inline __m256i kq_round8(__m256 v, __m256 id) {
    const __m256 sgn = _mm256_set1_ps(-0.0f), q = _mm256_mul_ps(v, id);
    const __m256 t = _mm256_round_ps(q, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sgn, _mm256_sub_ps(q, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(q, sgn));
    return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, one)));
}

static void q8_0_row(const void* src, int bf16, int64_t n, blk_q8_0* y) {
    const __m256 sgn = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n / QK; i++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = kq_load8(src, bf16, i * QK + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sgn, v[k]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float d = _mm_cvtss_f32(h) / 127.0f, id = kq_inverse(d);
        y[i].d = kq_f2h(d);
        const __m256 vid = _mm256_set1_ps(id);
        /* int32 lanes to int8: pack to int16 then int8 (saturating: |q| <= 127), undoing the lanes' interleave */
        const __m256i a = _mm256_packs_epi32(kq_round8(v[0], vid), kq_round8(v[1], vid));
        const __m256i b = _mm256_packs_epi32(kq_round8(v[2], vid), kq_round8(v[3], vid));
        const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)y[i].qs, p);
    }
}
#else
static void q8_0_row(const void* src, int bf16, int64_t n, blk_q8_0* y) {
    const float* xf = (const float*)src;
    const uint16_t* xh = (const uint16_t*)src;
    float v[QK];
    for (int64_t i = 0; i < n / QK; i++) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            v[j] = bf16 ? kq_bf2f(xh[i * QK + j]) : xf[i * QK + j];
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = kq_inverse(d);
        y[i].d = kq_f2h(d);
        for (int j = 0; j < QK; j++) {
            const float q = v[j] * id, t = truncf(q);
            y[i].qs[j] = (int8_t)(t + (float)(fabsf(q - t) >= 0.5f) * copysignf(1.0f, q));
        }
    }
}
#endif

/* rows x n weights (float32, or bfloat16 when bf16 is 1), row r at x + r * stride elements, to rows of n / 32
   Q8_0 blocks at out (n / 32 * 34 bytes a row). Returns -1 when n is not a multiple of 32. */
int kq_quantize_q8_0(const void* x, int bf16, int64_t rows, int64_t n, int64_t stride, uint8_t* out, int threads) {
    if (n % QK || rows < 0 || stride < n) return -1;
    const int64_t es = bf16 ? 2 : 4, rb = n / QK * (int64_t)sizeof(blk_q8_0);
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (threads > 1 && rows > 64)
    for (int64_t r = 0; r < rows; r++)
        q8_0_row((const char*)x + r * stride * es, (int)bf16, n, (blk_q8_0*)(out + r * rb));
    return 0;
}

/* Float weights to bitsandbytes' 4-bit blocks (``--quantize nf4``: engine/model/nf4_quant.py gives it to
   bitsandbytes as its CPU ``quantize_4bit`` kernel). The arithmetic of bitsandbytes' own torch code
   (backends/default/ops.py), bit for bit: per block of ``blocksize`` the scale absmax = max|x|, each weight
   clamp(x * (1 / max(absmax, 1e-38)), -1, 1) (a last, partial block: x / its absmax), its code the number of the 15
   ``bounds`` (the codebook's midpoints) below it, two codes a byte (the first in the high nibble, an odd last one
   beside a 0). bitsandbytes' torch code spent 66 s of a 1B model's 143 s load in ``bucketize``; this reads each
   weight once. */
static inline int kq_code4(float v, const float* bounds) {
    int q = 0;
    for (int k = 0; k < 15; k++) q += v > bounds[k];
    return q;
}

static inline float kq_clamp1(float v) { return v < -1.0f ? -1.0f : v > 1.0f ? 1.0f : v; }

/* codes of 16 (AVX-512) / 8 (AVX2) scaled weights at once: each weight's count of bounds below it, added up bound
   by bound; then two codes a byte */
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline void kq_codes16(const float* xb, float inv, const float* bounds, uint8_t* out) {
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(xb), _mm512_set1_ps(inv)),
                                                 _mm512_set1_ps(-1.0f)), _mm512_set1_ps(1.0f));
    __m512i q = _mm512_setzero_si512();
    for (int k = 0; k < 15; k++)
        q = _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(v, _mm512_set1_ps(bounds[k]), _CMP_GT_OQ), q,
                                  _mm512_set1_epi32(1));
    const __m128i c = _mm512_cvtepi32_epi8(q);  /* 16 codes, one a byte */
    const __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0xff)), 4),
                                       _mm_srli_epi16(c, 8));  /* (even << 4) | odd in each 16-bit lane */
    _mm_storel_epi64((__m128i*)out, _mm_packus_epi16(pairs, pairs));
}
#define KQ_CODES 16
#define kq_codes kq_codes16
#elif defined(__AVX2__)
static inline void kq_codes8(const float* xb, float inv, const float* bounds, uint8_t* out) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(xb), _mm256_set1_ps(inv)),
                                                 _mm256_set1_ps(-1.0f)), _mm256_set1_ps(1.0f));
    __m256i q = _mm256_setzero_si256();
    for (int k = 0; k < 15; k++)  /* a true compare is all ones: -1, subtracted */
        q = _mm256_sub_epi32(q, _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_set1_ps(bounds[k]), _CMP_GT_OQ)));
    int32_t c[8];
    _mm256_storeu_si256((__m256i*)c, q);
    for (int j = 0; j < 8; j += 2) out[j / 2] = (uint8_t)(c[j] << 4 | c[j + 1]);
}
#define KQ_CODES 8
#define kq_codes kq_codes8
#endif

/* one whole block of bitsandbytes' 4-bit codes: its absolute maximum, then each value's code two a byte */
static void block4(const float* xb, int64_t blocksize, const float* bounds, uint8_t* pb, float* absmax) {
    float amax = 0.0f;
    for (int64_t j = 0; j < blocksize; j++) amax = fmaxf(amax, fabsf(xb[j]));
    *absmax = amax;
    const float inv = 1.0f / fmaxf(amax, 1e-38f);
    int64_t j = 0;
#ifdef KQ_CODES
    for (; j + KQ_CODES <= blocksize; j += KQ_CODES) kq_codes(xb + j, inv, bounds, pb + j / 2);
#endif
    for (; j < blocksize; j += 2)
        pb[j / 2] = (uint8_t)(kq_code4(kq_clamp1(xb[j] * inv), bounds) << 4 | kq_code4(kq_clamp1(xb[j + 1] * inv), bounds));
}

/* The same codes of bfloat16 values (a safetensors file's weights, read from its mapping), each block widened on the
   stack: the float32 copy of a whole weight took ~1 s of a 1B model's load. Whole blocks only (n % blocksize == 0,
   blocksize <= 4096); 0 done, -1 bad arguments. */
int kq_quantize_4bit_bf16(const uint16_t* x, int64_t n, int64_t blocksize, const float* bounds, uint8_t* packed,
                          float* absmax, int threads) {
    if (n < 0 || blocksize < 2 || blocksize % 2 || blocksize > 4096 || n % blocksize) return -1;
    const int64_t blocks = n / blocksize;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (threads > 1 && blocks > 256)
    for (int64_t b = 0; b < blocks; b++) {
        float xb[4096];
        for (int64_t j = 0; j < blocksize; j++) {
            const uint32_t u = (uint32_t)x[b * blocksize + j] << 16;
            memcpy(xb + j, &u, 4);
        }
        block4(xb, blocksize, bounds, packed + b * blocksize / 2, absmax + b);
    }
    return 0;
}

int kq_quantize_4bit(const float* x, int64_t n, int64_t blocksize, const float* bounds, uint8_t* packed,
                     float* absmax, int threads) {
    if (n < 0 || blocksize < 2 || blocksize % 2) return -1;
    const int64_t blocks = n / blocksize, full = blocks * blocksize;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (threads > 1 && blocks > 256)
    for (int64_t b = 0; b < blocks; b++)
        block4(x + b * blocksize, blocksize, bounds, packed + b * blocksize / 2, absmax + b);
    if (full < n) {  /* the last, partial block: its own scale, and a division as bitsandbytes' code divides */
        float amax = 0.0f;
        for (int64_t j = full; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
        amax = fmaxf(amax, 1e-38f);
        absmax[blocks] = amax;
        for (int64_t j = full; j < n; j += 2) {
            const int hi = kq_code4(kq_clamp1(x[j] / amax), bounds);
            const int lo = j + 1 < n ? kq_code4(kq_clamp1(x[j + 1] / amax), bounds) : kq_code4(0.0f, bounds);
            packed[j / 2] = (uint8_t)(hi << 4 | lo);
        }
    }
    return 0;
}

/* bitsandbytes' 4-bit codes (row-major [n_out, n_in], two a byte, the even element in the high nibble) in the layout
   its AVX512-BF16 CPU kernel reads (bitsandbytes.functional._convert_weight_packed_for_cpu): per 32 rows and pair of
   inputs k, 32 bytes, byte 2t + j holding input 2k + j of row 16 + t (high nibble) and of row t (low). bitsandbytes
   makes it in torch at each layer's first forward through int32 copies of every code (a 1B model: 5.4 s, 4 GB in
   flight); here one pass, 32 rows' streams side by side. 0 done, -1 bad arguments (n_out % 32, n_in % 2). */
int kq_nf4_cpu_layout(const uint8_t* q, int64_t n_out, int64_t n_in, uint8_t* out) {
    if (n_out < 32 || n_out % 32 || n_in < 2 || n_in % 2) return -1;
    const int64_t half = n_in / 2;
    for (int64_t g = 0; g < n_out / 32; g++) {
        const uint8_t* lo = q + g * 32 * half;
        const uint8_t* hi = lo + 16 * half;
        uint8_t* o = out + g * half * 32;
        for (int64_t k = 0; k < half; k++)
            for (int t = 0; t < 16; t++) {
                const uint8_t a = lo[t * half + k], b = hi[t * half + k];
                o[k * 32 + 2 * t] = (uint8_t)((b & 0xF0) | (a >> 4));
                o[k * 32 + 2 * t + 1] = (uint8_t)((b & 0x0F) << 4 | (a & 0x0F));
            }
    }
    return 0;
}

/* bitsandbytes' 4-bit NF4 codes (as above: row-major [n_out, n_in], the even element in the high nibble) and their
   float32 scales (one per `blocksize` weights) as KQ_NF4 rows of 32-blocks (kq_blocks.h): the codes regrouped in
   Q4_0's nibble order (qs[j] = element j low, j + 16 high), d = absmax / 127 in half precision (to nearest even:
   within 2^-11 of it, for absmax >= 127 * 2^-14). Every 32-block lies in one of bitsandbytes' blocks
   (blocksize % 32 == 0). 0 done, -1 bad arguments. */
int kq_nf4_blocks(const uint8_t* q, const float* absmax, int64_t blocksize, int64_t n_out, int64_t n_in,
                  uint8_t* out, int threads) {
    if (n_out < 1 || n_in < QK || n_in % QK || blocksize < QK || blocksize % QK) return -1;
    const int64_t nb = n_in / QK;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static) if (threads > 1 && n_out > 64)
    for (int64_t o = 0; o < n_out; o++) {
        blk_nf4* y = (blk_nf4*)(out + o * nb * sizeof(blk_nf4));
        for (int64_t b = 0; b < nb; b++) {
            const int64_t e0 = o * n_in + QK * b;  /* even: its codes start on a byte */
            const uint8_t* src = q + e0 / 2;
            y[b].d = kq_f2h(absmax[e0 / blocksize] / 127.0f);
            for (int j = 0; j < 16; j++) {
                const int lo = src[j / 2] >> (j % 2 ? 0 : 4) & 0xF, hi = src[8 + j / 2] >> (j % 2 ? 0 : 4) & 0xF;
                y[b].qs[j] = (uint8_t)(lo | hi << 4);
            }
        }
    }
    return 0;
}
