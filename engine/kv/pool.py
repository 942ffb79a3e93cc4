"""Page bookkeeping in plain ints: free list, reference counts, owners, fill and flags. No torch.

A page is ``page_size`` token slots of every layer (K and V). The pool only answers "which page ids";
the tensors live in ``engine.kv.storage``.

Ordering rule (tested by exact ids): ``allocate`` always returns the lowest-numbered free pages, in
increasing order. A sequence that grows alone therefore gets physically consecutive pages, which lets the
storage read it as one contiguous view instead of a gather (vLLM's "contiguous runs"). It also keeps the
used pages low, so the free tail can be given back (``shrink_to``) when sessions close.

The pool never grows by itself: its owner (``engine.kv.arena.PageArena``) first makes room for the tensors,
all or nothing, then calls ``grow_to``. ``allocate`` past the free pages is a ``CacheCapacityError``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from engine.errors import CacheCapacityError

FLAG_PINNED = 1
FLAG_QUANTIZED = 2
FLAG_OFFLOADED = 4

# Page states as the GUI sees them (``CacheSnapshot.page_state``; int8 codes).
PAGE_FREE = 0
PAGE_ACTIVE = 1
PAGE_SHARED = 2
PAGE_PINNED = 3
PAGE_QUANTIZED = 4
PAGE_OFFLOADED = 5
PAGE_EVICTED = 6  # freed by an eviction on this step ("just evicted"): set by the observer, not the pool
PAGE_STATE_NAMES = ("free", "active", "shared", "pinned", "quantized", "offloaded", "evicted")


@dataclass
class PoolStats:
    num_pages: int
    free: int
    used: int
    shared: int


class PagePool:
    """Reference-counted pages ``0 .. num_pages-1``.

    Invariants (checked by ``check()``): every page is either free (ref 0, in the free heap exactly once)
    or used (ref >= 1, not in the heap); ``free + used == num_pages``.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"page pool: num_pages {num_pages} must be at least 1")
        if page_size < 1:
            raise ValueError(f"page pool: page_size {page_size} must be at least 1")
        self.page_size = page_size
        self.num_pages = 0
        self.ref: list[int] = []
        self.owner: list[int] = []  # turn index that first wrote the page (-1 free)
        self.fill: list[int] = []  # tokens written in the page
        self.flags: list[int] = []
        self.session: list[int] = []  # session id holding the page (-1 free)
        self._free: list[int] = []  # min-heap of free page ids
        self.grow_to(num_pages)

    # -- queries ---------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """True if ``n`` pages are free now (growing is the arena's decision)."""
        return n <= len(self._free)

    def highest_used(self) -> int:
        """The highest page id in use, -1 when every page is free."""
        return max((p for p in range(self.num_pages - 1, -1, -1) if self.ref[p] > 0), default=-1)

    def page_states(self) -> list[int]:
        """``PAGE_*`` code of every page: free, or held (shared when ref > 1; pinned / quantized /
        offloaded flags win over shared, in that order of precedence)."""
        out = []
        for ref, flags in zip(self.ref, self.flags):
            if ref == 0:
                out.append(PAGE_FREE)
            elif flags & FLAG_OFFLOADED:
                out.append(PAGE_OFFLOADED)
            elif flags & FLAG_PINNED:
                out.append(PAGE_PINNED)
            elif flags & FLAG_QUANTIZED:
                out.append(PAGE_QUANTIZED)
            else:
                out.append(PAGE_SHARED if ref > 1 else PAGE_ACTIVE)
        return out

    def stats(self) -> PoolStats:
        shared = sum(1 for r in self.ref if r > 1)
        return PoolStats(self.num_pages, self.num_free, self.num_used, shared)

    # -- mutations -------------------------------------------------------------------------------------
    def allocate(self, n: int, owner: int = -1, session: int = -1) -> list[int]:
        """Take ``n`` free pages (lowest ids first, increasing), each with ref count 1 and fill 0.

        ``CacheCapacityError`` (and nothing taken) when fewer than ``n`` are free: ask ``can_allocate``
        first, or let the arena grow the pool.
        """
        if n < 0:
            raise ValueError("allocate: negative page count")
        if n > len(self._free):
            raise CacheCapacityError(f"KV cache full: {n} more pages needed, {len(self._free)} free of "
                                     f"{self.num_pages} pages of {self.page_size} tokens")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
            self.owner[p] = owner
            self.session[p] = session
            self.fill[p] = 0
            self.flags[p] = 0
        return pages

    def incref(self, page: int) -> None:
        """Share a used page (fork)."""
        if self.ref[page] < 1:
            raise RuntimeError(f"page {page} is free: cannot share it")
        self.ref[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one reference; returns True if the page became free."""
        if self.ref[page] < 1:
            raise RuntimeError(f"page {page} is already free")
        self.ref[page] -= 1
        if self.ref[page] == 0:
            self.owner[page] = -1
            self.session[page] = -1
            self.fill[page] = 0
            self.flags[page] = 0
            heapq.heappush(self._free, page)
            return True
        return False

    def set_flag(self, page: int, flag: int, on: bool = True) -> None:
        if on:
            self.flags[page] |= flag
        else:
            self.flags[page] &= ~flag

    def grow_to(self, n: int) -> None:
        """Add free pages ``num_pages .. n-1`` (the arena grew its tensors first)."""
        if n <= self.num_pages:
            return
        old = self.num_pages
        extra = n - old
        self.ref.extend([0] * extra)
        self.owner.extend([-1] * extra)
        self.fill.extend([0] * extra)
        self.flags.extend([0] * extra)
        self.session.extend([-1] * extra)
        for p in range(old, n):
            heapq.heappush(self._free, p)
        self.num_pages = n

    def shrink_to(self, n: int) -> None:
        """Drop pages ``n ..`` (all free: the caller checked ``highest_used() < n``)."""
        if n >= self.num_pages:
            return
        if n < 1 or self.highest_used() >= n:
            raise ValueError(f"shrink_to {n}: pages at or above it are in use")
        self._free = [p for p in self._free if p < n]
        heapq.heapify(self._free)
        for lst in (self.ref, self.owner, self.fill, self.flags, self.session):
            del lst[n:]
        self.num_pages = n

    # -- checking --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is in the free list twice"
        for p in range(self.num_pages):
            if p in free:
                assert self.ref[p] == 0, f"free page {p} has ref {self.ref[p]}"
            else:
                assert self.ref[p] >= 1, f"used page {p} has ref {self.ref[p]}"
        assert self.num_free + self.num_used == self.num_pages
