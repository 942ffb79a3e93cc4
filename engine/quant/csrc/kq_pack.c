/* GGUF weights repacked sixteen rows at a time for the AVX-512 VNNI products (kq_packed.c; kq_packed_avx2.c on AVX2
   machines with the same layout: a 64-byte chunk as two 256-bit halves): llama.cpp's idea
   (ggml-cpu's repack.cpp interleaves 4 or 8 rows so that one activation block meets several rows' blocks per
   load), laid out here for 512-bit vectors. In a group of sixteen weight rows, each block's quants are stored as
   64-byte chunks of four bytes per row, row r at bytes 4r..4r+3: one load is the same four byte positions of
   sixteen rows, and one vpdpbusd against four activation quants (broadcast) is sixteen rows' four products — the
   rows' sums stay in the vector's lanes, no horizontal sums, no per-row setup, one activation load for sixteen
   rows. A block's scales sit in front of its quants as vectors of sixteen (half-precision d, the k-quants' scales
   and mins as bytes), so a group is one stream read front to back (the hardware prefetchers follow one stream;
   scales and quants in two regions ran ~1.4x slower) and every step starts on a 64-byte line.

   A group is ns steps of SB bytes (kq_x16_shape), sixteen rows each:
     Q4_K  one block (256):  d[16] dmin[16] sc[8][16] mn[4][16][2] (320 B: the 6-bit scales and mins unpacked to
           bytes, the mins in pairs for a 16-bit pair product), then 32 chunks: chunk 8k + l = qs[32k + 4l..]
           (low nibbles: sub-block 2k's quants 4l..4l+3, high nibbles 2k+1's)           2,368 B (file: 2,304)
     Q6_K  one block (256):  d[16] sc[16][16] (288 B, padded to 320), then 16 triples of chunks in the order the
           product reads them: ql[64h + 4l..], ql[64h + 32 + 4l..], qh[32h + 4l..] for h = 0, 1 and l = 0..7
                                                                                        3,392 B (file: 3,360)
     Q4_0  two blocks (64):  d[2][16] (64 B), then each block's 4 chunks: chunk c = qs[4c..4c+3]   576 B (576)
           (NF4 the same: its codes are looked up in its table by the product; AVX-512 VNNI only)
     Q8_0  two blocks (64):  d[2][16] (64 B), then each block's 8 chunks of qs[4c..4c+3] + 128 (stored unsigned,
           w ^ 0x80)                                                                    1,088 B (1,088)
   A row whose block count is odd (32-block types) ends in half a step, the other half zeros; a last group of
   fewer than sixteen rows is padded with zero rows (never written out). */
#include <stdlib.h>
#include "kq_blocks.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define PR 16  /* rows a group */

/* elements and bytes of a step (0: no packed layout for the type) */
int kq_x16_shape(int type, int* se, int* sb) {
    switch (type) {
    case KQ_Q4_K: *se = QKK; *sb = 2368; return 1;
    case KQ_Q6_K: *se = QKK; *sb = 3392; return 1;
    case KQ_Q4_0: case KQ_NF4: *se = 2 * QK; *sb = 576; return 1;
    case KQ_Q8_0: *se = 2 * QK; *sb = 1088; return 1;
    default: return 0;
    }
}

int64_t kq_x16_group_bytes(int type, int64_t n) {
    int se, sb;
    if (!kq_x16_shape(type, &se, &sb)) return 0;
    return (n + se - 1) / se * sb;
}

/* bytes the packed weight takes (0: this type, or this build, has no packed product: keep the file's layout) */
int64_t kq_pack_bytes(int type, int64_t n_out, int64_t n) {
#if KQ_PACKED_512 || KQ_PACKED_AVX2
    if (n_out < 1 || kq_row_bytes(type, n) == 0 || kq_x16_group_bytes(type, n) == 0) return 0;
    return (n_out + PR - 1) / PR * kq_x16_group_bytes(type, n);
#else
    (void)type; (void)n_out; (void)n;
    return 0;
#endif
}

#if defined(__linux__)
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  /* Linux 5.14; older kernels refuse it (EINVAL) and the pages fault one by one */
#define MADV_POPULATE_WRITE 23
#endif
/* Hints before a packing, each refused harmlessly where the kernel lacks it: the source's file pages mapped and the
   destination's pages made in one call each instead of a fault per 4 KiB page (1B shape's Q4_K_M, one thread: 1.4 s
   -> 0.4 s a load), and marked for 2 MiB pages before they are made. Each such fault may wait for the kernel to
   compact memory into a free 2 MiB page (the 1B shape's packing 0.7-2.8 s against 0.43-0.87 s unmarked), but the
   packing runs on a thread of its own after the load, and khugepaged merges pages marked after the fill only at
   16 MiB per 10 s (its defaults): minutes of 4 KiB pages. 1B shape, one thread, quiet, 3 rounds interleaved: decode
   Q4_K_M 26.2 against 25.6 tok/s, Q4_0 28.9 against 25.4; a prompt sent at once waits 0-0.7 s longer. */
static void advise_out(uint8_t* out, int64_t total) {
    const uintptr_t page = 4096, huge = (uintptr_t)1 << 21;
    const uintptr_t d0 = ((uintptr_t)out + page - 1) & ~(page - 1), d1 = ((uintptr_t)out + (uintptr_t)total) & ~(page - 1);
    const uintptr_t h0 = ((uintptr_t)out + huge - 1) & ~(huge - 1), h1 = ((uintptr_t)out + (uintptr_t)total) & ~(huge - 1);
    if (h1 > h0) madvise((void*)h0, h1 - h0, MADV_HUGEPAGE);
    if (d1 > d0) madvise((void*)d0, d1 - d0, MADV_POPULATE_WRITE);
}

/* the source's pages: mapped before a chunk is packed (whole pages around it), or let go after (whole pages in it) */
static void advise_src(const uint8_t* src, int64_t bytes, int advice) {
    const uintptr_t page = 4096, a = (uintptr_t)src, e = a + (uintptr_t)bytes;
    const uintptr_t s0 = advice == MADV_DONTNEED ? (a + page - 1) & ~(page - 1) : a & ~(page - 1);
    const uintptr_t s1 = advice == MADV_DONTNEED ? e & ~(page - 1) : (e + page - 1) & ~(page - 1);
    if (s1 > s0) madvise((void*)s0, s1 - s0, advice);
}
#endif

static void put4(uint8_t* chunk, int r, const uint8_t* src) { memcpy(chunk + 4 * r, src, 4); }

/* where block b of a group starts (its scales) and where its chunks start */
static uint8_t* block_meta(int type, uint8_t* grp, int64_t b) {
    switch (type) {
    case KQ_Q4_K: return grp + 2368 * b;
    case KQ_Q6_K: return grp + 3392 * b;
    case KQ_Q4_0: case KQ_NF4: return grp + 576 * (b / 2) + 32 * (b % 2);
    default: return grp + 1088 * (b / 2) + 32 * (b % 2);
    }
}

static uint8_t* block_quants(int type, uint8_t* grp, int64_t b) {
    switch (type) {
    case KQ_Q4_K: return grp + 2368 * b + 320;
    case KQ_Q6_K: return grp + 3392 * b + 320;
    case KQ_Q4_0: case KQ_NF4: return grp + 576 * (b / 2) + 64 + 256 * (b % 2);
    default: return grp + 1088 * (b / 2) + 64 + 512 * (b % 2);
    }
}

/* row r of a group: its nb blocks' bytes into the group */
static void pack_row(int type, const uint8_t* row, int r, int64_t nb, uint8_t* grp) {
    for (int64_t b = 0; b < nb; b++) {
        uint8_t* M = block_meta(type, grp, b);
        uint8_t* Q = block_quants(type, grp, b);
        switch (type) {
        case KQ_Q4_0: case KQ_NF4: {
            const blk_q4_0* x = (const blk_q4_0*)row + b;
            memcpy(M + 2 * r, &x->d, 2);
            for (int c = 0; c < 4; c++) put4(Q + 64 * c, r, x->qs + 4 * c);
            break;
        }
        case KQ_Q8_0: {
            const blk_q8_0* x = (const blk_q8_0*)row + b;
            memcpy(M + 2 * r, &x->d, 2);
            for (int c = 0; c < 8; c++) {
                uint8_t u[4];
                for (int i = 0; i < 4; i++) u[i] = (uint8_t)x->qs[4 * c + i] ^ 0x80;
                put4(Q + 64 * c, r, u);
            }
            break;
        }
        case KQ_Q4_K: {
            const blk_q4_K* x = (const blk_q4_K*)row + b;
            memcpy(M + 2 * r, &x->d, 2);
            memcpy(M + 32 + 2 * r, &x->dmin, 2);
            for (int j = 0; j < 8; j++) {
                uint8_t sc, mn;
                kq_scale_min(j, x->scales, &sc, &mn);
                M[64 + 16 * j + r] = sc;
                M[192 + 32 * (j / 2) + 2 * r + (j & 1)] = mn;
            }
            for (int c = 0; c < 32; c++) put4(Q + 64 * c, r, x->qs + 32 * (c / 8) + 4 * (c % 8));
            break;
        }
        case KQ_Q6_K: {
            const blk_q6_K* x = (const blk_q6_K*)row + b;
            memcpy(M + 2 * r, &x->d, 2);
            if (r == 0) memset(M + 288, 0, 32);  /* the scales' padding */
            for (int g = 0; g < 16; g++) M[32 + 16 * g + r] = (uint8_t)x->scales[g];
            for (int t = 0; t < 16; t++) {  /* triple t = 8h + l */
                const int h = t / 8, l = t % 8;
                put4(Q + 192 * t, r, x->ql + 64 * h + 4 * l);
                put4(Q + 192 * t + 64, r, x->ql + 64 * h + 32 + 4 * l);
                put4(Q + 192 * t + 128, r, x->qh + 32 * h + 4 * l);
            }
            break;
        }
        default:
            break;
        }
    }
}

/* Rows packed a chunk at a time, ~16 MiB of the source each: a weight read from a file mapping holds its file pages
   only while its chunk is packed (drop: they are let go after it), not the whole tensor beside its packed copy
   (an 8B model's Q6_K output head: 431 MB of file pages at once, its load's peak +9%) */
#define CHUNK_BYTES ((int64_t)16 << 20)

static int pack_rows(int type, const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, uint8_t* out, int threads,
                     int drop) {
    const int64_t total = kq_pack_bytes(type, n_out, n);
    if (total == 0 || rb < kq_row_bytes(type, n)) return -1;
#if defined(__linux__)
    advise_out(out, total);
#else
    (void)drop;
#endif
    const int64_t nb = n / (kq_act_kind(type) == 1 ? QKK : QK), gb = kq_x16_group_bytes(type, n);
    const int64_t groups = (n_out + PR - 1) / PR;
    const int64_t step = CHUNK_BYTES / (rb * PR) > 1 ? CHUNK_BYTES / (rb * PR) : 1;  /* groups a chunk */
    if (threads < 1) threads = 1;
    for (int64_t g0 = 0; g0 < groups; g0 += step) {
        const int64_t g1 = g0 + step < groups ? g0 + step : groups;
        const int64_t r0 = g0 * PR, r1 = g1 * PR < n_out ? g1 * PR : n_out;
#if defined(__linux__)
        advise_src(w + r0 * rb, (r1 - r0) * rb, MADV_POPULATE_READ);
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t g = g0; g < g1; g++) {
            uint8_t* grp = out + g * gb;
            const int rows = n_out - g * PR < PR ? (int)(n_out - g * PR) : PR;
            if (rows < PR || nb % 2) memset(grp, 0, (size_t)gb);  /* padding */
            for (int r = 0; r < rows; r++) pack_row(type, w + (g * PR + r) * rb, r, nb, grp);
        }
#if defined(__linux__)
        if (drop) advise_src(w + r0 * rb, (r1 - r0) * rb, MADV_DONTNEED);
#endif
    }
    return 0;
}

/* w [n_out rows, rb bytes apart] in the file's layout -> out (kq_pack_bytes bytes; 64-byte aligned for speed).
   0 done; -1 no packed layout here or bad arguments. */
int kq_pack(int type, const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, uint8_t* out, int threads) {
    return pack_rows(type, w, rb, n_out, n, out, threads, 0);
}

/* The same for w inside a private file mapping never written (a GGUF's tensor): the process's pages of each chunk
   are let go once it is packed (read again from the file if the weight is). Never for memory of the heap or an
   anonymous mapping, whose pages would come back as zeros. */
int kq_pack_mapped(int type, const uint8_t* w, int64_t rb, int64_t n_out, int64_t n, uint8_t* out, int threads) {
    return pack_rows(type, w, rb, n_out, n, out, threads, 1);
}

/* row o of a packed weight back in the file's bytes (tests; a weight's rows read back). 0 done, -1 bad. */
int kq_unpack_row(int type, const uint8_t* p, int64_t n_out, int64_t n, int64_t o, uint8_t* row) {
    if (kq_pack_bytes(type, n_out, n) == 0 || o < 0 || o >= n_out) return -1;
    const int64_t nb = n / (kq_act_kind(type) == 1 ? QKK : QK);
    uint8_t* grp = (uint8_t*)p + (o / PR) * kq_x16_group_bytes(type, n);
    const int r = (int)(o % PR);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* M = block_meta(type, grp, b);
        const uint8_t* Q = block_quants(type, grp, b);
        switch (type) {
        case KQ_Q4_0: case KQ_NF4: {
            blk_q4_0* x = (blk_q4_0*)row + b;
            memcpy(&x->d, M + 2 * r, 2);
            for (int c = 0; c < 4; c++) memcpy(x->qs + 4 * c, Q + 64 * c + 4 * r, 4);
            break;
        }
        case KQ_Q8_0: {
            blk_q8_0* x = (blk_q8_0*)row + b;
            memcpy(&x->d, M + 2 * r, 2);
            for (int i = 0; i < 32; i++) x->qs[i] = (int8_t)(Q[64 * (i / 4) + 4 * r + i % 4] ^ 0x80);
            break;
        }
        case KQ_Q4_K: {
            blk_q4_K* x = (blk_q4_K*)row + b;
            memcpy(&x->d, M + 2 * r, 2);
            memcpy(&x->dmin, M + 32 + 2 * r, 2);
            uint8_t sc[8], mn[8];
            for (int j = 0; j < 8; j++) { sc[j] = M[64 + 16 * j + r]; mn[j] = M[192 + 32 * (j / 2) + 2 * r + (j & 1)]; }
            for (int j = 0; j < 4; j++) {  /* ggml's twelve bytes for eight 6-bit scales and mins */
                x->scales[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
                x->scales[j + 4] = (uint8_t)(mn[j] | (mn[j + 4] >> 4) << 6);
                x->scales[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | (mn[j + 4] & 0xF) << 4);
            }
            for (int c = 0; c < 32; c++) memcpy(x->qs + 32 * (c / 8) + 4 * (c % 8), Q + 64 * c + 4 * r, 4);
            break;
        }
        case KQ_Q6_K: {
            blk_q6_K* x = (blk_q6_K*)row + b;
            memcpy(&x->d, M + 2 * r, 2);
            for (int g = 0; g < 16; g++) x->scales[g] = (int8_t)M[32 + 16 * g + r];
            for (int t = 0; t < 16; t++) {
                const int h = t / 8, l = t % 8;
                memcpy(x->ql + 64 * h + 4 * l, Q + 192 * t + 4 * r, 4);
                memcpy(x->ql + 64 * h + 32 + 4 * l, Q + 192 * t + 64 + 4 * r, 4);
                memcpy(x->qh + 32 * h + 4 * l, Q + 192 * t + 128 + 4 * r, 4);
            }
            break;
        }
        default:
            return -1;
        }
    }
    return 0;
}
