"""A native product for the blocked linears (``engine.model.packed_linear``) at 2-8 rows: a batched decode step.

The blocked layout holds sixteen outputs' weights side by side for each input (``[out/16, in, 16]``). torch
multiplies several rows by it as one small matrix product per block (``bmm``), and MKL's per-block overhead makes
four rows cost 2.5x one: 46-61 ms for the SmolLM2 shape's linears at 4 rows against 22-38 ms at one (one thread,
this 2-core host). The kernel below keeps one sixteen-wide accumulator per row and streams each block's weights
once for every row: 20-29 ms at 2 and 4 rows, 31-35 at 8 (13-20 GB/s against torch's 5-9). One row stays on
torch (the compiled step's path, and as fast there), and so does a model torch runs on several threads (the
kernel runs on one; ``engine.model.threads`` gives the models of this size one on a 2-core machine). Built and
cached as the tq kernels are (``engine.kv.quantized.native``); without a compiler the torch path runs. Results
differ from torch's only in summation order.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kv.quantized.native import Native

MAX_ROWS = 8  # registers: eight accumulators and the weights' vector
BLOCK = 16

SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }

/* y[r, b*16 + j] = sum_i x[r, i] * wb[b, i, j] (+ bias[b*16 + j]), blocks b0 <= b < b1, R rows: each block's
   weights are read once for every row. x: [R, n_in] rows n_in apart; y: rows ldy apart. */
#define KVS_ROWS(R) \
    for (int64_t b = b0; b < b1; b++) { \
        const float* w = wb + b * (int64_t)n_in * 16; \
        v16 acc[R]; \
        for (int r = 0; r < R; r++) acc[r] = (v16){0}; \
        for (int i = 0; i < n_in; i++) { \
            v16 wv = ld(w + (int64_t)i * 16); \
            __builtin_prefetch(w + (int64_t)(i + 16) * 16); \
            for (int r = 0; r < R; r++) acc[r] += x[(int64_t)r * n_in + i] * wv; \
        } \
        for (int r = 0; r < R; r++) { \
            v16 o = acc[r]; \
            if (bias) o += ld(bias + b * 16); \
            memcpy(y + (int64_t)r * ldy + b * 16, &o, 64); \
        } \
    }

int kvs_blocked_mm(int rows, int n_in, int64_t b0, int64_t b1, const float* x, const float* wb, const float* bias,
                   float* y, int64_t ldy)
{
    switch (rows) {
    case 1: KVS_ROWS(1) break;
    case 2: KVS_ROWS(2) break;
    case 3: KVS_ROWS(3) break;
    case 4: KVS_ROWS(4) break;
    case 5: KVS_ROWS(5) break;
    case 6: KVS_ROWS(6) break;
    case 7: KVS_ROWS(7) break;
    case 8: KVS_ROWS(8) break;
    default: return -1;
    }
    return 0;
}
"""


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn = lib.kvs_blocked_mm
    fn.restype = i
    fn.argtypes = [i, i, i64, i64, p, p, p, p, i64]  # rows n_in b0 b1 x wb bias y ldy
    return lib


LINEAR = Native("linear", SOURCE, _declare, "the batched linears")


def usable(x2: torch.Tensor, wb: torch.Tensor) -> bool:
    """Can ``product`` take these (float32 on the CPU, 2..MAX_ROWS rows, torch on one thread, eager: not inside a
    trace)?"""
    return (not torch.compiler.is_compiling() and not torch.compiler.is_exporting()  # first: no guard on rows
            and type(x2) is torch.Tensor  # not a tracer's fake: no data to read
            and 2 <= x2.shape[0] <= MAX_ROWS and x2.dtype == torch.float32 and wb.dtype == torch.float32
            and torch.get_num_threads() == 1  # one thread: with more, MKL's bmm shares the blocks among them
            and x2.device.type == "cpu" and LINEAR.library() is not None)


def product(x2: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [rows, in] times blocked wb [out/16, in, 16] (+ bias [out]) -> [rows, out] (``usable`` first)."""
    x2 = x2.contiguous()
    wb = wb.contiguous()
    rows, n_in = x2.shape
    nb = wb.shape[0]
    y = torch.empty(rows, nb * BLOCK, dtype=torch.float32)  # [rows, out]
    b = bias.contiguous() if bias is not None else None
    LINEAR.library().kvs_blocked_mm(rows, n_in, 0, nb, x2.data_ptr(), wb.data_ptr(),
                                    b.data_ptr() if b is not None else None, y.data_ptr(), nb * BLOCK)
    return y
