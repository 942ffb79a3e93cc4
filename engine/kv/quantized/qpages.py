"""Quantized page objects: what ``engine.kv.quantized.quant`` returns and the page stores hold.

Each holds the tensors of one or many pages (any leading page/head dims, then ``[T, D]``-shaped codes) and
knows its bytes, how to select pages (``q[page_ids]``) and how to write pages in place (``put``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Union

import torch
from torch import Tensor

ROLES = ("k", "v")


class _FullWidthPage:
    """What the two int8 layouts share: codes ``[..., T, D]`` (one per element, no packing) and tensors
    that are all indexed by the same leading (page/head) dims, named in ``_tensors``."""

    _tensors: ClassVar[tuple[str, ...]]
    codes: Tensor
    scale: Tensor

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1]

    @property
    def num_tokens(self) -> int:
        """Tokens per page (T)."""
        return self.codes.shape[-2]

    @property
    def shape(self) -> torch.Size:
        """Shape of the dequantized tensor ``[..., T, D]``."""
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        """Bytes really held: codes + scales (+ zeros)."""
        return sum(_nbytes(getattr(self, name)) for name in self._tensors)

    def __getitem__(self, index):
        """Select pages along the leading dims only (``q[page_ids]``, ``q[2]``, ``q[:, 1:3]``)."""
        _check_index(index, self.codes.dim())
        return type(self)(*(getattr(self, name)[index] for name in self._tensors))

    def put(self, index, src) -> None:
        """Write ``src`` into these (storage) tensors at leading-dim ``index``, in place."""
        _check_index(index, self.codes.dim())
        if type(src) is not type(self) or src.scale.dtype != self.scale.dtype:
            raise ValueError(f"put: source is not a {self.kind} page of the same layout and scale dtype")
        for name in self._tensors:
            getattr(self, name)[index] = getattr(src, name)


@dataclass(frozen=True, eq=False)
class QInt8(_FullWidthPage):
    """int8 page(s): ``x ≈ codes * scale``.

    codes  int8 ``[..., T, D]`` in [-127, 127]
    scale  float16/float32 ``[..., T, 1]`` (absmax over D / 127, rounded up; 0 for an all-zero row)
    """

    codes: Tensor
    scale: Tensor
    kind: ClassVar[str] = "int8"
    _tensors: ClassVar[tuple[str, ...]] = ("codes", "scale")

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.int8:
            raise ValueError(f"int8 codes: dtype {self.codes.dtype} is not torch.int8")
        if self.codes.dim() < 2 or self.scale.shape != self.codes.shape[:-1] + (1,):
            raise ValueError(f"int8 scale: shape {tuple(self.scale.shape)} does not fit codes {tuple(self.codes.shape)}")


@dataclass(frozen=True, eq=False)
class QInt8Keys(_FullWidthPage):
    """int8 key page(s), per channel over the page: ``x ≈ code * scale + zero``.

    codes  uint8 ``[..., T, D]`` in 0..255
    scale, zero  float16/float32 ``[..., 1, D]`` (zero <= the channel's min, zero + 255 * scale >= its max)
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor
    kind: ClassVar[str] = "int8"
    role: ClassVar[str] = "k"
    _tensors: ClassVar[tuple[str, ...]] = ("codes", "scale", "zero")

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"int8 key codes: dtype {self.codes.dtype} is not torch.uint8")
        want = self.codes.shape[:-2] + (1, self.codes.shape[-1]) if self.codes.dim() >= 2 else None
        if want is None or self.scale.shape != want or self.zero.shape != want or self.zero.dtype != self.scale.dtype:
            raise ValueError(f"int8 key scale/zero: shapes {tuple(self.scale.shape)}/{tuple(self.zero.shape)} "
                             f"do not fit codes {tuple(self.codes.shape)}")


@dataclass(frozen=True, eq=False)
class QInt4:
    """int4 page(s), two codes per byte: ``x ≈ code * scale + zero``.

    codes  uint8 ``[..., T, ceil(D/2)]``; byte j = code[2j] | code[2j+1] << 4 (packed along head_dim)
    scale, zero  float16/float32; role "k": ``[..., 1, D]`` (per channel over the page's T tokens);
           role "v": ``[..., T, G]`` (per token, G = ceil(D / group) groups along head_dim)
    role   "k" | "v";  head_dim  D (needed: odd D is padded in ``codes``)
    group  "v": channels per group along head_dim (min(group, D)); "k": 0 (the group is the whole page)
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor
    role: str
    head_dim: int
    group: int
    kind: ClassVar[str] = "int4"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"int4 role: {self.role!r} is not one of {', '.join(ROLES)}")
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"int4 codes: dtype {self.codes.dtype} is not torch.uint8")
        if self.codes.dim() < 2 or self.codes.shape[-1] != (self.head_dim + 1) // 2:
            raise ValueError(f"int4 codes: shape {tuple(self.codes.shape)} does not fit head_dim {self.head_dim}")
        if self.role == "v" and not 1 <= self.group <= self.head_dim:
            raise ValueError(f"int4 values: group {self.group} is outside 1..head_dim {self.head_dim}")
        lead, t = self.codes.shape[:-2], self.codes.shape[-2]
        want = lead + ((1, self.head_dim) if self.role == "k" else (t, _num_groups(self.head_dim, self.group)))
        if self.scale.shape != want or self.zero.shape != want or self.zero.dtype != self.scale.dtype:
            raise ValueError(
                f"int4 {self.role} scale/zero: shapes {tuple(self.scale.shape)}/{tuple(self.zero.shape)} "
                f"are not {tuple(want)}"
            )

    @property
    def num_tokens(self) -> int:
        """Tokens per page (T)."""
        return self.codes.shape[-2]

    @property
    def shape(self) -> torch.Size:
        """Shape of the dequantized tensor ``[..., T, D]``."""
        return self.codes.shape[:-1] + (self.head_dim,)

    @property
    def nbytes(self) -> int:
        """Bytes really held: packed codes + scales + zeros."""
        return _nbytes(self.codes) + _nbytes(self.scale) + _nbytes(self.zero)

    def __getitem__(self, index) -> QInt4:
        """Select pages along the leading dims only (``q[page_ids]``, ``q[2]``, ``q[:, 1:3]``)."""
        _check_index(index, self.codes.dim())
        return QInt4(self.codes[index], self.scale[index], self.zero[index], self.role, self.head_dim, self.group)

    def put(self, index, src: QInt4) -> None:
        """Write ``src`` into these (storage) tensors at leading-dim ``index``, in place."""
        _check_index(index, self.codes.dim())
        if (
            not isinstance(src, QInt4)
            or (src.role, src.head_dim, src.group) != (self.role, self.head_dim, self.group)
            or src.scale.dtype != self.scale.dtype
        ):
            raise ValueError("put: source is not an int4 page with the same role, head_dim, group and scale dtype")
        self.codes[index] = src.codes
        self.scale[index] = src.scale
        self.zero[index] = src.zero


QuantizedPage = Union[QInt8, QInt8Keys, QInt4]


@dataclass(frozen=True)
class QuantError:
    """Round-trip error of one quantized tensor (plain floats, for stats panels)."""

    mse: float  # mean((x - x̂)²)
    max_abs: float  # max |x - x̂|
    rel_rms: float  # ||x - x̂|| / ||x|| (0 when x is all zero)



def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _check_index(index, ndim: int) -> None:
    parts = index if isinstance(index, tuple) else (index,)
    if any(p is Ellipsis or p is None for p in parts) or len(parts) > ndim - 2:
        raise ValueError("page index: select leading (page/head) dims only, without ... or None")


def _num_groups(head_dim: int, group: int) -> int:
    return math.ceil(head_dim / group) if group > 0 else 0
