"""One new token's attention over a sequence's plain pages, read in place: the operator ``kvscope::paged_decode`` that
the compiled decode step calls in place of gathering its K/V and running SDPA (``engine.kv.hf_cache.StepCache``).

The step's cache layer hands the attention its page tensors, the cached tokens' slots and the new token's K/V
(``STEP_KEY``) beside the gathered K/V it returns as before; the attention (``attend``) calls the operator where it
applies (one query, no mask, no soft-capping, sinks or window, float32 or bfloat16 on a CPU, and the attention got
exactly the tensors the cache returned) and the gathered K/V are then never used: the compiler drops them. Elsewhere
the attention runs as before on the gathered K/V.

The operator's kernels, the same results up to float32 summation order: the C++ one (``engine.model.linear_op``,
loaded with the compiled step; ~2 us a call), else the Python one below (the native kernel through ctypes, else torch:
the gathered K/V and SDPA in float32). Measured on the SmolLM2-135M shape (bfloat16, one thread, a layer): 128 cached
tokens ~5 us against ~30 for the gather, the cast and flash attention; 512 ~15 against ~90.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from engine.kv.quantized import native

# the attention kwargs entry: (k pages, v pages, slots, lens or None, new k, new v, k returned, v returned)
STEP_KEY = "kvscope_step"
DTYPES = (torch.float32, torch.bfloat16)


def reference(q: Tensor, kp: Tensor, vp: Tensor, slots: Tensor, nk: Tensor, nv: Tensor, scale: float) -> Tensor:
    """What the operator computes, with torch's ops: the K/V gathered through ``slots`` and the new token's appended,
    SDPA in float32. q [1, Hq, 1, Dk]; kp [Hk, S, Dk], vp [Hk, S, Dv]; slots [n]; nk [1, Hk, 1, Dk], nv [1, Hk, 1, Dv].
    Returns [1, 1, Hq, Dv] in q's dtype."""
    k = torch.cat([kp.index_select(1, slots)[None], nk], 2).float()  # [1, Hk, n + 1, Dk]
    v = torch.cat([vp.index_select(1, slots)[None], nv], 2).float()  # [1, Hk, n + 1, Dv]
    o = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, scale=scale,
                                                         enable_gqa=q.shape[1] != k.shape[1])  # [1, Hq, 1, Dv]
    return o.transpose(1, 2).to(q.dtype).contiguous()


def native_run(q: Tensor, kp: Tensor, vp: Tensor, slots: Tensor, nk: Tensor, nv: Tensor, scale: float) -> Tensor | None:
    """The native kernel through ctypes (``engine.kv.quantized.plain_kernel``), or None where it does not apply."""
    lib = native.library()
    if lib is None or not fits(q, kp, vp, slots, nk, nv):
        return None
    hq, hk, dk, dv = q.shape[1], kp.shape[0], kp.shape[2], vp.shape[2]
    q, nk, nv, slots = q.contiguous(), nk.contiguous(), nv.contiguous(), slots.contiguous()
    out = q.new_empty(1, 1, hq, dv)
    rc = lib.kvs_plain_decode(0, hk, hq // hk, slots.shape[0], dk, dv, int(kp.dtype == torch.bfloat16), _ptr(kp),
                              kp.stride(0), _ptr(vp), vp.stride(0), _ptr(slots), _ptr(q), _ptr(nk), _ptr(nv), scale,
                              _ptr(out))
    return None if rc else out


def fits(q: Tensor, kp: Tensor, vp: Tensor, slots: Tensor, nk: Tensor, nv: Tensor) -> bool:
    """Shapes, dtypes and layouts the native kernel reads (the C++ kernel checks the same)."""
    hq, hk = q.shape[1], kp.shape[0]
    return (q.dim() == 4 and q.shape[0] == 1 and q.shape[2] == 1 and hq % hk == 0 and q.device.type == "cpu"
            and kp.dtype in DTYPES and vp.dtype == kp.dtype == q.dtype == nk.dtype == nv.dtype
            and kp.stride()[1:] == (kp.shape[2], 1) and vp.stride()[1:] == (vp.shape[2], 1)
            and vp.shape[0] == hk and q.shape[3] == kp.shape[2] and slots.dtype == torch.long
            and max(kp.shape[2], vp.shape[2]) <= 1024)


def python_kernel(q: Tensor, kp: Tensor, vp: Tensor, slots: Tensor, nk: Tensor, nv: Tensor, scale: float) -> Tensor:
    """The operator's Python kernel: the native kernel through ctypes, else torch's ops."""
    out = native_run(q, kp, vp, slots, nk, nv, scale)
    return out if out is not None else reference(q, kp, vp, slots, nk, nv, scale)


@torch.library.custom_op("kvscope::paged_decode", mutates_args=())
def paged_decode(q: Tensor, kp: Tensor, vp: Tensor, slots: Tensor, nk: Tensor, nv: Tensor, scale: float) -> Tensor:
    """One query token's attention over the cached rows at ``slots`` of the page tensors and its own new K/V
    (``reference`` says the shapes): [1, 1, Hq, Dv]. A CPU kernel in C++ takes over once ``engine.model.linear_op``
    has loaded."""
    return python_kernel(q, kp, vp, slots, nk, nv, scale)


@paged_decode.register_fake
def _(q, kp, vp, slots, nk, nv, scale):
    return q.new_empty(1, 1, q.shape[1], vp.shape[2])  # [1, 1, Hq, Dv]


def reference_batch(q: Tensor, kp: Tensor, vp: Tensor, slots: Tensor, lens: Tensor, nk: Tensor, nv: Tensor,
                    scale: float) -> Tensor:
    """``reference`` for B sequences of one arena: q [B, Hq, 1, Dk]; slots [B, n] each sequence's cached slots padded
    to the longest, lens [B] how many are its own; nk [B, Hk, 1, Dk], nv [B, Hk, 1, Dv]. Returns [B, 1, Hq, Dv]."""
    outs = [reference(q[b:b + 1], kp, vp, slots[b, :int(lens[b])], nk[b:b + 1], nv[b:b + 1], scale)
            for b in range(q.shape[0])]
    return torch.cat(outs, 0)


@torch.library.custom_op("kvscope::paged_decode_batch", mutates_args=())
def paged_decode_batch(q: Tensor, kp: Tensor, vp: Tensor, slots: Tensor, lens: Tensor, nk: Tensor, nv: Tensor,
                       scale: float) -> Tensor:
    """``paged_decode`` for each of B sequences of one arena (``reference_batch`` says the shapes): [B, 1, Hq, Dv].
    Its Python kernel calls the one-sequence kernel per sequence; the C++ one shares sequences and heads among
    torch's threads."""
    outs = [python_kernel(q[b:b + 1], kp, vp, slots[b, :int(lens[b])], nk[b:b + 1], nv[b:b + 1], scale)
            for b in range(q.shape[0])]
    return torch.cat(outs, 0)


@paged_decode_batch.register_fake
def _(q, kp, vp, slots, lens, nk, nv, scale):
    return q.new_empty(q.shape[0], 1, q.shape[1], vp.shape[2])  # [B, 1, Hq, Dv]


def write_slot_python(pages: list[Tensor], rows: list[Tensor], slot: int) -> None:
    """``kvscope::write_slot``'s Python kernel: ``rows[i]`` [1, H, 1, D] into ``pages[i]`` [H, S, D] at ``slot``."""
    for t, x in zip(pages, rows):
        t[:, slot].copy_(x[0, :, 0])  # [H, D] into the token's slot


# The compiled step's new K/V written after it, every layer's K and V in one call: the C++ kernel, once
# ``engine.model.linear_op`` has loaded, copies the rows straight (~10 us where 60 indexed copies from Python take
# ~250). Defined without ``torch.library.custom_op``: its Python layer bumps each page tensor's version from Python
# (~0.2 ms a call here).
_LIB = torch.library.Library("kvscope", "FRAGMENT")
_LIB.define("write_slot(Tensor(a!)[] pages, Tensor[] rows, int slot) -> ()")
_LIB.impl("write_slot", write_slot_python, "CompositeExplicitAutograd")


def attend(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, step: tuple, kwargs: dict) -> Tensor | None:
    """The attention output [B, 1, Hq, Dv] by ``paged_decode`` (one sequence) or ``paged_decode_batch`` (the compiled
    batched step: ``step`` carries each sequence's length), or None where it does not apply (the caller then runs its
    attention on ``key`` / ``value``). ``step``: what the cache layer handed over (``STEP_KEY``)."""
    kp, vp, slots, lens, nk, nv, k_out, v_out = step
    if (key is not k_out or value is not v_out or mask is not None or query.shape[2] != 1
            or query.device.type != "cpu" or query.dtype not in DTYPES or kp.dtype != query.dtype
            or any(kwargs.get(a) is not None for a in ("softcap", "s_aux", "sliding_window"))
            or query.shape[1] % kp.shape[0] or query.shape[3] != kp.shape[2] or kwargs.get("dropout", 0.0)):
        return None
    scale = kwargs.get("scaling")
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    if lens is None:
        return torch.ops.kvscope.paged_decode(query, kp, vp, slots, nk, nv, scale)
    return torch.ops.kvscope.paged_decode_batch(query, kp, vp, slots, lens, nk, nv, scale)


def attend_tensors(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, kwargs: dict) -> Tensor | None:
    """An eager decode step's attention of one bfloat16 query over the K/V its cache returned ([1, Hk, n + 1, D], a
    view of one run of pages or a gathered copy: any head stride, rows D apart) by the native kernel through
    ctypes, the cached rows read in place: [1, 1, Hq, Dv], or None where it does not apply (the caller's SDPA then
    answers). bfloat16 only: float32 stays exactly torch's, as HF's greedy ids are compared against it."""
    if (query.dtype != torch.bfloat16 or query.shape[0] != 1 or query.shape[2] != 1 or query.device.type != "cpu"
            or torch.compiler.is_compiling() or torch.compiler.is_exporting() or type(query) is not Tensor
            or key.dim() != 4 or key.shape[0] != 1 or key.dtype != query.dtype or value.dtype != query.dtype
            or any(kwargs.get(a) is not None for a in ("softcap", "s_aux", "sliding_window"))
            or kwargs.get("dropout", 0.0) or not _all_visible(mask)):
        return None
    n = key.shape[2] - 1
    kp, vp = key[0], value[0]  # [Hk, n + 1, D]: the cached rows 0 .. n - 1, then the new token's
    scale = kwargs.get("scaling")
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    return native_run(query, kp, vp, _arange(n), key[:, :, n:], value[:, :, n:], scale)


def _all_visible(mask: Tensor | None) -> bool:
    """The mask lets the one query see every key (None, or all true / 0)."""
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


_ARANGE: list[Tensor] = [torch.arange(0)]


def _arange(n: int) -> Tensor:
    """0 .. n - 1 (the rows of a run read in place), kept and grown, so a decode step makes none."""
    if _ARANGE[0].shape[0] < n:
        _ARANGE[0] = torch.arange(max(n, 2 * _ARANGE[0].shape[0], 1024))
    return _ARANGE[0][:n]


def _ptr(t: Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
