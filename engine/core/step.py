"""The one step implementation of a ``ChatSession`` (``Stepping``, its base): ``prepare`` plans and reserves the
next forward (a ``Work`` for ``engine.model.runner.ModelRunner``), ``finish`` commits it and takes the token — its
stop checks, its snapshot — or ``abort`` rolls it back. ``step()`` is the three for one session; the engine
core (``engine.core.scheduler``) runs them with several sessions' work in one forward.

What a step reads and writes is the session's: its ``Sequence`` (``engine.core.sequence``) and its ``SeqCache``
(``engine.core.seq_cache``), the one writer of the cache.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable


from engine.core import observe, reprefill
from engine.core.kv_manager import SIT_OUT
from engine.core.records import Demand
from engine.errors import ContextOverflowError, EngineError, as_engine_error
from engine.model.runner import Output, Work
from engine.snapshot import StepResult

if TYPE_CHECKING:
    from engine.core.eviction import EvictionPlan
    from engine.model.loaded import LoadedModel
    from engine.core.seq_cache import SeqCache
    from engine.core.sequence import Sequence
    from engine.core.verify import Speculator


@dataclasses.dataclass(frozen=True)
class OpenStep:
    """A forward prepared and reserved, waiting for its output (``prepare`` → ``finish`` / ``abort``)."""

    t0: float  # when it was prepared (its step's time counts from here)
    n_in: int  # tokens it feeds
    work: Work
    plan: "EvictionPlan | None"  # what the evictor decided for it (None: a verification, or the cache off)
    drafts: list[int] | None  # a verification's draft tokens (None: a plain step)


class Stepping:
    """Stepping a reply; the session provides its parts (declared here) and ``check_open`` / ``snapshot``."""

    lm: "LoadedModel"
    sequence: "Sequence"
    cache: "SeqCache"
    prefill_chunk: int
    _open: OpenStep | None  # the prepared forward
    spec: "Speculator | None"  # speculative decoding (``engine.core.verify``), None: off
    _ready: list  # tokens a verification gave beyond its first: (event, stop, text), one per step, no forward
    _proposal: tuple | None  # the next forward's drafts, once proposed: (reply, its length, drafts, seconds)

    def step(self) -> StepResult:
        """One model forward: a chunk of a long prefill (``event`` None), or the forward that gives a token. The
        scheduler's own path (``run_forward``) for this session alone; what ended the reply is raised, typed."""
        result = run_forward([(self, None)])[id(self)]
        if isinstance(result, BaseException):
            raise result
        return result

    # -- what the core's scheduler and KV manager ask (``engine.core.scheduler``, ``engine.core.kv_manager``) -----
    @property
    def runner(self):
        """The model runner its forwards run on (requests of one runner may share a forward)."""
        return self.lm.runner

    def demand(self) -> Demand:
        """What its next forward asks of a round (the scheduler grants its tokens from it, once a round). A decoding
        reply that speculates proposes its drafts here (``_propose``): the grant, and the room the KV manager finds,
        are its verification's ``len(drafts) + 1`` tokens."""
        pending = self.pending_tokens()
        limit = reprefill.chunk(self.prefill_chunk) if reprefill.running(self.sequence.reply) else self.prefill_chunk
        return Demand(pending, limit, self.shares(), self.runner, self._propose() if pending == 1 else ())

    def room_for(self, n: int) -> bool:
        """Its cache can take ``n`` more tokens now (True when it needs none: no reply in progress, no cache)."""
        return not self.sequence.running or self.cache.store is None or self.cache.can_reserve(n)

    def preemptible(self) -> bool:
        """Its cache can be given up and recomputed exactly: it holds tokens, no policy decides what it keeps, and
        none of them was evicted (the recomputation would not be the same)."""
        return self.cache.can_give_up()

    def give_up_cache(self) -> None:
        self.cache.truncate(0)

    def swap_idle(self) -> bool:
        """Between replies: its pages given back, its K/V moved to host memory (its next reply brings them back, as
        an idle chat of the app's pool). False when it has none to give (replying, closed, swapped, no pages)."""
        q, c = self.sequence, self.cache
        if q.running or q.closed or c.host is not None or c.pool_key() is None or not c.n:
            return False
        return c.swap_out() > 0

    def can_wait(self, n: int) -> bool:
        """It may wait for room for ``n`` more tokens (``KVManager.sit_out``): a plain paged store whose cache can
        be given up and recomputed exactly (or holds nothing), its sequence and ``n`` more tokens within its pool's
        page cap with nothing else in it (else no wait could give it room)."""
        c = self.cache
        if c.reserved_pages(0) is None or not (c.n == 0 or c.can_give_up()):
            return False
        return max(c.n + n, len(self.sequence.ids)) <= observe.capacity(c)

    def pool_key(self) -> int | None:
        """Which page pool its cache writes (sessions of one pool see every page a shared forward wrote)."""
        return self.cache.pool_key()

    def pages_for(self, work: Work) -> tuple[int, tuple[int, ...]] | None:
        """(pool, pages) the prepared ``work`` writes, on a plain paged store; else None."""
        return self.cache.reserved_pages(work.q)

    def pending_tokens(self) -> int:
        """Tokens the reply's next forwards still have to feed before its next token (1 while decoding; 0 while
        a verification's tokens are still being handed out)."""
        if self._ready:
            return 0
        return self.cache.pending(len(self.sequence.ids)) if self.sequence.running else 1

    def shares(self) -> int:
        """Tokens the next step would feed in a forward shared with other sessions (one decode token, or a prefill
        of more; a decode step granted its drafts' verification shares the forward as a decode row too); 0 when it
        cannot share one (cancelled, cache off or swapped, a score-reading policy)."""
        ok = self.sequence.running and not self.sequence.cancelled and self.cache.can_share(len(self.sequence.ids))
        ok = ok and not self._ready  # a verification's later tokens are handed out without a forward
        return self.cache.pending(len(self.sequence.ids)) if ok else 0

    def prepare(self, tokens: int | None = None) -> Work | StepResult:
        """Plan and reserve the next forward, feeding at most ``tokens`` (the scheduler's grant; None: its own
        ``demand``'s): its ``Work``, or the reply's last ``StepResult`` when it ends without one (cancelled,
        context full). A typed error ends the reply (nothing reserved)."""
        self.check_open()
        if self._ready:  # a verification's later tokens: one per step, so every consumer sees one at a time
            return self._hand_out()
        if not self.sequence.running:
            raise EngineError("no reply in progress: call start() first")
        q, c = self.sequence, self.cache
        if q.cancelled:
            return self._finish("cancelled", None)
        chunk = tokens if tokens is not None else self.demand().tokens  # alone: its own demand's (drafts proposed)
        t0 = time.perf_counter()
        c.begin_step()
        drafts, draft_s = self._granted(chunk)
        if drafts:
            try:
                work = c.next_verify(q.ids, drafts, owner=q.turn)
            except BaseException as e:
                raise self._fail(e) from e
            self._open = OpenStep(t0 - draft_s, len(drafts) + 1, work, None, list(drafts))  # drafting is its cost
            return work
        try:
            work, plan = c.next_forward(q.ids, q.protected, q.priorities, max(1, chunk), q.turn)
        except ContextOverflowError as e:
            q.add_notes([str(e)])
            return self._finish("context_full", None)
        except BaseException as e:
            raise self._fail(e) from e
        q.planned(plan, t0)  # its notes; prompt tokens it dropped unread are not counted as computed
        n_in = c.pending(len(q.ids))  # after planning: without the tokens dropped to fit the context
        self._open = OpenStep(t0, n_in, work, plan, None)
        return work

    def _propose(self) -> tuple[int, ...]:
        """The drafts its next forward would verify (() : a plain step), proposed once for that forward (asked again
        before it runs, the same ones: a drafter's proposal moves its state, a draft model runs forwards). Only
        while decoding, within the reply's remaining tokens, the room the cache can cut back exactly
        (``SeqCache.draft_room``) and the pages it can take now."""
        q, c, spec = self.sequence, self.cache, self.spec
        t, p = q.reply, self._proposal
        if p is not None and p[0] is t and p[1] == len(q.ids):
            return p[2]
        self._proposal = None
        budget = q.draft_budget() if spec is not None else 0
        if budget <= 0:
            return ()
        t0 = time.perf_counter()
        room = min(c.draft_room(len(q.ids)), budget)
        drafts = tuple(q.propose(spec, room) if room > 0 else ())
        drafts = drafts if drafts and c.can_reserve(len(drafts) + 1) else ()
        self._proposal = (t, len(q.ids), drafts, time.perf_counter() - t0)
        return drafts

    def _granted(self, tokens: int) -> tuple[tuple[int, ...], float]:
        """The proposed drafts and the seconds proposing took, when ``tokens`` (the grant) is their verification's
        and the cache can take them; else ((), 0.0): a plain step. The proposal is used up either way."""
        p, self._proposal = self._proposal, None
        q = self.sequence
        if p is None or not p[2] or p[0] is not q.reply or p[1] != len(q.ids) or tokens != len(p[2]) + 1:
            return (), 0.0
        c, n = self.cache, len(p[2])
        return (p[2], p[3]) if c.draft_room(len(q.ids)) >= n and c.can_reserve(tokens) else ((), 0.0)

    def abort(self, exc: BaseException) -> BaseException:
        """The prepared forward failed: roll it back, end the reply; the typed error to report."""
        if self._open is not None and self.cache.store is not None:
            self.cache.rollback()
        return self._fail(exc)

    def finish(self, out: Output, written: tuple[int, ...] = ()) -> StepResult:
        """After the prepared forward (``out``; ``written``: pages a batched forward wrote in this pool): commit,
        then the prefill chunk's progress, or the token, its stop checks and the snapshot."""
        opened, self._open = self._open, None
        t0, n_in, work, plan, drafts = opened.t0, opened.n_in, opened.work, opened.plan, opened.drafts
        if drafts:
            return self._finish_verify(t0, work, drafts, out)
        q, c = self.sequence, self.cache
        at = len(q.ids) - n_in  # where this forward's tokens start (0 with the cache off: every token fed)
        try:
            fed = c.forward_done(work, out, plan, q.ids, written)
            q.forward_done(c.last)
            ms = (time.perf_counter() - t0) * 1000.0
            if out.batch == 1:  # alone: its time is its own (the model's prefill rate)
                reprefill.record(self.lm, work.q, ms, work.scores)
            moved, again_ms = reprefill.feed(q.reply, at, work.q, ms)  # the share of a cache change's re-prefill
            if not fed:  # a chunk of a longer prefill: Stop can act before the next
                q.chunk_done(ms - again_ms)
                return StepResult(event=None, snapshot=self.snapshot("prefill", ms - again_ms), done=False,
                                  text=q.text, reprefill=moved)
            t0 += again_ms / 1000.0  # the token's time (TTFT, decode) starts after it
            event, stop = q.next_token(out.logits, t0, n_in, out.path, self.lm.stop_ids)
        except BaseException as e:
            raise self._fail(e) from e
        if event.phase == "decode" and self.spec is not None:
            self.spec.record_plain(event.step_ms)
        stop = stop or ("context_full" if c.fills_context(len(q.ids)) else "")
        if stop:
            return self._finish(stop, event, moved)
        return StepResult(event=event, snapshot=self.snapshot(event.phase, event.step_ms), done=False,
                          text=q.text, reprefill=moved)

    def _finish_verify(self, t0: float, work: Work, drafts: list[int], out: Output) -> StepResult:
        """After a verification: the tokens it yields (drafts that stay, then the model's own), each accepted
        with its stop checks; the cache cut back to the kept slots; the first token now, the rest queued."""
        q, c, spec = self.sequence, self.cache, self.spec
        try:
            tokens = q.verified(out.logits, drafts)
        except BaseException as e:
            c.rollback()
            raise self._fail(e) from e
        ready, clock = [], t0
        for j, token in enumerate(tokens):
            event, stop = q.accept(token, clock, work.q if j == 0 else 0, out.path, self.lm.stop_ids)
            clock = time.perf_counter()  # the forward's time goes to the first token; the rest cost ~0
            event = dataclasses.replace(event, draft=j < len(tokens) - 1)
            # token j is written j + 1 places after the fed one: the context is full when the one after it would not fit
            stop = stop or ("context_full" if c.fills_context(len(q.ids), ahead=j + 1) else "")
            ready.append((event, stop, q.text))
            if stop:
                break
        kept = len(ready) - 1  # drafts that stay (a stop can end the reply on an accepted draft)
        try:
            c.commit_verify(work, len(ready), q.ids, out.batch)
        except BaseException as e:
            raise self._fail(e) from e
        ms = (time.perf_counter() - t0) * 1000.0
        q.verification_done(spec.record_verify(len(drafts), kept, len(ready), ms) if spec is not None else "")
        self._ready_snapshot = self.snapshot("decode", ms)
        self._ready = ready
        return self._hand_out()

    def _hand_out(self) -> StepResult:
        event, stop, text = self._ready.pop(0)
        if stop:
            self._ready = []
            return self._finish(stop, event)
        return StepResult(event=event, snapshot=self._ready_snapshot, done=False, text=text)

    def _fail(self, exc: BaseException) -> BaseException:
        """End the turn after ``exc`` (its forward rolled back): the typed error."""
        self._open, self._ready, self._proposal = None, [], None
        self.sequence.end("error")
        return as_engine_error(exc)

    def _finish(self, reason: str, event, moved=None) -> StepResult:
        self._open = None
        event, stats = self.sequence.end_reply(reason, event)
        snapshot = self.snapshot(event.phase if event is not None else "decode", event.step_ms if event else 0.0)
        self.cache.settle()  # an idle chat's picture shows no page being written
        self.sequence.add_notes(self.cache.disk_writer_notes())  # a full disk since the reply began: said with it
        return StepResult(event=event, snapshot=snapshot, done=True, stop_reason=reason, text=self.sequence.text,
                          stats=stats, warnings=self.sequence.take_notes(), reprefill=moved)


def run_forward(unit: list[tuple[Any, int | None]], room: Callable[[Any, Any], Any] | None = None) -> dict[int, Any]:
    """One forward of ``unit`` (one session, or a batchable group, each with the tokens granted it: None, its own
    demand's): each prepared (room first: ``room(session, tokens)`` gives the grant it runs with, or ``SIT_OUT``:
    not this forward, no result for it), one runner call for those that need the model, then each one's own finish
    — a ``StepResult`` or the exception that ended its reply, by ``id(session)``. The only place scheduled work
    reaches the model runner (the core's round runs each of its forwards here; ``Stepping.step``, a session
    alone)."""
    out: dict[int, Any] = {}
    joined, works = [], []
    for s, tokens in unit:
        try:
            if room is not None:
                tokens = room(s, tokens)
                if tokens == SIT_OUT:
                    continue
            w = s.prepare(tokens)
        except BaseException as e:  # noqa: BLE001 - typed by the session, which ended the reply
            out[id(s)] = e
            continue
        if isinstance(w, StepResult):
            out[id(s)] = w
        else:
            joined.append(s)
            works.append(w)
    if not joined:
        return out
    try:
        outs: list[Output] = joined[0].runner.run(works)
    except BaseException as e:  # noqa: BLE001 - every session of the forward ends with it
        for s in joined:
            typed = s.abort(e)
            if typed is not e and typed.__cause__ is None:
                typed.__cause__ = e  # the original, for KVSCOPE_DEBUG's traceback
            out[id(s)] = typed
        return out
    written = _written_together(joined, works, outs) if len(joined) > 1 else {}
    for s, o in zip(joined, outs):
        try:
            out[id(s)] = s.finish(o, written.get(s.pool_key(), ()))
        except BaseException as e:  # noqa: BLE001 - this session's reply ended, typed
            out[id(s)] = e
    return out


def _written_together(sessions: list, works: list, outs: list[Output]) -> dict[int | None, tuple[int, ...]]:
    """Each pool's pages a batched forward wrote (every session's snapshot shows them all)."""
    by_pool: dict[int | None, set[int]] = {}
    for s, w, o in zip(sessions, works, outs):
        if o.path in ("batched", "compiled batch"):
            pages = s.pages_for(w)
            if pages is not None:
                by_pool.setdefault(pages[0], set()).update(pages[1])
    return {k: tuple(sorted(v)) for k, v in by_pool.items()}
