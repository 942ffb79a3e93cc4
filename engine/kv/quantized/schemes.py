"""KV quantization schemes: one class each (quantize / dequantize / allocate / bytes per token), one registry.

A scheme is what one role (K or V) of a quantized page store holds. ``scheme_for(kind, role, head_dim,
page_size)`` picks the layout by the rules of ``engine.kv.paged.sizes`` (the torch-free formulas the app's memory
estimate shares); the arithmetic lives in ``engine.kv.quantized.quant``.

Every method works on ``[..., T, D]`` (T = the tokens of one page): one page ``[H, P, D]`` or a layer's
pages ``[H, N, P, D]``. ``layer`` names the layer the pages belong to: the rotated schemes
(``engine.kv.quantized.tq_schemes``: tq4 / tq3 / tq2, keys with a QJL residual) rotate each layer and head by its
own seeded matrix; the int8 / int4 ones ignore it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kv.quantized import quant, tq_schemes  # noqa: F401 - tq_schemes registers the rotated schemes
from engine.kv.quantized.scheme_base import Scheme, registry  # noqa: F401 - re-exported
from engine.kv.paged import sizes


def _int8_table(signed: bool, device) -> tuple[Tensor, Tensor]:
    """The fused kernel's levels (unused at eight bits: zeros) and byte table ``[256]``: each byte's code as a float,
    read as int8 (``signed``) or uint8."""
    key = (signed, torch.device(device))
    if key not in _INT8_TABLES:
        b = torch.arange(256, dtype=torch.int32, device=key[1])
        codes = torch.where(b > 127, b - 256, b) if signed else b
        _INT8_TABLES[key] = (torch.zeros(16, dtype=torch.float32, device=key[1]), codes.float().contiguous())
    return _INT8_TABLES[key]


_INT8_TABLES: dict = {}


class Int8Tokens(Scheme):
    """int8, one scale per token and head (q8_0-like): values always, keys on short pages. The fused decode kernel
    reads a row as its codes times its scale (the kernel's norm)."""

    name, kind, role = sizes.INT8_TOKENS, "int8", "v"

    def fusable(self, device) -> bool:
        return True

    def fused_role(self, pages: quant.QInt8, tail: Tensor, layer: int):
        from engine.kv.quantized import tq_attend

        h = pages.codes.shape[0]
        norms = pages.scale.reshape(h, -1).float().contiguous()  # [H, rows]: each token's scale
        role = tq_attend.RolePages(tq_attend.row_view(pages.codes), norms, *_int8_table(True, pages.codes.device), 8,
                                   tail.float().contiguous(), mode=tq_attend.TQ)
        return role, None

    def quantize(self, x: Tensor, layer: int = 0) -> quant.QuantizedPage:
        return quant.quantize_int8(x)

    def dequantize_into(self, q, out, layer: int = 0) -> None:
        h = out.shape[0]
        scale = q.scale.reshape(h, -1, 1).to(out.dtype)  # [H, N*P, 1]
        torch.mul(q.codes.reshape(h, -1, self.head_dim), scale, out=out)  # codes × scale in one pass

    def bytes_per_token(self, kv_heads: int) -> float:
        return sizes.bytes_per_token("int8", "v", kv_heads, self.head_dim, self.page_size)


class Int8ChannelKeys(Scheme):
    """int8 keys per channel over the page (KIVI's key grouping at 8 bits), asymmetric."""

    name, kind, role = sizes.INT8_CHANNEL_KEYS, "int8", "k"
    per_channel = True

    def quantize(self, x: Tensor, layer: int = 0) -> quant.QuantizedPage:
        return quant.quantize_int8_keys(x)

    def fusable(self, device) -> bool:
        return True

    def fused_role(self, pages: quant.QInt8Keys, tail: Tensor, layer: int):
        """As int4 keys (code × scale + zero per page and channel), a byte a code."""
        from engine.kv.quantized import tq_attend

        h, n = pages.codes.shape[:2]
        scale = pages.scale.reshape(h, n, self.head_dim).float().contiguous()  # [H, N, D] per page and channel
        zero = pages.zero.reshape(h, n, self.head_dim).float().contiguous()
        role = tq_attend.RolePages(tq_attend.row_view(pages.codes), None, *_int8_table(False, pages.codes.device), 8,
                                   tail.float().contiguous(), mode=tq_attend.INT4_KEYS, page_size=self.page_size,
                                   scale=scale, zero=zero)
        return role, None

    def dequantize_into(self, q, out, layer: int = 0) -> None:
        if out.dtype != torch.float32:  # computed in float32, one rounding to the cache dtype
            return super().dequantize_into(q, out)
        h = out.shape[0]
        out4 = out.view(h, -1, self.page_size, self.head_dim)  # [H, N, P, D]
        torch.mul(q.codes, q.scale.float(), out=out4).add_(q.zero.float())  # × [H, N, 1, D] + zero


_INT4_TABLES: dict = {}  # by device: the levels and the byte table the int4 layouts share


class _Int4(Scheme):
    """What the int4 layouts share: the fused decode kernel reads their nibbles as codes 0..15."""

    def fusable(self, device) -> bool:
        return self.head_dim % 2 == 0 and self.head_dim % self._group() == 0

    def _group(self) -> int:
        return self.head_dim

    def _codes(self, device) -> tuple[Tensor, Tensor]:
        """The levels 0..15 and the byte table ``[256, 2]`` (low nibble, high nibble)."""
        key = torch.device(device)
        if key not in _INT4_TABLES:
            b = torch.arange(256, device=key)
            _INT4_TABLES[key] = (torch.arange(16, dtype=torch.float32, device=key),
                                  torch.stack([b & 15, b >> 4], 1).float().contiguous())
        return _INT4_TABLES[key]


class Int4Keys(_Int4):
    """int4 keys per channel over the page (KIVI), two codes per byte."""

    name, kind, role = sizes.INT4_KEYS, "int4", "k"
    per_channel = True

    def quantize(self, x: Tensor, layer: int = 0) -> quant.QuantizedPage:
        return quant.quantize_int4_keys(x)

    def fused_role(self, pages: quant.QInt4, tail: Tensor, layer: int):
        from engine.kv.quantized import tq_attend

        h, n = pages.codes.shape[:2]
        scale = pages.scale.reshape(h, n, self.head_dim).float().contiguous()  # [H, N, D] per page and channel
        zero = pages.zero.reshape(h, n, self.head_dim).float().contiguous()
        role = tq_attend.RolePages(tq_attend.row_view(pages.codes), None, *self._codes(pages.codes.device), 4,
                                   tail.float().contiguous(), mode=tq_attend.INT4_KEYS, page_size=self.page_size,
                                   scale=scale, zero=zero)
        return role, None


class Int4Values(_Int4):
    """int4 values per token in groups of 32 channels (KIVI), two codes per byte."""

    name, kind, role = sizes.INT4_VALUES, "int4", "v"

    def quantize(self, x: Tensor, layer: int = 0) -> quant.QuantizedPage:
        return quant.quantize_int4_values(x, sizes.INT4_VALUE_GROUP)

    def _group(self) -> int:
        return min(sizes.INT4_VALUE_GROUP, self.head_dim)

    def fused_role(self, pages: quant.QInt4, tail: Tensor, layer: int):
        from engine.kv.quantized import tq_attend

        h, rows = pages.codes.shape[0], pages.codes.shape[1] * pages.codes.shape[2]
        groups = self.head_dim // self._group()
        scale = pages.scale.reshape(h, rows, groups).float().contiguous()  # [H, rows, G] per token and group
        zero = pages.zero.reshape(h, rows, groups).float().contiguous()
        role = tq_attend.RolePages(tq_attend.row_view(pages.codes), None, *self._codes(pages.codes.device), 4,
                                   tail.float().contiguous(), mode=tq_attend.INT4_VALUES, group=self._group(),
                                   scale=scale, zero=zero)
        return role, None


def scheme_for(kind: str, role: str, head_dim: int, page_size: int) -> Scheme:
    """The scheme ``kind`` (``sizes.KINDS``: int8, int4, tq4 / tq3 / tq2, tqB-qjl keys) uses for ``role`` at this head
    dim and page size."""
    return registry[sizes.scheme_name(kind, role, head_dim, page_size)](head_dim, page_size, role)

