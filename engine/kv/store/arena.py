"""The page arena of a model (one page pool + the K and V role tensors), and the registry of a model's arenas.

Growth is all or nothing: the new tensors of every layer and role are allocated first, and only once all
exist are the old pages copied over and the pool told about the new pages. An allocation failure (an
ordinary CUDA out-of-memory) leaves the old arena exactly as it was, so every chat of the model keeps
working, and surfaces as a typed ``OutOfMemoryError`` that says what to change.

Limits, checked before anything is allocated ("can I?" before "do it"):

- ``max_pages`` from ``CacheConfig`` (a hard page cap);
- a memory limit shared by all arenas of the model, by default a share of the device's free memory when
  the registry was made (80% on a GPU, 50% of the available RAM on a CPU: the OS and other apps need the
  rest). Past it, ``CacheCapacityError`` says how much the cache holds and what to change.

Memory goes back when sessions close: ``trim()`` shrinks the tensors to the pages still in use (the pool
hands out low ids first, so the free pages gather at the top), and arenas nobody uses are dropped when the
registry makes another.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Callable

import torch

from engine.errors import CacheCapacityError, OutOfMemoryError, is_oom
from engine.kv.paged.pool import PagePool
from engine.kv.quantized.roles import KVShape, make_role
from engine.kv.store.state_shelf import StateShelf

GPU_SHARE = 0.8
CPU_SHARE = 0.5
MiB = 1 << 20


def default_memory_limit(device: torch.device) -> int | None:
    """Bytes the KV cache of a model may take on ``device`` (None when the machine does not say)."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * GPU_SHARE)
        if device.type == "mps" and hasattr(torch, "mps"):
            return int(torch.mps.recommended_max_memory() * GPU_SHARE) - int(torch.mps.current_allocated_memory())
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return int(pages * size * CPU_SHARE)
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None


class PageArena:
    """The page pool of one model at one page size and precision, plus its tensors."""

    def __init__(self, shape: KVShape, page_size: int, num_pages: int, max_pages: int | None = None,
                 k_kind: str = "auto", v_kind: str = "auto",
                 budget: Callable[["PageArena"], int | None] | None = None) -> None:
        self.shape = shape
        self.page_size = page_size
        self.kinds = {"k": k_kind, "v": v_kind}
        self.roles = {"k": make_role(k_kind, shape, page_size, "k"), "v": make_role(v_kind, shape, page_size, "v")}
        self.max_pages = max_pages
        self._budget = budget or (lambda arena: None)
        num_pages = max(1, min(num_pages, self.cap_pages()))
        self.initial_pages = num_pages
        self._install(num_pages, keep=0)  # may raise OutOfMemoryError: nothing was built
        self.pool = PagePool(num_pages, page_size)

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return any(role.quantized for role in self.roles.values())

    @property
    def rotated(self) -> bool:
        """K or V pages can be read in a rotated basis (tq kinds: ``engine.kv.quantized.basis``)."""
        return any(role.quantized and role.scheme.rotated for role in self.roles.values())

    @property
    def fusable(self) -> bool:
        """The fused decode kernel reads both K and V pages (tq and int4 kinds: ``engine.kv.quantized.tq_attend``)."""
        return all(role.quantized and role.scheme.fusable(self.shape.device) for role in self.roles.values())

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers (K and V), as stored."""
        return self.shape.num_layers * sum(role.page_bytes() for role in self.roles.values())

    @property
    def nbytes(self) -> int:
        return self.pool.num_pages * self.page_bytes if hasattr(self, "pool") else 0

    def cap_pages(self) -> int:
        """Most pages this arena may have: ``max_pages`` and the memory limit, whichever is lower."""
        cap = self.max_pages if self.max_pages is not None else 1 << 40
        budget = self._budget(self)
        if budget is not None:
            cap = min(cap, max(0, budget) // self.page_bytes)
        return cap

    def can_provide(self, n: int) -> bool:
        """True if ``n`` free pages can be had (now, or by growing within the limits)."""
        short = n - self.pool.num_free
        return short <= 0 or self.pool.num_pages + short <= self.cap_pages()

    # -- growth ----------------------------------------------------------------------------------------
    def ensure_free(self, n: int) -> None:
        """Make ``n`` pages free, growing (doubling, within the limits) if needed. All or nothing:
        ``CacheCapacityError`` / ``OutOfMemoryError`` leave the arena as it was."""
        short = n - self.pool.num_free
        if short <= 0:
            return
        need = self.pool.num_pages + short
        cap = self.cap_pages()
        if need > cap:
            raise CacheCapacityError(self._full_message(need, cap))
        target = min(max(need, 2 * self.pool.num_pages), cap)
        try:
            self._install(target, keep=self.pool.num_pages)
        except OutOfMemoryError:
            if target == need:
                raise
            self._install(need, keep=self.pool.num_pages)  # the doubling was too much: just what is needed
        self.pool.grow_to(self._pages)

    def _install(self, num_pages: int, keep: int) -> None:
        """New tensors of ``num_pages`` pages for both roles, the first ``keep`` pages copied over."""
        try:
            new = {name: role.allocate(num_pages) for name, role in self.roles.items()}
        except Exception as e:  # noqa: BLE001 - only allocation failures are expected here
            if not is_oom(e):
                raise
            have = getattr(self, "_pages", 0)
            raise OutOfMemoryError(
                f"out of memory growing the KV cache from {have * self.page_bytes / MiB:.1f} to "
                f"{num_pages * self.page_bytes / MiB:.1f} MiB on {self.shape.device}: close other chats, use "
                "KV int8/int4, a shorter context or an eviction policy") from None
        for name, role in self.roles.items():
            role.install(new[name], keep)
        self._pages = num_pages

    def trim(self) -> int:
        """Give memory back: shrink to the pages in use (with room to double) when at most a quarter of the
        arena is in use. Returns the pages given back."""
        pages = self.pool.num_pages
        top = self.pool.highest_used() + 1
        if pages <= self.initial_pages or top * 4 > pages:
            return 0
        target = max(self.initial_pages, 2 * top)
        try:
            # every page below the new size is copied, not only those in use: cached pages there keep their names
            # (the prefix cache), so their K/V must come along
            self._install(target, keep=target)
        except OutOfMemoryError:
            return 0  # copying out needs memory too; keep the larger arena, nothing lost
        self.pool.shrink_to(target)
        return pages - target

    def copy_page(self, src: int, dst: int) -> None:
        for role in self.roles.values():
            role.copy_page(src, dst)

    def _full_message(self, need: int, cap: int) -> str:
        P = self.page_size
        if self.max_pages is not None and cap == self.max_pages:
            why = f"the page limit of {self.max_pages} pages ({self.max_pages * P} tokens)"
        else:
            why = f"the KV memory limit ({cap * self.page_bytes / MiB:.1f} MiB for this cache setting)"
        return (f"KV cache full: {need} pages of {P} tokens needed, {why} reached "
                f"({self.pool.num_used} pages in use by this model's chats): close or clear other chats, use "
                "KV int8/int4 or an eviction policy, or raise the limit")


class ArenaRegistry:
    """The page arenas of one loaded model, one per (page size, page cap, K precision, V precision).

    Every arena of the model shares one memory limit (bytes), default ``default_memory_limit(device)``.
    """

    def __init__(self, shape: KVShape, context_length: int, memory_limit: int | None = -1) -> None:
        self.shape = shape
        self.context_length = context_length
        self.memory_limit = default_memory_limit(shape.device) if memory_limit == -1 else memory_limit
        self.states = StateShelf()  # recurrent states at named page boundaries (``engine.kv.store.state_shelf``)
        self.disk = None  # engine.kv.tier.disk.DiskTier: full pages of the prefix cache kept on disk (``configure``)
        self.listener = None  # ``listener(arena, kind, page, digest, info)``: every pool's names (``set_listener``)
        self._arenas: dict[tuple, PageArena] = {}

    def set_listener(self, listener) -> None:
        """Tell ``listener`` every prefix-cache name given or dropped in this model's arenas, now and later (None:
        stop). The server's KV events use it."""
        self.listener = listener
        for arena in self._arenas.values():
            arena.pool.listener = None if listener is None else partial(listener, arena)

    def _drop(self, key: tuple) -> None:
        """Forget an arena no session holds pages in: its cached names go with it (told to the listener)."""
        arena = self._arenas.pop(key)
        if self.listener is not None:
            for page, digest in enumerate(arena.pool.hash):
                if digest is not None:
                    self.listener(arena, "removed", page, digest, None)

    def __iter__(self):
        return iter(list(self._arenas.values()))

    def __len__(self) -> int:
        return len(self._arenas)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arenas.values())

    def budget(self, arena: PageArena) -> int | None:
        """Bytes ``arena`` may hold: the limit less what the model's other arenas hold."""
        if self.memory_limit is None:
            return None
        return self.memory_limit - sum(a.nbytes for a in self._arenas.values() if a is not arena)

    def get(self, page_size: int, max_pages: int | None, k_kind: str, v_kind: str, group: str = "full",
            shape: KVShape | None = None, tokens: int | None = None) -> PageArena:
        """The arena for these settings, made on first use (arenas nobody uses are dropped first). ``group``
        names a set of layers with their own pages (a sliding window), ``shape`` their K/V shape, ``tokens``
        how many tokens the first pages should hold."""
        key = (group, page_size, max_pages, k_kind, v_kind)
        arena = self._arenas.get(key)
        if arena is None:
            for k in [k for k, a in self._arenas.items() if a.pool.num_used == 0 and k[1:] != key[1:]]:
                self._drop(k)  # an arena no session uses gives its memory back (not a sibling group of this setting)
            tokens = tokens or min(self.context_length, 2048)
            arena = PageArena(shape or self.shape, page_size, -(-tokens // page_size), max_pages, k_kind, v_kind,
                              budget=self.budget)
            arena.group = group  # the events' ``group_idx`` / ``kv_cache_spec_kind`` come from it
            if self.listener is not None:
                arena.pool.listener = partial(self.listener, arena)
            self._arenas[key] = arena
        return arena

    def drop_idle(self) -> None:
        """Forget arenas no session holds pages in, and trim the others."""
        for k in [k for k, a in self._arenas.items() if a.pool.num_used == 0]:
            self._drop(k)
        for a in self._arenas.values():
            a.trim()
