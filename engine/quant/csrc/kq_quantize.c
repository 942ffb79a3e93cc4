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
