"""The API's side of the engine core (``engine.core.scheduler.EngineCore``): requests queue FIFO here, are admitted
while fewer than ``max_running`` run (``max_waiting`` queued more get 429), and run as ``Request``s of the core
with ``Priority.API`` — next to the app's own chats when the app serves, on a ``CoreThread`` of their own for
``python -m engine serve``. The core decides what runs in each forward (one-token decodes batched).

Torch is only ever called on the engine thread (``Scheduler.admit`` and the sinks run there); the HTTP side
submits ``Job``s and reads their events from an asyncio queue (``Job.next``). A cancelled job (the client went
away) has its session closed, so its pages go back to the pool at once; a finished one leaves its session idle
for the next request of the same conversation (``engine.core.session_pool.SessionPool`` in ``CLOSE`` mode),
whose pages the core may reclaim.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from typing import Any, Callable

from engine.config import CacheConfig, SamplingConfig
from engine.errors import CacheCapacityError
from engine.kv.tier.report import problems
from engine.core.scheduler import CoreThread, EngineCore, Priority, Request, Source
from engine.core.session_pool import CLOSE, SessionPool
from engine.core.vocab import FinishReason
from engine.snapshot import MissReason
from engine.speculation.draft_model import speculation as draft_speculation
from engine.server.account import public, recomputed_by_reason
from engine.server.errors import ApiError, bad_request, from_exception, one_line
from engine.server.jobs import Backlog, Job, JobRecord
from engine.server.limits import StreamLimits
from engine.server.prompts import Prepared, Tokenizing
from engine.server.message_kinds import MessageKinds
from engine.server.render import reply_text, session_messages
from engine.server.tool_calls import as_message
from engine.server.logprobs import TokenText
from engine.server.metrics import Metrics
from engine.server.schemas import GenRequest

log = logging.getLogger("kvscope.server")


class Scheduler(Source):
    """The API's requests on an engine core: ``core`` (shared with the app), or one of its own on a
    ``CoreThread`` started by ``start``."""

    def __init__(self, lm, cache: CacheConfig, metrics: Metrics | None = None, max_running: int = 16,
                 max_waiting: int = 32, max_idle: int = 4, core: EngineCore | None = None,
                 limits: StreamLimits | None = None, speculation: tuple = (None, None)) -> None:
        """``speculation``: (SpecConfig or None, its draft model or None) for every conversation."""
        self.lm = lm
        self.cache = cache
        self.metrics = metrics or Metrics()
        self.max_running = max(1, max_running)
        self.max_waiting = max(0, max_waiting)
        self.limits = limits or StreamLimits()
        self.tokenizing = Tokenizing(lm, cache, self.limits.max_tokens)
        # finished conversations kept with their KV, closed to make room; each speculates as ``serve`` says (its
        # draft model checked against the model when it loaded)
        spec, draft_lm = speculation
        self.idle = SessionPool(lm, cache, max_idle, evict=CLOSE, on_evict=self.metrics.session_evicted,
                                speculation=draft_speculation(spec, draft_lm, lm, check=False))
        self.token_text = TokenText(lm.tokenizer) if lm.tokenizer is not None else None
        self.records: deque[JobRecord] = deque(maxlen=1024)
        self.kinds = MessageKinds()  # each conversation's messages, for a viewer (the app's token strip)
        self._lock = threading.Lock()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._stopping = False
        self._paused = False
        self._attached = False
        self.own_thread = CoreThread(EngineCore(lm)) if core is None else None
        self.core = core if core is not None else self.own_thread.core

    # -- the HTTP side (any thread) ---------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        if self._stopping or not self._attached:
            return False
        return self.own_thread.alive if self.own_thread is not None else True

    @property
    def thread(self) -> threading.Thread | None:
        """The server's own engine thread (None when it runs on the app's core)."""
        return self.own_thread.thread if self.own_thread is not None else None

    def pause(self) -> None:
        """Hold the API's requests where they are (nothing admitted, nothing stepped) until ``resume``."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self.core.wake()

    def start(self) -> None:
        """Attach to the core (on its thread) and, without a shared core, start the engine thread."""
        if self.own_thread is not None:
            self.own_thread.on_exit.append(self._shutdown)
            self.own_thread.start()
        self._attached = True
        self.core.call(lambda: self.core.sources.append(self))

    async def prepare(self, req: GenRequest, tenant: bytes = b"") -> Prepared:
        """The request's prompt rendered and tokenized off the engine thread (400s for what cannot fit), holding
        the ids ``tenant``'s earlier replies were fed as (``engine.server.reply_ids``)."""
        return await self.tokenizing.prepare(req, tenant)

    def submit(self, req: GenRequest, loop: asyncio.AbstractEventLoop, prepared: Prepared, request_id: str = "",
               tenant: bytes = b"") -> Job:
        """Queue a request (``prepared`` by ``prepare``; ``tenant``: who may share its cache); 429 when
        ``max_waiting`` are queued already, 503 once the server stops."""
        lim = self.limits
        job = Job(req, loop, request_id, tenant, Backlog(lim.stream_buffer, lim.stall_s) if req.stream else None)
        job.prepared = prepared
        job.scheduler, job.on_taken = self, self.core.wake
        with self._lock:
            if not self.alive:
                raise ApiError(503, "the server is shutting down", "server_error", None, "shutting_down")
            if len(self._waiting) >= self.max_waiting:
                self.metrics.outcome("rejected")
                raise ApiError(429, f"too many requests queued ({len(self._waiting)} waiting, {len(self._running)} "
                               "running): try again later", "rate_limit_error", None, "queue_full",
                               headers={"Retry-After": "1"})
            self._waiting.append(job)
        self.core.wake()
        return job

    def cancelled(self, job: Job) -> None:
        with self._lock:
            if job in self._waiting:  # never started: gone at once
                self._waiting.remove(job)
                job.finished = True
                self.metrics.outcome("cancelled")
        self.core.call(lambda: job.request.cancel() if job.request is not None and not job.request.done else None)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two rounds; its result as a future."""
        return self.core.call(fn)

    def stop(self, timeout: float = 30.0) -> None:
        """End the API's work: running requests end with an error (503), idle sessions are closed; then the
        engine thread if it is the server's own. With a shared core, the app's work goes on."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self.tokenizing.close()
        if self.own_thread is not None:
            self.own_thread.stop(timeout)
            return
        fut = self.core.call(self._shutdown)
        try:
            fut.result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            log.warning("the engine did not end the API's requests within %.0f s", timeout)

    # -- the engine thread (the core calls these) ---------------------------------------------------------
    def admit(self, core: EngineCore) -> None:
        """Start waiting requests while fewer than ``max_running`` run. A stream held for a client that stopped
        reading does not count (it takes no steps): 8 such clients no longer keep a 9th request waiting until
        they are cancelled; held and running together stay under ``max_running + max_waiting``."""
        while True:
            with self._lock:
                stepping = sum(1 for j in self._running if j.backlog.held_since is None)
                if (self._stopping or self._paused or not self._waiting or stepping >= self.max_running
                        or len(self._running) >= self.max_running + self.max_waiting):
                    return
                job = self._waiting.popleft()
            self._guard(self._begin, job)

    def reclaim(self) -> bool:
        """Idle conversations give their pages to a request that needs them."""
        return self.idle.reclaim()

    def _guard(self, fn: Callable[[Job], None], job: Job) -> None:
        """Run one job's begin or step; whatever it raises ends that job only (the server goes on)."""
        try:
            fn(job)
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, ApiError):
                log.warning("request %d failed: %s: %s", job.id, type(e).__name__, one_line(e))
            self._end_failed(job, from_exception(e))

    def _end_failed(self, job: Job, err: ApiError) -> None:
        s = job.session
        if job in self._running:
            self._running.remove(job)
            if self._waiting:
                self.core.wake()
        if job.request is not None:
            self.core.finish(job.request, FinishReason.ERROR)
        if s is not None:
            s.close()  # whatever state a failure left, its pages go back
        job.finished = True
        self.metrics.outcome("error")
        job.post("error", err)

    def _begin(self, job: Job) -> None:
        if job.cancelled:
            job.finished = True
            self.metrics.outcome("cancelled")
            return
        req, ids = job.req, list(job.prepared.ids)
        job.sampling = SamplingConfig(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                      max_new_tokens=job.prepared.max_new, stop_strings=req.stop,
                                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                      logprobs=req.logprobs, top_k=req.top_k, min_p=req.min_p,
                                      repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
                                      min_new_tokens=min(req.min_tokens, job.prepared.max_new),
                                      stop_token_ids=req.stop_token_ids, grammar=job.prepared.constraint.grammar)
        if job.prepared.constraint.tool_format:
            job.read_tools(job.prepared.constraint.tool_format, job.prepared.constraint.specials, self.lm.tokenizer,
                           self.lm.stop_ids)
        job.session, shared = self.idle.take(ids, job.tenant)
        # a prompt that goes on with a whole conversation of its own, not one cut back to whole pages for it or a
        # new session: only then is its account told to the token (``engine.server.account``)
        job.own = shared > 0 and job.session.cache.lost[1] is not MissReason.PARTIAL_PAGE
        try:
            self._start_turn(job)
        except CacheCapacityError:
            if not self.reclaim():
                raise
            self._start_turn(job)  # idle conversations gave their pages back (a swapped-in cache needed room)
        self._running.append(job)
        self.kinds.note(job.session.session_id, req.messages if req.kind == "chat" else (), req.tools)
        job.request = self.core.add(Request(job.session, lambda r, job=job: self._guard(lambda j: self._emit(j, r), job),
                                            Priority.API, hold=lambda job=job: self._paused or self._held(job)))
        st = job.stats
        self.metrics.request_started(st.prompt_tokens, st.reused_tokens,
                                     recomputed_by_reason(self._account(job, st)))
        job.post("start", {"prompt_tokens": job.stats.prompt_tokens, "cached_tokens": job.stats.reused_tokens})

    def _account(self, job: Job, stats) -> dict:
        """The cache account of ``job``'s prompt as its client may see it (``stats``: a ``TurnStats``)."""
        return public(stats.cache, job.stats.prompt_tokens, job.stats.reused_tokens, job.own, self.idle.grain)

    def _placed(self, job: Job, account: dict) -> dict:
        """The account with the message (and its kind: a tool call, a tool result, ...) each recomputed range
        starts in (``engine.server.places``). A prompt that left a conversation is told only where computing began,
        which ``cached_tokens`` says already: placing it in the client's own messages tells nothing more."""
        if job.req.kind != "chat":
            return account
        from engine.server.places import place_misses

        return place_misses(self.lm.tokenizer, job.req.messages, job.req.tools, account)

    def _held(self, job: Job) -> bool:
        """Engine thread: is ``job``'s reader too far behind (``engine.server.jobs``)? A new hold is counted and
        a timer armed on the HTTP loop that cancels the job if it is still held ``stall_s`` later."""
        if job.cancelled:
            return False  # stepped once more, to end
        was = job.backlog.held_since
        held = job.backlog.hold()
        if held and was is None:
            self.metrics.stall("paused")
            since = job.backlog.held_since
            try:
                job.loop.call_soon_threadsafe(job.loop.call_later, self.limits.stall_s, self._stalled, job, since)
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass
        return held

    def _stalled(self, job: Job, since: float) -> None:
        """HTTP loop: the job held since ``since`` is still held: cancel it (its pages and slot go back)."""
        if job.backlog.held_since == since and not job.finished and not job.cancelled:
            self.metrics.stall("cancelled")
            job.cancel()

    @staticmethod
    def _start_turn(job: Job) -> None:
        s, req, p = job.session, job.req, job.prepared
        if req.kind == "chat":  # rendered off this thread (``engine.server.prompts``)
            job.stats = s.start_rendered(p.ids, session_messages(req.messages), p.spans, job.sampling, mark=p.mark)
        else:
            job.stats = s.start_ids(p.ids, job.sampling)

    def _emit(self, job: Job, r) -> None:
        """Hand a step's token to the client; end the request when the step ended the reply."""
        if isinstance(r, BaseException):
            raise r
        evicted = len(r.snapshot.evicted_positions) if r.snapshot is not None else 0
        self.metrics.tokens(1 if r.event is not None else 0, evicted)
        if r.event is not None:  # a chunk per token, its text empty while a character or a stop string is held
            look = r.event.index >= job.sampling.min_new_tokens  # min_tokens: the first ones' text not searched
            job.post("delta", (job.text_of(r.event.token_id, r.event.text_delta, look),
                               self._logprob(job, r.event.token_id), r.event.token_id))
        if r.done:
            self._end(job, r.stop_reason, r)

    def _logprob(self, job: Job, token: int) -> dict | None:
        """The token's ``logprobs.content`` entry when the request asked for them (the sampler recorded them)."""
        if job.logprobs is None:
            return None
        sampler = job.session.turn_state.sampler
        last, sampler.last_logprobs = sampler.last_logprobs, None  # each token's own, never a previous one's
        if last is None:  # a path that picked the token without the sampler's __call__ (nothing recorded)
            return None
        entry = self.token_text.entry(token, *last)
        job.logprobs.append(entry)
        return entry

    def _end(self, job: Job, reason: str, result) -> None:
        s = job.session
        self._running.remove(job)
        if self._waiting:
            self.core.wake()  # a slot is free: the next round admits a waiting request (else the core may sleep)
        finish = FinishReason.parse(reason, FinishReason.EOS).openai
        calls: list = []
        if reason == FinishReason.CANCELLED or result is None:
            s.close()  # the client is gone: free its pages now
            finish = FinishReason.CANCELLED.openai
        else:
            tail, calls = job.finish_text()
            if tail:
                job.post("delta", (tail, None, None))
            if calls and finish == "stop":
                finish = "tool_calls"
            if job.req.kind == "chat":  # before "done" (the follow-up may be rendered right after it) and before
                # ``put``, which may close the session (no idle ones kept)
                self.tokenizing.replies.put(job.tenant, reply_text(as_message(job.text, calls)), s.fed_ids())
            self.idle.put(s)
        stats = job.stats
        last = getattr(result, "stats", None) or stats  # the account as the reply left it (planning may drop)
        completion = len(s.turn_state.generated)
        self.records.append(JobRecord(job.id, job.request_id, s.session_id, stats.prompt_tokens, stats.reused_tokens,
                                      stats.recomputed_tokens, completion, finish))
        job.finished = True
        self.metrics.outcome(finish)
        if s.last_stats is not None:
            self.metrics.speculated(s.last_stats)
        warnings = problems(result.warnings) if result is not None else []
        for note in warnings:  # the operator's console too: a full disk is the server's problem, not the client's
            log.warning("%s", note)
        job.post("done", {"finish_reason": finish, "text": job.text, "tool_calls": calls,
                          "stop_sequence": job.trim.matched,
                          "prompt_tokens": stats.prompt_tokens,
                          "completion_tokens": completion, "cached_tokens": stats.reused_tokens,
                          "logprobs": job.logprobs, "token_ids": list(s.turn_state.generated),
                          "prompt_token_ids": list(job.prepared.ids), "warnings": warnings,
                          "cache": self._placed(job, self._account(job, last))})

    def _shutdown(self) -> None:
        """Engine thread: leave the core; running and waiting requests end with 503; idle sessions close."""
        if self in self.core.sources:
            self.core.sources.remove(self)
        with self._lock:
            self._stopping = True
            jobs = list(self._running) + list(self._waiting)
            self._waiting.clear()
        for job in jobs:
            self._end_failed(job, ApiError(503, "the server is shutting down", "server_error", None,
                                           "shutting_down"))
        self.idle.close()

    # -- measurements (engine thread: through ``call``) -----------------------------------------------------
    def conversations(self) -> list[tuple[Any, bool]]:
        """(session, running) for every conversation holding a cache now: running requests first, then the
        idle ones (most recently used last). Engine thread only (the app's Server list reads it through
        ``call``)."""
        running = [(j.session, True) for j in self._running if j.session is not None and not j.session.closed]
        return running + [(s, False) for s in self.idle if not s.closed]

    def kv_gauges(self) -> dict[str, float]:
        """KV bytes and pages in use now, with running / waiting / idle counts. Pages count once however many
        conversations share them (the arenas' own count); contiguous caches add their buffers."""
        sessions = [j.session for j in self._running if j.session is not None] + list(self.idle)
        arenas = list(self.lm.arenas) if self.lm.arenas is not None else []
        paged = sum(a.pool.num_used * a.page_bytes for a in arenas)
        from engine.kv.tier.disk import gauges as disk_gauges
        from engine.kv.store.contiguous import ContiguousKV

        contiguous = sum(sum(s.store.bytes_per_layer()) for s in sessions
                         if not s.closed and isinstance(s.store, ContiguousKV))
        return {"running": len(self._running), "waiting": len(self._waiting), "idle_sessions": len(self.idle),
                "kv_bytes_used": paged + contiguous, "kv_bytes_allocated": sum(a.nbytes for a in arenas),
                "kv_pages_used": sum(a.pool.num_used for a in arenas),
                "kv_pages_cached": sum(a.pool.num_cached for a in arenas),
                "kv_pages_total": sum(a.pool.num_pages for a in arenas), **disk_gauges(self.lm.arenas),
                **self._block_gauges(arenas)}

    def _block_gauges(self, arenas) -> dict[str, float]:
        """vLLM's view of one block pool: the serving setting's arena (page size = block size), its most pages
        as ``num_gpu_blocks`` (the pool grows to that cap here; vLLM allocates it at start), used share."""
        main = [a for a in arenas if getattr(a, "group", "full") == "full" and a.page_size == self.cache.page_size]
        if not main:
            return {"block_size": self.cache.page_size, "num_gpu_blocks": 0, "kv_usage": 0.0}
        arena = max(main, key=lambda a: a.pool.num_pages)
        # without a memory limit (cap 2^40) say 64 full contexts, a pool this server could plausibly fill
        cap = min(arena.cap_pages(), max(arena.pool.num_pages, 64 * self.lm.info.context_length // arena.page_size))
        return {"block_size": arena.page_size, "num_gpu_blocks": cap, "kv_usage": arena.pool.num_used / max(1, cap)}
