/* A greedy decode's choice: the first index of the largest of n float32 logits, and that value
   (engine/core/sampling.py, through engine/model/linear_kernel.py; part of the linear library, its flags).

   torch.argmax on the CPU reads ~1 GB/s: 31 us a token for a 32,064-word vocabulary, 116 for Llama-3's 128,256,
   246 for Gemma's 262,144, plus the logits' max the sampler reads to refuse NaN / inf (16 us at 128K). Here each of
   sixteen lanes keeps its largest value and the first index it came at (a later equal value never replaces it), four
   sets of lanes so no compare waits on the one before, then the lanes are reduced to the smallest index among the
   largest: torch's answer (its first maximum; -0.0 equals 0.0) with the max beside it, in one pass (5 / 13 / 22 us
   for those three on this Zen 4). A NaN anywhere: the first NaN's index and NaN (torch takes NaN as the largest). */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));  /* sixteen lanes' indices, or compare masks */

static int64_t first_nan(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != x[i]) return i;
    return -1;
}

/* the first index of the largest of x[0..n) (n >= 1, n < 2^31), its value in *top; -1 for n < 1 or n >= 2^31 */
int64_t kvs_argmax(const float* x, int64_t n, float* top) {
    if (n < 1 || n >= ((int64_t)1 << 31)) return -1;
    int64_t best_i = 0;
    float best = x[0];
    int64_t i = 0;
    if (n >= 64) {  /* four sets of lanes: each set's compare waits on its own last blend only */
        v16 bv[4];
        i16 bi[4], at[4], nan = {0};
        for (int s = 0; s < 4; s++) {
            memcpy(&bv[s], x + 16 * s, 64);
            for (int l = 0; l < 16; l++) bi[s][l] = 16 * s + l;
            at[s] = bi[s];
            nan |= bv[s] != bv[s];
        }
        for (i = 64; i + 64 <= n; i += 64)
            for (int s = 0; s < 4; s++) {
                v16 v;
                memcpy(&v, x + i + 16 * s, 64);
                at[s] += 64;
                const i16 gt = v > bv[s];  /* -1 where this lane's new value is larger (never for NaN) */
                bv[s] = (v16)(((i16)v & gt) | ((i16)bv[s] & ~gt));
                bi[s] = (at[s] & gt) | (bi[s] & ~gt);
                nan |= v != v;
            }
        int any = 0;
        for (int l = 0; l < 16; l++) any |= nan[l];
        if (any) {
            *top = NAN;
            return first_nan(x, n);
        }
        best = bv[0][0];
        best_i = bi[0][0];
        for (int s = 0; s < 4; s++)  /* the largest, at the smallest index any lane holding it came at */
            for (int l = 0; l < 16; l++)
                if (bv[s][l] > best || (bv[s][l] == best && bi[s][l] < best_i)) {
                    best = bv[s][l];
                    best_i = bi[s][l];
                }
    } else if (x[0] != x[0]) {
        *top = NAN;
        return 0;
    }
    for (; i < n; i++) {  /* the tail after the whole sixteens (or all of a short row): later, so only larger wins */
        if (x[i] != x[i]) {
            *top = NAN;
            return i;
        }
        if (x[i] > best) {
            best = x[i];
            best_i = i;
        }
    }
    *top = best;
    return best_i;
}
