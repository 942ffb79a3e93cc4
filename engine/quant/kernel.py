"""The GGUF block kernels from Python: products of float32 activations with weights kept as the file stores them,
embedding rows dequantized as they are looked up, whole tensors dequantized (tests, the fallback).

Weights are uint8 tensors ``[rows, row_bytes]`` (transformers' ``GgufLinear`` layout: one GGUF row of blocks per
output), usually views of the memory-mapped file. Every call checks the shapes against the type before the C code
reads a byte (``check_rows``): a tensor shorter than its rows need is refused, never read past.

Roads (``ROADS``): ``int8`` quantizes each activation row to 8-bit blocks and multiplies integers (llama.cpp's
numerics and speed; the default), ``float`` dequantizes each weight row to float32 (the model the gguf package
dequantizes, up to summation order). ``KVSCOPE_GGUF_ROAD=float`` makes float the default.

Packed weights (``pack``): on AVX-512 VNNI the integer road multiplies Q4_0, Q8_0, Q4_K and Q6_K weights repacked
sixteen rows a group (kq_pack.c: one load is four quants of sixteen rows, the rows' sums stay in the vector's lanes,
llama.cpp's repacked buffers for 512-bit vectors): ~1.5-2x the row products on the 1B shape, the same sums.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from engine.native.build import Native
from engine.native.libraries import KQ
from engine.quant import formats

ROADS = ("int8", "float")


class Weight(ctypes.Structure):
    """``kq_weight`` of kq_matmul.c: a linear's weight and what goes with it, made once per linear (``weight``)."""

    _fields_ = [("type", ctypes.c_int32), ("road", ctypes.c_int32), ("w", ctypes.c_void_p), ("rb", ctypes.c_int64),
                ("n_out", ctypes.c_int64), ("n", ctypes.c_int64), ("bias", ctypes.c_void_p), ("map", ctypes.c_void_p),
                ("packed", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kq_linear.restype = i
    lib.kq_linear.argtypes = [p, p, i64, p, i]  # &weight x m y threads
    lib.kq_matmul.restype = i
    # type w rb n_out n x m ldx y ldy bias map road threads
    lib.kq_matmul.argtypes = [i, p, i64, i64, i64, p, i64, i64, p, i64, p, p, i, i]
    lib.kq_get_rows.restype = i
    lib.kq_get_rows.argtypes = [i, p, i64, i64, i64, p, i64, p]  # type w rb n_rows n ids count out
    lib.kq_dequant.restype = i
    lib.kq_dequant.argtypes = [i, p, i64, i64, i64, i64, p]  # type w rb r0 r1 n out
    lib.kq_row_bytes_of.restype = i64
    lib.kq_row_bytes_of.argtypes = [i, i64]
    lib.kq_pack_bytes.restype = i64
    lib.kq_pack_bytes.argtypes = [i, i64, i64]  # type n_out n
    lib.kq_pack.restype = i
    lib.kq_pack.argtypes = [i, p, i64, i64, i64, p, i]  # type w rb n_out n out threads
    lib.kq_pack_mapped.restype = i
    lib.kq_pack_mapped.argtypes = [i, p, i64, i64, i64, p, i]  # type w rb n_out n out threads
    lib.kq_packed_matmul.restype = i
    # type packed n_out n x m ldx y ldy bias map threads
    lib.kq_packed_matmul.argtypes = [i, p, i64, i64, p, i64, i64, p, i64, p, p, i]
    lib.kq_unpack_row.restype = i
    lib.kq_unpack_row.argtypes = [i, p, i64, i64, i64, p]  # type packed n_out n o row
    lib.kq_gemm_float_pairs.restype = i
    lib.kq_gemm_float_pairs.argtypes = [i, i]
    lib.kq_isa_name.restype = ctypes.c_char_p
    lib.kq_isa_name.argtypes = []
    return lib


KERNELS = Native(KQ, _declare)  # engine/quant/csrc/*.c, built and found by the engine's one build path


def library() -> ctypes.CDLL | None:
    """The loaded kernels (None where there are none: ``why()``)."""
    return KERNELS.library()


def why() -> str | None:
    return KERNELS.why()


def isa() -> str:
    """The instruction set the integer products were built for ('' without the library)."""
    lib = library()
    return lib.kq_isa_name().decode() if lib is not None else ""


def packs(ggml_type: int = 12) -> bool:
    """Does this build hold the integer road's weights of ``ggml_type`` (Q4_K by default) packed (AVX-512 VNNI:
    Q4_0, Q8_0, Q4_K, Q6_K, NF4; AVX2 the same), so that ``pack`` gives a packed copy?"""
    lib = library()
    return lib is not None and ggml_type in formats.PACKED_STEPS and \
        lib.kq_pack_bytes(ggml_type, 16, formats.PACKED_STEPS[ggml_type][0]) > 0


def default_road() -> str:
    road = os.environ.get("KVSCOPE_GGUF_ROAD", "int8").strip().lower()
    return road if road in ROADS else "int8"


def check_rows(w: torch.Tensor, ggml_type: int, n_in: int) -> int:
    """Refuse a weight ``w`` that is not ``[rows, row_bytes]`` uint8 of ``ggml_type`` for ``n_in`` inputs, contiguous
    in its rows, on the CPU; returns the row stride in bytes."""
    need = formats.row_bytes(ggml_type, n_in)
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != need or w.stride(1) != 1 or w.device.type != "cpu":
        raise ValueError(f"{formats.name(ggml_type)} weight: expected uint8 [rows, {need}] on the CPU for {n_in} "
                         f"inputs, got {w.dtype} {tuple(w.shape)} on {w.device.type}")
    return int(w.stride(0))


def pack(w: torch.Tensor, ggml_type: int, n_in: int, threads: int | None = None,
         mapped: bool = False) -> torch.Tensor | None:
    """The weight w [rows, row_bytes] repacked sixteen rows a group for the integer road's product (uint8 in memory
    of its own, the file's bytes rearranged: Q4_K +2.8%, Q6_K +1%), or None where this build or type has no packed
    product (the row products read ``w`` as it is). ``mapped``: ``w`` lies in a private file mapping never written,
    whose pages are let go ~16 MiB at a time as they are packed (they would come back as zeros from any other
    memory)."""
    lib = library()
    if lib is None:
        return None
    rb = check_rows(w, ggml_type, n_in)
    nbytes = int(lib.kq_pack_bytes(ggml_type, w.shape[0], n_in))
    if nbytes <= 0:
        return None
    # a mapping of its own, not the heap: packed at a first reply's prefill, the weights landed between the
    # activations' freed chunks and kept the heap from shrinking (+23 MB anonymous memory, 1B-shape Q4_K_M); pages
    # are aligned, so every step of a group starts on a 64-byte line
    out = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    fn = lib.kq_pack_mapped if mapped else lib.kq_pack
    if fn(ggml_type, w.data_ptr(), rb, w.shape[0], n_in, out.data_ptr(), threads or torch.get_num_threads()):
        raise ValueError(f"{formats.name(ggml_type)} weight: cannot be packed")
    return out


def unpack(packed: torch.Tensor, ggml_type: int, n_out: int, n_in: int) -> torch.Tensor:
    """A packed weight (``pack``'s) back in the file's layout, [n_out, row_bytes] uint8."""
    lib = library()
    if lib is None or packed.numel() != lib.kq_pack_bytes(ggml_type, n_out, n_in) or not packed.is_contiguous():
        raise ValueError(f"{formats.name(ggml_type)}: not a packed weight of {n_out}x{n_in}")
    out = torch.empty(n_out, formats.row_bytes(ggml_type, n_in), dtype=torch.uint8)  # [n_out, row_bytes]
    for o in range(n_out):
        lib.kq_unpack_row(ggml_type, packed.data_ptr(), n_out, n_in, o, out[o].data_ptr())
    return out


def weight(w: torch.Tensor, ggml_type: int, n_in: int, bias: torch.Tensor | None, out_map: torch.Tensor | None,
           road: str, packed: torch.Tensor | None = None) -> Weight:
    """The descriptor ``linear`` takes, checked once (the caller keeps ``w``, ``bias``, ``out_map`` and ``packed``
    alive: the descriptor holds their addresses). ``bias`` float32 contiguous, ``out_map`` int32, one per output;
    ``packed`` (``pack``'s) is multiplied instead of ``w`` on the integer road."""
    rb = check_rows(w, ggml_type, n_in)
    n_out = w.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != n_out):
        raise ValueError(f"bias: expected float32 [{n_out}] contiguous")
    if out_map is not None and (out_map.dtype != torch.int32 or not out_map.is_contiguous() or out_map.numel() != n_out
                                or sorted(out_map.tolist()) != list(range(n_out))):
        raise ValueError("out_map: expected an int32 permutation of the outputs")
    if packed is not None and packed.numel() != library().kq_pack_bytes(ggml_type, n_out, n_in):
        raise ValueError("packed: not this weight's packed bytes")
    return Weight(ggml_type, ROADS.index(road), w.data_ptr(), rb, n_out, n_in,
                  bias.data_ptr() if bias is not None else None, out_map.data_ptr() if out_map is not None else None,
                  packed.data_ptr() if packed is not None and road == "int8" else None)


def linear(desc: Weight, x2: torch.Tensor, threads: int) -> torch.Tensor:
    """x2 [m, n] float32 contiguous (the caller's duty: nothing is checked here but the return code) times the
    weight of ``desc`` -> [m, n_out] float32. The lean path a model's linears take (``BlockLinear``)."""
    m = x2.shape[0]
    y = torch.empty(m, desc.n_out, dtype=torch.float32)  # [m, n_out]
    if m and KERNELS.library().kq_linear(ctypes.addressof(desc), x2.data_ptr(), m, y.data_ptr(), threads) != 0:
        raise RuntimeError("the GGUF block product refused its arguments or ran out of memory")
    return y


def matmul(x2: torch.Tensor, w: torch.Tensor, ggml_type: int, n_in: int, bias: torch.Tensor | None = None,
           out_map: torch.Tensor | None = None, road: str | None = None, threads: int | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [m, n_in] float32 times the GGUF weight w [n_out, row_bytes] -> [m, n_out] float32 (``+ bias``; output
    row o written to column ``out_map[o]``); on the integer road ``packed`` (``pack(w)``) is multiplied instead."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"GGUF block kernels are not available ({why()})")
    rb = check_rows(w, ggml_type, n_in)
    if x2.dtype != torch.float32 or x2.dim() != 2 or x2.shape[1] != n_in:
        raise ValueError(f"activations: expected float32 [m, {n_in}], got {x2.dtype} {tuple(x2.shape)}")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n_out = x2.shape[0], w.shape[0]
    y = torch.empty(m, n_out, dtype=torch.float32)  # [m, n_out]
    if m == 0:
        return y
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != n_out):
        bias = bias.to(torch.float32).contiguous().reshape(-1)
    if out_map is not None and (out_map.dtype != torch.int32 or out_map.numel() != n_out):
        raise ValueError("out_map: expected int32 with one entry per output")
    road = road or default_road()
    bp, mp = bias.data_ptr() if bias is not None else None, out_map.data_ptr() if out_map is not None else None
    if packed is not None and road == "int8":
        if packed.numel() != lib.kq_pack_bytes(ggml_type, n_out, n_in):
            raise ValueError("packed: not this weight's packed bytes")
        rc = lib.kq_packed_matmul(ggml_type, packed.data_ptr(), n_out, n_in, x2.data_ptr(), m, x2.stride(0),
                                  y.data_ptr(), n_out, bp, mp, threads or torch.get_num_threads())
    else:
        rc = lib.kq_matmul(ggml_type, w.data_ptr(), rb, n_out, n_in, x2.data_ptr(), m, x2.stride(0), y.data_ptr(),
                           n_out, bp, mp, ROADS.index(road), threads or torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("the GGUF block product refused its arguments" if rc == -1 else "out of memory")
    return y


def get_rows(w: torch.Tensor, ggml_type: int, n: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the GGUF table w [rows, row_bytes] dequantized: [*ids.shape, n] float32. An id
    outside the table raises IndexError (nothing read)."""
    lib = library()
    rb = check_rows(w, ggml_type, n)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), n, dtype=torch.float32)  # [count, n]
    if flat.numel():
        if lib is None:
            raise RuntimeError(f"GGUF block kernels are not available ({why()})")
        if lib.kq_get_rows(ggml_type, w.data_ptr(), rb, w.shape[0], n, flat.data_ptr(), flat.numel(),
                           out.data_ptr()) != 0:
            raise IndexError(f"an id outside the table's {w.shape[0]} rows")
    return out.reshape(*ids.shape, n)


def dequantize(w: torch.Tensor, ggml_type: int, n: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The GGUF weight w [rows, row_bytes] (or its rows ``rows``) as float32 [rows, n]."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"GGUF block kernels are not available ({why()})")
    rb = check_rows(w, ggml_type, n)
    r0, r1 = rows or (0, w.shape[0])
    if not 0 <= r0 <= r1 <= w.shape[0]:
        raise IndexError(f"rows {r0}..{r1} outside 0..{w.shape[0]}")
    out = torch.empty(r1 - r0, n, dtype=torch.float32)  # [r1 - r0, n]
    lib.kq_dequant(ggml_type, w.data_ptr(), rb, r0, r1, n, out.data_ptr())
    return out
