"""What a page store keeps for K and for V: a *role*, at full precision or quantized, composed into
``engine.kv.store.storage.PagedKV`` (one role object per K and per V, no subclassing).

Each role has two halves:

- the arena half (``FullRole`` / ``QuantRole``), shared by every session of a model: the page tensors of
  every layer, grown all or nothing by ``PageArena``;
- the session half (``FullView`` / ``QuantView``): how one session writes and reads its pages, given a
  ``DevicePlan`` (its block table's ``SlotPlan`` plus index tensors made once per forward).

Layouts, per layer: full precision ``[kv_heads, num_pages * P, head_dim]`` (token axis in the middle, so a
run of pages is one strided view); quantized ``[kv_heads, num_pages, P, ...]`` page objects of a
``engine.kv.quantized.schemes`` scheme. A quantized role keeps the page being filled (its *tail*) in full precision
per session, and quantizes it once full (KIVI's residual; per-channel keys need a whole page).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kv.quantized import quant
from engine.kv.paged.block_table import SlotPlan
from engine.kv.paged.pool import FLAG_QUANTIZED, PagePool
from engine.kv.quantized.schemes import Scheme
from engine.kv.quantized.tq_attend import RolePages  # noqa: F401 - named in a signature


@dataclass
class DevicePlan:
    """A ``SlotPlan`` with its index tensors on the device (made once, used by every layer)."""

    plan: SlotPlan
    slots: Tensor | None  # [end] physical slots, None when the pages are one run
    pages: Tensor  # [n_pages] page ids

    @classmethod
    def of(cls, plan: SlotPlan, device) -> "DevicePlan":
        pages = torch.tensor(plan.pages, dtype=torch.long, device=device)  # [n_pages]
        slots = None
        if plan.run_start is None and plan.end:  # page p's slots are p*P .. p*P+P-1 (no Python loop over tokens)
            P = plan.page_size
            slots = (pages[:, None] * P + torch.arange(P, device=device)).reshape(-1)[:plan.end]  # [end]
        return cls(plan, slots, pages)


@dataclass(frozen=True)
class KVShape:
    """What a group of layers caches: K ``[k_heads, T, k_dim]`` and V ``[v_heads, T, v_dim]`` per layer (MLA
    caches keys wider than values; ``v_heads``/``v_dim`` default to the keys')."""

    num_layers: int
    kv_heads: int  # K heads
    head_dim: int  # K width
    dtype: torch.dtype
    device: torch.device
    v_heads: int = 0  # 0: as K
    v_dim: int = 0

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize  # (a snapshot reads it a few times a token: no tensor made to ask)

    def of(self, role: str) -> tuple[int, int]:
        """(heads, width) of ``role`` "k" or "v"."""
        if role == "k":
            return self.kv_heads, self.head_dim
        return self.v_heads or self.kv_heads, self.v_dim or self.head_dim

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in one layer, K and V, at full precision."""
        (hk, dk), (hv, dv) = self.of("k"), self.of("v")
        return (hk * dk + hv * dv) * self.elem_bytes


# -------------------------------------------------------------------------------------- full precision
LAZY_BYTES = 1 << 20  # page tensors this large, on the CPU, get a mapping of their own (``page_zeros``)


def page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """``torch.zeros(shape)``, where a large CPU tensor is an anonymous mapping of its own: the OS hands out zero
    pages as they are first written, so the pages no token reached take no memory. An arena's first pages are
    sized for 2,048 tokens (a 1B model's float32 K/V: 128 MiB), and zeroing them all made a 190-token chat hold
    them all (+116 MiB resident against its 12). Marked for 4 KiB pages: under THP "always" one written token
    would bring in 2 MiB, four heads' rows (the decode reads a few KiB a head and page, no TLB wall)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    anon = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, nbytes, flags=anon) if anon else mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


class FullRole:
    """K or V pages at the model's precision: per layer ``[H, num_pages * P, D]``."""

    quantized = False

    def __init__(self, shape: KVShape, page_size: int, role: str = "k") -> None:
        self.shape, self.page_size = shape, page_size
        self.heads, self.dim = shape.of(role)
        self.layers: list[Tensor] = []

    def page_bytes(self) -> int:
        """Bytes one page of one layer holds."""
        return self.heads * self.page_size * self.dim * self.shape.elem_bytes

    def allocate(self, num_pages: int) -> list[Tensor]:
        s = self.shape
        return [page_zeros((self.heads, num_pages * self.page_size, self.dim), s.dtype, s.device)  # [H, n*P, D]
                for _ in range(s.num_layers)]

    def install(self, new: list[Tensor], keep_pages: int) -> None:
        """Use ``new`` from now on, with the first ``keep_pages`` pages copied from the old tensors."""
        n = keep_pages * self.page_size
        for old, t in zip(self.layers, new):
            t[:, :n].copy_(old[:, :n])  # [H, n, D]
        self.layers = new

    def copy_page(self, src: int, dst: int) -> None:
        P = self.page_size
        for t in self.layers:
            t[:, dst * P:(dst + 1) * P].copy_(t[:, src * P:(src + 1) * P])  # [H, P, D]

    def view(self) -> "FullView":
        return FullView(self)


class FullView:
    """A session's reads and writes of a ``FullRole``."""

    def __init__(self, role: FullRole) -> None:
        self.role = role

    def begin(self, start: int, q: int) -> None:
        pass

    def rollback(self, start: int) -> None:
        pass

    def write(self, layer: int, x: Tensor, start: int, dp: DevicePlan, pool: PagePool | None = None) -> None:
        """``x``: [H, q, D], the tokens at positions ``[start, start + q)``."""
        t = self.role.layers[layer]  # [H, S, D]
        run = dp.plan.run_start
        if run is not None:
            t[:, run + start:run + start + x.shape[1]].copy_(x)  # one run of slots
        else:
            t.index_copy_(1, dp.slots[start:start + x.shape[1]], x)  # scatter into page slots

    def read(self, layer: int, n: int, dp: DevicePlan) -> Tensor:
        """Tokens ``[0, n)``: [H, n, D], a view when the pages are one run, else a gather of whole pages (blocks
        of P*D contiguous values: ~1.7x faster than gathering token rows)."""
        t = self.role.layers[layer]
        run = dp.plan.run_start
        if run is not None:
            return t[:, run:run + n]
        P = self.role.page_size
        H, S, D = t.shape
        pages = dp.pages[:-(-n // P)]
        return t.view(H, S // P, P, D).index_select(1, pages).view(H, -1, D)[:, :n]  # [H, n, D]

    def read_basis(self, layer: int, n: int, dp: DevicePlan) -> tuple[Tensor, None]:
        """As ``read``: full-precision pages are never rotated."""
        return self.read(layer, n, dp), None

    def read_fused(self, layer: int, n: int, dp: DevicePlan) -> None:
        """Full-precision pages are never read by the fused tq kernel."""
        return None

    def truncate(self, old_n: int, n: int, dp: DevicePlan) -> None:
        pass

    def bytes_held(self, n: int, pages: int) -> int:
        return pages * self.role.page_bytes()

    def to_host(self, layer: int, n: int, dp: DevicePlan, host) -> tuple[Tensor, int]:
        t = host(self.read(layer, n, dp))  # [H, n, D]
        return t, t.numel() * t.element_size()

    def from_host(self, layer: int, data: Tensor, dp: DevicePlan, pool: PagePool, start: int = 0) -> None:
        """Tokens ``[start, n)`` of ``data`` [H, n, D] back into the pages (those before ``start`` were taken back
        from the prefix cache)."""
        self.write(layer, data[:, start:].to(self.role.shape.device, non_blocking=True), start, dp)

    def copy_from(self, other: "FullView") -> None:
        pass


# ------------------------------------------------------------------------------------------- quantized


class QuantRole:
    """K or V pages held as a quantization ``scheme``: per layer ``[H, num_pages, P, ...]``."""

    quantized = True

    def __init__(self, shape: KVShape, page_size: int, scheme: Scheme, role: str = "k") -> None:
        self.shape, self.page_size, self.scheme = shape, page_size, scheme
        self.heads, self.dim = shape.of(role)
        self.layers: list[quant.QuantizedPage] = []

    def page_bytes(self) -> int:
        return int(round(self.scheme.bytes_per_token(self.heads) * self.page_size))

    def full_page_bytes(self) -> int:
        """Bytes of a page still being filled (the session's full-precision tail)."""
        return self.heads * self.page_size * self.dim * self.shape.elem_bytes

    def allocate(self, num_pages: int) -> list[quant.QuantizedPage]:
        return [self.scheme.allocate((self.heads, num_pages), self.shape.device) for _ in range(self.shape.num_layers)]

    def install(self, new: list, keep_pages: int) -> None:
        for old, q in zip(self.layers, new):
            q.put((slice(None), slice(0, keep_pages)), old[:, :keep_pages])
        self.layers = new

    def copy_page(self, src: int, dst: int) -> None:
        for q in self.layers:
            q.put((slice(None), dst), q[:, src])  # [H, P, ...]

    def view(self) -> "QuantView":
        return QuantView(self)


class QuantView:
    """A session's quantized pages: full pages in the arena, the page being filled in its own tail."""

    def __init__(self, role: QuantRole) -> None:
        self.role = role
        s = role.shape
        # full-precision tail page per layer: [H, P, D]
        self.tail = [torch.zeros((role.heads, role.page_size, role.dim), dtype=s.dtype, device=s.device)
                     for _ in range(s.num_layers)]
        self._saved: list[Tensor] | None = None  # the tail before a forward that may overwrite it
        self._buf: Tensor | None = None  # one layer dequantized: [H, capacity, D], reused

    def begin(self, start: int, q: int) -> None:
        """Before writing ``[start, start+q)``: keep the tail if the write may spill past its page."""
        off = start % self.role.page_size
        self._saved = [t[:, :off].clone() for t in self.tail] if off and off + q >= self.role.page_size else None

    def rollback(self, start: int) -> None:
        """The forward failed: the tail holds positions ``[start - off, start)`` again."""
        if self._saved is not None:
            for t, saved in zip(self.tail, self._saved):
                t[:, :saved.shape[1]].copy_(saved)
        self._saved = None

    def write(self, layer: int, x: Tensor, start: int, dp: DevicePlan, pool: PagePool | None = None) -> None:
        """``x``: [H, q, D] at positions ``[start, start + q)``: whole pages quantized straight from ``x``,
        the rest through the tail (quantized the moment its page is complete)."""
        role, P = self.role, self.role.page_size
        store, tail = role.layers[layer], self.tail[layer]  # [H, N, P, ...], [H, P, D]
        q, i = x.shape[1], 0
        while i < q:
            pos = start + i
            off, page_i = pos % P, pos // P
            if off == 0 and q - i >= P:
                m = (q - i) // P
                block = x[:, i:i + m * P].reshape(x.shape[0], m, P, x.shape[2])  # [H, m, P, D]
                ids = dp.pages[page_i:page_i + m]
                store.put((slice(None), ids), role.scheme.quantize(block, layer))
                self._flag(pool, dp.plan.pages[page_i:page_i + m])
                i += m * P
                continue
            take = min(P - off, q - i)
            tail[:, off:off + take].copy_(x[:, i:i + take])  # [H, take, D]
            i += take
            if off + take == P:
                store.put((slice(None), dp.plan.pages[page_i]), role.scheme.quantize(tail, layer))
                self._flag(pool, dp.plan.pages[page_i:page_i + 1])

    @staticmethod
    def _flag(pool: PagePool | None, pages) -> None:
        if pool is not None:
            for p in pages:
                pool.set_flag(p, FLAG_QUANTIZED)

    def _buffer(self, n: int, width: int) -> Tensor:
        """A reused ``[H, >= n, width]`` buffer (one layer at a time; grown by doubling)."""
        role, buf = self.role, self._buf
        P, s = role.page_size, role.shape
        if buf is None or buf.shape[1] < n or buf.shape[2] != width:
            held = buf.shape[1] if buf is not None else 0
            # doubled only when the tokens outgrow it: a read of another width (QJL keys rotated are 2 D wide, read
            # back turned D) keeps the size; doubling on every change of width asked for 64 GB after 30 steps
            cap = held if held >= n else max(n, 2 * max(held, P))
            with torch.inference_mode(False):  # a normal tensor: also written by switches outside a forward
                buf = torch.empty((role.heads, -(-cap // P) * P, width), dtype=s.dtype, device=s.device)
            self._buf = buf
        return buf

    def _full_pages(self, layer: int, full: int, dp: DevicePlan):
        store = self.role.layers[layer]  # [H, N, P, ...]
        first = dp.plan.full_run  # a run of the plan's full pages is a run of any prefix of them
        return store[:, first:first + full] if first is not None else store[:, dp.pages[:full]]  # [H, full, P, ...]

    def read(self, layer: int, n: int, dp: DevicePlan) -> Tensor:
        """Tokens ``[0, n)`` dequantized: [H, n, D] (a view of a reused buffer; one layer at a time)."""
        P = self.role.page_size
        full, fill = divmod(n, P)
        buf = self._buffer(n, self.role.dim)
        if full:
            self.role.scheme.dequantize_into(self._full_pages(layer, full, dp), buf[:, :full * P], layer)
        if fill:
            buf[:, full * P:n].copy_(self.tail[layer][:, :fill])  # [H, fill, D]
        return buf[:, :n]

    def read_basis(self, layer: int, n: int, dp: DevicePlan) -> tuple[Tensor, Tensor | None]:
        """Tokens ``[0, n)`` as attention can take them: a rotated scheme's pages left rotated, with the matrix the
        attention turns by (``engine.kv.quantized.basis``); any other scheme's as ``read`` (and None)."""
        scheme = self.role.scheme
        if not scheme.rotated:
            return self.read(layer, n, dp), None
        P = self.role.page_size
        full, fill = divmod(n, P)
        buf = self._buffer(n, scheme.width)  # [H, cap, width]
        if full:
            scheme.read_rotated_into(self._full_pages(layer, full, dp), buf[:, :full * P], layer)
        if fill:
            buf[:, full * P:n].copy_(scheme.rotate(self.tail[layer][:, :fill], layer))  # [H, fill, width]
        return buf[:, :n], scheme.read_map(layer, self.role.heads, buf.device, buf.dtype)

    def read_fused(self, layer: int, n: int, dp: DevicePlan) -> tuple[RolePages, Tensor | None] | None:
        """Tokens ``[0, n)`` left as codes for the fused decode kernel (``engine.kv.quantized.tq_attend``), with the
        matrix the attention turns by (None: not rotated); None where the kernel does not read this scheme."""
        scheme = self.role.scheme
        if not scheme.fusable(self.role.shape.device):
            return None
        full, fill = divmod(n, self.role.page_size)
        return scheme.fused_role(self._full_pages(layer, full, dp), self.tail[layer][:, :fill], layer)

    def truncate(self, old_n: int, n: int, dp: DevicePlan) -> None:
        """Keep ``[0, n)``: when the new last page was full (quantized), bring it back to the tail."""
        P = self.role.page_size
        if n % P and (n // P + 1) * P <= old_n:
            page = dp.plan.pages[n // P]
            for layer, t in enumerate(self.tail):
                t.copy_(self.role.scheme.dequantize(self.role.layers[layer][:, page], t.dtype, layer))  # [H, P, D]

    def bytes_held(self, n: int, pages: int) -> int:
        full = n // self.role.page_size
        return full * self.role.page_bytes() + (pages - full) * self.role.full_page_bytes()

    def to_host(self, layer: int, n: int, dp: DevicePlan, host) -> tuple[tuple, int]:
        """The pages as held (codes + scales) and the tail in full precision, on the host."""
        full, fill = divmod(n, self.role.page_size)
        q = quant.map_tensors(self.role.layers[layer][:, dp.pages[:full]], host)  # [H, full, P, ...]
        tail = host(self.tail[layer][:, :fill])  # [H, fill, D]
        return (q, tail), q.nbytes + tail.numel() * tail.element_size()

    def from_host(self, layer: int, data: tuple, dp: DevicePlan, pool: PagePool, start: int = 0) -> None:
        if start:
            raise ValueError("quantized pages are never taken back from the prefix cache")
        q, tail = data
        full = dp.plan.full_pages
        dev = self.role.shape.device
        if full:
            self.role.layers[layer].put((slice(None), dp.pages[:full]),
                                        quant.map_tensors(q, lambda t: t.to(dev, non_blocking=True)))
            self._flag(pool, dp.plan.pages[:full])
        if tail.shape[1]:
            self.tail[layer][:, :tail.shape[1]].copy_(tail)

    def copy_from(self, other: "QuantView") -> None:
        for mine, theirs in zip(self.tail, other.tail):
            mine.copy_(theirs)


def make_role(kind: str, shape: KVShape, page_size: int, role: str):
    """The arena half of a role: ``kind`` "auto" (model precision) or a quantized kind."""
    if kind == "auto":
        return FullRole(shape, page_size, role)
    from engine.kv.quantized.schemes import scheme_for

    return QuantRole(shape, page_size, scheme_for(kind, role, shape.of(role)[1], page_size), role)
