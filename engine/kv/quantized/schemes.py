"""KV quantization schemes: one class each (quantize / dequantize / allocate / bytes per token), one registry.

A scheme is what one role (K or V) of a quantized page store holds. ``scheme_for(kind, role, head_dim,
page_size)`` picks the layout by the rules of ``engine.kv.paged.sizes`` (the torch-free formulas the app's memory
estimate shares); the arithmetic lives in ``engine.kv.quantized.quant``.

Every method works on ``[..., T, D]`` (T = the tokens of one page): one page ``[H, P, D]`` or a layer's
pages ``[H, N, P, D]``.
"""

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

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        registry[cls.name] = cls

    def __init__(self, head_dim: int, page_size: int) -> None:
        self.head_dim = head_dim
        self.page_size = page_size

    def quantize(self, x: Tensor) -> quant.QuantizedPage:
        raise NotImplementedError

    def dequantize(self, q: quant.QuantizedPage, dtype: torch.dtype) -> Tensor:
        return quant.dequantize(q, dtype)

    def allocate(self, lead: tuple[int, ...], device) -> quant.QuantizedPage:
        """Zeroed storage ``[*lead, page_size, head_dim]`` (dequantizes to 0)."""
        return quant.allocate(self.kind, self.role, lead, self.page_size, self.head_dim, device=device)

    def bytes_per_token(self, kv_heads: int) -> float:
        return sizes.bytes_per_token(self.kind, self.role, kv_heads, self.head_dim, self.page_size)

    def dequantize_into(self, q: quant.QuantizedPage, out: Tensor) -> None:
        """Dequantize pages ``q`` ``[H, N, P, ...]`` into ``out`` ``[H, N*P, D]`` (computed in float32)."""
        out.copy_(self.dequantize(q, out.dtype).reshape(out.shape[0], -1, self.head_dim))


class Int8Tokens(Scheme):
    """int8, one scale per token and head (q8_0-like): values always, keys on short pages."""

    name, kind, role = sizes.INT8_TOKENS, "int8", "v"

    def quantize(self, x: Tensor) -> quant.QuantizedPage:
        return quant.quantize_int8(x)

    def dequantize_into(self, q, out) -> None:
        h = out.shape[0]
        scale = q.scale.reshape(h, -1, 1).to(out.dtype)  # [H, N*P, 1]
        torch.mul(q.codes.reshape(h, -1, self.head_dim), scale, out=out)  # codes × scale in one pass

    def bytes_per_token(self, kv_heads: int) -> float:
        return sizes.bytes_per_token("int8", "v", kv_heads, self.head_dim, self.page_size)


class Int8ChannelKeys(Scheme):
    """int8 keys per channel over the page (KIVI's key grouping at 8 bits), asymmetric."""

    name, kind, role = sizes.INT8_CHANNEL_KEYS, "int8", "k"
    per_channel = True

    def quantize(self, x: Tensor) -> quant.QuantizedPage:
        return quant.quantize_int8_keys(x)

    def dequantize_into(self, q, out) -> None:
        if out.dtype != torch.float32:  # computed in float32, one rounding to the cache dtype
            return super().dequantize_into(q, out)
        h = out.shape[0]
        out4 = out.view(h, -1, self.page_size, self.head_dim)  # [H, N, P, D]
        torch.mul(q.codes, q.scale.float(), out=out4).add_(q.zero.float())  # × [H, N, 1, D] + zero


class Int4Keys(Scheme):
    """int4 keys per channel over the page (KIVI), two codes per byte."""

    name, kind, role = sizes.INT4_KEYS, "int4", "k"
    per_channel = True

    def quantize(self, x: Tensor) -> quant.QuantizedPage:
        return quant.quantize_int4_keys(x)


class Int4Values(Scheme):
    """int4 values per token in groups of 32 channels (KIVI), two codes per byte."""

    name, kind, role = sizes.INT4_VALUES, "int4", "v"

    def quantize(self, x: Tensor) -> quant.QuantizedPage:
        return quant.quantize_int4_values(x, sizes.INT4_VALUE_GROUP)


def scheme_for(kind: str, role: str, head_dim: int, page_size: int) -> Scheme:
    """The scheme ``kind`` ("int8" | "int4") uses for ``role`` at this head dim and page size."""
    return registry[sizes.scheme_name(kind, role, head_dim, page_size)](head_dim, page_size)
