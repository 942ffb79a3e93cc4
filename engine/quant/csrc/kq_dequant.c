/* GGUF blocks to float32, one row at a time (embedding rows as they are looked up, the float-activation road of
   the products, tests), and float32 activation rows to the 8-bit blocks the integer products read. The arithmetic
   is ggml's reference code (ggml-quants.c: dequantize_row_*, quantize_row_q8_K_ref, quantize_row_q8_1): the
   dequantized values are exactly what the gguf package's dequantize gives. */
#include <math.h>
#include "kq_blocks.h"

int64_t kq_row_bytes(int type, int64_t n) {
    if (n < 0) return 0;
    switch (type) {
    case KQ_F32: return 4 * n;
    case KQ_F16: case KQ_BF16: return 2 * n;
    case KQ_Q4_0: case KQ_NF4: return n % QK ? 0 : n / QK * 18;
    case KQ_Q4_1: return n % QK ? 0 : n / QK * 20;
    case KQ_Q5_0: return n % QK ? 0 : n / QK * 22;
    case KQ_Q5_1: return n % QK ? 0 : n / QK * 24;
    case KQ_Q8_0: return n % QK ? 0 : n / QK * 34;
    case KQ_Q4_K: return n % QKK ? 0 : n / QKK * 144;
    case KQ_Q5_K: return n % QKK ? 0 : n / QKK * 176;
    case KQ_Q6_K: return n % QKK ? 0 : n / QKK * 210;
    default: return 0;
    }
}

int kq_act_kind(int type) {
    switch (type) {
    case KQ_Q4_0: case KQ_Q4_1: case KQ_Q5_0: case KQ_Q5_1: case KQ_Q8_0: case KQ_NF4: return 0;
    case KQ_Q4_K: case KQ_Q5_K: case KQ_Q6_K: return 1;
    default: return -1;
    }
}

static void dq_nf4(const blk_nf4* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = kq_h2f(x[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = kq_nf4_i8[x[i].qs[j] & 0xF] * d;
            y[j + 16] = kq_nf4_i8[x[i].qs[j] >> 4] * d;
        }
    }
}

static void dq_q4_0(const blk_q4_0* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = kq_h2f(x[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = ((x[i].qs[j] & 0xF) - 8) * d;
            y[j + 16] = ((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void dq_q4_1(const blk_q4_1* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = kq_h2f(x[i].d), m = kq_h2f(x[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = (x[i].qs[j] & 0xF) * d + m;
            y[j + 16] = (x[i].qs[j] >> 4) * d + m;
        }
    }
}

static void dq_q5_0(const blk_q5_0* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = kq_h2f(x[i].d);
        uint32_t qh; memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = (((x[i].qs[j] & 0xF) | h0) - 16) * d;
            y[j + 16] = (((x[i].qs[j] >> 4) | h1) - 16) * d;
        }
    }
}

static void dq_q5_1(const blk_q5_1* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = kq_h2f(x[i].d), m = kq_h2f(x[i].m);
        uint32_t qh; memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = ((x[i].qs[j] & 0xF) | h0) * d + m;
            y[j + 16] = ((x[i].qs[j] >> 4) | h1) * d + m;
        }
    }
}

static void dq_q8_0(const blk_q8_0* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        const float d = kq_h2f(x[i].d);
        for (int j = 0; j < 32; j++) y[j] = x[i].qs[j] * d;
    }
}

static void dq_q4_K(const blk_q4_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t* q = x[i].qs;
        const float d = kq_h2f(x[i].d), dmin = kq_h2f(x[i].dmin);
        for (int j = 0; j < 8; j += 2, q += 32) {
            uint8_t sc, m;
            kq_scale_min(j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            kq_scale_min(j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

static void dq_q5_K(const blk_q5_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t* ql = x[i].qs;
        const uint8_t* qh = x[i].qh;
        const float d = kq_h2f(x[i].d), dmin = kq_h2f(x[i].dmin);
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < 8; j += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, m;
            kq_scale_min(j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            kq_scale_min(j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        }
    }
}

static void dq_q6_K(const blk_q6_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const float d = kq_h2f(x[i].d);
        const uint8_t* ql = x[i].ql;
        const uint8_t* qh = x[i].qh;
        const int8_t* sc = x[i].scales;
        for (int n = 0; n < QKK; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * sc[is] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

void kq_dequant_row(int type, const void* row, float* y, int64_t n) {
    switch (type) {
    case KQ_F32: memcpy(y, row, (size_t)n * 4); break;
    case KQ_F16: { const uint16_t* h = row; for (int64_t i = 0; i < n; i++) y[i] = kq_h2f(h[i]); break; }
    case KQ_BF16: { const uint16_t* h = row; for (int64_t i = 0; i < n; i++) y[i] = kq_bf2f(h[i]); break; }
    case KQ_Q4_0: dq_q4_0(row, y, n / QK); break;
    case KQ_NF4: dq_nf4(row, y, n / QK); break;
    case KQ_Q4_1: dq_q4_1(row, y, n / QK); break;
    case KQ_Q5_0: dq_q5_0(row, y, n / QK); break;
    case KQ_Q5_1: dq_q5_1(row, y, n / QK); break;
    case KQ_Q8_0: dq_q8_0(row, y, n / QK); break;
    case KQ_Q4_K: dq_q4_K(row, y, n / QKK); break;
    case KQ_Q5_K: dq_q5_K(row, y, n / QKK); break;
    case KQ_Q6_K: dq_q6_K(row, y, n / QKK); break;
    default: break;
    }
}

/* ggml's Q8_0 / Q8_1 activation blocks: d = max|x| / 127 rounded through half precision, q = round(x / d);
   s = d * sum(q) (ggml keeps s in half precision too; float here) */
void kq_quant_act32(const float* x, int64_t n, int8_t* qs, float* d, float* s) {
    for (int64_t b = 0; b < n / QK; b++, x += QK, qs += QK) {
        float amax = 0;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float db = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            const int q = (int)lrintf(x[j] * id);  /* to nearest even, as ggml's AVX code rounds */
            qs[j] = (int8_t)q;
            sum += q;
        }
        d[b] = kq_h2f(kq_f2h(db));
        s[b] = d[b] * (float)sum;
    }
}

/* ggml's Q8_K: scale by the value of largest magnitude (its sign kept: -127 / max), sums of sixteen */
void kq_quant_actk(const float* x, int64_t n, int8_t* qs, float* d, int16_t* bsums) {
    for (int64_t b = 0; b < n / QKK; b++, x += QKK, qs += QKK, bsums += 16) {
        float amax = 0, max = 0;
        for (int j = 0; j < QKK; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0.f) {
            d[b] = 0;
            memset(qs, 0, QKK);
            memset(bsums, 0, 16 * sizeof(int16_t));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QKK; j++) {
            int v = (int)lrintf(iscale * x[j]);
            qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += qs[j * 16 + i];
            bsums[j] = (int16_t)sum;
        }
        d[b] = 1 / iscale;
    }
}
