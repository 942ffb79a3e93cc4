"""The engine core: one scheduler for everything that runs on a model — app chats, comparisons and API requests.

``EngineCore.round()`` is one scheduling step, on the engine thread (the app's worker thread, or
``CoreThread`` for ``python -m engine serve``)::

    calls, admissions          what other threads asked for (``call``), what sources let in (``Source.admit``)
    schedule                   requests by priority (the chat on screen first): each asked once what its next
                               forward needs (``Demand``: a speculating chat's drafts proposed there); decode rows
                               and verifications granted, prefill chunks within a budget
    batch                      the decode rows (and the first prefill chunk) of one runner in one forward, the rest
                               alone (``records.grants`` and ``records.forward_units``: arithmetic over demands)
    run                        room for each granted forward (the KV manager), each prepared with its grant, one
                               runner call a forward (``engine.core.step.run_forward``)
    postprocess                each request's result to its sink; finished requests leave
    tasks                      one step of each background task (a comparison), alone, so its timing is its own

Room before work ("can I?" before "do it"): a request whose next forward needs pages the pool does not have
first gets pages from idle caches (each source's ``reclaim``: swapped to host memory or dropped), then from
running requests of lower priority, which are preempted (their cache is cut back and recomputed on their next
step, as vLLM's recompute preemption does), never an error in the middle of a forward.

Threads: ``submit``-like calls come through ``call`` (a future) and ``wake``; everything else — sessions,
stores, the model — is touched on the engine thread only.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from engine.errors import EngineError
from engine.snapshot import StepResult
from engine.core.kv_manager import SIT_OUT, Holder, KVManager
from engine.core.records import Demand, forward_units, grants, share_groups
from engine.core.vocab import FinishReason, Priority, RequestStatus

PREFILL_BUDGET = 2048  # prefill tokens per round beyond the first chunk: a new message waits at most one round


class Steppable(Holder, Protocol):
    """What the core steps: a ``ChatSession`` (``engine.core.session``) or anything with its step interface: what
    the round and a forward ask (``engine.core.step.run_forward``), and what the KV manager asks (``Holder``)."""

    generating: bool  # a reply is in progress
    closed: bool  # its owner closed it (the KV manager takes ended replies' caches only while it is open)
    turn_state: Any  # its reply's record (``engine.core.sequence.TurnState``): the request's status lives there
    lm: Any  # the ``LoadedModel`` it runs on
    runner: Any  # its model runner (requests of one runner may share a forward)

    def step(self) -> StepResult: ...
    def cancel(self) -> None: ...
    def demand(self) -> Demand: ...  # what its next forward asks of the round (asked once a round)
    def prepare(self, tokens: int | None = None) -> Any: ...  # lays out the round's grant (at most ``tokens``)
    def finish(self, out: Any, written: tuple[int, ...] = ()) -> StepResult: ...
    def abort(self, exc: BaseException) -> BaseException: ...
    def pool_key(self) -> int | None: ...  # a shared forward's pages: which pool, which pages
    def pages_for(self, work: Any) -> tuple[int, tuple[int, ...]] | None: ...


@dataclass(eq=False)
class Request:
    """One reply in progress: a started session and where its results go (``sink(result)``, called on the engine
    thread with a ``StepResult`` or the exception that ended the reply; the last call is a done result or an
    exception). Its ``status`` is its reply's (the session's ``turn_state``: one lifecycle, read by both, moved
    through ``RequestStatus.to``); ``finish_reason`` is the core's to write (``EngineCore.finish`` / ``abort``)."""

    session: Steppable
    sink: Callable[[Any], None]
    priority: Priority = Priority.API
    hold: Callable[[], bool] = lambda: False  # True: not stepped this round (its source paused it)
    finish_reason: FinishReason | None = None
    preempted: int = 0  # times its cache was given up for a request that came first (recomputed since)
    reply: Any = field(init=False, repr=False)  # the reply's record, whose ``status`` this request's is

    def __post_init__(self) -> None:
        self.reply = self.session.turn_state  # this reply's, not a later one's: a session starts a new record

    @property
    def status(self) -> RequestStatus:
        return self.reply.status

    @status.setter
    def status(self, new: RequestStatus) -> None:
        if new is not self.reply.status:
            self.reply.status = self.reply.status.to(new)

    @property
    def done(self) -> bool:
        return self.reply.status is RequestStatus.FINISHED

    def cancel(self) -> None:
        """Stop the reply at its next step (engine thread, or any thread: only a flag is set)."""
        self.session.cancel()


@dataclass(frozen=True)
class Scheduled:
    """One request's part of a round: what it asked (``demand``) and the tokens it was granted (a prefill chunk,
    or the one decode token)."""

    request: Request
    demand: Demand
    tokens: int


class Source(Protocol):
    """Something that submits work to the core (the app's worker, the API server). Hooks run on the engine thread."""

    def admit(self, core: "EngineCore") -> None:
        """Start what waits (``core.add`` the started requests)."""

    def reclaim(self) -> bool:
        """Give back pages of idle caches (swap to host memory, or drop); True if any were given back."""


@dataclass(eq=False)
class Task:
    """A background job stepped once per round, alone (``step()`` runs at most one forward), until ``done``."""

    job: Any
    on_step: Callable[[Any], None]
    on_error: Callable[[BaseException], None]
    priority: Priority = Priority.BACKGROUND


class EngineCore:
    """The scheduler of one loaded model's work. ``round()`` on the engine thread; ``call``/``wake`` anywhere."""

    def __init__(self, lm, prefill_budget: int = PREFILL_BUDGET) -> None:
        self.lm = lm
        self._model = lm if hasattr(lm, "fast_step") else None  # a LoadedModel (tests drive the core without one)
        self.prefill_budget = prefill_budget
        self.requests: list[Request] = []
        self.tasks: list[Task] = []
        self.sources: list[Source] = []
        self.kv = KVManager(lambda: self.sources, lambda: self.requests)
        from engine.core.step import run_forward  # torch's side: a core runs with a model loaded

        self._forward = run_forward
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._lock = threading.Lock()
        self._woken = False  # ``wake`` was called: the next round lets sources admit what they queued
        self.waker: Callable[[], None] = lambda: None  # set by whoever drives ``round`` (a thread, the Qt worker)
        self.thread: threading.Thread | None = None  # the engine thread, once known (``round`` records it)

    # -- any thread ----------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread at the start of the next round; its result as a future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, fut))
        self.wake()
        return fut

    def wake(self) -> None:
        """Something new to do (a source queued work): the driver runs a round soon."""
        self._woken = True
        self.waker()

    @property
    def preemptions(self) -> int:
        """Requests preempted so far (their caches given up for a request that came first)."""
        return self.kv.preemptions

    @property
    def busy(self) -> bool:
        """Work is in flight or was announced (requests, tasks, calls, ``wake``): keep calling ``round``."""
        return bool(self._woken or self.tasks or self._calls or any(not r.hold() for r in self.requests))

    # -- the engine thread ---------------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        """Run ``request`` (its session started: its reply waiting, or running where another core stepped it)
        from the next round on."""
        self.requests.append(request)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """``request`` is over (its reply ended, or its owner gave it up): it leaves at the end of this round. The
        first reason given is its ``finish_reason``."""
        if request.finish_reason is None:
            request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason(reason)

    def abort(self, request: Request) -> StepResult | None:
        """End ``request`` now, on the engine thread: a reply still running is cancelled and ends without a
        forward (a cancelled session's step runs none); its last result is returned, not sent to the sink."""
        last = None
        if request.status is not RequestStatus.FINISHED and request.session.generating:
            request.session.cancel()
            last = request.session.step()
        self.finish(request, FinishReason.CANCELLED)
        return last

    def add_task(self, task: Task) -> Task:
        self.tasks.append(task)
        return task

    def round(self) -> bool:
        """One scheduling step (see the module doc). Returns ``busy``."""
        self.thread = threading.current_thread()
        self._woken = False
        fast = self._model.fast_step if self._model is not None else None
        if fast is not None:
            fast.poll()  # a compiled step built meanwhile is taken up between two rounds
        self._run_calls()
        for source in list(self.sources):
            source.admit(self)
        for r in self.requests:
            if r.finish_reason is None and not r.session.generating:
                self.finish(r, FinishReason.DONE)  # its session ended the reply itself (closed, reset): it leaves
        live = sorted((r for r in self.requests if not r.done and not r.hold()), key=lambda r: r.priority)
        if live:
            chosen = self._schedule(live)
            for unit in forward_units(chosen, [x.demand for x in chosen]):
                self._postprocess(unit, self._run(unit))
        self.kv.ended([r.session for r in self.requests if r.done])  # their idle caches: still within its reach
        self.requests = [r for r in self.requests if not r.done]
        for task in sorted(self.tasks, key=lambda t: t.priority):
            self._task_step(task)
        return self.busy

    def _run_calls(self) -> None:
        with self._lock:
            calls = list(self._calls)
            self._calls.clear()
        for fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _schedule(self, live: list[Request]) -> list[Scheduled]:
        """The round's work, in priority order: each request asked once (``demand``), granted its tokens within the
        round's prefill budget (``records.grants``)."""
        demands = [r.session.demand() for r in live]
        chosen = []
        for r, d, tokens in zip(live, demands, grants(demands, self.prefill_budget)):
            if tokens is not None:
                if r.status is not RequestStatus.PREEMPTED:  # a preempted one runs again once it has room (``_run``)
                    r.status = RequestStatus.RUNNING
                chosen.append(Scheduled(r, d, tokens))
        return chosen

    def _run(self, unit: list[Scheduled]) -> dict[int, Any]:
        """One forward of ``unit``: room for each granted forward first (the KV manager, in priority order), then
        ``run_forward``. A request preempted since it was asked is granted again (its cache was given up: a prefill
        chunk now, not its one decode token). One that finds no room sits the round out while requests before it
        hold its pool's pages (``KVManager.sit_out``)."""
        def room(session: Steppable, tokens: int) -> int:
            x = by_session[id(session)]
            if x.request.status is RequestStatus.PREEMPTED:
                x.request.status, tokens = RequestStatus.RUNNING, session.demand().tokens
            elif x.demand.drafts and not self.kv.can_allocate(session, tokens):
                tokens = 1  # drafts never cost another request's pages: this step decodes its one token
            return tokens if self.kv.room(x.request, tokens) else SIT_OUT

        by_session = {id(x.request.session): x for x in unit}
        return self._forward([(x.request.session, x.tokens) for x in unit], room)

    def _postprocess(self, unit: list[Scheduled], results: dict[int, Any]) -> None:
        """The one place a forward's results are applied to their requests: each request's status (finished when
        its reply ended, by why), then its result to its sink, in the order they were scheduled."""
        for x in unit:
            req, res = x.request, results.get(id(x.request.session))
            if res is None:
                continue  # it sat the round out, waiting for room
            if isinstance(res, BaseException):
                self.finish(req, FinishReason.ERROR)
            elif res.done:
                self.finish(req, FinishReason.parse(res.stop_reason, FinishReason.DONE))
            try:
                req.sink(res)
            except Exception:  # noqa: BLE001 - a client's trouble never stops the core
                import traceback

                traceback.print_exc()

    def _task_step(self, task: Task) -> None:
        try:
            out = task.job.step()
        except BaseException as e:  # noqa: BLE001 - the task ends with its error
            self.tasks.remove(task)
            task.on_error(e)
            return
        if task.job.done:
            self.tasks.remove(task)
        task.on_step(out)

    def remove_task(self, job: Any) -> None:
        self.tasks = [t for t in self.tasks if t.job is not job]

    def drop_calls(self) -> None:
        """The engine thread ends: calls still queued are cancelled (their callers stop waiting)."""
        with self._lock:
            calls = list(self._calls)
            self._calls.clear()
        for _, fut in calls:
            fut.cancel()


def batchable(sessions: Sequence) -> list[list]:
    """The groups of ``sessions`` that would share a forward now (``share_groups``), each asked for its ``demand``."""
    return share_groups(list(sessions), [s.demand() for s in sessions])


def forwards(sessions: Sequence) -> list[list]:
    """``sessions`` (in priority order) as the forwards they run in, in order (``forward_units``)."""
    return forward_units(list(sessions), [s.demand() for s in sessions])


def step_all(sessions: Sequence, before: Callable[[Any], None] | None = None) -> list[Any]:
    """Step every generating session once, in the given order (the core passes them by priority): those whose
    next step is one token on a plain store decode together in one forward (``forwards``), the rest alone. Each
    gets its ``StepResult`` or the exception that ended its reply; a failed forward ends every reply it carried,
    each rolled back. ``before(session)``, if given, runs before each session is prepared (room for it)."""
    def room(s: Any, tokens: int | None) -> int | None:
        before(s)
        return tokens

    from engine.core.step import run_forward

    results: dict[int, Any] = {}
    for unit in forwards(sessions):
        results.update(run_forward([(s, None) for s in unit], room if before is not None else None))
    return [results[id(s)] for s in sessions]


def drive(session: Steppable, priority: Priority = Priority.FOREGROUND) -> Iterator[StepResult]:
    """Each result of ``session``'s reply (started), stepped by a core of its own: the CLI, bench and quality
    loops run their replies as the app and the server do, through ``EngineCore.round`` (one request, so a round
    is one step). The exception that ended the reply is raised; the last result is ``done``.

    Each result is yielded as soon as its round ends, so a loop over it times and streams per step as a loop
    over ``session.step()`` did (the core adds 0.03-0.16 ms a step on stories260K, CPU: 1.70 vs 1.73 ms a token
    eager, 400 tokens, paged). Leaving the loop early (``break``: say, at the first token) leaves the reply
    started, for another core to go on with."""
    if not session.generating:
        raise EngineError("no reply in progress: call start() first")  # as ``step()`` says; the core would skip it
    core, out = EngineCore(session.lm), deque()
    request = core.add(Request(session, out.append, priority))
    while True:
        if not out:
            if request.done:
                return
            core.round()
            continue
        result = out.popleft()
        if isinstance(result, BaseException):
            raise result
        yield result
        if result.done:
            return


class CoreThread:
    """Drives ``core.round()`` on a thread of its own (``python -m engine serve``; tests): rounds while busy,
    waits for ``wake`` otherwise."""

    def __init__(self, core: EngineCore, name: str = "kvscope-engine") -> None:
        self.core = core
        self._cond = threading.Condition()
        self._stopping = False
        core.waker = self._wake
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.on_exit: list[Callable[[], None]] = []  # run on the engine thread after the last round

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stopping

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.core.busy:
                    self._cond.wait()
                if self._stopping:
                    break
            self.core.round()
        for fn in self.on_exit:
            fn()
        self.core.drop_calls()
