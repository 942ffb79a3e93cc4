"""A session's KV tensors: ``ContiguousKV`` (one buffer per layer, ``engine.kv.store.contiguous``) or ``PagedKV``
(a block table in a model's shared ``PageArena``, its K and V kept by two composed roles,
``engine.kv.quantized.roles``); ``KVStore``, what both share, and ``copy_kv`` between any two.

Layout, per layer: ``[kv_heads, slots, head_dim]``; attention gets ``[1, kv_heads, L, head_dim]`` (never
repeated for GQA).

Protocol of a forward pass (driven by ``engine.kv.hf_cache.KVCache``), "can I?" before "do it"::

    store.can_reserve(q)              # pages (or memory) for q more tokens?
    store.reserve(q, owner)           # take them: raises a typed error and changes nothing if it cannot
    store.update(layer, k, v) * L     # write the new K/V, return all K/V of the layer
    store.commit()                    # the forward finished: num_tokens += q
    store.rollback()                  # ... or it failed: back to exactly the state before reserve
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine.kv.store.arena import PageArena
from engine.kv.paged.block_table import BlockTable
from engine.kv.paged.pool import FLAG_QUANTIZED
from engine.kv.quantized import native, tq_attend
from engine.kv.quantized.basis import Basis
from engine.kv.quantized.roles import DevicePlan, KVShape

ROLES = ("k", "v")
# (layer, k [H, m, D], kept idx) -> k; a ``role`` attribute "v" rotates the values instead (MLA caches its
# rotary key there, ``engine.kv.store.rope``)
Rotate = Callable[[int, torch.Tensor, np.ndarray], torch.Tensor]


@dataclass
class HostKV:
    """A session's K/V in host memory (``to_host``); ``from_host`` of the same kind of store restores it."""

    n: int  # tokens per layer
    layers: list[Any]  # per layer what the store keeps (full-precision tensors, or pages as held)
    nbytes: int  # host bytes held, all layers
    owners: list[int] = field(default_factory=list)  # paged stores: owner turn of each page


def host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` copied into a new host tensor (page-locked when ``pin``, so the copy back can be asynchronous)."""
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    h.copy_(t)
    return h


class KVStore:
    """What ``ContiguousKV`` and ``PagedKV`` share: the forward protocol and the counters."""

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.num_layers, self.dtype, self.device = shape.num_layers, shape.dtype, torch.device(shape.device)
        self._n_before = 0  # tokens cached before the running forward
        self._n_new = 0  # tokens reserved by it

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in one layer (K and V) at full precision."""
        return self.shape.token_bytes

    @property
    def past_len(self) -> int:
        return self._n_before

    @property
    def num_tokens(self) -> int:
        raise NotImplementedError

    def free(self) -> None:
        self.truncate(0)

    def reusable(self, k: int) -> int:
        """The longest prefix ``<= k`` this store can be cut back to (any, for keys and values of full layers)."""
        return k

    stateful = False  # only some positions can be cut back to (``GroupedKV``: recurrent states, sliding windows)

    def update_in_basis(self, layer, k, v):
        """``update`` as ``(k, v, basis)``: a ``Basis`` the K/V were left rotated in (``PagedKV``), or None."""
        return (*self.update(layer, k, v), None)

    def limit(self, k: int) -> str:
        """Why ``reusable(k) < k``: "" here (full layers can go back anywhere)."""
        return ""

    def checkpoint(self) -> None:
        """Keep the position now as one to cut back to: nothing to keep for full layers."""

    def checkpoint_bytes(self) -> tuple[int, int]:
        """(bytes of recurrent-state copies, bytes of window pages held) kept for checkpoints: none here."""
        return 0, 0

    def compact(self, keep: list[np.ndarray], rotate: Rotate | None = None, start: int = 0) -> list[int]:
        """Keep, per layer, the cached tokens at indices ``keep[l]`` (``[m]``, or ``[H, m]`` where each KV head
        keeps its own; ascending, the same count in every layer), packed to the front in that order, in place.
        Tokens before ``start`` are kept where they are in every layer. ``rotate`` may re-rotate the moved keys.
        Returns the pages freed."""
        raise NotImplementedError


def take_slots(x: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
    """x [H, n, D] → [H, m, D]: the slots ``idx`` ([m]: the same in every head; [H, m]: each head its own)."""
    t = torch.from_numpy(idx).to(x.device)
    if t.dim() == 1:
        return x.index_select(1, t)
    return x.gather(1, t[:, :, None].expand(-1, -1, x.shape[-1]))  # per head: [H, m, D]


class PagedKV(KVStore):
    """A session's pages in a shared ``PageArena``: a block table, and a view of each role (K, V)."""

    def __init__(self, arena: PageArena, session_id: int = -1, table: BlockTable | None = None) -> None:
        super().__init__(arena.shape)
        self.arena = arena
        self.table = table if table is not None else BlockTable(arena.pool, session_id)
        self.views = {r: arena.roles[r].view() for r in ROLES}
        self._n_before = self.table.num_tokens
        self._dp: DevicePlan | None = None

    @property
    def page_size(self) -> int:
        return self.arena.page_size

    @property
    def num_tokens(self) -> int:
        return self.table.num_tokens

    def _plan(self, n: int | None = None) -> DevicePlan:
        return DevicePlan.of(self.table.plan(n), self.device)

    # -- forward ---------------------------------------------------------------------------------------
    def can_reserve(self, q: int) -> bool:
        return self.arena.can_provide(self.table.pages_needed(q))

    def reserve(self, q: int, owner: int = -1) -> None:
        self.arena.ensure_free(self.table.pages_needed(q))  # typed error, nothing changed, if it cannot
        self._n_before = self.table.num_tokens
        for src, dst in self.table.append(q, owner=owner):
            self.arena.copy_page(src, dst)  # copy-on-write of a shared partial page
        self._n_new = q
        for view in self.views.values():
            view.begin(self._n_before, q)
        self._dp = None  # made at its first use (``_forward_plan``): a compiled step writes through its own slots

    def _forward_plan(self) -> DevicePlan:
        """The reserved forward's plan (tokens ``[0, n_before + n_new)``), made once per forward where a write or a
        read asks for it: its index tensors took ~0.1 ms a token that a compiled decode step never reads."""
        if self._dp is None:
            self._dp = self._plan(self._n_before + self._n_new)
        return self._dp

    def _write(self, layer, k, v) -> int:
        start, dp, pool = self._n_before, self._forward_plan(), self.arena.pool
        self.views["k"].write(layer, k[0], start, dp, pool)  # k: [1, H, q, D]
        self.views["v"].write(layer, v[0], start, dp, pool)
        return start

    def update(self, layer, k, v):
        if self._write(layer, k, v) == 0:
            return k, v  # nothing cached before: attention reads the (contiguous) new K/V, as HF does
        n, dp = self._n_before + self._n_new, self._forward_plan()
        return self.views["k"].read(layer, n, dp)[None], self.views["v"].read(layer, n, dp)[None]  # [1, H, n, D]

    def update_in_basis(self, layer, k, v):
        """Rotated pages (tq kinds) are read back rotated: one ``[D, D]`` turn of the query and of the output instead
        of one per cached token (``engine.kv.quantized.basis``); a decode token's tq and int4 pages are left as
        codes for the fused kernel (``engine.kv.quantized.tq_attend``)."""
        fusable = self._n_new == 1 and self.arena.fusable and native.library() is not None
        if not (self.arena.rotated or fusable):
            return (*self.update(layer, k, v), None)
        if self._write(layer, k, v) == 0:
            return k, v, None
        n, dp = self._n_before + self._n_new, self._forward_plan()
        fused = self._read_fused(layer, n, dp, k) if fusable else None
        if fused is not None:
            return fused
        if not self.arena.rotated:
            return self.views["k"].read(layer, n, dp)[None], self.views["v"].read(layer, n, dp)[None], None
        kk, mk = self.views["k"].read_basis(layer, n, dp)  # [H, n, Dk'], [H, Dk', Dk] or None
        vv, mv = self.views["v"].read_basis(layer, n, dp)
        return kk[None], vv[None], Basis(mk, mv)

    def _read_fused(self, layer, n, dp, k):
        """A decode step's pages left as codes for the fused kernel (both roles kinds it reads, the kernel built):
        placeholders for K/V and the pages in the ``Basis``; None: read them as tensors."""
        kf, vf = self.views["k"].read_fused(layer, n, dp), self.views["v"].read_fused(layer, n, dp)
        if kf is None or vf is None:
            return None

        def materialize():
            return (self.views["k"].read_basis(layer, n, dp)[0][None],  # [1, H, n, Dk]
                    self.views["v"].read_basis(layer, n, dp)[0][None])

        (kp, mk), (vp, mv) = kf, vf
        key = tq_attend.placeholder(kp.codes.shape[0], n, kp.dim, k.dtype, k.device)
        value = tq_attend.placeholder(vp.codes.shape[0], n, vp.dim, k.dtype, k.device)
        return key, value, Basis(mk, mv, tq_attend.FusedPages(kp, vp, key, materialize))

    def commit(self) -> None:
        self._n_before, self._n_new, self._dp = self.table.num_tokens, 0, None

    def rollback(self) -> None:
        start = self._n_before
        for view in self.views.values():
            view.rollback(start)
        self._n_new, self._dp = 0, None
        self.truncate(start)

    # -- table changes ---------------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        old = self.table.num_tokens
        if not 0 <= n <= old:
            raise ValueError(f"truncate: {n} is outside 0..{old}")
        if n < old:
            dp = self._plan(old)
            for view in self.views.values():
                view.truncate(old, n, dp)
        self.table.truncate(n)
        self._unflag_tail()
        self._n_before = n

    def adopt(self, pages: list[int], owner: int = -1) -> None:
        """Append full pages found in the prefix cache (computed by this or another session of the arena), as if
        their tokens had been prefilled here; the table must end on a page boundary."""
        self.table.adopt(pages, owner=owner)
        self._n_before = self.table.num_tokens

    def _unflag_tail(self) -> None:
        """A partial last page is held in full precision (the quantized roles' tail)."""
        pages, P = self.table.pages, self.page_size
        if pages and self.table.num_tokens % P and self.arena.pool.ref[pages[-1]] == 1:
            self.arena.pool.set_flag(pages[-1], FLAG_QUANTIZED, False)

    def free(self) -> None:
        self.truncate(0)
        self.arena.trim()

    def fork(self, session_id: int = -1) -> "PagedKV":
        other = PagedKV(self.arena, session_id, self.table.fork(session_id))
        for role in ROLES:
            other.views[role].copy_from(self.views[role])
        return other

    def read_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached K/V of a layer as new tensors ``[H, n, D]``."""
        n = self.table.num_tokens
        dp = self._plan(n)
        return tuple(self.views[r].read(layer, n, dp).clone() for r in ROLES)

    def compact(self, keep, rotate=None, start=0) -> list[int]:
        n, n_keep, P = self.table.num_tokens, np.shape(keep[0])[-1], self.page_size
        s = (start // P) * P  # rewrite whole pages from here
        first, last = s // P, -(-n_keep // P)
        self.arena.ensure_free(self.table.shared_pages(first, last))  # before any change
        old = self._plan(n)
        self.table.make_private(first, last)  # pages shared with a fork are never written
        new = self._plan(n)
        pool = self.arena.pool
        try:
            for layer in range(self.num_layers):
                idx = np.asarray(keep[layer], dtype=np.int64)[..., s:]  # [m] or [H, m] (per head)
                for role in ROLES:
                    x = take_slots(self.views[role].read(layer, n, old), idx)  # [H, n_keep - s, D] copy
                    if rotate is not None and role == getattr(rotate, "role", "k"):  # "v": MLA's rotary key
                        x = rotate(layer, x, idx)
                    self.views[role].write(layer, x, s, new, pool)
        except BaseException:
            self.truncate(0)  # half the layers rewritten: drop the cache rather than keep it inconsistent
            raise
        before = set(self.table.pages)
        self.table.truncate(n_keep)
        self._unflag_tail()
        self._n_before = n_keep
        kept = set(self.table.pages)
        return sorted(p for p in before - kept if pool.ref[p] == 0)

    # -- swap ------------------------------------------------------------------------------------------
    def to_host(self, pin: bool = False) -> HostKV:
        """Every layer's pages as held (quantized pages stay codes + scales) in host memory."""
        n = self.table.num_tokens
        dp = self._plan(n)
        layers, nbytes = [], 0
        for layer in range(self.num_layers):
            entry = {}
            for role in ROLES:
                entry[role], size = self.views[role].to_host(layer, n, dp, lambda t: host_copy(t, pin))
                nbytes += size
            layers.append(entry)
        return HostKV(n, layers, nbytes, [self.arena.pool.owner[p] for p in self.table.pages])

    def can_restore(self, host: HostKV, adopt: Sequence[int] = ()) -> bool:
        # adopted pages the LRU holds stop counting as free once taken; new pages are needed for the rest
        unheld = sum(1 for p in adopt if self.arena.pool.ref[p] == 0)
        need = -(-host.n // self.page_size) - len(adopt) + unheld
        return self.table.num_tokens == 0 and self.arena.can_provide(need)

    def from_host(self, host: HostKV, adopt: Sequence[int] = ()) -> None:
        """Pages for ``host.n`` tokens (typed error and no change if there are none), then the copy back.
        ``adopt``: full pages of the prefix cache that hold the first tokens exactly (same tokens from the start,
        same arena): taken back as they are, only the tokens after them are copied (full precision only)."""
        P = self.page_size
        start = len(adopt) * P
        if adopt:
            self.table.adopt(adopt)  # first: making room for the rest must not drop them from the LRU
        try:
            self.arena.ensure_free(-(-host.n // P) - len(adopt))
        except BaseException:
            self.truncate(0)  # the adopted pages go back to the prefix cache
            raise
        self.table.append(host.n - start)
        pool = self.arena.pool
        for i, p in enumerate(self.table.pages):
            pool.set_owner(p, host.owners[min(i, len(host.owners) - 1)] if host.owners else -1)
        dp = self._plan(host.n)
        for layer, entry in enumerate(host.layers):
            for role in ROLES:
                self.views[role].from_host(layer, entry[role], dp, pool, start)
        self._n_before = host.n

    # -- accounting ------------------------------------------------------------------------------------
    def bytes_per_layer(self) -> list[int]:
        n, pages = self.table.num_tokens, len(self.table.pages)
        return [sum(self.views[r].bytes_held(n, pages) for r in ROLES)] * self.num_layers

    def capacity_tokens(self) -> int:
        arena = self.arena
        return max(arena.pool.num_pages, min(arena.cap_pages(), 1 << 30)) * self.page_size


def copy_kv(src: KVStore, dst: KVStore, owner: int = -1) -> int:
    """Copy every cached token of ``src`` into the empty store ``dst`` (a mode, page size or precision
    switch: quantized on the way in, dequantized on the way out). Returns the tokens copied."""
    n = src.num_tokens
    if not n:
        return 0
    dst.reserve(n, owner=owner)
    try:
        for layer in range(src.num_layers):
            k, v = src.read_layer(layer)  # [H, n, D]
            dst.update(layer, k[None], v[None])
    except BaseException:
        dst.rollback()
        raise
    dst.commit()
    return n
