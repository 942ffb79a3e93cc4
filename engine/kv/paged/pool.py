"""Page bookkeeping in plain ints: free list, reference counts, owners, fill and flags. No torch.

A page is ``page_size`` token slots of every layer (K and V). The pool only answers "which page ids";
the tensors live in ``engine.kv.store.storage``.

Ordering rule (tested by exact ids): ``allocate`` always returns the lowest-numbered free pages, in
increasing order. A sequence that grows alone therefore gets physically consecutive pages, which lets the
storage read it as one contiguous view instead of a gather (vLLM's "contiguous runs"). It also keeps the
used pages low, so the free tail can be given back (``shrink_to``) when sessions close.

Prefix cache (automatic prefix caching across sessions, as vLLM v1's block pool): a *full* page whose
tokens are known can be registered under the hash of its token chain (``engine.kv.paged.prefix``). When no
table holds it any more (ref 0) it is not free but *cached*: kept, with its hash, in an LRU, so another
session whose prompt starts with the same tokens takes it back (``take``) instead of recomputing it.
``allocate`` takes truly free pages first (lowest ids), then evicts cached pages least recently used
first, dropping their hashes. Cached pages count as free (``num_free``): the pool never grows for them.
A hashed page is never written again while it keeps its hash; a writer drops the hash first (``unhash``).

The pool never grows by itself: its owner (``engine.kv.store.arena.PageArena``) first makes room for the tensors,
all or nothing, then calls ``grow_to``. ``allocate`` past the free pages is a ``CacheCapacityError``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

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
PAGE_CACHED = 7  # no table holds it, kept in the prefix cache with its hash (reusable, evicted LRU first)
PAGE_STATE_NAMES = ("free", "active", "shared", "pinned", "quantized", "offloaded", "evicted", "cached")


@dataclass
class PoolStats:
    num_pages: int
    free: int
    used: int
    shared: int
    cached: int = 0


class PagePool:
    """Reference-counted pages ``0 .. num_pages-1``.

    Invariants (checked by ``check()``): every page is exactly one of free (ref 0, no hash, in the free
    heap once), cached (ref 0, hashed, in the LRU once) or used (ref >= 1, in neither);
    ``free + cached + used == num_pages``; the hash table maps each hash to the one page that carries it.
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
        self.hash: list[bytes | None] = []  # prefix-cache hash of a full page's token chain (None: not cached)
        self._free: list[int] = []  # min-heap of free page ids (no hash)
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref-0 hashed pages, least recently used first
        self._by_hash: dict[bytes, int] = {}
        self.cache_evictions = 0  # cached pages dropped for an allocation (or a shrink)
        # hears every name given and dropped: ``listener("stored", page, digest, (parent, tokens))`` and
        # ``listener("removed", page, digest, None)`` (the server's KV events, ``engine.server.kv_events``)
        self.listener = None
        self.grow_to(num_pages)

    # -- queries ---------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: truly free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages some table holds (ref >= 1)."""
        return self.num_pages - self.num_free

    def can_allocate(self, n: int) -> bool:
        """True if ``n`` pages are free or cached now (growing is the arena's decision)."""
        return n <= self.num_free

    def lookup(self, digest: bytes) -> int | None:
        """The page registered under ``digest`` (held or cached), or None."""
        return self._by_hash.get(digest)

    def cached_pages(self) -> list[int]:
        """The cached (ref 0) pages, least recently used first: the order ``allocate`` evicts them."""
        return list(self._cached)

    def highest_used(self) -> int:
        """The highest page id in use, -1 when every page is free."""
        return max((p for p in range(self.num_pages - 1, -1, -1) if self.ref[p] > 0), default=-1)

    def page_states(self) -> np.ndarray:
        """[num_pages] int8 ``PAGE_*`` code of every page: free, cached (no table holds it, its hash kept: the LRU's),
        or held (shared when ref > 1; offloaded, pinned, quantized flags win over shared, in that order). Whole-array
        selects: a snapshot asks each token, and a Python loop over the pages took ~50 us for 128 of them."""
        ref = np.asarray(self.ref, dtype=np.int64)  # [num_pages]
        flags = np.asarray(self.flags, dtype=np.int64)  # [num_pages]
        out = np.where(ref > 1, PAGE_SHARED, PAGE_ACTIVE).astype(np.int8)  # [num_pages]
        for flag, code in ((FLAG_QUANTIZED, PAGE_QUANTIZED), (FLAG_PINNED, PAGE_PINNED),
                           (FLAG_OFFLOADED, PAGE_OFFLOADED)):  # lowest precedence first: the last written wins
            out[(flags & flag) != 0] = code
        out[ref == 0] = PAGE_FREE
        if self._cached:  # ref 0 and hashed: exactly the LRU's pages (``check``)
            out[np.fromiter(self._cached, dtype=np.int64, count=len(self._cached))] = PAGE_CACHED
        return out

    def stats(self) -> PoolStats:
        shared = sum(1 for r in self.ref if r > 1)
        return PoolStats(self.num_pages, self.num_free, self.num_used, shared, len(self._cached))

    # -- mutations -------------------------------------------------------------------------------------
    def allocate(self, n: int, owner: int = -1, session: int = -1) -> list[int]:
        """Take ``n`` pages, each with ref count 1 and fill 0: the free ones first (lowest ids first,
        increasing), then cached ones, least recently used first (their hashes are dropped).

        ``CacheCapacityError`` (and nothing taken) when fewer than ``n`` are free or cached: ask
        ``can_allocate`` first, or let the arena grow the pool.
        """
        if n < 0:
            raise ValueError("allocate: negative page count")
        if n > self.num_free:
            raise CacheCapacityError(f"KV cache full: {n} more pages needed, {self.num_free} free of "
                                     f"{self.num_pages} pages of {self.page_size} tokens")
        k = min(n, len(self._free))
        pages = [heapq.heappop(self._free) for _ in range(k)]
        for _ in range(n - k):
            p, _ = self._cached.popitem(last=False)  # least recently used cached page
            self._forget(p)
            self.cache_evictions += 1
            pages.append(p)
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

    def take(self, page: int, owner: int = -1, session: int = -1) -> None:
        """Hold a hashed page found by ``lookup``: a held one is shared (ref + 1), a cached one leaves the LRU
        with ref 1 (and this owner / session)."""
        if self.hash[page] is None:
            raise RuntimeError(f"page {page} is not in the prefix cache")
        if self.ref[page] == 0:
            del self._cached[page]
            self.ref[page] = 1
            self.owner[page] = owner
            self.session[page] = session
            self.fill[page] = self.page_size
            self.flags[page] = 0
        else:
            self.ref[page] += 1

    def register(self, page: int, digest: bytes, parent: bytes | None = None, tokens=()) -> bool:
        """Put a full, held page in the prefix cache under ``digest`` (``parent``: the previous page's name,
        ``tokens``: its ids, told to the listener). False (nothing changed) if the page has a hash already or
        another page carries ``digest`` (the first page computed keeps it)."""
        if self.ref[page] < 1:
            raise RuntimeError(f"page {page} is free: cannot register it")
        if self.hash[page] is not None or digest in self._by_hash:
            return False
        self.hash[page] = digest
        self._by_hash[digest] = page
        if self.listener is not None:
            self.listener("stored", page, digest, (parent, tuple(tokens)))
        return True

    def _forget(self, page: int) -> None:
        """Drop a page's name (told to the listener)."""
        digest = self.hash[page]
        del self._by_hash[digest]
        self.hash[page] = None
        if self.listener is not None:
            self.listener("removed", page, digest, None)

    def unhash(self, page: int) -> None:
        """Take a page out of the prefix cache before it is written again (a cached one becomes free)."""
        if self.hash[page] is None:
            return
        self._forget(page)
        if self.ref[page] == 0:
            del self._cached[page]
            self.fill[page] = 0
            heapq.heappush(self._free, page)

    def decref(self, page: int) -> bool:
        """Drop one reference; returns True if the page became free."""
        if self.ref[page] < 1:
            raise RuntimeError(f"page {page} is already free")
        self.ref[page] -= 1
        if self.ref[page] == 0:
            self.owner[page] = -1
            self.session[page] = -1
            self.flags[page] = 0
            if self.hash[page] is not None:  # kept for the prefix cache, most recently used last
                self._cached[page] = None
            else:
                self.fill[page] = 0
                heapq.heappush(self._free, page)
            return True
        return False

    def set_fill(self, page: int, tokens: int) -> None:
        """``page`` holds ``tokens`` tokens (0..page_size): what its table wrote or kept there."""
        if not 0 <= tokens <= self.page_size:
            raise ValueError(f"page {page}: fill {tokens} is outside 0..{self.page_size}")
        self.fill[page] = tokens

    def set_owner(self, page: int, owner: int) -> None:
        """``page``'s tokens belong to turn ``owner`` (-1: none): the page map colours them so."""
        self.owner[page] = owner

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
        self.hash.extend([None] * extra)
        for p in range(old, n):
            heapq.heappush(self._free, p)
        self.num_pages = n

    def shrink_to(self, n: int) -> None:
        """Drop pages ``n ..`` (free or cached: the caller checked ``highest_used() < n``); cached pages among
        them leave the prefix cache."""
        if n >= self.num_pages:
            return
        if n < 1 or self.highest_used() >= n:
            raise ValueError(f"shrink_to {n}: pages at or above it are in use")
        self._free = [p for p in self._free if p < n]
        heapq.heapify(self._free)
        for p in [p for p in self._cached if p >= n]:
            del self._cached[p]
            self._forget(p)
            self.cache_evictions += 1
        for lst in (self.ref, self.owner, self.fill, self.flags, self.session, self.hash):
            del lst[n:]
        self.num_pages = n

    # -- checking --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is in the free list twice"
        assert not free & set(self._cached), "a page is both free and cached"
        for p in range(self.num_pages):
            if p in free:
                assert self.ref[p] == 0, f"free page {p} has ref {self.ref[p]}"
                assert self.hash[p] is None, f"free page {p} has a hash"
            elif p in self._cached:
                assert self.ref[p] == 0, f"cached page {p} has ref {self.ref[p]}"
                assert self.hash[p] is not None, f"cached page {p} has no hash"
            else:
                assert self.ref[p] >= 1, f"used page {p} has ref {self.ref[p]}"
        assert len(self._by_hash) == sum(1 for h in self.hash if h is not None), "hash table out of step"
        for h, p in self._by_hash.items():
            assert self.hash[p] == h, f"hash table points at page {p}, which carries another hash"
            assert self.fill[p] == self.page_size, f"hashed page {p} is not full"
        assert self.num_free + self.num_used == self.num_pages
