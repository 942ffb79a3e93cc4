"""Idle conversations kept with their KV cache, so a request that goes on with a conversation reuses it.

A client of the OpenAI API sends the whole conversation every time: the previous messages, the reply it
got, and a new user message. ``IdleSessions.take`` picks the idle session whose tokens share the longest
prefix with the new prompt; its ``start()`` then prefills only the rest (``TurnStats.reused_tokens``).
A prompt that shares less than ``min_shared`` tokens with every idle session (and does not extend one
whole) gets a new session, so one conversation's cache is not thrown away for another's. At most ``max_idle`` sessions are kept; the least
recently used is closed first (its pages go back to the pool).

Runs on the engine thread only (no locks).
"""

from __future__ import annotations

from typing import Callable, Sequence

from engine.config import CacheConfig
from engine.sequence import common_prefix


class IdleSessions:
    def __init__(self, lm, cache: CacheConfig, max_idle: int = 4, min_shared: int | None = None,
                 on_evict: Callable[[], None] | None = None) -> None:
        self.lm = lm
        self.cache = cache
        self.max_idle = max(0, max_idle)
        self.min_shared = min_shared if min_shared is not None else (cache.page_size if cache.mode == "paged" else 16)
        self.on_evict = on_evict or (lambda: None)
        self._idle: list = []  # ChatSession, least recently used first

    def __len__(self) -> int:
        return len(self._idle)

    def __iter__(self):
        return iter(list(self._idle))

    def take(self, ids: Sequence[int]):
        """(session, shared): the idle session sharing the longest prefix with ``ids`` (removed from the idle
        list), or a new session and 0."""
        best, shared, whole = None, 0, False
        for s in self._idle:
            cached = s.seq[:s.index.intact]
            n = common_prefix(cached, ids)
            if n > shared:
                best, shared, whole = s, n, n == len(cached)
        if best is not None and (shared >= self.min_shared or whole):
            self._idle.remove(best)
            return best, shared
        from engine.session import ChatSession

        return ChatSession(self.lm, self.cache), 0

    def put(self, session) -> None:
        """Keep a finished session (most recently used); close the oldest beyond ``max_idle``."""
        if session.closed:
            return
        self._idle.append(session)
        while len(self._idle) > self.max_idle:
            self._idle.pop(0).close()
            self.on_evict()

    def close(self, evicted: bool = False) -> None:
        """Close every idle session (``evicted``: counted as evictions, to make room)."""
        for s in self._idle:
            s.close()
            if evicted:
                self.on_evict()
        self._idle.clear()
