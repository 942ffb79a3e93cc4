"""The KV tensors: a contiguous per-layer buffer, or a page arena shared by every session of a model.

Layout (both stores), per layer ``l``:

    K[l], V[l] : [kv_heads, slots, head_dim]

A contiguous store's token ``i`` is slot ``i``. The page arena's page ``p`` owns slots ``[p*P, (p+1)*P)``.
Putting the token axis in the middle keeps each head's keys contiguous in memory, so a run of
consecutive pages is read as a strided *view* ``K[l][:, s0:s0+L]`` (no copy); scattered pages are read
with one ``index_select`` gather. Both give attention the ``[1, kv_heads, L, head_dim]`` tensors
transformers expects from ``Cache.update`` (never repeated for GQA).

Protocol of a forward pass (driven by ``engine.kv.hf_cache.KVCache``):

    store.begin_forward(q)            # reserve slots for q new tokens
    store.update(layer, k, v) * L     # write the new K/V, return all K/V of the layer
    store.end_forward()               # commit: num_tokens += q
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv.block_table import BlockTable
from engine.kv.pool import PagePool


@dataclass
class HostKV:
    """A session's K/V moved to host memory by ``KVStore.to_host``; ``from_host`` of the same kind of store
    brings it back. ``layers`` is per layer whatever that store keeps (full-precision tensors, or quantized
    pages exactly as held: codes and scales, never dequantized)."""

    n: int  # tokens per layer
    layers: list[Any]
    nbytes: int  # host bytes held, all layers
    owners: list[int] = field(default_factory=list)  # paged stores: owner turn of each page


def host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` copied into a new host tensor (page-locked when ``pin``, so the copy back can be asynchronous)."""
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    h.copy_(t)
    return h


class KVStore:
    """Interface shared by ``ContiguousKV`` and ``PagedKV``."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self._n_before = 0  # tokens cached before the running forward
        self._n_new = 0

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in one layer (K and V) at full precision."""
        return 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def past_len(self) -> int:
        return self._n_before

    @property
    def num_tokens(self) -> int:
        raise NotImplementedError

    def begin_forward(self, n_new: int, owner: int = -1) -> None:
        raise NotImplementedError

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def end_forward(self) -> None:
        self._n_before += self._n_new
        self._n_new = 0

    def truncate(self, n: int) -> None:
        raise NotImplementedError

    def free(self) -> None:
        self.truncate(0)

    def bytes_per_layer(self) -> list[int]:
        raise NotImplementedError

    def capacity_tokens(self) -> int:
        raise NotImplementedError

    def read_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached K/V of a layer, ``[kv_heads, num_tokens, head_dim]`` each (for copies and tests)."""
        raise NotImplementedError

    # -- swap ------------------------------------------------------------------------------------------
    def to_host(self, pin: bool = False) -> HostKV:
        """Copy every layer's K/V to host memory (the store itself is left as is: ``free()`` it after)."""
        layers, nbytes = [], 0
        for layer in range(self.num_layers):
            k, v = self.read_layer(layer)  # [H, n, D]
            hk, hv = host_copy(k, pin), host_copy(v, pin)
            layers.append((hk, hv))
            nbytes += hk.numel() * hk.element_size() + hv.numel() * hv.element_size()
        return HostKV(self.num_tokens, layers, nbytes)

    def from_host(self, host: HostKV) -> None:
        """Replace the content with what ``to_host`` saved."""
        self.begin_rewrite(host.n, owners=host.owners or None)
        for layer, (hk, hv) in enumerate(host.layers):
            self.rewrite_layer(layer, hk.to(self.device, non_blocking=True), hv.to(self.device, non_blocking=True))
        self.end_rewrite()

    # -- compaction (eviction) -------------------------------------------------------------------------
    def begin_rewrite(self, n: int, owners: list[int] | None = None) -> None:
        """Start replacing the whole content with ``n`` tokens per layer (written by ``rewrite_layer``)."""
        raise NotImplementedError

    def rewrite_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``, ``v``: [kv_heads, n, head_dim], the layer's new content (must not alias the store)."""
        raise NotImplementedError

    def end_rewrite(self) -> None:
        raise NotImplementedError

    def compact(self, keep: list[torch.Tensor], rotate=None, owners: list[int] | None = None) -> None:
        """Keep, per layer, the cached tokens at indices ``keep[l]`` ([n_keep] ascending, same n_keep for
        every layer), packed to the front in that order. ``rotate(layer, k, keep_idx) -> k`` may re-rotate
        moved keys. Layers are processed one at a time (one layer's K/V copied at once)."""
        n_keep = int(keep[0].numel())
        self.begin_rewrite(n_keep, owners)
        for layer in range(self.num_layers):
            k, v = self.read_layer(layer)  # [H, n, D]
            idx = keep[layer].to(k.device)
            k = k.index_select(1, idx)  # [H, n_keep, D] copies
            v = v.index_select(1, idx)
            if rotate is not None:
                k = rotate(layer, k, idx)
            self.rewrite_layer(layer, k, v)
        self.end_rewrite()


class ContiguousKV(KVStore):
    """One buffer per layer, grown by doubling (one copy per growth, amortised O(1) per token)."""

    def __init__(self, num_layers, kv_heads, head_dim, dtype, device, initial_tokens: int = 256) -> None:
        super().__init__(num_layers, kv_heads, head_dim, dtype, device)
        self._cap = max(16, initial_tokens)
        shape = (kv_heads, self._cap, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._len = 0

    @property
    def num_tokens(self) -> int:
        return self._len

    def begin_forward(self, n_new: int, owner: int = -1) -> None:
        need = self._len + n_new
        if need > self._cap:
            cap = self._cap
            while cap < need:
                cap *= 2
            for lst in (self.k, self.v):
                for i, old in enumerate(lst):
                    new = torch.zeros((self.kv_heads, cap, self.head_dim), dtype=self.dtype, device=self.device)
                    new[:, : self._len].copy_(old[:, : self._len])  # [H, len, D]
                    lst[i] = new
            self._cap = cap
        self._n_before = self._len
        self._n_new = n_new

    def update(self, layer, k, v):
        s, e = self._n_before, self._n_before + self._n_new
        self.k[layer][:, s:e].copy_(k[0])  # k: [1, H, q, D] → buffer slots [s, e)
        self.v[layer][:, s:e].copy_(v[0])
        if s == 0:
            return k, v  # nothing cached before: attention reads the (contiguous) new K/V, as HF does
        return self.k[layer][None, :, :e], self.v[layer][None, :, :e]  # [1, H, e, D] views

    def end_forward(self) -> None:
        self._len = self._n_before + self._n_new
        super().end_forward()

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"truncate: {n} is outside 0..{self._len}")
        self._len = n
        self._n_before = n

    def bytes_per_layer(self) -> list[int]:
        return [self._cap * self.token_bytes] * self.num_layers

    def capacity_tokens(self) -> int:
        return self._cap

    def read_layer(self, layer):
        return self.k[layer][:, : self._len], self.v[layer][:, : self._len]

    def begin_rewrite(self, n: int, owners: list[int] | None = None) -> None:
        self._rewrite_n = n

    def rewrite_layer(self, layer, k, v):
        n = self._rewrite_n
        self.k[layer][:, :n].copy_(k)  # [H, n, D]
        self.v[layer][:, :n].copy_(v)

    def end_rewrite(self) -> None:
        self._len = self._n_before = self._rewrite_n


class PageArena:
    """The page pool of one model plus its tensors; every paged session of that model allocates here."""

    def __init__(self, num_layers, kv_heads, head_dim, dtype, device, page_size: int, num_pages: int,
                 max_pages: int | None = None, k_kind: str = "auto", v_kind: str = "auto") -> None:
        self.kinds = {"k": k_kind, "v": v_kind}
        self.q: dict[str, list] = {"k": [], "v": []}  # quantized page storage per role: [H, N, P, ...] per layer
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size, max_pages=max_pages)
        self._slots = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.sync_capacity()

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.kinds["k"] != "auto" or self.kinds["v"] != "auto"

    def role_page_bytes(self, role: str, quantized: bool) -> int:
        """Bytes one page of one layer holds for K or V (codes + scales when quantized)."""
        if quantized and self.kinds[role] != "auto":
            from engine.kv import quant

            per_tok = quant.bytes_per_token(self.kinds[role], role, self.kv_heads, self.head_dim, self.page_size)
            return int(round(per_tok * self.page_size))
        return self.kv_heads * self.page_size * self.head_dim * self.elem_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one full page across all layers (K and V), as stored."""
        return self.num_layers * (self.role_page_bytes("k", True) + self.role_page_bytes("v", True))

    def sync_capacity(self) -> None:
        """Grow the tensors after the pool grew (copying the old pages)."""
        pages = self.pool.num_pages
        slots = pages * self.page_size
        if slots <= self._slots:
            return
        old_pages = self._slots // self.page_size
        shape = (self.kv_heads, slots, self.head_dim)
        for role, lst in (("k", self.k), ("v", self.v)):
            if self.kinds[role] != "auto":
                continue  # a quantized role keeps no full-precision pages
            if not lst:
                lst.extend(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers))
                continue
            for i, old in enumerate(lst):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                new[:, : self._slots].copy_(old)  # [H, old_slots, D]
                lst[i] = new
        for role in ("k", "v"):
            kind = self.kinds[role]
            if kind == "auto":
                continue
            from engine.kv import quant

            store = self.q[role]
            for i in range(self.num_layers):
                new = quant.allocate(kind, role, (self.kv_heads, pages), self.page_size, self.head_dim,
                                     device=self.device)  # [H, N, P, ...]: a run of pages is one view per head
                if i < len(store):
                    new.put((slice(None), slice(0, old_pages)), store[i][:, :old_pages])
                    store[i] = new
                else:
                    store.append(new)
        self._slots = slots

    def copy_page(self, src: int, dst: int) -> None:
        P = self.page_size
        for lst in (self.k, self.v):
            for t in lst:
                t[:, dst * P:(dst + 1) * P].copy_(t[:, src * P:(src + 1) * P])  # [H, P, D]
        for store in self.q.values():
            for q in store:
                q.put((slice(None), dst), q[:, src])  # [H, P, ...]


class PagedKV(KVStore):
    """A session's paged view: a block table in a shared ``PageArena``."""

    def __init__(self, arena: PageArena, session_id: int = -1, table: BlockTable | None = None) -> None:
        super().__init__(arena.num_layers, arena.kv_heads, arena.head_dim, arena.dtype, arena.device)
        self.arena = arena
        self.table = table if table is not None else BlockTable(arena.pool, session_id)
        self._n_before = self.table.num_tokens
        self._wslots: torch.Tensor | None = None  # [q] slot ids, None when the slots are one run
        self._write_start = 0
        self._read: torch.Tensor | None = None  # [L] slot ids, None when the pages are one run
        self._read_start = 0

    @property
    def page_size(self) -> int:
        return self.arena.page_size

    @property
    def num_tokens(self) -> int:
        return self.table.num_tokens

    def begin_forward(self, n_new: int, owner: int = -1) -> None:
        arena = self.arena
        self._n_before = self.table.num_tokens
        copies = self.table.append(n_new, owner=owner)
        arena.sync_capacity()
        for src, dst in copies:
            arena.copy_page(src, dst)
        self._n_new = n_new
        self._plan_slots()

    def _plan_slots(self) -> None:
        start = self.table.contiguous_start()
        end = self._n_before + self._n_new
        if start is not None:
            self._read, self._read_start = None, start
            self._wslots, self._write_start = None, start + self._n_before
        else:
            dev = self.arena.device
            self._read = torch.tensor(self.table.slots(0, end), dtype=torch.long, device=dev)  # [L]
            self._wslots = self._read[self._n_before:end]  # [q]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``, ``v``: [H, q, D] for the reserved slots."""
        kl, vl = self.arena.k[layer], self.arena.v[layer]  # [H, S, D]
        if self._wslots is None:
            s, q = self._write_start, self._n_new
            kl[:, s:s + q].copy_(k)  # slots [s, s+q) of one run
            vl[:, s:s + q].copy_(v)
        else:
            kl.index_copy_(1, self._wslots, k)  # scatter q tokens into their page slots
            vl.index_copy_(1, self._wslots, v)

    def update(self, layer, k, v):
        self._write(layer, k[0], v[0])  # k: [1, H, q, D]
        if self._n_before == 0:
            return k, v  # nothing cached before: attention reads the (contiguous) new K/V, as HF does
        kl, vl = self.arena.k[layer], self.arena.v[layer]  # [H, S, D]
        L = self._n_before + self._n_new
        if self._read is None:
            s = self._read_start
            return kl[None, :, s:s + L], vl[None, :, s:s + L]  # [1, H, L, D] views of one run
        return kl.index_select(1, self._read)[None], vl.index_select(1, self._read)[None]  # [1, H, L, D]

    def end_forward(self) -> None:
        super().end_forward()
        self._n_before = self.table.num_tokens

    def truncate(self, n: int) -> None:
        self.table.truncate(n)
        self._n_before = n

    def fork(self, session_id: int = -1) -> "PagedKV":
        return PagedKV(self.arena, session_id, self.table.fork(session_id))

    def bytes_per_layer(self) -> list[int]:
        per_page = self.page_size * self.token_bytes
        return [len(self.table.pages) * per_page] * self.num_layers

    def capacity_tokens(self) -> int:
        pool = self.arena.pool
        cap_pages = pool.max_pages if pool.max_pages is not None else pool.num_pages
        return cap_pages * self.page_size

    @property
    def _source_table(self) -> BlockTable:
        """The table holding the current content (the old one while a rewrite is in progress)."""
        old = getattr(self, "_old_table", None)
        return old if old is not None else self.table

    def to_host(self, pin: bool = False) -> HostKV:
        host = super().to_host(pin)
        host.owners = [self.arena.pool.owner[p] for p in self.table.pages]
        return host

    def read_layer(self, layer):
        table = self._source_table
        idx = torch.tensor(table.slots(0, table.num_tokens), dtype=torch.long, device=self.arena.device)
        return self.arena.k[layer].index_select(1, idx), self.arena.v[layer].index_select(1, idx)

    def begin_rewrite(self, n: int, owners: list[int] | None = None) -> None:
        """Write the new content into fresh pages (so pages shared with a fork are never overwritten)."""
        self._old_table = self.table
        self.table = BlockTable(self.arena.pool, self._old_table.session_id)
        self.table.append(n)
        if owners:
            pool = self.arena.pool
            for i, p in enumerate(self.table.pages):
                pool.owner[p] = owners[min(i, len(owners) - 1)]
        self.arena.sync_capacity()
        self._n_before, self._n_new = 0, n
        self._plan_slots()

    def rewrite_layer(self, layer, k, v):
        self._write(layer, k, v)

    def end_rewrite(self) -> None:
        self._old_table.free()
        self._old_table = None
        self._n_before, self._n_new = self.table.num_tokens, 0
