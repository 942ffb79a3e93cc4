"""``--quantize nf4`` on a CPU: bitsandbytes' 4-bit quantization (``bitsandbytes::quantize_4bit``) computed by C
(``kq_quantize_4bit`` in engine/quant/csrc/kq_quantize.c, built with the GGUF block kernels) instead of its torch
code, bit for bit the same blocks and scales; then each 4-bit linear multiplied by the block kernels (``to_blocks``).

The product (``to_blocks``): each ``Linear4bit`` becomes a ``BlockLinear`` of the kernels' NF4 type
(``engine.quant.formats.NF4``): the same codes regrouped in 32-blocks as Q4_0 lays them out, the scale absmax / 127
in half precision, the codebook times 127 rounded to int8 (at most 0.5 / 127 of the block's absmax off NF4's float
levels), multiplied on the integer road as a Q4_0 GGUF is (8-bit activation blocks, one vpshufb for the table,
vpdpbusd; repacked sixteen rows a group on AVX-512 VNNI, the rows' copy let go). 1B shape, one thread: 0.17 ms for an
8192x2048 row against bitsandbytes' AVX512-BF16 kernel's 0.69. ``KVSCOPE_NF4=bitsandbytes`` keeps bitsandbytes'
module and kernel (``cpu_layout``).

Why: bitsandbytes has no CPU kernel of its own for this op; its default, torch's ``bucketize`` over every weight,
took 97 s of a 1B model's 143 s load (Llama-3.2-1B shape, one thread, 2026-12-06) and held the float copy, its
absolute values and the scaled copy at once (+231 MB over the kept weights at the peak). The stored bytes and the
product are bitsandbytes' (its AVX512-BF16 4-bit kernel reads them: 0.69 ms for an 8192x2048 row).

The kernel is registered for the op's CPU dispatch key (torch's public ``register_kernel``) once, where the block
kernels' library is there and bitsandbytes has no CPU kernel of its own for the op; float32 and bfloat16 weights
in byte storage; anything else goes to bitsandbytes' own code.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

log = logging.getLogger(__name__)
OP = "bitsandbytes::quantize_4bit"
ENV = "KVSCOPE_NF4"  # "bitsandbytes": keep its Linear4bit and CPU kernel
_state = {"installed": False}


def _library():
    from engine.quant import kernel

    lib = kernel.library()
    if lib is None:
        return None
    fn = lib.kq_quantize_4bit
    if fn.argtypes is None:  # declared once, here: the library is the block kernels' (engine.quant.kernel)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int]  # x n blocksize bounds packed absmax threads
        lib.kq_quantize_4bit_bf16.restype = ctypes.c_int
        lib.kq_quantize_4bit_bf16.argtypes = fn.argtypes  # the same, x bfloat16
        lib.kq_nf4_cpu_layout.restype = ctypes.c_int
        lib.kq_nf4_cpu_layout.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.kq_nf4_blocks.restype = ctypes.c_int
        lib.kq_nf4_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int]  # codes absmax blocksize n_out n_in out threads
    return lib


# bitsandbytes' NF4 codebook (its ``get_4bit_type("nf4")``), sorted: the quantizer's bounds are its midpoints
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


@functools.cache
def _bounds(quant_type: str) -> torch.Tensor:
    """The codebook's 15 midpoints as bitsandbytes computes them (float32), for the codes' order NF4 has. NF4's
    from its codebook here (a folder's mapped load never imports bitsandbytes: ~1.5 s and a warning of its own)."""
    if quant_type == "nf4":
        code = torch.tensor(NF4_CODE, dtype=torch.float32)
        return ((code[:-1] + code[1:]) / 2).contiguous()  # bitsandbytes' arithmetic: float32 sums halved
    from bitsandbytes.backends.default.ops import _get_4bit_quantize_bounds

    bounds, _ = _get_4bit_quantize_bounds(quant_type, torch.device("cpu"))
    return bounds.to(torch.float32).contiguous()


def quantize_4bit(a: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype):
    """(packed codes [ceil(n / 2), 1] uint8, absmax [blocks] float32) of ``a`` as bitsandbytes' own kernel returns
    them (``nf4`` into uint8; other requests to bitsandbytes' code)."""
    lib = _library()
    if lib is None or quant_type != "nf4" or quant_storage != torch.uint8 or a.device.type != "cpu" or blocksize % 2:
        return _default(a, blocksize, quant_type, quant_storage)
    x = a.reshape(-1)
    n = x.numel()
    fn = lib.kq_quantize_4bit
    if x.dtype == torch.bfloat16 and n % blocksize == 0 and blocksize <= 4096:
        fn = lib.kq_quantize_4bit_bf16  # widened block by block in C: no float32 copy of the weight
    elif x.dtype != torch.float32:
        x = x.float()
    x = x.contiguous()
    packed = torch.empty((n + 1) // 2, 1, dtype=torch.uint8)  # [ceil(n / 2), 1]
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)  # [blocks]
    if fn(x.data_ptr(), n, blocksize, _bounds(quant_type).data_ptr(), packed.data_ptr(), absmax.data_ptr(),
          torch.get_num_threads()) != 0:
        raise ValueError(f"4-bit blocks of {blocksize}: not an even block size")
    return packed, absmax


def _default(a, blocksize, quant_type, quant_storage):
    """bitsandbytes' own torch code for the op (its "default" kernel), for the requests the C code leaves."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return torch.ops.bitsandbytes.quantize_4bit.default.redispatch(keys, a, blocksize, quant_type, quant_storage)


def install() -> bool:
    """Register ``quantize_4bit`` as the CPU kernel of bitsandbytes' op (once; False where it is not: no block
    kernels, or bitsandbytes has a CPU kernel of its own)."""
    if _state["installed"]:
        return True
    try:
        import bitsandbytes  # noqa: F401 - defines the op
        from bitsandbytes.backends.default import ops  # noqa: F401 - registers its default kernels
    except ImportError:
        return False
    # (torch has no public question for "does this op have a CPU kernel already": bitsandbytes' own, where a
    # version brings one, must stay the one that runs)
    if _library() is None or torch._C._dispatch_has_kernel_for_dispatch_key(OP, "CPU"):
        return False
    try:
        torch.library.register_kernel(OP, "cpu", quantize_4bit)
    except RuntimeError:  # bitsandbytes has a CPU kernel of its own for it: that one runs
        return False
    _state["installed"] = True
    log.info("bitsandbytes' 4-bit quantization on the CPU: kq_quantize_4bit (C)")
    return True


# the bitsandbytes releases whose CPU layout ``cpu_layout`` makes (tests/engine/test_quant.py compares it with theirs)
LAYOUT_VERSIONS = ("0.50.",)


def cpu_layout(model) -> int:
    """Put the model's 4-bit linears that bitsandbytes' AVX512-BF16 CPU kernel multiplies in that kernel's layout now,
    by C (``kq_nf4_cpu_layout``), with the state its ``_convert_weight_packed_for_cpu`` leaves: bitsandbytes makes it
    in torch at each layer's first forward (a 1B model: 5.4 s of a 14.5 s load, in the loader's test run). The same
    bytes and state as bitsandbytes' (tested); left to it on other releases. Returns how many were laid out."""
    try:
        import bitsandbytes
        from bitsandbytes.functional import dequantize_blockwise
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    lib = _library()
    if lib is None or not bitsandbytes.__version__.startswith(LAYOUT_VERSIONS):
        return 0
    done = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        qs = getattr(w, "quant_state", None)
        if (not isinstance(mod, Linear4bit) or qs is None or w.device.type != "cpu" or mod.training
                or not getattr(mod, "support_avx512bf16_for_cpu", False) or getattr(qs, "packing_format_for_cpu", False)
                or len(qs.shape) != 2 or qs.shape[0] % 32 or qs.shape[1] % qs.blocksize or qs.blocksize % 2):
            continue
        q = (w.data if w.data.dtype == torch.uint8 else w.data.view(torch.uint8)).contiguous()  # kept for the call
        if w.data.dtype != torch.uint8:
            qs.original_storage_type = w.data.dtype
        n_out, n_in = int(qs.shape[0]), int(qs.shape[1])
        if q.numel() != n_out * n_in // 2:  # codes not of its shape: left to bitsandbytes (never read past them)
            continue
        out = torch.empty(n_out, n_in // 2, dtype=torch.uint8)  # [N, K/2] in the kernel's order
        if lib.kq_nf4_cpu_layout(q.data_ptr(), n_out, n_in, out.data_ptr()) != 0:
            continue
        qs.original_dtype, qs.original_nested, qs.original_qshape = qs.dtype, qs.nested, q.shape
        if qs.nested:
            absmax = dequantize_blockwise(qs.absmax, qs.state2)
            absmax += qs.offset
            qs.absmax, qs.nested = absmax.float(), False
            delattr(qs, "state2")
        qs.absmax = qs.absmax.reshape(n_out, n_in // qs.blocksize).T.to(torch.bfloat16).contiguous()  # [K/bs, N]
        qs.dtype, qs.packing_format_for_cpu = torch.bfloat16, True
        w.data = out
        done += 1
    return done


def available(device: str) -> bool:
    """Does ``--quantize nf4`` multiply by the block kernels here (a CPU with them, not turned off by
    ``KVSCOPE_NF4=bitsandbytes``)?"""
    if device != "cpu" or os.environ.get(ENV, "").strip().lower() in ("bitsandbytes", "bnb"):
        return False
    return _library() is not None


def _absmax(qs) -> torch.Tensor:
    """The float32 scale of each of bitsandbytes' blocks (its double-quantized scales dequantized)."""
    if getattr(qs, "nested", False):
        from bitsandbytes.functional import dequantize_blockwise

        return (dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).float().contiguous()
    return qs.absmax.float().contiguous()


def blocks_of(mod, lib=None) -> torch.Tensor | None:
    """A CPU ``Linear4bit``'s NF4 codes and scales as the block kernels' NF4 rows [out, in / 32 * 18] uint8
    (``kq_nf4_blocks``), or None where they cannot be: not NF4, inputs no multiple of 32, bitsandbytes' blocks no
    multiple of 32, its CPU layout made already, codes not of the weight's shape (never read past them)."""
    lib = lib or _library()
    w = getattr(mod, "weight", None)
    qs = getattr(w, "quant_state", None)
    if (lib is None or qs is None or w.device.type != "cpu" or getattr(qs, "quant_type", "") != "nf4"
            or getattr(qs, "packing_format_for_cpu", False) or len(qs.shape) != 2 or qs.blocksize % 32):
        return None
    n_out, n_in = int(qs.shape[0]), int(qs.shape[1])
    q = (w.data if w.data.dtype == torch.uint8 else w.data.view(torch.uint8)).contiguous()  # kept for the call
    absmax = _absmax(qs)
    if n_in % 32 or q.numel() != n_out * n_in // 2 or absmax.numel() * qs.blocksize < n_out * n_in:
        return None
    out = torch.empty(n_out, n_in // 32 * 18, dtype=torch.uint8)  # [out, row_bytes]
    if lib.kq_nf4_blocks(q.data_ptr(), absmax.data_ptr(), qs.blocksize, n_out, n_in, out.data_ptr(),
                         torch.get_num_threads()) != 0:
        return None
    return out


def to_blocks(model) -> int:
    """Replace the model's CPU ``Linear4bit`` modules by ``BlockLinear`` modules of the kernels' NF4 type (bias
    kept), each repacked for the integer road and holding that copy only (``hold_packed_only``); bitsandbytes'
    buffers go with the module they belonged to, one linear at a time (the load's peak: one linear's bytes more).
    Those ``blocks_of`` refuses stay bitsandbytes'. Returns how many were replaced."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    from engine.quant import formats
    from engine.quant.modules import BlockLinear

    done = 0
    # by name: a list of the modules would hold every replaced one (and its buffers) until the end
    for name in [n for n, m in model.named_modules() if isinstance(m, Linear4bit)]:
        mod = model.get_submodule(name)
        rows = blocks_of(mod)
        if rows is None:
            continue
        bias = mod.bias.detach() if mod.bias is not None else None
        new = BlockLinear(rows, formats.NF4, mod.in_features, bias)
        new.hold_packed_only()
        model.set_submodule(name, new)
        mod._parameters.clear()  # its Params4bit points back at it (.module): freed now, not at a collection
        del mod, rows
        done += 1
    if done:
        log.info("--quantize nf4: %d linears multiplied by the block kernels", done)
    return done
