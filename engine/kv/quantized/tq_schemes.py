"""The rotated low-bit schemes (TurboQuant-class): ``tq4`` / ``tq3`` / ``tq2`` for keys or values, and
``tq4-qjl`` / ``tq3-qjl`` / ``tq2-qjl`` for keys (one of the bits a QJL sign of the residual).

One class per layout, registered with the others in ``engine.kv.quantized.schemes``; the arithmetic is
``engine.kv.quantized.turbo``, the matrices ``rotation``, the codebooks ``codebook``, the bytes ``engine.kv.paged.sizes``.
Each layer, head and role has its own seeded rotation (and QJL projection), built on first use and kept per device
(at 30 layers × 3 heads × 64² float32: 1.5 MB a role, not counted as KV bytes).

Pages read back two ways: in the original basis (``dequantize_into``: the stores' default, every consumer's), or
rotated (``read_rotated_into`` + ``rotate`` for the full-precision tail + ``read_map``), which the attention turns
its queries and output for (``engine.kv.quantized.basis``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from engine.kv.paged import sizes
from engine.kv.quantized import codebook, rotation, tq_attend, turbo
from engine.kv.quantized.scheme_base import Scheme


class _Turbo(Scheme):
    """Rotated codes + a norm a vector (``qjl``: keys with the residual's QJL signs and norm)."""

    kind: ClassVar[str]
    qjl: ClassVar[bool] = False
    rotated = True

    def __init__(self, head_dim: int, page_size: int, role: str | None = None) -> None:
        super().__init__(head_dim, page_size, role)
        self.bits = sizes.tq_bits(self.kind) - (1 if self.qjl else 0)  # bits of the codes
        self._centroids = torch.from_numpy(codebook.centroids(head_dim, self.bits))  # [2^bits]
        self._thresholds = torch.from_numpy(codebook.thresholds(head_dim, self.bits))  # [2^bits - 1]
        self._mats: dict[tuple, tuple[Tensor, Tensor | None]] = {}
        self._maps: dict[tuple, Tensor] = {}
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._pairs: dict[torch.device, Tensor | None] = {}  # two bytes of codes → their levels (4 and 2 bits)
        self._fused: dict[object, tuple[Tensor, Tensor]] = {}  # a byte of codes → their levels, for the fused kernel

    @property
    def width(self) -> int:
        """Width of a vector read in the rotated basis (QJL keys carry the projected residual beside it)."""
        return 2 * self.head_dim if self.qjl else self.head_dim

    def _table(self, device) -> tuple[Tensor, Tensor]:
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = (self._centroids.to(device), self._thresholds.to(device))
        return self._tables[device]

    def matrices(self, layer: int, heads: int, device) -> tuple[Tensor, Tensor | None]:
        """(R ``[H, D, D]``, S ``[H, D, D]`` or None) of ``layer``, float32 on ``device``."""
        key = (layer, heads, torch.device(device))
        if key not in self._mats:
            rot = rotation.stack(rotation.rotation, heads, self.head_dim, layer, self.role, device)
            proj = rotation.stack(rotation.qjl, heads, self.head_dim, layer, self.role, device) if self.qjl else None
            self._mats[key] = (rot, proj)
        return self._mats[key]

    # -- the Scheme surface (original basis) ----------------------------------------------------------
    def quantize(self, x: Tensor, layer: int = 0) -> turbo.QTurbo:
        rot, proj = self.matrices(layer, x.shape[0], x.device)
        c, th = self._table(x.device)
        return turbo.quantize(x, rot, c, th, self.bits, proj)

    def dequantize(self, q: turbo.QTurbo, dtype: torch.dtype, layer: int = 0) -> Tensor:
        rot, proj = self.matrices(layer, q.codes.shape[0], q.codes.device)
        return turbo.dequantize(q, rot, self._table(q.codes.device)[0], proj).to(dtype)

    def dequantize_into(self, q: turbo.QTurbo, out: Tensor, layer: int = 0) -> None:
        out.copy_(self.dequantize(q, torch.float32, layer).reshape(out.shape[0], -1, self.head_dim))

    def allocate(self, lead: tuple[int, ...], device) -> turbo.QTurbo:
        return turbo.allocate(lead, self.page_size, self.head_dim, self.bits, self.qjl, device)

    def bytes_per_token(self, kv_heads: int) -> float:
        return sizes.bytes_per_token(self.kind, self.role, kv_heads, self.head_dim, self.page_size)

    # -- the rotated basis --------------------------------------------------------------------------
    def read_rotated_into(self, q: turbo.QTurbo, out: Tensor, layer: int = 0) -> None:
        """Pages ``q`` ``[H, N, P, ...]`` into ``out`` ``[H, N*P, width]`` without turning them back: ŷ (and, for
        QJL keys, α‖r‖z beside it)."""
        h, d = out.shape[0], self.head_dim
        c = self._table(q.codes.device)[0]
        out4 = out.view(h, -1, self.page_size, out.shape[-1])  # [H, N, P, width]
        dev = q.codes.device
        if dev not in self._pairs:
            self._pairs[dev] = turbo.pair_table(c, self.bits)
        vals = turbo.levels(q.codes, d, self.bits, c, self._pairs[dev])  # [H, N, P, D] float32 levels
        if self.qjl:
            out4[..., :d].copy_(vals.mul_(q.norm.float()))
            out4[..., d:].copy_(turbo.qjl_signs(q))
        elif out.dtype == torch.float32:
            torch.mul(vals, q.norm.float(), out=out4)  # levels × norm in one pass
        else:
            out4.copy_(vals.mul_(q.norm.float()))

    def fused_table(self, device) -> tuple[Tensor, Tensor] | None:
        """The fused decode kernel's tables (``engine.kv.quantized.tq_attend.RolePages``: the levels padded to 16,
        the byte table), or None where the kernel does not read this layout (QJL keys; a head_dim whose codes do
        not fill whole bytes)."""
        d, g = self.head_dim, 8 // self.bits if self.bits in (4, 2) else 4
        if d % (8 if self.bits == 3 or self.qjl else g):
            return None
        device = torch.device(device)
        if device not in self._fused:
            c = self._table(device)[0]
            t = turbo.table3(c) if self.bits == 3 else c[turbo.byte_fields(self.bits, device)]  # [4096, 4] / [256, g]
            padded = torch.zeros(16, dtype=torch.float32, device=device)
            padded[:c.numel()] = c
            self._fused[device] = (padded, t.float().contiguous())
        return self._fused[device]

    def fusable(self, device) -> bool:
        return self.fused_table(device) is not None

    def fused_role(self, pages: turbo.QTurbo, tail: Tensor, layer: int):
        h, dev = pages.codes.shape[0], pages.codes.device
        rows = pages.codes.shape[1] * pages.codes.shape[2]
        codes = tq_attend.row_view(pages.codes)  # [H, rows, C]
        norms = pages.norm.reshape(h, rows).float().contiguous()  # [H, rows]
        exact = self.rotate(tail, layer).float().contiguous()  # [H, fill, width]
        signs = self.fused_signs(pages) if self.qjl else (None, None, None)
        role = tq_attend.RolePages(codes, norms, *self.fused_table(dev), self.bits, exact, *signs)
        return role, self.read_map(layer, h, dev, tail.dtype)

    def fused_signs(self, q: turbo.QTurbo) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """QJL keys' residual for the fused kernel: signs ``[H, rows, D/8]``, ‖r‖·√(π/2)/D float32 ``[H, rows]``,
        and the sign tables ({-1, +1} padded to 16, ``[256, 8]``)."""
        h, dev = q.signs.shape[0], q.signs.device
        if ("signs", dev) not in self._fused:
            pm = torch.tensor([-1.0, 1.0], device=dev)
            padded = torch.zeros(16, dtype=torch.float32, device=dev)
            padded[:2] = pm
            self._fused[("signs", dev)] = (padded, pm[turbo.byte_fields(1, dev)].float().contiguous())  # [256, 8]
        rows = q.signs.shape[1] * q.signs.shape[2]
        signs = q.signs.reshape(h, rows, q.signs.shape[-1])  # [H, rows, D/8]
        scale = q.rnorm.reshape(h, rows).float() * (turbo.QJL_SCALE / self.head_dim)  # [H, rows]
        return signs, scale.contiguous(), self._fused[("signs", dev)]

    def rotate(self, x: Tensor, layer: int = 0) -> Tensor:
        """Full-precision vectors ``[H, T, D]`` into the rotated read basis ``[H, T, width]`` (exact: QJL keys get
        zeros for the residual part)."""
        rot, _ = self.matrices(layer, x.shape[0], x.device)
        y = turbo.rotate(x.float(), rot)  # [H, T, D]
        if self.qjl:
            y = torch.cat([y, torch.zeros_like(y)], dim=-1)  # [H, T, 2D]
        return y.to(x.dtype)

    def read_map(self, layer: int, heads: int, device, dtype: torch.dtype) -> Tensor:
        """What the attention turns by: keys M ``[H, width, D]`` (queries become q @ Mᵀ), values R ``[H, D, D]``."""
        key = (layer, heads, torch.device(device), dtype)
        if key not in self._maps:
            rot, proj = self.matrices(layer, heads, device)
            m = torch.cat([rot, torch.matmul(proj, rot)], dim=-2) if self.qjl else rot  # [H, width, D]
            self._maps[key] = m.to(dtype)
        return self._maps[key]


class Turbo4(_Turbo):
    name, kind = sizes.TQ_MSE[4], "tq4"


class Turbo3(_Turbo):
    name, kind = sizes.TQ_MSE[3], "tq3"


class Turbo2(_Turbo):
    name, kind = sizes.TQ_MSE[2], "tq2"


class TurboQJL4(_Turbo):
    name, kind, qjl = sizes.TQ_QJL[4], "tq4-qjl", True


class TurboQJL3(_Turbo):
    name, kind, qjl = sizes.TQ_QJL[3], "tq3-qjl", True


class TurboQJL2(_Turbo):
    name, kind, qjl = sizes.TQ_QJL[2], "tq2-qjl", True
