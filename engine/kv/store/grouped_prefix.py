"""The prefix cache on a hybrid or sliding-window model's cache (``GroupedKV``): what lets a new chat, an API request
or a restarted app go on from a prefix an earlier sequence computed.

A prefix of ``j`` full pages (``p = j * P`` tokens) can be taken when every part can be had at ``p``:

- the full-attention layers' pages ``0 .. j-1`` from their pool (named as on a plain model);
- each sliding group's pages of the window before ``p`` (``first .. j-1``, ``first = (p - window + 1) // P``) from
  its own pool, where its pages carry the same names: a page the window gave back stays there, named and free to
  be taken by an allocation, until one needs its room (the pool's LRU) — so windows cost no pinned memory;
- the recurrent states at ``p`` from the model's ``StateShelf`` (``engine.kv.store.state_shelf``), kept at the
  page boundaries a prefill stops at (``SeqCache.plan``).

The sequence's cache is the one writer of what it takes; the pools and the shelf are the model's.
"""

from __future__ import annotations

from engine.kv.paged.block_table import BlockTable
from engine.kv.paged.prefix import cached_run
from engine.kv.store.storage import PagedKV


class GroupedPrefix:
    """Mixin of ``GroupedKV``: its full part ``full``, sliding groups ``windows``, states ``states``, ``fed``."""

    def prefix_parts(self) -> list[tuple[object, PagedKV, int]]:
        """(window or None, paged part, logical page of its first page) of every part the prefix cache names: the
        full-attention pages and each sliding group's, all paged at the model's own precision; else empty."""
        full = self.full
        if full is not None and (type(full) is not PagedKV or full.arena.kinds != {"k": "auto", "v": "auto"}):
            return []
        if any(w.arena.kinds != {"k": "auto", "v": "auto"} for w in self.windows.values()):
            return []
        P = self.windows[next(iter(self.windows))].arena.page_size if self.windows else full.page_size
        parts = [(None, full, 0)] if full is not None else []
        # a window copied from another page size may start inside a page of this one: its pages are not named
        # pages (their tokens do not start at a multiple of P) until the window has moved past them
        return parts + [(w, w.inner, w.base // P) for w in self.windows.values() if w.base % P == 0]

    @property
    def prefix_page_size(self) -> int:
        part = self.full if self.full is not None else next(iter(self.windows.values())).inner
        return part.page_size

    def name_pages(self, chain: list[bytes], first: int, last: int) -> list[tuple[object, list[int], list[bytes]]]:
        """Register logical pages ``first .. last-1`` (full, intact, named by ``chain``) of every part still holding
        them. Returns (arena, pages, names) newly registered, per part (for the disk tier)."""
        out = []
        for _, part, base in self.prefix_parts():
            pool, pages, got = part.arena.pool, part.table.pages, ([], [])
            for j in range(max(first, base), min(last, len(chain))):
                i = j - base
                if i < len(pages) and (i + 1) * part.page_size <= part.table.num_tokens:
                    if pool.register(pages[i], chain[j], chain[j - 1] if j else None):
                        got[0].append(pages[i])
                        got[1].append(chain[j])
            if got[0]:
                out.append((part.arena, *got))
        return out

    def window_pages_at(self, win, chain: list[bytes], j: int) -> tuple[int, list[bytes]]:
        """(first logical page, names) of the pages ``win`` needs to go on from ``j`` full pages."""
        P = win.arena.page_size
        first = max(0, j * P - win.window + 1) // P
        return first, chain[first:j]

    def windows_available(self, chain: list[bytes], j: int) -> bool:
        """Does every sliding group's pool hold the pages of its window before ``j`` full pages?"""
        for win in self.windows.values():
            first, names = self.window_pages_at(win, chain, j)
            if len(cached_run(win.arena.pool, names, 0)) < len(names):
                return False
        return True

    def available(self, chain: list[bytes], j: int, shelf) -> bool:
        """Can every sliding group and the states be had in memory at ``j`` full pages?"""
        if not self.windows_available(chain, j):
            return False
        return not self.states or (j > 0 and shelf is not None and shelf.get(self.prefix_page_size, chain[j - 1])
                                   is not None)

    def take_prefix(self, chain: list[bytes], j: int, let_go, shelf, owner: int = -1) -> bool:
        """Hold the first ``j`` full pages' prefix (``available``) instead of whatever this cache held; ``let_go()``
        lets go of this cache's tokens (its caller's index with them). Nothing of this store is kept; ``fed`` is
        ``j * P`` after. The pages are found by name and held before ``let_go``: it drops this cache's checkpoints,
        and a window page given back then may trim its arena, which forgets the named free pages above the pages
        still in use — a page list found before would point at pages that no longer hold the prefix. False (and
        ``let_go`` not called) if a page is gone since ``available``."""
        parts = ([(self.full, chain[:j])] if self.full is not None else []) + \
            [(win.inner, self.window_pages_at(win, chain, j)[1]) for win in self.windows.values()]
        pins = []
        try:
            for part, names in parts:
                pin = BlockTable(part.arena.pool, part.table.session_id)
                pin.adopt(cached_run(part.arena.pool, names, 0), owner=owner)
                pins.append(pin)
                if len(pin.pages) < len(names):
                    return False
            let_go()
            self.truncate(0)
            held = ([self.full] if self.full is not None else []) + [w.inner for w in self.windows.values()]
            for part, pin in zip(held, pins):  # (the parts as they are after letting go, in the same order)
                part.adopt(pin.pages, owner=owner)
            for win in self.windows.values():
                win.base = self.window_pages_at(win, chain, j)[0] * win.arena.page_size
            if self.states:
                self.states.restore(shelf.get(self.prefix_page_size, chain[j - 1]))
            self.fed = j * self.prefix_page_size
            return True
        finally:
            for pin in pins:  # the parts hold them now (or nobody asked for them)
                pin.truncate(0)

    def share_states(self, chain: list[bytes], shelf) -> bool:
        """Keep the states at ``fed`` (a page boundary named by ``chain``) on the model's shelf."""
        P = self.prefix_page_size
        j = self.fed // P
        if not self.states or shelf is None or self.fed % P or not 0 < j <= len(chain):
            return False
        if (P, chain[j - 1]) in shelf:
            shelf.get(P, chain[j - 1])
            return True
        saved = self.states.snapshot()
        return shelf.put(P, chain[j - 1], saved, self.states.nbytes_of(saved))
