"""Attention of a few new float32 query rows over many cached keys on a CPU by the native kernel
(``kvs_prefill_attend`` in ``engine/native/csrc/kv_prefill.c``): a suffix prefill after a prefix-cache hit (an agent
loop's step: ~80 new tokens over ~4,600 cached), a chunk of a long prompt after its first.

torch's SDPA reads the same K/V (GQA through ``enable_gqa``) at ~55-60 GFLOP/s on one core here; the kernel ~70
(SmolLM2 shape, 80 queries over 4,680 keys: 12.3 against 14.1 ms a layer, one thread, AVX-512). Where it is slower
(a few keys, one query: its fixed cost; more than one thread: it runs the heads on the calling thread, where torch
shares them) or cannot read the call (not float32, another mask than the prefill's causal one, soft-capping, sinks,
a window, no library, a CPU without AVX-512), ``attend`` says None and the caller's SDPA answers. Numerics: float32
scores and sums, the same as SDPA up to summation order (~1e-6 relative; HF's greedy ids stay the same: the
prefix-reuse tests compare them).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from engine.kv.quantized import native

# Where the kernel is faster than torch's SDPA (one thread, AVX-512, SmolLM2 shape, medians of interleaved runs on a
# shared 2-core EPYC): 8 rows x1.07-1.69 (256 to 4,680 keys), 16 x1.15-1.46, 80 x1.28-1.50, a whole 2,048-token
# prompt x2.5; one row x0.86-0.96 (a decode token: SDPA keeps it, and float32 decoding stays exactly torch's).
MIN_ROWS = 8
MIN_KEYS = 256
MAX_ROWS = 4096  # the kernel's scratch holds rows x query heads of a KV head: bounded (4,096 x 8 x 128 floats = 16 MB)
WIDE = 16  # the kernel's vector width where it beats SDPA (AVX-512); narrower builds leave the call to SDPA

_checked = threading.local()  # the last mask found causal: (the tensor, its version, rows, keys)


def _lib():
    lib = native.library()
    return lib if lib is not None and hasattr(lib, "kvs_prefill_attend") else None


def _wide(lib) -> bool:
    w = getattr(lib, "_kvs_prefill_width", None)
    if w is None:
        w = lib._kvs_prefill_width = int(lib.kvs_prefill_width())
    return w >= WIDE


def causal_offset(mask: Tensor | None, rows: int, keys: int) -> int | None:
    """``mask`` as the kernel's ``causal``: keys - rows where it is the prefill's bool causal mask aligned to the end
    of the K/V (row i sees keys <= keys - rows + i; [1, 1, rows, >= keys]), else None. The same mask tensor is handed
    to every layer of a forward: found once, then known by identity and version."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        return None
    if mask.shape[2] != rows or mask.shape[3] < keys:
        return None
    version = -1 if mask.is_inference() else mask._version  # an inference tensor keeps no version (made, not edited)
    last = getattr(_checked, "last", None)
    if last is not None and last[0] is mask and last[1:] == (version, rows, keys):
        return keys - rows
    want = torch.ones(rows, keys, dtype=torch.bool, device=mask.device).tril(keys - rows)  # [rows, keys]
    if not torch.equal(mask[0, 0, :, :keys], want):
        return None
    _checked.last = (mask, version, rows, keys)
    return keys - rows


def attend(module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, kwargs: dict) -> Tensor | None:
    """query [1, Hq, q, D], key / value [1, Hk, n, D] / [1, Hk, n, Dv] (views of the pages or copies: rows contiguous),
    ``mask`` the prefill's causal one, or None for a whole prompt (q == n) of a causal ``module`` (transformers then
    asks SDPA for ``is_causal``). Returns [1, q, Hq, Dv] by the kernel, or None where it does not apply or would be
    slower."""
    if (query.device.type != "cpu" or query.dtype != torch.float32 or key.dtype != torch.float32
            or value.dtype != torch.float32 or query.dim() != 4 or key.dim() != 4 or value.dim() != 4
            or query.shape[0] != 1 or key.shape[0] != 1 or value.shape[0] != 1 or torch.get_num_threads() != 1):
        return None
    _, hq, rows, d = query.shape
    hk, n, dv = key.shape[1], key.shape[2], value.shape[3]
    if (rows < MIN_ROWS or rows > MAX_ROWS or n < MIN_KEYS or hq % hk or value.shape[1] != hk or value.shape[2] != n
            or key.shape[3] != d or d > 1024 or dv > 1024 or query.stride(3) != 1 or key.stride(3) != 1
            or value.stride(3) != 1):
        return None
    if (kwargs.get("dropout", 0.0) or kwargs.get("output_attentions") or type(query) is not Tensor
            or any(kwargs.get(a) is not None for a in ("softcap", "s_aux", "sliding_window", "position_bias"))
            or torch.compiler.is_compiling() or query.requires_grad and torch.is_grad_enabled()):
        return None
    if mask is None:
        causal = 0 if rows == n and kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False else None
    else:
        causal = causal_offset(mask, rows, n)
    if causal is None:
        return None
    lib = _lib()
    if lib is None or not _wide(lib):
        return None
    scale = kwargs.get("scaling")
    return kernel(query, key, value, causal, float(scale) if scale is not None else d ** -0.5)


def kernel(query: Tensor, key: Tensor, value: Tensor, causal: int, scale: float) -> Tensor | None:
    """The kernel itself, whatever the sizes (``attend`` says where it pays): float32 query [1, Hq, q, D], key /
    value [1, Hk, n, D] / [1, Hk, n, Dv] with contiguous rows, ``causal`` >= 0: row i sees keys <= causal + i, < 0:
    every key. [1, q, Hq, Dv], or None without the library."""
    lib = _lib()
    if lib is None:
        return None
    _, hq, rows, d = query.shape
    hk, n, dv = key.shape[1], key.shape[2], value.shape[3]
    out = query.new_empty(1, rows, hq, dv)  # [1, q, Hq, Dv]
    rc = lib.kvs_prefill_attend(0, hk, hq // hk, rows, n, d, dv, query.data_ptr(), query.stride(1), query.stride(2),
                                key.data_ptr(), key.stride(1), key.stride(2), value.data_ptr(), value.stride(1),
                                value.stride(2), scale, causal, out.data_ptr(), hq * dv)
    return None if rc else out
