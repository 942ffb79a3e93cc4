"""A sequence's logical → physical page list. Plain ints; asks the pool, never touches tensors.

Token ``i`` of the sequence lives in page ``pages[i // P]`` at offset ``i % P``, i.e. physical slot
``pages[i // P] * P + i % P``.

Copy-on-write rule: full pages are shared between forks by ref count and never written again. A shared
*partial* last page is copied to a private page just before the first write into it; ``append`` returns
those ``(src, dst)`` page copies and the caller copies the tensors before writing. A page in the prefix cache
(hashed, ``PagePool.register``) is never written while it keeps its hash: a table cut back into it, or
rewriting it, drops the hash first when it holds the page alone (else copies it, as above).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.kv.paged.pool import PagePool


def page_run(pages: Sequence[int]) -> int | None:
    """The first page id when ``pages`` are consecutive ids ``p, p+1, ...`` (one run), else None.

    The one place that decides it, and it checks every page: ``[0, 3, 2]`` starts at 0 and ends at 2
    like a three-page run, but is not one (reading it as one would put page 1's tokens where page 3's
    belong). An empty list is no run.
    """
    if not pages:
        return None
    first = pages[0]
    if pages[-1] - first != len(pages) - 1:
        return None
    for i, p in enumerate(pages):
        if p != first + i:
            return None
    return first


@dataclass(frozen=True)
class SlotPlan:
    """Where tokens ``[0, end)`` of a table live: decided once (per forward, read or rewrite) and handed to
    the stores, so no store guesses.

    run_start  first physical slot when the pages covering the tokens form one run (read as a view)
    full_run   first page id when the *full* pages ``[0, end // P)`` form one run (quantized page reads)
    """

    end: int
    page_size: int
    pages: tuple[int, ...]  # page ids covering [0, end)
    run_start: int | None
    full_run: int | None

    @property
    def full_pages(self) -> int:
        return self.end // self.page_size

    def slots(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Physical slot of each token in ``[start, stop)`` (default: to ``end``)."""
        P, pages = self.page_size, self.pages
        stop = self.end if stop is None else stop
        return [pages[i // P] * P + i % P for i in range(start, stop)]


class BlockTable:
    def __init__(self, pool: PagePool, session_id: int = -1) -> None:
        self.pool = pool
        self.session_id = session_id
        self.pages: list[int] = []
        self.num_tokens = 0

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def pages_needed(self, n: int) -> int:
        """Pages ``append(n)`` would take from the pool (new pages plus a copy-on-write page)."""
        P = self.page_size
        total = -(-(self.num_tokens + n) // P)
        need = max(0, total - len(self.pages))
        if n > 0 and self.num_tokens % P and self.pool.ref[self.pages[-1]] > 1:
            need += 1
        return need

    def can_append(self, n: int) -> bool:
        """True if the pool has the free pages ``append(n)`` needs now (without growing)."""
        return self.pool.can_allocate(self.pages_needed(n))

    def append(self, n: int, owner: int = -1) -> list[tuple[int, int]]:
        """Reserve slots for ``n`` more tokens; returns the page copies the caller must perform first."""
        P = self.page_size
        copies: list[tuple[int, int]] = []
        if n <= 0:
            return copies
        if self.num_tokens % P:
            last = self.pages[-1]
            if self.pool.ref[last] > 1:  # shared partial page: copy before writing into it
                new = self.pool.allocate(1, owner=owner, session=self.session_id)[0]
                self.pool.set_fill(new, self.num_tokens % P)
                self.pool.decref(last)
                self.pages[-1] = new
                copies.append((last, new))
            else:
                self.pool.unhash(last)  # a cached prefix page cut back and written again: no longer that prefix
        total = -(-(self.num_tokens + n) // P)
        if total > len(self.pages):
            self.pages.extend(self.pool.allocate(total - len(self.pages), owner=owner, session=self.session_id))
        end = self.num_tokens + n
        first_page = self.num_tokens // P
        for i in range(first_page, total):
            self.pool.set_fill(self.pages[i], min(P, end - i * P))
        self.num_tokens = end
        return copies

    def slots(self, start: int, stop: int) -> list[int]:
        """Physical slot index of each logical token in ``[start, stop)``."""
        P = self.page_size
        pages = self.pages
        return [pages[i // P] * P + i % P for i in range(start, stop)]

    def contiguous_start(self) -> int | None:
        """First physical slot if the pages are one run (``page_run``), else None; 0 when empty."""
        if not self.pages:
            return 0
        first = page_run(self.pages)
        return None if first is None else first * self.page_size

    def plan(self, end: int | None = None) -> SlotPlan:
        """Where tokens ``[0, end)`` live (default: every token of the table)."""
        end = self.num_tokens if end is None else end
        P = self.page_size
        pages = tuple(self.pages[:-(-end // P)])
        run = page_run(pages)
        full = end // P
        full_run = run if full == len(pages) else page_run(pages[:full])
        return SlotPlan(end, P, pages, None if run is None else run * P, full_run)

    def shared_pages(self, start: int, stop: int) -> int:
        """How many of ``pages[start:stop]`` are shared with another table (ref > 1)."""
        return sum(1 for p in self.pages[start:stop] if self.pool.ref[p] > 1)

    def make_private(self, start: int, stop: int) -> None:
        """Give ``pages[start:stop]`` that are shared fresh private pages, contents NOT copied: for a caller
        that rewrites those tokens (compaction). The other tables keep the old pages."""
        for i in range(start, min(stop, len(self.pages))):
            old = self.pages[i]
            if self.pool.ref[old] > 1:
                new = self.pool.allocate(1, owner=self.pool.owner[old], session=self.session_id)[0]
                self.pool.set_fill(new, self.pool.fill[old])
                self.pool.decref(old)
                self.pages[i] = new
            else:
                self.pool.unhash(old)  # rewritten in place: out of the prefix cache

    def truncate(self, n: int) -> list[int]:
        """Keep the first ``n`` tokens; returns the pages released (their refs dropped)."""
        if n < 0 or n > self.num_tokens:
            raise ValueError(f"truncate: {n} is outside 0..{self.num_tokens}")
        P = self.page_size
        keep = -(-n // P)
        dropped = self.pages[keep:]
        for p in reversed(dropped):  # tail first, as vLLM frees
            self.pool.decref(p)
        self.pages = self.pages[:keep]
        self.num_tokens = n
        if keep and self.pool.ref[self.pages[-1]] == 1:
            if n % P:
                self.pool.unhash(self.pages[-1])  # partial now: it will be written again
            self.pool.set_fill(self.pages[-1], n - (keep - 1) * P)
        return dropped

    def drop_front(self, pages: int) -> list[int]:
        """Forget the first ``pages`` pages (whole pages of tokens that left a sliding window): their refs are
        dropped and token ``i`` is now token ``i - pages * P``. Returns the pages released."""
        pages = max(0, min(pages, len(self.pages) - 1))  # never the page still being written
        dropped = self.pages[:pages]
        for p in dropped:
            self.pool.decref(p)
        self.pages = self.pages[pages:]
        self.num_tokens -= pages * self.page_size
        return dropped

    def adopt(self, pages: Sequence[int], owner: int = -1) -> None:
        """Append full pages found in the prefix cache (``PagePool.take`` each: shared or taken back from the
        LRU). The table must end on a page boundary."""
        if self.num_tokens % self.page_size:
            raise ValueError("adopt: the table ends inside a page")
        for p in pages:
            self.pool.take(p, owner=owner, session=self.session_id)
        self.pages.extend(pages)
        self.num_tokens += len(pages) * self.page_size

    def fork(self, session_id: int = -1) -> "BlockTable":
        """A new table sharing every page (ref count +1 each)."""
        other = BlockTable(self.pool, session_id)
        for p in self.pages:
            self.pool.incref(p)
        other.pages = list(self.pages)
        other.num_tokens = self.num_tokens
        return other

    def free(self) -> None:
        self.truncate(0)
