"""The base of the KV quantization schemes and their registry (``engine.kv.quantized.schemes`` has the int8 / int4
ones and ``scheme_for``; ``engine.kv.quantized.tq_schemes`` the rotated ones)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from engine.kv.quantized import quant
from engine.kv.paged import sizes

registry: dict[str, type["Scheme"]] = {}


class Scheme:
    """One quantized layout for one role. Subclasses set ``name``, ``kind``, ``role`` and the two functions."""

    name: ClassVar[str]
    kind: ClassVar[str]
    role: ClassVar[str]
    per_channel: ClassVar[bool] = False  # statistics over a whole page: only full pages can be quantized
    rotated: ClassVar[bool] = False  # pages can be read in a rotated basis (``engine.kv.quantized.basis``)

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "name" in cls.__dict__:  # a named layout (not a shared base class)
            registry[cls.name] = cls

    def __init__(self, head_dim: int, page_size: int, role: str | None = None) -> None:
        self.head_dim = head_dim
        self.page_size = page_size
        if role is not None and not hasattr(type(self), "role"):  # one class for both roles (the tq schemes)
            self.role = role

    def quantize(self, x: Tensor, layer: int = 0) -> quant.QuantizedPage:
        raise NotImplementedError

    def dequantize(self, q: quant.QuantizedPage, dtype: torch.dtype, layer: int = 0) -> Tensor:
        return quant.dequantize(q, dtype)

    def allocate(self, lead: tuple[int, ...], device) -> quant.QuantizedPage:
        """Zeroed storage ``[*lead, page_size, head_dim]`` (dequantizes to 0)."""
        return quant.allocate(self.kind, self.role, lead, self.page_size, self.head_dim, device=device)

    def bytes_per_token(self, kv_heads: int) -> float:
        return sizes.bytes_per_token(self.kind, self.role, kv_heads, self.head_dim, self.page_size)

    def fusable(self, device) -> bool:
        """The fused decode kernel reads this scheme's pages (``engine.kv.quantized.tq_attend``)."""
        return False

    def fused_role(self, pages, tail: Tensor, layer: int):
        """Full pages ``[H, N, P, ...]`` and the exact tail ``[H, fill, D]`` as the kernel reads them:
        (``tq_attend.RolePages``, the matrix the attention turns by or None)."""
        raise NotImplementedError

    def dequantize_into(self, q: quant.QuantizedPage, out: Tensor, layer: int = 0) -> None:
        """Dequantize pages ``q`` ``[H, N, P, ...]`` into ``out`` ``[H, N*P, D]`` (computed in float32)."""
        out.copy_(self.dequantize(q, out.dtype, layer).reshape(out.shape[0], -1, self.head_dim))
