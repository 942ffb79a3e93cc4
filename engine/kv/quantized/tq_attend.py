"""Fused decode attention over quantized pages (tq kinds, rotated; int4, KIVI; int8): one new token's attention read
straight from the codes.

The cache hands a decode step's K/V over as ``FusedPages`` (codes, norms and the exact tail of each role,
``QuantView.read_fused``) with placeholders in place of the K/V tensors; the attention (``attend``) runs the native
kernel (``engine.kv.quantized.tq_kernel``) on them in the rotated basis, or, where it cannot (a mask that hides
tokens, soft-capping, attention sinks, a model that changed what the cache returned), reads the pages as before
(``materialize``) and runs SDPA. Both give the same attention up to float32 summation order.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from engine.kv.quantized import native


TQ, INT4_KEYS, INT4_VALUES = 0, 1, 2  # RolePages.mode: how a row's levels become the vector


@dataclass(frozen=True, eq=False)
class RolePages:
    """One role's tokens ``[0, n)`` of one layer as the kernel reads them.

    codes  uint8 ``[H, rows, C]`` with rows ``C`` bytes apart (any head stride): the full pages' codes
    norms  float32 ``[H, rows]`` contiguous
    levels float32 ``[16]``: the 2^bits levels, padded with zeros
    table  float32 ``[entries, g]``: the levels of each byte's codes (``g`` codes an entry; 3 bits: ``[4096, 4]``;
           8 bits: ``[256]``, each byte's code, signed or not)
    bits   bits a code;  tail  float32 ``[H, nt, W]`` contiguous: the page being filled, rotated, exact (W: D, or
           2 D for QJL keys, whose second half is zero there)
    signs  QJL keys: uint8 ``[H, rows, D/8]`` the residual's signs, and ``sign_norms`` float32 ``[H, rows]``
           (‖r‖·√(π/2)/D), ``sign_tables`` ({-1, +1} padded to 16, ``[256, 8]``); else None
    mode   ``TQ`` (levels × norm; per-token int8: codes × scale), ``INT4_KEYS`` (code × scale + zero, ``scale`` /
           ``zero`` float32 ``[H, pages, D]``, per page and channel; ``norms`` unused; also per-channel int8 keys)
           or ``INT4_VALUES`` (``[H, rows, D / group]``, per token and group of channels)
    """

    codes: Tensor
    norms: Tensor
    levels: Tensor
    table: Tensor
    bits: int
    tail: Tensor
    signs: Tensor | None = None
    sign_norms: Tensor | None = None
    sign_tables: tuple[Tensor, Tensor] | None = None
    mode: int = 0
    page_size: int = 0
    group: int = 0
    scale: Tensor | None = None
    zero: Tensor | None = None

    @property
    def rows(self) -> int:
        return self.codes.shape[1]

    @property
    def width(self) -> int:
        return self.tail.shape[-1]

    @property
    def dim(self) -> int:
        return self.width // 2 if self.signs is not None else self.width

    def struct(self) -> native.Role:
        signs = self.signs
        sl, st = self.sign_tables if signs is not None else (None, None)
        return native.Role(_ptr(self.codes), self.codes.stride(0), self.codes.shape[2], self.bits, self.dim,
                           self.width, _ptr(self.norms), _ptr(self.levels), _ptr(self.table), _ptr(self.tail),
                           _ptr(signs), 0 if signs is None else signs.stride(0),
                           0 if signs is None else signs.shape[2], _ptr(self.sign_norms), _ptr(sl), _ptr(st),
                           self.mode, self.page_size, self.group, _ptr(self.scale), _ptr(self.zero))


@dataclass(frozen=True, eq=False)
class FusedPages:
    """A decode step's keys and values left as pages, the placeholders handed in their place, and how to read
    them as tensors instead (``[1, H, n, D]`` each, rotated)."""

    keys: RolePages
    values: RolePages
    key_placeholder: Tensor
    materialize: Callable[[], tuple[Tensor, Tensor]]


def row_view(codes: Tensor) -> Tensor:
    """Pages' codes ``[H, N, P, C]`` as ``[H, N*P, C]`` rows ``C`` bytes apart in each head (copied if they are not)."""
    h, n, p, c = codes.shape
    if codes.stride()[1:] != (p * c, c, 1):
        codes = codes.contiguous()
    return codes.view(h, n * p, c)


def placeholder(heads: int, n: int, dim: int, dtype: torch.dtype, device) -> Tensor:
    """``[1, heads, n, dim]`` zeros that take no memory (one row, expanded): the shape a model expects back."""
    return torch.zeros((1, heads, 1, dim), dtype=dtype, device=device).expand(1, heads, n, dim)


def _plain_mask(mask: Tensor | None) -> bool:
    """The mask lets the query see every cached token (a decode step of one sequence: None, or all true / 0)."""
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def attend(fused: FusedPages, query: Tensor, key: Tensor, mask: Tensor | None, kwargs: dict) -> Tensor | None:
    """The attention output ``[1, 1, Hq, Dv]`` (rotated basis, the query's dtype) of one query ``[1, Hq, 1, Dk]``
    (already turned into the rotated basis), or None where the kernel does not apply (then ``materialize``)."""
    lib = native.library()
    if (lib is None or query.shape[0] != 1 or query.shape[2] != 1 or key is not fused.key_placeholder
            or query.device.type != "cpu" or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
            or kwargs.get("sliding_window") is not None or not _plain_mask(mask)):
        return None
    k, v = fused.keys, fused.values
    hq, hk = query.shape[1], k.codes.shape[0]
    if hq % hk or v.codes.shape[0] != hk or k.rows != v.rows or query.shape[-1] != k.width:
        return None
    scale = kwargs.get("scaling") or k.dim ** -0.5
    out = run(lib, query[0, :, 0].float() * scale, k, v)  # [Hq, Dv]
    return None if out is None else out.to(query.dtype)[None, None]  # [1, 1, Hq, Dv]


def run(lib, q: Tensor, k: RolePages, v: RolePages) -> Tensor | None:
    """The kernel itself: scaled queries ``q`` ``[Hq, Dk]`` (float32, rotated) → ``[Hq, Dv]`` (None: it refused)."""
    q = q.contiguous()
    hq, hk = q.shape[0], k.codes.shape[0]
    n, nt = k.rows, k.tail.shape[1]
    out = torch.empty((hq, v.dim), dtype=torch.float32)
    ks, vs = k.struct(), v.struct()
    par = native.PARALLEL_TQ
    if par is not None and torch.get_num_threads() > 1:  # the heads shared among torch's threads
        rc = par(hk, hq // hk, _ptr(q), n, nt, ctypes.byref(ks), ctypes.byref(vs), _ptr(out), k.width, v.dim)
        return None if rc else out
    scratch = torch.empty((hq // hk, n + nt), dtype=torch.float32)  # [rep, n + nt]: one KV head's probabilities
    rc = lib.kvs_tq_decode(hk, hq // hk, _ptr(q), n, nt, ctypes.byref(ks), ctypes.byref(vs), _ptr(scratch), _ptr(out))
    return None if rc else out


def _ptr(t: Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())
