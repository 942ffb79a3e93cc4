"""The engine core's KV manager: whether a request's next forward can get its pages, and when it cannot, where they
come from — the one place one request's pages are given up for another's.

Asked by the scheduler before each request is prepared (vLLM's ``KVCacheManager``, nano-vllm's ``BlockManager``:
"can allocate?" before "allocate"), in priority order::

    can_allocate(session, n)     the ``n`` tokens its next forward was granted fit the pool now
    make_room(session, n, ...)   idle caches give their pages back first (each source's ``reclaim``: swapped to
                                 host memory or dropped; then the caches of replies this core ran that ended, which
                                 no source holds: swapped), then running requests of lower priority are preempted
                                 (their cache cut back to nothing and recomputed on their next step, as vLLM's
                                 recompute preemption does) — never an error in the middle of a forward

The pages themselves are taken by the session's cache when it is prepared (``SeqCache.reserve``: its one writer)
and given back when a request is preempted (``preempt``) or its session closes. Bookkeeping only: plain ints and
the sessions' own answers; no tensor is touched here.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Protocol

from engine.core.vocab import RequestStatus


class Holder(Protocol):
    """What the manager asks of a session (``engine.core.step.Stepping``)."""

    def room_for(self, n: int) -> bool: ...  # its cache can take ``n`` more tokens now (True: it needs none)
    def preemptible(self) -> bool: ...  # its whole cache can be given up and recomputed exactly
    def give_up_cache(self) -> None: ...  # give every page back (recomputed on its next step)
    def swap_idle(self) -> bool: ...  # its reply over: its pages back, its K/V kept in host memory (True: gave some)
    closed: bool  # closed by its owner (nothing to give back)


class KVManager:
    """Room for the requests of one core. ``sources()`` are the core's sources (their ``reclaim``); ``running()``
    its live requests, each with ``session``, ``priority`` and ``preempted``."""

    def __init__(self, sources: Callable[[], Iterable[Any]], running: Callable[[], Iterable[Any]]) -> None:
        self._sources, self._running = sources, running
        self.preemptions = 0  # requests preempted so far (the scheduler panel's count)
        self._ended: dict[int, weakref.ref] = {}  # sessions whose replies ended, oldest first (not kept alive here)

    def ended(self, sessions: list[Holder]) -> None:
        """``sessions``' requests left the core: their caches, idle now (kept for a next message), may give their
        pages back to a later request (``make_room``) until they are closed or collected."""
        for s in sessions:
            self._ended.pop(id(s), None)
            self._ended[id(s)] = weakref.ref(s)
        if sessions:
            self._ended = {k: w for k, w in self._ended.items() if (s := w()) is not None and not s.closed}

    def can_allocate(self, session: Holder, n: int) -> bool:
        return n <= 0 or session.room_for(n)

    def make_room(self, session: Holder, n: int, priority: int) -> bool:
        """Room for the ``n`` tokens of ``session``'s next forward (it runs at ``priority``): from idle caches, then
        from running requests of lower priority (a larger number), lowest first. True when they fit now (else its
        forward refuses, typed).

        An ended reply's cache no source holds (a chat whose owner keeps it open, outside the app's pool or the
        server's idle conversations) is swapped to host memory like an idle chat of the app: held, it left a request
        that fits the pool alone with "KV cache full" once nothing ran beside it (stories260K, 4-token pages: a
        28-page reply beside an ended chat's 20, on every pool of 30-46 pages)."""
        if self.can_allocate(session, n):
            return True
        for source in list(self._sources()):
            if source.reclaim() and self.can_allocate(session, n):
                return True
        for idle in [s for w in list(self._ended.values()) if (s := w()) is not None and not s.closed]:
            if idle is not session and idle.swap_idle() and self.can_allocate(session, n):
                return True
        for r in sorted(self._running(), key=lambda r: -r.priority):
            if r.priority <= priority or r.session is session:
                break
            if self.preempt(r) and self.can_allocate(session, n):
                return True
        return self.can_allocate(session, n)

    def preempt(self, request: Any) -> bool:
        """Give up ``request``'s cached K/V when it can be recomputed exactly (no policy has evicted from it, nothing
        is lost): its next step re-prefills them. False when it cannot."""
        if not request.session.preemptible():
            return False
        request.session.give_up_cache()
        request.status = RequestStatus.PREEMPTED  # the core's manager: part of the one writer of a request's status
        request.preempted += 1
        self.preemptions += 1
        return True
