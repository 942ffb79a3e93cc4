/* What the packed products (kq_packed.c for AVX-512 VNNI, kq_packed_avx2.c for AVX2) share: the activation rows
   quantized to 8 bits with the sums each type's kernel reads, and a share of rows or groups per thread. */
#ifndef KQ_PACT_H
#define KQ_PACT_H
#include <stdlib.h>
#include "kq_blocks.h"
#ifdef _OPENMP
#include <omp.h>
#endif

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

int64_t kq_x16_group_bytes(int type, int64_t n);

/* one group's sixteen output rows for activation rows [r0, r0 + R), R <= 4, stored as floats in o16[R][16] */
typedef void (*kfn)(const uint8_t* grp, int64_t n, const pact* A, int64_t r0, int R, float (*o16)[16]);

/* y [m, n_out] (+ bias, output row o to column map[o]) = x [m, n] times the packed weight p, by the group kernel
   fn: the activation rows quantized (shared by row across threads), then the groups shared across threads.
   0 done; -1 bad arguments; -2 no memory */
static inline int packed_matmul(kfn fn, int type, const uint8_t* p, int64_t n_out, int64_t n, const float* x,
                                int64_t m, int64_t ldx, float* y, int64_t ldy, const float* bias, const int32_t* map,
                                int threads) {
    if (!fn || kq_pack_bytes(type, n_out, n) == 0 || m < 1 || ldx < n) return -1;
    if (threads < 1) threads = 1;
    const int64_t nb = n / (kq_act_kind(type) == 1 ? QKK : QK), gb = kq_x16_group_bytes(type, n);
    const int64_t groups = (n_out + 15) / 16;
    pact A = {0};
    A.n = n;
    A.qs = malloc((size_t)(m * n));
    A.d = malloc((size_t)(m * nb) * sizeof(float));
    A.o = malloc((size_t)(m * (n / 16)) * sizeof(int32_t));
    A.b2 = malloc((size_t)(m * (n / 32)) * sizeof(int16_t));
    int16_t* bs = malloc((size_t)(m * (n / 16)) * sizeof(int32_t));  /* Q8_K's sums of 16, or Q8_0's s */
    int rc = 0;
    if (!A.qs || !A.d || !A.o || !A.b2 || !bs) rc = -2;
    else {
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            int t = 0, nt = 1;
#ifdef _OPENMP
            t = omp_get_thread_num(); nt = omp_get_num_threads();
#endif
            int64_t b0, b1;
            share(m, t, nt, &b0, &b1);
            quantize(type, x, ldx, b0, b1, &A, bs);
#pragma omp barrier
            share(groups, t, nt, &b0, &b1);
            float o16[4][16];
            for (int64_t g = b0; g < b1; g++) {
                const uint8_t* grp = p + g * gb;
                const int rows = n_out - g * 16 < 16 ? (int)(n_out - g * 16) : 16;
                for (int64_t r = 0; r < m; r += 4) {
                    const int R = m - r < 4 ? (int)(m - r) : 4;
                    fn(grp, n, &A, r, R, o16);
                    for (int k = 0; k < R; k++)
                        for (int i = 0; i < rows; i++) {
                            const int64_t o = g * 16 + i;
                            y[(r + k) * ldy + (map ? map[o] : o)] = o16[k][i] + (bias ? bias[o] : 0.f);
                        }
                }
            }
        }
    }
    free(A.qs); free(A.d); free(A.o); free(A.b2); free(bs);
    return rc;
}

#endif
