"""A native product for the blocked linears (``engine.model.packed_linear``): any number of rows.

The blocked layout holds sixteen outputs' weights side by side for each input (``[out/16, in, 16]``). torch
multiplies rows by it as one small matrix product per block (``bmm``): MKL's per-block overhead makes four rows
cost 2.5x one, and its bfloat16 ``bmm`` reads 5 GB/s. The kernel (``engine/native/csrc/blocked_linear.c``, its
measurements there) goes block by block, each block's weights read from memory once for all rows. On one torch
thread Python calls the library straight; on several, the operator's C++ kernel (``engine.model.linear_op``, loaded
in the background) shares the blocks among them (``PARALLEL``) — until then float32 goes to MKL's ``bmm`` and
bfloat16 runs here on one thread. A compiled step calls it as the operator ``kvscope::blocked_linear`` (below). Built
by the engine's one build path (``engine.native.build``: prebuilt for this CPU, else compiled at first use); without
it the torch path runs. Results differ from torch's only in summation order.

Float32 rows may meet bfloat16 weights (``float_product``: a BF16 GGUF's linears in float32 compute), the outputs
float32: the weights widened in registers, or the rows rounded to bfloat16 once and multiplied by pairs where the
GGUF road rounds them so (``rounded``).
"""

from __future__ import annotations

import ctypes

import torch

from engine.native.build import Native
from engine.native.libraries import LINEAR as LIBRARY

BLOCK = 16
# Set once ``engine.model.linear_op`` has loaded the operator's C++ kernel: it shares a product's blocks among
# torch's threads, so ``product`` calls it on several threads (on one, the library straight: no dispatch).
PARALLEL = False
# ``engine.model.linear_op``'s ctypes entry sharing a float32-rows product's blocks among torch's threads (None: not
# loaded, or a library prebuilt without it: one thread)
PARALLEL_XH = None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for fn in (lib.kvs_blocked_mm, lib.kvs_blocked_mm_h):
        fn.restype = i
        fn.argtypes = [i, i, i64, i64, p, p, p, p, i64]  # rows n_in b0 b1 x wb bias y ldy
    if hasattr(lib, "kvs_blocked_mm_xh"):  # (a library prebuilt before it has no float32-rows product)
        lib.kvs_blocked_mm_xh.restype = i
        lib.kvs_blocked_mm_xh.argtypes = [i, i, i64, i64, p, p, p, p, p, i64]  # rows n_in b0 b1 xf xb wb bias y ldy
    lib.kvs_bf16_pairs.restype = i
    lib.kvs_bf16_pairs.argtypes = []
    if hasattr(lib, "kvs_argmax"):  # (a library prebuilt before it has no greedy pick)
        lib.kvs_argmax.restype = i64
        lib.kvs_argmax.argtypes = [p, i64, p]  # x n &top
    lib.kvs_block16.restype = i
    lib.kvs_block16.argtypes = [p, i64, i64, i64, i, p]  # src rows cols ld elem dst
    return lib


LINEAR = Native(LIBRARY, _declare)


DTYPES = (torch.float32, torch.bfloat16)


def block_into(w: torch.Tensor, out: torch.Tensor) -> bool:
    """Write w [rows, in] (rows a multiple of 16, rows contiguous) blocked into out [rows/16, in, 16] (contiguous,
    same dtype) by the library (~4x torch's transposing copy). False where it cannot: the caller copies."""
    lib = LINEAR.library()
    if (lib is None or w.device.type != "cpu" or w.dtype not in DTYPES or out.dtype != w.dtype or w.dim() != 2
            or w.stride(1) != 1 or not out.is_contiguous() or tuple(out.shape) != (w.shape[0] // 16, w.shape[1], 16)):
        return False
    return lib.kvs_block16(w.data_ptr(), w.shape[0], w.shape[1], w.stride(0), w.element_size(), out.data_ptr()) == 0


def usable(x2: torch.Tensor, wb: torch.Tensor) -> bool:
    """Can ``product`` take these (float32 or bfloat16 weights on the CPU, rows of their dtype or float32 rows with
    bfloat16 weights, one row or more, float32 weights on one torch thread, eager: not inside a trace)?"""
    mixed = x2.dtype == torch.float32 and wb.dtype == torch.bfloat16  # ``float_product``'s pair
    return (not torch.compiler.is_compiling() and not torch.compiler.is_exporting()  # first: no guard on rows
            and type(x2) is torch.Tensor  # not a tracer's fake: no data to read
            and x2.shape[0] >= 1 and wb.dtype in DTYPES and (x2.dtype == wb.dtype or (mixed and takes_float()))
            # float32 on several threads only when the operator's C++ kernel shares the blocks among them
            # (``PARALLEL``), else MKL's bmm does; bfloat16 always (torch's per-block bfloat16 product reads 5 GB/s)
            and (torch.get_num_threads() == 1 or PARALLEL or wb.dtype == torch.bfloat16)
            and x2.device.type == "cpu" and LINEAR.library() is not None)


def product(x2: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [rows, in] times blocked wb [out/16, in, 16] (+ bias [out]) -> [rows, out] in their dtype (``usable``
    first; float32 rows and bfloat16 weights: ``float_product``, float32). bfloat16's sums are float32 (by pairs of inputs where the CPU has AVX512_BF16, ``bf16_pairs``, else
    widened in registers), rounded once at the end. Nothing else
    runs around the call (a decode step makes 121 of them: each microsecond here is 0.1 ms a token)."""
    if x2.dtype != wb.dtype:
        return float_product(x2, wb, bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows, n_in = x2.shape
    if PARALLEL and torch.get_num_threads() > 1:
        return torch.ops.kvscope.blocked_linear(x2, wb, bias)  # the C++ kernel: the blocks shared among threads
    nb = wb.shape[0]
    y = torch.empty(rows, nb * BLOCK, dtype=x2.dtype)  # [rows, out]
    b = bias.to(x2.dtype).contiguous() if bias is not None else None
    lib = LINEAR.library()
    fn = lib.kvs_blocked_mm if wb.dtype == torch.float32 else lib.kvs_blocked_mm_h
    fn(rows, n_in, 0, nb, x2.data_ptr(), wb.data_ptr(), b.data_ptr() if b is not None else None, y.data_ptr(),
       nb * BLOCK)
    return y


def argmax(logits: torch.Tensor) -> tuple[int, float] | None:
    """(the first index of the largest, the largest) of ``logits`` [vocab] float32 on the CPU, contiguous: torch's
    ``argmax`` and ``max`` in one pass (argmax.c; NaN anywhere: the first NaN's index and NaN). None where the library
    cannot: the caller asks torch."""
    lib = LINEAR.library()
    if (lib is None or not hasattr(lib, "kvs_argmax") or logits.dtype != torch.float32 or logits.dim() != 1
            or logits.device.type != "cpu" or not logits.is_contiguous() or type(logits) is not torch.Tensor):
        return None
    top = ctypes.c_float()
    i = lib.kvs_argmax(logits.data_ptr(), logits.shape[0], ctypes.byref(top))
    return (int(i), top.value) if i >= 0 else None


def takes_float() -> bool:
    """Has the library the float32-rows product (``float_product``; not in one prebuilt before it)?"""
    lib = LINEAR.library()
    return lib is not None and hasattr(lib, "kvs_blocked_mm_xh")


def float_product(x2: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None, rounded: bool = False
                  ) -> torch.Tensor:
    """x2 [rows, in] float32 times blocked bfloat16 wb [out/16, in, 16] (+ float32 bias [out]) -> [rows, out]
    float32 (``takes_float`` first): the weights widened in registers, the sums float32 (the float32 model the gguf
    package dequantizes, in another order); ``rounded``: the rows rounded to bfloat16 first (to nearest even, once a
    call) and multiplied by pairs where the CPU has AVX512_BF16 (a BF16 GGUF's default road there: twice the
    products a cycle for a prompt's rows). On several threads the blocks are shared among them (``PARALLEL_XH``)."""
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows, nb = x2.shape[0], wb.shape[0]
    y = torch.empty(rows, nb * BLOCK, dtype=torch.float32)  # [rows, out]
    xb = x2.to(torch.bfloat16) if rounded else None  # [rows, in]
    b = bias.to(torch.float32).contiguous() if bias is not None else None
    args = (x2.data_ptr(), xb.data_ptr() if xb is not None else None, wb.data_ptr(),
            b.data_ptr() if b is not None else None, y.data_ptr(), nb * BLOCK)
    if PARALLEL_XH is not None and torch.get_num_threads() > 1:
        rc = PARALLEL_XH(rows, x2.shape[1], nb, *args)
    else:
        rc = LINEAR.library().kvs_blocked_mm_xh(rows, x2.shape[1], 0, nb, *args)
    if rc != 0:
        raise RuntimeError("the blocked product refused its arguments")
    return y


def blocked_product(x2: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [rows, in] times blocked wb (+ bias) -> [rows, out]: the native product where it can run (``usable``),
    torch's otherwise."""
    return product(x2, wb, bias) if usable(x2, wb) else torch_product(x2, wb, bias)


def bf16_pairs() -> bool:
    """Does the native product sum bfloat16 by pairs of inputs (AVX512_BF16: twice the products a cycle, so it
    beats oneDNN at every row count here, where the widened product loses to it beyond ~16 rows)?"""
    lib = LINEAR.library()
    if lib is None:
        return False
    if _PAIRS.get(id(lib)) is None:  # asked per linear call: the library's answer is kept
        _PAIRS[id(lib)] = bool(lib.kvs_bf16_pairs())
    return _PAIRS[id(lib)]


_PAIRS: dict[int, bool] = {}


def torch_product(x2: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same with torch's ops: one small matrix product per block (MKL's ``bmm``)."""
    rows = x2.shape[0]
    y = torch.matmul(x2, wb.to(x2.dtype)).transpose(0, 1).reshape(rows, -1)  # [out/B, rows, B] -> [rows, out]
    return y + bias if bias is not None else y


# -- in a compiled step -------------------------------------------------------------------------------------
# A compiled step (``engine.model.aot_build``) cannot call ctypes, but it can call an operator registered with
# torch: AOTInductor's package calls it through torch's dispatcher (~10 us a call here, ~1.2 ms for the 121
# linears of a SmolLM2-shape step). ``IN_GRAPH`` says whether a package being built calls it (the parent's
# ``in_graph()`` at the time it asked, part of the package's key): the child sets it from the job.
IN_GRAPH = False


def in_graph() -> bool:
    """Will a compiled step built now call the native product for its blocked linears?"""
    return LINEAR.library() is not None


@torch.library.custom_op("kvscope::blocked_linear", mutates_args=())
def blocked_linear(x2: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``blocked_product`` as an operator a compiled step's package calls (the package is the same whether the
    native product or torch's runs inside)."""
    return blocked_product(x2, wb, bias)


@blocked_linear.register_fake
def _(x2, wb, bias):
    return x2.new_empty(x2.shape[0], wb.shape[0] * wb.shape[2])  # [rows, out]
