/* The fused decode attention over tq, int4 and int8 pages (``kvs_tq_decode``; called by
   engine/kv/quantized/tq_attend.py through engine/kv/quantized/native.py).

   One new query token per sequence attends to its cached tokens straight from their codes: each cached row is turned
   into its levels once (a byte -> levels table, in L1), dotted with the ``rep`` query heads that share its KV head
   (scores), and after the softmax summed into their outputs (values), so nothing of the size of the cache is written.
   The materialized read it replaces wrote [H, n, D] float32 twice a layer (3 MB at 2,048 tokens x 3 heads x 64) and
   then ran SDPA over it: on the SmolLM2-135M shape that read was ~0.8 ms a layer, the fused pass ~0.1-0.2 ms. */
#include "kv_math.h"
#include "kv_levels.h"

/* One role's pages of one layer, every KV head (head h's rows start at codes + h * head_stride bytes). */
typedef struct {
    const uint8_t *codes;
    int64_t head_stride;
    int row_bytes, bits, dim, width;  /* codes a row; a row's width in the read basis (QJL keys: 2 dim) */
    const float *norms;  /* [hk, n] */
    const float *levels;  /* [16]: the 2^bits levels, zero-padded */
    const float *table;  /* the byte table of ``levels`` */
    const float *tail;  /* [hk, nt, width]: the page being filled, rotated, exact */
    const uint8_t *signs;  /* QJL keys: the residual's signs, a 1-bit plane (else NULL) */
    int64_t sign_head_stride;
    int sign_row_bytes;
    const float *sign_norms;  /* [hk, n]: ||r|| sqrt(pi/2) / dim */
    const float *sign_levels;  /* {-1, +1, 0, ...} */
    const float *sign_table;  /* [256, 8] */
    int mode;  /* 0: level x norm (tq); 1: code x scale + zero per page and channel (int4 keys, KIVI);
                  2: code x scale + zero per token and group of channels (int4 values) */
    int page_size, group;
    const float *scale, *zero;  /* mode 1: [hk, n / page_size, dim]; mode 2: [hk, n, dim / group] */
} kvs_role;

#ifdef KVS_WIDE
/* The quantized rows' scores of KV head h, sixteen rows at a time: each row's levels dotted with the rep queries as
   sixteen partial sums, the sixteen rows' sums reduced at once (sums16: a tenth of the shuffles of one sum each).
   Scratch as head()'s. */
static void scores16(int h, int rep, const float *q, int64_t n, const kvs_role *k, const uint8_t *kc, const float *kn,
                     float *s, int64_t len, float *lv, float *zv, float *qs, float *cst) {
    const int dk = k->dim, wk = k->width;
    v16 part[16][16];
    float add[16][16], res[16] __attribute__((aligned(64)));
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int cnt = n - i0 < 16 ? (int)(n - i0) : 16;
        for (int t = 0; t < 16; t++) {
            const int64_t i = i0 + t;
            if (t >= cnt) {
                for (int r = 0; r < rep; r++) part[r][t] = (v16){0}, add[r][t] = 0.0f;
                continue;
            }
            levels(kc + i * k->row_bytes, k->bits, dk, k->levels, k->table, lv);
            if (k->mode == 1) {  /* q . (code s + z) = (q s) . code + q . z, s and z the page's */
                if (i % k->page_size == 0) {
                    const int64_t pg = h * (n / k->page_size) + i / k->page_size;
                    const float *sc = k->scale + pg * dk, *zr = k->zero + pg * dk;
                    for (int r = 0; r < rep; r++) {
                        for (int c = 0; c < dk; c++) qs[r * dk + c] = q[r * wk + c] * sc[c];
                        cst[r] = dot(q + r * wk, zr, dk);
                    }
                }
                for (int r = 0; r < rep; r++) part[r][t] = dotv(qs + r * dk, lv, dk), add[r][t] = cst[r];
                continue;
            }
            for (int r = 0; r < rep; r++) part[r][t] = dotv(q + r * wk, lv, dk) * kn[i], add[r][t] = 0.0f;
            if (k->signs) {  /* QJL: + q_proj . (alpha ||r|| z) */
                levels(k->signs + h * k->sign_head_stride + i * k->sign_row_bytes, 1, dk, k->sign_levels,
                       k->sign_table, zv);
                const float a = k->sign_norms[h * n + i];
                for (int r = 0; r < rep; r++) part[r][t] += dotv(q + r * wk + dk, zv, dk) * a;
            }
        }
        for (int r = 0; r < rep; r++) {
            *(v16 *)res = sums16(part[r]);
            for (int t = 0; t < cnt; t++) s[r * len + i0 + t] = res[t] + add[r][t];
        }
    }
}
#endif

/* One KV head h of one decode step. q [rep, k->width] (rotated, scaled), out [rep, v->dim] (rotated; zeroed here).
   Quantized rows first, then the exact tail rows. s: scratch [rep, n + nt]. */
static int head(int h, int rep, const float *q, int64_t n, int64_t nt, const kvs_role *k, const kvs_role *v,
                float *s, float *out) {
    float lv[1024] __attribute__((aligned(64))), zv[1024] __attribute__((aligned(64)));
    float qs[4096] __attribute__((aligned(64))), cst[64];  /* int4 keys: the queries times the page's scales */
    const int dk = k->dim, wk = k->width, dv = v->dim;
    const int64_t len = n + nt;
    if (dk > 1024 || dv > 1024 || (k->mode == 1 && (rep * dk > 4096 || rep > 64))) return -1;
    const uint8_t *kc = k->codes + h * k->head_stride, *vc = v->codes + h * v->head_stride;
    const float *kn = k->mode == 0 ? k->norms + h * n : 0, *vn = v->mode == 0 ? v->norms + h * n : 0;
    const float *kt = k->tail + h * nt * wk, *vt = v->tail + h * nt * dv;
    int64_t n_done = 0;
#ifdef KVS_WIDE
    if ((dk & 15) == 0 && rep <= 16) {
        scores16(h, rep, q, n, k, kc, kn, s, len, lv, zv, qs, cst);
        n_done = n;
    }
#endif
    for (int64_t i = n_done; i < n; i++) {
        levels(kc + i * k->row_bytes, k->bits, dk, k->levels, k->table, lv);
        if (k->mode == 1) {  /* q . (code s + z) = (q s) . code + q . z, s and z the page's */
            if (i % k->page_size == 0) {
                const int64_t pg = h * (n / k->page_size) + i / k->page_size;
                const float *sc = k->scale + pg * dk, *zr = k->zero + pg * dk;
                for (int r = 0; r < rep; r++) {
                    for (int c = 0; c < dk; c++) qs[r * dk + c] = q[r * wk + c] * sc[c];
                    cst[r] = dot(q + r * wk, zr, dk);
                }
            }
            for (int r = 0; r < rep; r++) s[r * len + i] = dot(qs + r * dk, lv, dk) + cst[r];
            continue;
        }
        for (int r = 0; r < rep; r++) s[r * len + i] = dot(q + r * wk, lv, dk) * kn[i];
        if (k->signs) {  /* QJL: + q_proj . (alpha ||r|| z) */
            levels(k->signs + h * k->sign_head_stride + i * k->sign_row_bytes, 1, dk, k->sign_levels, k->sign_table,
                   zv);
            const float a = k->sign_norms[h * n + i];
            for (int r = 0; r < rep; r++) s[r * len + i] += dot(q + r * wk + dk, zv, dk) * a;
        }
    }
    for (int64_t i = 0; i < nt; i++)
        for (int r = 0; r < rep; r++) s[r * len + n + i] = dot(q + r * wk, kt + i * wk, wk);
    for (int r = 0; r < rep; r++) softmax(s + r * len, len);
    memset(out, 0, sizeof(float) * rep * dv);
    for (int64_t i = 0; i < n; i++) {
        levels(vc + i * v->row_bytes, v->bits, dv, v->levels, v->table, lv);
        if (v->mode == 2) {  /* p (code s + z), s and z the token's group's */
            const int ng = dv / v->group;
            const float *sc = v->scale + (h * n + i) * ng, *zr = v->zero + (h * n + i) * ng;
            for (int r = 0; r < rep; r++) {
                const float p = s[r * len + i];
                for (int g = 0; g < ng; g++)
                    axpyb(p * sc[g], lv + g * v->group, p * zr[g], out + r * dv + g * v->group, v->group);
            }
            continue;
        }
        for (int r = 0; r < rep; r++) axpy(s[r * len + i] * vn[i], lv, out + r * dv, dv);
    }
    for (int64_t i = 0; i < nt; i++)
        for (int r = 0; r < rep; r++) axpy(s[r * len + n + i], vt + i * dv, out + r * dv, dv);
    return 0;
}

/* Every KV head; the query heads of KV head h are h * rep .. h * rep + rep - 1: q [hk * rep, k->width],
   out [hk * rep, v->dim]. Returns 0, or -1 for a head_dim over 1024. */
int kvs_tq_decode(int hk, int rep, const float *q, int64_t n, int64_t nt, const kvs_role *k, const kvs_role *v,
                  float *s, float *out) {
    for (int h = 0; h < hk; h++) {
        int rc = head(h, rep, q + (int64_t)h * rep * k->width, n, nt, k, v, s, out + (int64_t)h * rep * v->dim);
        if (rc) return rc;
    }
    return 0;
}

/* KV heads h0 .. h1 - 1 only, with scratch of their own (so threads may split the heads: ``engine.model.linear_op``
   shares them among torch's threads). Returns -1 as kvs_tq_decode does, or where memory runs out. */
int kvs_tq_decode_heads(int h0, int h1, int rep, const float *q, int64_t n, int64_t nt, const kvs_role *k,
                        const kvs_role *v, float *out) {
    float *s = (float *)malloc(sizeof(float) * rep * (n + nt));
    if (!s) return -1;
    int rc = 0;
    for (int h = h0; h < h1 && !rc; h++)
        rc = head(h, rep, q + (int64_t)h * rep * k->width, n, nt, k, v, s, out + (int64_t)h * rep * v->dim);
    free(s);
    return rc;
}
