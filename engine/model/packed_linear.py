"""The linears ``engine.model.prepack`` puts in a model: one weight, held in the layout its kernel reads fastest.

``onednn``  [out, in] reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``),
            multiplied by ``_linear_pointwise``: the fastest here for many rows (a server's batches, a prompt).
``blocked`` float32 or bfloat16 [out/16, in, 16]: sixteen outputs' weights side by side for each input, so a
            row's product streams the weights in order with one vector accumulator per sixteen outputs and no
            horizontal sums: the native product (``engine.model.linear_kernel``, any number of rows where it
            beats oneDNN, ``native_max_rows``; in a compiled step through the ``kvscope::blocked_linear``
            operator), else one small matrix product per block (``torch.matmul`` -> MKL). One row of the SmolLM2
            shape's linears: float32 19-21 ms native against 25-37 torch's and 32-35 oneDNN's; bfloat16 8 ms
            native by pairs (10-12 widened) against 16-18 oneDNN's (one thread, 2026-12-04; a ``sum`` reads
            25 GB/s here). Without the native product, prompts (rows > ``BLOCKED_MAX_ROWS``) restore the plain
            layout per call and use oneDNN.

A merged group (q/k/v, gate/up) is one of these whose output its members slice (``part``); the other members are
``MergedPart`` and hold no weight. In the compiled step's child the weights are plain or blocked throwaway ones:
``_linear_pointwise`` takes either layout, so the package's graph calls the same kernels on the parent's weights.
"""

from __future__ import annotations

import functools
import math
import mmap
import threading

import torch
from torch import nn

from engine.model import linear_kernel

BLOCK = 16  # outputs per block: one AVX-512 vector of float32
BLOCKED_MAX_ROWS = 64  # more rows than this (a prompt chunk): oneDNN on the plain layout restored for the call


# ... unless the native product takes them (all of the SmolLM2 shape's linears, one thread): float32 at any count
# (128 rows 281 ms against 469 restored + oneDNN, 512 rows 1.01 s against 1.19), bfloat16 at any count where it
# sums by pairs (AVX512_BF16: 128 rows 149 ms against 218), else up to 16 rows (widened: 16 rows 62 ms against
# 79, 24 rows 97 against 84 — oneDNN's bf16 tiles win from there). On several threads the native product shares
# the blocks among them once the operator's C++ kernel is loaded (``linear_kernel.PARALLEL``); until then a
# prompt's bfloat16 rows stay oneDNN's, which shares them, and float32 goes to MKL's bmm.
def native_max_rows(dtype: torch.dtype) -> float:
    """The most rows of ``dtype`` a blocked linear gives the native product (more: oneDNN or MKL)."""
    if dtype == torch.float32:
        return float("inf")
    if dtype == torch.bfloat16:
        shared = torch.get_num_threads() == 1 or linear_kernel.PARALLEL
        return float("inf") if (linear_kernel.bf16_pairs() and shared) or not onednn_takes(dtype) else 16
    return 0


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")  # [..., out]


@functools.cache
def onednn_takes(dtype: torch.dtype) -> bool:
    """Does oneDNN's linear run ``dtype`` on this CPU? Its bfloat16 product needs AVX-512: on a CPU with AVX2 only
    (many AMD EPYC / Ryzen and older Intel parts) it refuses every call ("could not create a primitive
    descriptor"), so bfloat16 weights there are never oneDNN's. Asked once, with two rows."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    try:
        _onednn(torch.ones(2, 16, dtype=dtype), torch.ones(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def _to_fill(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor every byte of which is about to be written: where large, an anonymous mapping with
    its pages made in one call (``MADV_POPULATE_WRITE``, Linux 5.14+) rather than a fault per 4 KiB page as the
    blocking writes them (a 1B model's 2 GB of bfloat16: 500,000 faults, ~1 s of a load), in 2 MiB pages where the
    kernel lends them (``MADV_HUGEPAGE``; transparent huge pages on 'madvise', the usual setting): a product
    streaming the weights then takes a TLB miss per 2 MiB, not per 4 KiB (8 x 8192x2048 bfloat16, one row, one
    thread: 20-22 -> 30-32 GB/s widened, 24.5 -> 28-29 by pairs)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    anon = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if nbytes < 1 << 20 or not anon:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=anon)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # (Linux's)
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # no transparent huge pages here: 4 KiB pages
            pass
    try:
        buf.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
    except (OSError, AttributeError):  # an older kernel: the pages fault in as they are written
        pass
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def block(w: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """[out, in] -> [out/BLOCK, in, BLOCK] (a new tensor; ``out`` a multiple of BLOCK). A list of weights (a merged
    group's members, each ``out`` a multiple of BLOCK) is blocked as their concatenation, without making it."""
    parts = w if isinstance(w, (list, tuple)) else [w]
    i = parts[0].shape[1]
    out = _to_fill((sum(p.shape[0] for p in parts) // BLOCK, i, BLOCK), parts[0].dtype)  # [out/B, in, B]
    g = 0
    for p in parts:
        n = p.shape[0] // BLOCK
        if not linear_kernel.block_into(p, out[g:g + n]):
            out[g:g + n].copy_(p.reshape(n, BLOCK, i).transpose(1, 2))  # [n, in, B]
        g += n
    return out


def unblock(wb: torch.Tensor) -> torch.Tensor:
    """[out/BLOCK, in, BLOCK] -> [out, in] (a new tensor)."""
    return wb.transpose(1, 2).reshape(-1, wb.shape[1])


def _blocked(x: torch.Tensor, wb: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    n_in = wb.shape[1]
    x2 = x.reshape(-1, n_in)  # [rows, in]
    rows = x2.shape[0]
    if linear_kernel.IN_GRAPH and (torch.compiler.is_exporting() or torch.compiler.is_compiling()):
        y = torch.ops.kvscope.blocked_linear(x2, wb, b)  # [rows, out]: a compiled step calls the native product
    elif rows <= native_max_rows(wb.dtype) and linear_kernel.usable(x2, wb):
        y = linear_kernel.blocked_product(x2, wb, b)  # [rows, out]: native, each block read once
    elif rows > BLOCKED_MAX_ROWS and onednn_takes(wb.dtype):
        y = _onednn(x2, unblock(wb), b)  # [rows, out]
    else:
        y = linear_kernel.torch_product(x2, wb, b)  # [rows, out]
    return y.reshape(*x.shape[:-1], y.shape[-1])  # [..., out]


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` over ``weight`` held for ``kind``'s kernel (module doc); a merged group's owner when
    ``splits`` has several widths."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, splits: tuple[int, ...], kind: str,
                 n_in: int) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, n_in, sum(splits)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.splits = splits
        self.offsets = tuple(sum(splits[:i]) for i in range(len(splits) + 1))
        self._held = threading.local()  # the group's last input and output while members still take their part

    def extra_repr(self) -> str:
        held = "oneDNN-packed" if self.weight.is_mkldnn else "blocked" if self.kind == "blocked" else "plain"
        return f"in={self.in_features}, out={self.splits}, {held}"

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "blocked":
            return _blocked(x, self.weight, self.bias)
        return _onednn(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(0, x)

    def part(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``j``'s columns of the group's output for ``x``: computed once for all members fed the same
        tensor (the first asks, the others take their slice); a member asking again, or with another input,
        computes afresh (exact either way)."""
        if len(self.splits) == 1:
            return self.product(x)
        held = getattr(self._held, "v", None)
        if held is None or held[0] is not x or j in held[2]:
            held = (x, self.product(x), set())  # [..., sum(splits)]
            self._held.v = held
        held[2].add(j)
        if len(held[2]) == len(self.splits):
            self._held.v = None  # all taken: hold nothing between forwards
        return held[1][..., self.offsets[j]:self.offsets[j + 1]]  # [..., splits[j]] (a view)


class MergedPart(nn.Module):
    """A merged group's other member (k_proj of q/k/v): its columns of the owner's output. The owner is
    referenced, not registered, so the group's weight appears once among the model's parameters."""

    def __init__(self, owner: PackedLinear, j: int) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.j = j
        self.in_features, self.out_features = owner.in_features, owner.splits[j]

    def extra_repr(self) -> str:
        return f"part {self.j} of a merged linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.part(self.j, x)


class _BF16Blocked:
    """A BF16 block linear's weight (``engine.quant.modules.BlockLinear``: a safetensors file's or a BF16 GGUF's
    rows, mapped) held blocked for the native product, as ``PackedLinear`` holds a bfloat16 model's:
    ``BlockLinear.layout``. Why: the rows' own product (``kq_bf16_rows``: four rows against the activations, each a
    stream) read the 1B shape's weights at 78 ms a token against the blocked product's 99 -> 78 (one thread, the same
    machine); the blocking (``kvs_block16``) runs on the pack thread after the load and each weight's file pages go
    as it is blocked. ``compute``: the activations it serves. bfloat16 (a bf16 folder, ``BF16_BLOCKED``): the product
    rounds its sums to bfloat16, as the bfloat16 model does. float32 (a BF16 GGUF, ``BF16_BLOCKED_F32``): float32
    rows times the widened weights, float32 sums and outputs, the numerics of the rows' float product
    (``linear_kernel.float_product``: 8192x2048, one row, 28 GB/s against the rows' 20); ``rounded``
    (``BF16_BLOCKED_F32_ROUNDED``): the rows rounded to bfloat16 first and multiplied by pairs, as the GGUF default
    road rounds them on a CPU with AVX512_BF16 (256 rows of 2048x2048: 9.8 ms against the rows' GEMM's 12)."""

    def __init__(self, compute: torch.dtype = torch.bfloat16, rounded: bool = False) -> None:
        self.compute, self.rounded = compute, rounded

    def takes(self, ggml_type: int, n_out: int, dtype: torch.dtype) -> bool:
        native = linear_kernel.LINEAR.library() is not None if self.compute == torch.bfloat16 else \
            linear_kernel.takes_float()
        return ggml_type == 30 and dtype == self.compute and n_out % BLOCK == 0 and native

    def pack(self, rows: torch.Tensor, n_out: int, n_in: int) -> torch.Tensor:
        return block(rows.view(torch.bfloat16).view(n_out, n_in))  # [out/B, in, B]

    def product(self, x2: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.compute == torch.float32:
            return linear_kernel.float_product(x2.to(torch.float32), wb, bias, self.rounded)  # [m, out] float32
        return _blocked(x2.to(torch.bfloat16), wb, bias.to(torch.bfloat16) if bias is not None else None)  # [m, out]

    def bytes(self, n_out: int, n_in: int) -> int:
        return n_out * n_in * 2


BF16_BLOCKED = _BF16Blocked()
BF16_BLOCKED_F32 = _BF16Blocked(torch.float32)
BF16_BLOCKED_F32_ROUNDED = _BF16Blocked(torch.float32, rounded=True)


def gguf_float_layout(dtype: torch.dtype, device: str):
    """The float layout a GGUF's BF16 linears take (``BlockLinear.layout``, handed to ``engine.quant.gguf_keep``'s
    ``build`` / ``plan``; None: the rows' product): on the CPU in float32 compute, blocked on the pack thread for the
    native product (``BF16_BLOCKED_F32``: ~1.2-1.4x the rows' at a decode row), each file's pages let go once
    blocked; its activations rounded to bfloat16 where the rows' product rounds them (the default road on
    AVX512_BF16), else float32: the numerics unchanged."""
    from engine.quant import kernel

    lib = kernel.library()
    if device != "cpu" or dtype != torch.float32 or lib is None or not linear_kernel.takes_float():
        return None
    rounded = kernel.default_road() == "int8" and bool(lib.kq_gemm_float_pairs(30, 0))  # kq_matmul's own test
    return BF16_BLOCKED_F32_ROUNDED if rounded else BF16_BLOCKED_F32
