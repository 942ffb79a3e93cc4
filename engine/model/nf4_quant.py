"""``--quantize nf4`` on a CPU: bitsandbytes' 4-bit quantization (``bitsandbytes::quantize_4bit``) computed by C
(``kq_quantize_4bit`` in engine/quant/csrc/kq_quantize.c, built with the GGUF block kernels) instead of its torch
code, bit for bit the same blocks and scales.

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

import torch

log = logging.getLogger(__name__)
OP = "bitsandbytes::quantize_4bit"
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
        lib.kq_nf4_cpu_layout.restype = ctypes.c_int
        lib.kq_nf4_cpu_layout.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


@functools.cache
def _bounds(quant_type: str) -> torch.Tensor:
    """The codebook's 15 midpoints as bitsandbytes computes them (float32), for the codes' order NF4 has."""
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
    x = x.float() if x.dtype != torch.float32 else x
    x = x.contiguous()
    n = x.numel()
    packed = torch.empty((n + 1) // 2, 1, dtype=torch.uint8)  # [ceil(n / 2), 1]
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)  # [blocks]
    if lib.kq_quantize_4bit(x.data_ptr(), n, blocksize, _bounds(quant_type).data_ptr(), packed.data_ptr(),
                            absmax.data_ptr(), torch.get_num_threads()) != 0:
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
