"""The engine core's KV manager: whether a request's next forward can get its pages, and when it cannot, where they
come from — the one place one request's pages are given up for another's.

Asked by the scheduler before each request is prepared (vLLM's ``KVCacheManager``, nano-vllm's ``BlockManager``:
"can allocate?" before "allocate"), in priority order::

    can_allocate(session, n)     the ``n`` tokens its next forward was granted fit the pool now
    make_room(session, n, ...)   idle caches give their pages back first (each source's ``reclaim``: swapped to
                                 host memory or dropped; then the caches of replies this core ran that ended, which
                                 no source holds: swapped), then running requests that come after it (a lower
                                 priority; as high and younger: first come, first served) are preempted
                                 (their cache cut back to nothing and recomputed on their next step, as vLLM's
                                 recompute preemption does) — never an error in the middle of a forward
    room(request, n)             make_room, or the request sits the round out (``sit_out``): no room even so, or a
                                 request before it on its pool waits for room — it waits (its cache given up,
                                 preempted) while requests that come before it hold its pool's pages, when it
                                 alone fits the pool; else its forward refuses, typed

The pages themselves are taken by the session's cache when it is prepared (``SeqCache.reserve``: its one writer)
and given back when a request is preempted (``preempt``) or its session closes. Bookkeeping only: plain ints and
the sessions' own answers; no tensor is touched here.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Protocol, Sequence

from engine.core.vocab import RequestStatus

SIT_OUT = -1  # a forward's room answer (``engine.core.step.run_forward``): it waits (``sit_out``), no result now


class Holder(Protocol):
    """What the manager asks of a session (``engine.core.step.Stepping``)."""

    def room_for(self, n: int) -> bool: ...  # its cache can take ``n`` more tokens now (True: it needs none)
    def preemptible(self) -> bool: ...  # its whole cache can be given up and recomputed exactly
    def give_up_cache(self) -> None: ...  # give every page back (recomputed on its next step)
    def swap_idle(self) -> bool: ...  # its reply over: its pages back, its K/V kept in host memory (True: gave some)
    def can_wait(self, n: int) -> bool: ...  # it may wait for ``n`` tokens' room: fits its pool alone, gives up exactly
    closed: bool  # closed by its owner (nothing to give back)


class KVManager:
    """Room for the requests of one core. ``sources()`` are the core's sources (their ``reclaim``); ``requests()``
    its requests, oldest first (those ending this round too), each with ``session``, ``priority``, ``status``,
    ``done``, ``hold`` and ``preempted``."""

    def __init__(self, sources: Callable[[], Iterable[Any]], requests: Callable[[], Sequence[Any]]) -> None:
        self._sources, self._requests = sources, requests
        self.preemptions = 0  # requests preempted so far (the scheduler panel's count)
        self._ended: dict[int, weakref.ref] = {}  # sessions whose replies ended, oldest first (not kept alive here)
        self._waiting: set[int] = set()  # requests preempted that have not had room since (``id``)

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
        from running requests that come after it (a lower priority: a larger number; or as high and younger: first
        come, first served), the lowest and youngest first. True when they fit now (else it waits or its forward
        refuses, typed: ``room``).

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
        order = list(self._requests())
        i = next((j for j, r in enumerate(order) if r.session is session), len(order))
        behind = [(r.priority, j) for j, r in enumerate(order) if (r.priority, j) > (priority, i) and not r.done]
        for _, j in sorted(behind, reverse=True):  # the lowest priority first; as low: the youngest first
            if self.preempt(order[j]) and self.can_allocate(session, n):
                return True
        return self.can_allocate(session, n)

    def room(self, request: Any, n: int) -> bool:
        """Room for ``request``'s next forward of ``n`` tokens (``make_room``); False: it sits this round out
        (``sit_out``). Holding no cache, behind a request of its pool that waits for room, it waits too: the pages
        that one gave up are for the requests before it, not taken by a later one (else the later one, preempted
        again for them each round, recomputes its cache each round: 16 preemptions where 3 do)."""
        if self._waiting:  # asked only while some request waits (a decode round's walk stays as it was)
            waiting = any(id(r) in self._waiting and not r.hold() for r in self._ahead(request))
            if waiting and not request.session.preemptible() and self.sit_out(request, n):  # nothing to give up
                return False
            self._waiting.discard(id(request))
        return self.make_room(request.session, n, request.priority) or not self.sit_out(request, n)

    def _ahead(self, request: Any) -> list[Any]:
        """The requests on ``request``'s page pool that come before it: a higher priority, or as high and older
        (first come, first served); those ending this round too (their pages go back as they leave)."""
        order, key = list(self._requests()), request.session.pool_key()
        i = order.index(request)
        self._waiting.intersection_update(id(r) for r in order if not r.done)
        return [r for j, r in enumerate(order) if (r.priority, j) < (request.priority, i) and key is not None
                and r.session is not request.session and r.session.pool_key() == key]

    def sit_out(self, request: Any, n: int) -> bool:
        """``request`` got no room for its ``n`` tokens (``make_room``): it sits this round out — its cache given up
        (recomputed when it resumes, as vLLM's preempted requests are), PREEMPTED — when it alone fits its pool and
        a request that comes before it (a higher priority, or as high and older: first come, first served; one
        ending this round too) is on that pool; it resumes once they gave their pages back. The first request of a
        pool never waits, so none waits forever (stories260K, 4-token pages: a background chat's 20 pages under the
        chat on screen's 28 failed with "KV cache full" on pools of 30-36 pages). False: it cannot fit alone, or
        nothing before it is on its pool — its forward refuses, typed."""
        s = request.session
        if not s.can_wait(n) or not self._ahead(request):
            return False
        if s.preemptible():  # an empty cache (it never ran, or gave it up) has nothing to give: not counted again
            s.give_up_cache()
            request.preempted += 1
            self.preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._waiting.add(id(request))
        return True

    def preempt(self, request: Any) -> bool:
        """Give up ``request``'s cached K/V when it can be recomputed exactly (no policy has evicted from it, nothing
        is lost): its next step re-prefills them. False when it cannot."""
        if not request.session.preemptible():
            return False
        request.session.give_up_cache()
        request.status = RequestStatus.PREEMPTED  # the core's manager: part of the one writer of a request's status
        self._waiting.add(id(request))
        request.preempted += 1
        self.preemptions += 1
        return True
