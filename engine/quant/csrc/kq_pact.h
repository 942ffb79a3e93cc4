/* What the packed products (kq_packed.c for AVX-512 VNNI, kq_packed_avx2.c for AVX2) share: the activation rows
   quantized to 8 bits with the sums each type's kernel reads, and a share of rows or groups per thread. */
#ifndef KQ_PACT_H
#define KQ_PACT_H
#include <stdlib.h>
#include "kq_blocks.h"

/* activation rows for the packed products: qs [m][n] int8 (natural order), d the block scales ([m][n/32] for the
   32-block types, [m][n/256] for the k-quants), o [m][n/32] or [m][n/16] int32 offsets (Q4_0: 8 sum(q), Q8_0:
   128 sum(q), Q6_K: 32 sum(q) of each sixteen), b2 [m][n/32] int16 sums of 32 (Q4_K's mins) */
typedef struct {
    int8_t* qs;
    float* d;
    int32_t* o;
    int16_t* b2;
    int64_t n;
} pact;

/* activation rows [r0, r1) quantized with their sums as the type's kernel reads them */
static inline void quantize(int type, const float* x, int64_t ldx, int64_t r0, int64_t r1, const pact* A, int16_t* bs) {
    const int64_t n = A->n;
    for (int64_t r = r0; r < r1; r++) {
        int8_t* qs = A->qs + r * n;
        if (type == KQ_Q4_K || type == KQ_Q6_K) {
            int16_t* b16 = bs + r * (n / 16);
            kq_quant_actk(x + r * ldx, n, qs, A->d + r * (n / QKK), b16);
            for (int64_t g = 0; g < n / 32; g++)
                if (type == KQ_Q4_K) A->b2[r * (n / 32) + g] = (int16_t)(b16[2 * g] + b16[2 * g + 1]);
            if (type == KQ_Q6_K)
                for (int64_t g = 0; g < n / 16; g++) A->o[r * (n / 16) + g] = 32 * b16[g];
        } else {
            float* s = (float*)bs + r * (n / QK);  /* ggml's s = d sum(q): not read here */
            kq_quant_act32(x + r * ldx, n, qs, A->d + r * (n / QK), s);
            const int z = type == KQ_Q4_0 ? 8 : 128;
            for (int64_t b = 0; b < n / QK; b++) {
                int sum = 0;
                for (int i = 0; i < QK; i++) sum += qs[QK * b + i];
                A->o[r * (n / QK) + b] = z * sum;
            }
        }
    }
}

static inline void share(int64_t total, int t, int nt, int64_t* b0, int64_t* b1) {
    *b0 = total * t / nt;
    *b1 = total * (t + 1) / nt;
}

#endif
