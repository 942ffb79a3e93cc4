"""Idle conversations kept with their KV cache, so a request that goes on with a conversation reuses it.

A client of the OpenAI API sends the whole conversation every time: the previous messages, the reply it
got, and a new user message. ``IdleSessions.take`` picks the idle session whose tokens share the longest
prefix with the new prompt; its ``start()`` then prefills only the rest (``TurnStats.reused_tokens``).
A prompt that shares less than ``min_shared`` tokens, or less than half, with every idle session (and does not
extend one whole) gets a new session, so one conversation's cache is not thrown away for another's. At most ``max_idle`` sessions are kept; the least
recently used is closed first (its pages go back to the pool).

Isolation (a client must not learn another conversation's prompt from ``cached_tokens`` or from timing): a
session belongs to one tenant (``tenant``: the API key's and the request's ``cache_salt``'s digest) and only
that tenant's requests take it; its pages are named from the tenant's own prefix-cache root, so another
tenant's request never finds them in the pool either. Within a tenant, a request that does not go on with a
whole idle conversation reuses it in whole pages only (``grain`` tokens): matching one more token of a secret
then changes nothing the client can see, as vLLM's block-granular prefix caching.

Runs on the engine thread only (no locks).
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

from engine.config import CacheConfig
from engine.kv.paged.prefix import salted_root
from engine.core.sequence import common_prefix


class IdleSessions:
    def __init__(self, lm, cache: CacheConfig, max_idle: int = 4, min_shared: int | None = None,
                 on_evict: Callable[[], None] | None = None, speculation: tuple = (None, None)) -> None:
        self.lm = lm
        self.spec, self.draft_lm = speculation  # every conversation speculates so (``serve --speculative``)
        self.cache = cache
        self.max_idle = max(0, max_idle)
        self.min_shared = min_shared if min_shared is not None else (cache.page_size if cache.mode == "paged" else 16)
        self.on_evict = on_evict or (lambda: None)
        # whole pages of the cache (16 tokens when not paged): the unit reused across conversations
        self.grain = cache.page_size if cache.mode == "paged" else 16
        self._idle: list = []  # ChatSession, least recently used first
        self.tenant_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> its tenant

    def __len__(self) -> int:
        return len(self._idle)

    def __iter__(self):
        return iter(list(self._idle))

    def take(self, ids: Sequence[int], tenant: bytes = b""):
        """(session, shared): the idle session of ``tenant`` sharing the longest prefix with ``ids`` (removed from
        the idle list), cut back to whole pages unless ``ids`` goes on with all of it; or a new session and 0."""
        best, shared, whole = None, 0, False
        for s in self._idle:
            if self.tenant_of.get(s) != tenant or s.cache.host is not None or s.cache.store is None:
                continue
            cached = s.seq[:s.index.intact]
            n = common_prefix(cached, ids)
            if n > shared:
                best, shared, whole = s, n, n == len(cached)
        if not whole and best is not None:  # the last prompt token is always fed: whole pages before it
            shared = best.cache.store.reusable(min(shared, len(ids) - 1) // self.grain * self.grain)
        # a prompt that shares only a start (a chat template's header, a system prompt) with a conversation does
        # not take it over: cutting it back would lose that conversation's cache to an unrelated request (its
        # follow-up then found 8 of 111 tokens), and the new one gets the shared pages from the prefix cache anyway
        mostly = best is not None and 2 * shared >= best.index.intact
        if best is not None and shared > 0 and (whole or (shared >= self.min_shared and mostly)):
            self._idle.remove(best)
            if not whole:
                best.cache.truncate(shared)  # what lies past the last whole page is not reused
            return best, shared
        return self.new_session(tenant), 0

    def new_session(self, tenant: bytes = b""):
        """A session of ``tenant``: its full pages are named from the tenant's own prefix-cache root."""
        from engine.core.session import ChatSession

        s = ChatSession(self.lm, self.cache)
        s.cache.root = salted_root(tenant)
        if self.spec is not None and self.spec.method != "off":
            from engine.speculation.draft_model import ModelDrafter

            drafter = ModelDrafter(self.draft_lm, self.lm, check=False) if self.draft_lm is not None else None
            s.speculate(self.spec, drafter)  # a draft cache of its own; the draft model checked at start
        self.tenant_of[s] = tenant
        return s

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
