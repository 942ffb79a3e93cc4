"""A paged store whose full pages are held quantized (int8 or int4, per K and per V).

The page being filled (the *tail*) stays in full precision in a small per-session buffer
``[kv_heads, page_size, head_dim]`` per layer and role; the moment it is full it is quantized into the
arena's page storage (KIVI's residual: int4 keys, and int8 keys where that is no dearer, are grouped per
channel over a whole page, so a key page can only be quantized once complete). Reads dequantize one layer
at a time: the pages of that layer in one batched call, then the tail, so the transient full-precision
copy is one layer's K or V, never the cache.

A role left at ``auto`` is stored exactly as ``PagedKV`` stores it.
"""

from __future__ import annotations

import torch

from engine.kv import quant
from engine.kv.pool import FLAG_QUANTIZED
from engine.kv.storage import HostKV, PageArena, PagedKV, host_copy

ROLES = ("k", "v")


class QuantPagedKV(PagedKV):
    def __init__(self, arena: PageArena, session_id: int = -1, table=None) -> None:
        super().__init__(arena, session_id, table)
        P, H, D = arena.page_size, arena.kv_heads, arena.head_dim
        self.kinds = dict(arena.kinds)
        # full-precision tail page per quantized role and layer: [H, P, D]
        self.tail = {r: [torch.zeros((H, P, D), dtype=arena.dtype, device=arena.device)
                         for _ in range(arena.num_layers)] if self.kinds[r] != "auto" else []
                     for r in ROLES}
        self._pages_t: torch.Tensor | None = None
        self._buf: dict[str, torch.Tensor] = {}  # one layer's dequantized K or V: [H, capacity, D], reused

    # -- writing -----------------------------------------------------------------------------------------
    def begin_forward(self, n_new: int, owner: int = -1) -> None:
        super().begin_forward(n_new, owner)
        self._pages_t = torch.tensor(self.table.pages, dtype=torch.long, device=self.arena.device)

    def _write_role(self, role: str, layer: int, x: torch.Tensor) -> None:
        """``x``: [H, q, D], the new tokens at positions [n_before, n_before + q)."""
        arena = self.arena
        P = arena.page_size
        kind = self.kinds[role]
        tail = self.tail[role][layer]  # [H, P, D]
        store = arena.q[role][layer]  # [H, N, P, ...]
        pool = arena.pool
        pos, q, i = self._n_before, x.shape[1], 0
        while i < q:
            off = (pos + i) % P
            page = self.table.pages[(pos + i) // P]
            if off == 0 and q - i >= P:  # whole pages straight from x, quantized in one call
                m = (q - i) // P
                block = x[:, i:i + m * P].reshape(x.shape[0], m, P, x.shape[2])  # [H, m, P, D]
                ids = self._pages_t[(pos + i) // P:(pos + i) // P + m]
                store.put((slice(None), ids), quant.quantize(kind, block, role))
                for p in ids.tolist():
                    pool.set_flag(p, FLAG_QUANTIZED)
                i += m * P
                continue
            take = min(P - off, q - i)
            tail[:, off:off + take].copy_(x[:, i:i + take])  # [H, take, D]
            i += take
            if off + take == P:  # the tail page is complete: quantize it
                store.put((slice(None), page), quant.quantize(kind, tail, role))
                pool.set_flag(page, FLAG_QUANTIZED)

    def _read_role(self, role: str, layer: int, n: int) -> torch.Tensor:
        """All ``n`` tokens of a role in a layer, dequantized: [H, n, D] (a view of a reused buffer)."""
        arena = self.arena
        P, H, D = arena.page_size, arena.kv_heads, arena.head_dim
        full, fill = divmod(n, P)
        buf = self._buf.get(role)
        if buf is None or buf.shape[1] < n:
            cap = max(n, 2 * (buf.shape[1] if buf is not None else P))
            with torch.inference_mode(False):  # a normal tensor: also written by switches outside a forward
                buf = torch.empty((H, -(-cap // P) * P, D), dtype=arena.dtype, device=arena.device)
            self._buf[role] = buf
        if full:
            store = arena.q[role][layer]  # [H, N, P, ...]
            pages = self._pages_t[:full]
            first = int(pages[0])
            if int(pages[-1]) - first == full - 1:  # one run of pages: views, no gather
                q = store[:, first:first + full]
            else:
                q = store[:, pages]  # [H, full, P, ...] gathered
            dst = buf[:, :full * P]  # [H, full*P, D]
            if isinstance(q, quant.QInt8):
                scale = q.scale.reshape(H, full * P, 1).to(arena.dtype)  # [H, full*P, 1] (small)
                torch.mul(q.codes.reshape(H, full * P, D), scale, out=dst)  # codes × scale in one pass
            elif isinstance(q, quant.QInt8Keys) and arena.dtype == torch.float32:
                dst4 = dst.view(H, full, P, D)  # [H, full, P, D]
                torch.mul(q.codes, q.scale.float(), out=dst4).add_(q.zero.float())  # × [H, full, 1, D] + zero
            else:  # computed in float32, one rounding to the cache dtype
                dst.copy_(quant.dequantize(q, arena.dtype).reshape(H, full * P, D))
        if fill:
            buf[:, full * P:n].copy_(self.tail[role][layer][:, :fill])  # [H, fill, D]
        return buf[:, :n]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for role, x in (("k", k), ("v", v)):
            if self.kinds[role] == "auto":
                self._write_fp(role, layer, x)
            else:
                self._write_role(role, layer, x)

    def _write_fp(self, role: str, layer: int, x: torch.Tensor) -> None:
        t = (self.arena.k if role == "k" else self.arena.v)[layer]  # [H, S, D]
        if self._wslots is None:
            s = self._write_start
            t[:, s:s + x.shape[1]].copy_(x)
        else:
            t.index_copy_(1, self._wslots, x)

    def _read_fp(self, role: str, layer: int, n: int) -> torch.Tensor:
        t = (self.arena.k if role == "k" else self.arena.v)[layer]
        if self._read is None:
            s = self._read_start
            return t[:, s:s + n]
        return t.index_select(1, self._read[:n])

    def update(self, layer, k, v):
        self._write(layer, k[0], v[0])  # k: [1, H, q, D]
        n = self._n_before + self._n_new
        out = []
        for role in ROLES:
            if self.kinds[role] == "auto":
                out.append(self._read_fp(role, layer, n))
            else:
                out.append(self._read_role(role, layer, n))
        return out[0][None], out[1][None]  # [1, H, n, D]

    def end_forward(self) -> None:
        super().end_forward()
        self._pages_t = None

    # -- table changes -------------------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        old = self.table.num_tokens
        P = self.arena.page_size
        if n % P and n < old and (n // P + 1) * P <= old:
            # the new last page was full (quantized): bring it back to the full-precision tail
            page = self.table.pages[n // P]
            for role in ROLES:
                if self.kinds[role] == "auto":
                    continue
                for layer in range(self.num_layers):
                    page_q = self.arena.q[role][layer][:, page]  # [H, P, ...]
                    self.tail[role][layer].copy_(quant.dequantize(page_q, self.arena.dtype))
        super().truncate(n)
        if n % P and self.table.pages and self.arena.pool.ref[self.table.pages[-1]] == 1:
            self.arena.pool.set_flag(self.table.pages[-1], FLAG_QUANTIZED, False)

    def read_layer(self, layer):
        table = self._source_table
        n = table.num_tokens
        dev = self.arena.device
        saved = self._pages_t, self._read, self._read_start
        self._pages_t = torch.tensor(table.pages, dtype=torch.long, device=dev)
        start = table.contiguous_start()
        if start is not None:
            self._read, self._read_start = None, start
        else:
            self._read = torch.tensor(table.slots(0, n), dtype=torch.long, device=dev)
        try:
            out = []
            for role in ROLES:
                if self.kinds[role] == "auto":
                    out.append(self._read_fp(role, layer, n).clone())
                else:
                    out.append(self._read_role(role, layer, n).clone())
        finally:
            self._pages_t, self._read, self._read_start = saved
        return out[0], out[1]

    def begin_rewrite(self, n: int, owners=None) -> None:
        super().begin_rewrite(n, owners)
        self._pages_t = torch.tensor(self.table.pages, dtype=torch.long, device=self.arena.device)

    def end_rewrite(self) -> None:
        super().end_rewrite()
        self._pages_t = None

    # -- swap: quantized pages travel as they are held (codes + scales), the tail in full precision -------
    def to_host(self, pin: bool = False) -> HostKV:
        n = self.num_tokens
        full, fill = divmod(n, self.arena.page_size)
        dev = self.arena.device
        pages = torch.tensor(self.table.pages[:full], dtype=torch.long, device=dev)
        slots = torch.tensor(self.table.slots(0, n), dtype=torch.long, device=dev)  # a role kept in full precision
        layers, nbytes = [], 0
        for layer in range(self.num_layers):
            entry = {}
            for role in ROLES:
                if self.kinds[role] == "auto":
                    store = (self.arena.k if role == "k" else self.arena.v)[layer]  # [H, S, D]
                    entry[role] = host_copy(store.index_select(1, slots), pin)  # [H, n, D]
                    nbytes += entry[role].numel() * entry[role].element_size()
                    continue
                q = quant.map_tensors(self.arena.q[role][layer][:, pages], lambda t: host_copy(t, pin))
                tail = host_copy(self.tail[role][layer][:, :fill], pin)  # [H, fill, D]
                entry[role] = (q, tail)
                nbytes += q.nbytes + tail.numel() * tail.element_size()
            layers.append(entry)
        owners = [self.arena.pool.owner[p] for p in self.table.pages]
        return HostKV(n, layers, nbytes, owners)

    def from_host(self, host: HostKV) -> None:
        arena, dev = self.arena, self.arena.device
        full, fill = divmod(host.n, arena.page_size)
        self.begin_rewrite(host.n, owners=host.owners or None)
        ids = self._pages_t[:full]
        for layer, entry in enumerate(host.layers):
            for role in ROLES:
                if self.kinds[role] == "auto":
                    self._write_fp(role, layer, entry[role].to(dev, non_blocking=True))
                    continue
                q, tail = entry[role]
                if full:
                    arena.q[role][layer].put((slice(None), ids),
                                             quant.map_tensors(q, lambda t: t.to(dev, non_blocking=True)))
                if fill:
                    self.tail[role][layer][:, :fill].copy_(tail)
        if any(kind != "auto" for kind in self.kinds.values()):
            for p in self.table.pages[:full]:
                arena.pool.set_flag(p, FLAG_QUANTIZED)
        self.end_rewrite()

    def fork(self, session_id: int = -1) -> "QuantPagedKV":
        other = QuantPagedKV(self.arena, session_id, self.table.fork(session_id))
        for role in ROLES:
            for layer, t in enumerate(self.tail[role]):
                other.tail[role][layer].copy_(t)
        return other

    # -- accounting ----------------------------------------------------------------------------------------
    def bytes_per_layer(self) -> list[int]:
        arena = self.arena
        P = arena.page_size
        n = self.num_tokens
        full, fill = divmod(n, P)
        pages = len(self.table.pages)
        total = 0
        for role in ROLES:
            if self.kinds[role] == "auto":
                total += pages * arena.role_page_bytes(role, False)
            else:
                total += full * arena.role_page_bytes(role, True) + (arena.role_page_bytes(role, False) if fill else 0)
        return [total] * self.num_layers
