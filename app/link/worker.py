"""The engine's thread: ``EngineWorker``, a QObject living on a QThread (``app.link.engine_thread.EngineThread`` owns
both).

Over 400 lines on purpose: its slots are the GUI's commands, and each reads and writes the same few fields (the
model, the pool, the active session, the core, the reply in flight); the jobs it runs (a comparison, the fidelity
check, the disk tier, draft models, token counts) already live in modules of their own.

The worker owns the loaded model, its engine core (``engine.core.scheduler.EngineCore``), the chats' sessions and at
most one cache-settings comparison; the GUI thread never runs torch. Work runs as rounds of the core from one
zero-delay timer: each turn of the worker's event loop runs one ``core.round()`` — one step of the chat's reply
(first: the chat on screen has the highest priority), of the API server's requests when the app serves (decoded
together with the reply where they can), then one step of the comparison — so queued commands (stop, a new
cache config, a new message) are handled between steps and never land in the middle of a forward pass. While
the app serves, the user still chats, compares and changes the cache: the server is one more client of the
same core (``engine.server.Scheduler``), woken from its HTTP thread through ``core.wake``.

Signals (every reply event carries its ``generation_id``)::

    progress(str, float)            load progress, fraction in [0, 1] or -1 when unknown
    loaded(ModelInfo)
    environment(dict)               device facts found after torch is imported
    started(int)                    a reply began
    token(TokenEvent)               a step that produced a token (a prefill chunk produces none)
    snapshot(CacheSnapshot)
    noted(int, list[str])           generation_id, notes the user must see (each once per reply)
    finished(int, str, object, str) generation_id, stop_reason, TurnStats | None, full text
    failed(Failure)                 what raised, at which stage (see ``app.ground.failure``)
    applied(object, object)         CacheConfig, list of notes
    asked(object, object, int, float)  CacheConfig, chat, tokens, ms: that change would read this many tokens
                                    again (about ms): not applied until asked again without a limit
    speculated(object, object)      SpecConfig now in force, list of notes (``failed``, stage "speculate": refused)
    compared(int, dict)             comparison id, one row
    compare_progress(int, tuple)    comparison id, (fraction done, seconds left or None, what runs now)
    compare_finished(int, str)      comparison id, "done" | "cancelled" | why it failed
    described(object, object, int)  chat, its session's snapshot (None: nothing cached), its token count
    measured(int, int)              request id, token count (-1: no model, or it could not be counted)
    foreseen(int, object)           request id, what a reply would read and pass over unread (``Foresight``; None:
                                    no model, or it could not be foreseen)
    called(int, object)             generation_id, a reply with tools read for calls (``ToolTurn``), before
                                    ``finished`` (whose text is then the reply's without the calls)
    core_ready(object, object)      the loaded model and its engine core, for the API server (``serve``);
                                    (None, None): no model
    waiting(int, str)               generation_id, what its reply waits for before its first step
    reprefilling(int, object)       generation_id, ``engine.core.records.Reprefill``: tokens a cache change made
                                    mid-reply has it read again, as it begins and after each forward
    placed(int, list)               generation_id, where its prompt's recomputed tokens sit in the chat (before
                                    ``finished``; only when it has misses)

For one reply the order is strict: ``started``, then ``token``/``snapshot``/``noted`` events, then
(``failed`` if something raised) ``finished``; ``finished`` always fires, so the GUI can always leave
"generating". Every exception becomes ``failed``.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal, Slot

from app.ground.failure import Failure, describe, log
from app.link import counts, tool_replies
from app.link.backend import EngineBackend, default_backend
from app.link.comparison import Comparisons
from app.link.copies import CopiesControl
from app.link.disk_tier import DiskTierControl
from app.link.fidelity_task import FidelityControl
from app.link.places import miss_places
from app.link.spec_drafts import SpecDrafts
from engine.config import CacheConfig, ModelSpec, SamplingConfig, SpecConfig
from engine.errors import EngineError, LoadCancelled
from engine.core.reprefill import running as running_reprefill
from engine.core.scheduler import EngineCore, Priority, Request, Source, Task
from engine.core.vocab import FinishReason

__all__ = ["EngineBackend", "EngineWorker", "default_backend", "NEXT_MESSAGE"]

NEXT_MESSAGE = "taken for the chat's next message"  # a setting for a chat whose cache is not the one in use now


class _Chats(Source):
    """The app's chats as a source of the core: idle chats give their pages back when a request needs room."""

    def __init__(self, pool: Callable[[], Any]) -> None:
        self.pool = pool  # the worker's session pool now (None before a model is loaded)

    def reclaim(self) -> bool:
        pool = self.pool()
        return bool(pool is not None and pool.reclaim())


class EngineWorker(QObject):
    """Owns the engine on its thread. Use through :class:`EngineThread`; slots are called queued."""

    progress = Signal(str, float)
    loaded = Signal(object)
    environment = Signal(object)
    started = Signal(int)
    token = Signal(object)
    snapshot = Signal(object)
    noted = Signal(int, object)
    finished = Signal(int, str, object, str)
    failed = Signal(object)
    applied = Signal(object, object)
    asked = Signal(object, object, int, float)  # cfg, chat, tokens to read again, ms (``apply_cache_config``'s ask_ms)
    speculated = Signal(object, object)
    compared = Signal(int, object)
    compare_progress = Signal(int, object)
    compare_finished = Signal(int, str)
    described = Signal(object, object, int)
    measured = Signal(int, int)
    foreseen = Signal(int, object)  # request id, an ``engine.core.foresee.Foresight`` (None: no model, or unknown)
    called = Signal(int, object)  # generation_id, ``app.link.tool_replies.ToolTurn``: a reply with tools, read
    core_ready = Signal(object, object)
    fast_changed = Signal(str)  # the compiled decode step in words, after its setting changed
    waiting = Signal(int, str)  # generation_id, what its reply waits for before its first step (app.chat.reply_wait)
    placed = Signal(int, object)  # generation_id, where its recomputed tokens sit in the chat (app.link.places)
    reprefilling = Signal(int, object)  # generation_id, a cache change's re-prefill begun or moved on (app.chat.reprefill_line)
    _woken = Signal()  # from any thread (the API server's): the core has work; queued to this thread

    def __init__(self, backend: EngineBackend | None = None) -> None:
        super().__init__()
        self._backend = backend or default_backend()
        self.load_cancel = threading.Event()  # set from the GUI thread: the running load stops at its next tensor
        self._loaded: Any = None
        self._session: Any = None  # the active chat's session; None until needed (made on the next submit)
        self._pool: Any = None  # sessions by chat (when the backend has a pool)
        self._cache = CacheConfig()
        self._spec = SpecDrafts(self._backend.load)  # speculative decoding and the draft model it loaded
        self._model_spec: ModelSpec | None = None  # what the chats' model was loaded from (a draft model's base)
        self._fast_mode = ""  # the compiled decode step's mode from the settings ("": engine.model.fast_step's default)
        self._gen_id = 0  # the reply being generated, 0 when idle
        self._chat: Any = None  # the chat of that reply
        self.applied_chat: Any = None  # the chat the last ``applied`` notes describe (the GUI reads it)
        self._text = ""
        self._messages: list[dict] = []  # the chat that reply answers (where its recomputed tokens sit: ``placed``)
        self._tool_reply: Any = None  # a reply with tools: how to read its calls (``app.link.tool_replies``)
        self._noted: set[str] = set()  # notes already sent for this reply
        self._cancel_flag = threading.Event()  # set from any thread; checked between steps
        self._cancel_gen = 0  # the reply that flag is for (0: whichever runs), written with it
        self._core: EngineCore | None = None  # the loaded model's engine core (made with the model)
        self._request: Request | None = None  # the chat's reply on the core
        self._timer = QTimer(self)  # moves with the worker; runs one round of the core per event-loop turn
        self._timer.setSingleShot(True)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self._pump)
        self._woken.connect(self._kick, Qt.ConnectionType.QueuedConnection)  # runs on this worker's thread
        self.disk = DiskTierControl(self)  # the KV disk tier (a child: it moves to this thread with the worker)
        self.copies = CopiesControl(self)  # quantized copies: their setting for the loads, their count, Clear
        self.fidelity = FidelityControl(self)  # the fidelity check on the user's chat (a background task of the core)
        self.comparisons = Comparisons(self, self._backend)  # Tools ▸ Compare's run (a background task of the core)

    # -- commands (queued slots) ------------------------------------------------------------------------
    @Slot(object, object)
    def load(self, spec: ModelSpec, cache: CacheConfig | None = None) -> None:
        self._abort_running()
        if cache is not None:
            self._cache = cache
        try:
            self.progress.emit("starting the engine (torch, transformers)", -1.0)
            self.load_cancel.clear()  # a cancel meant for an earlier load does not stop this one
            loaded = self._backend.load(spec, self._report_progress, self.load_cancel)
            try:
                self.environment.emit(self._backend.probe())
            except Exception:  # noqa: BLE001 - facts are optional
                pass
            old = self._pool if self._pool is not None else self._session
            old_fast = getattr(self._loaded, "fast_step", None)
            if self._backend.make_pool is not None:
                pool = self._backend.make_pool(loaded, self._cache)
                session, _ = pool.activate(0)  # chat 0: the session shown before any chat is active
            else:
                pool, session = None, self._backend.make_session(loaded, self._cache)
            self.comparisons.close("cancelled")  # it ran on the model being replaced
            self.fidelity.close("cancelled")  # likewise
            self._loaded, self._pool, self._session, self._model_spec = loaded, pool, session, spec
            self._speculate_new_model()
            self._core = EngineCore(loaded)
            self._core.waker = self._woken.emit  # thread-safe: queued to this thread from another one
            self._core.sources.append(_Chats(lambda: self._pool))
            self._apply_fast_mode()
            self.disk.attach(loaded)  # the old model's tier writes its queue and stops
            if old is not None and hasattr(old, "close"):
                old.close()  # the previous model's pages go back; its tensors go with the last reference
            if old_fast is not None:
                old_fast.close()  # its compile, if one runs, is of no use any more
            self.loaded.emit(getattr(loaded, "info", None))
            self._emit_idle_snapshot()
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message
            log(exc)
            if isinstance(exc, LoadCancelled):
                self.failed.emit(Failure(-1, "load", f"Loading {spec.source} was cancelled.", "LoadCancelled"))
            else:
                self.failed.emit(Failure.from_exception(-1, "load", exc, f"Could not load {spec.source}"))
        finally:
            self._kick()  # a comparison the load interrupted goes on

    def _report_progress(self, *args: Any, **kwargs: Any) -> None:
        msg = next((a for a in args if isinstance(a, str)), kwargs.get("message", "loading"))
        frac = next((float(a) for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)), -1.0)
        self.progress.emit(str(msg), frac)

    @Slot(int, object, object, object, object)
    def submit(self, generation_id: int, messages: list[dict], sampling: SamplingConfig, chat: Any = None,
               tools: Any = None) -> None:
        """Start a reply in ``chat``'s session (each chat keeps its own cache; idle ones go to host memory);
        ``tools``: a ``ToolUse`` (the chat's MCP tools), its reply read for calls (``called``)."""
        self._abort_running()
        self._cancel_flag.clear()
        self._noted = set()
        self._tool_reply = None
        agent = tool_replies.needs_tools(messages, tools)
        self._chat, self._messages = chat, ([] if agent else messages)  # places: plain chats
        self.started.emit(generation_id)
        if self._loaded is None:
            self._fail_reply(generation_id, "start", EngineError("No model is loaded yet."))
            return
        stage = "swap"
        try:
            self._say_swap_in(generation_id, chat)
            if self._pool is not None and (chat is not None or self._session is None):
                self._session, notes = self._pool.activate(chat if chat is not None else 0)
                if notes:
                    self.applied_chat = chat
                    self.applied.emit(self._cache, list(notes))
            elif self._session is None:
                self._session = self._backend.make_session(self._loaded, self._cache)
            stage = "start"
            if agent:
                self._tool_reply = tool_replies.start(self._session, self._loaded, messages, sampling, generation_id,
                                                      tools)
            else:
                self._session.start(messages, sampling, generation_id)
        except BaseException as exc:  # noqa: BLE001
            self._fail_reply(generation_id, stage, exc)
            return
        self._gen_id = generation_id
        self._text = ""
        self._request = self._core.add(Request(self._session, lambda r, g=generation_id: self._on_step(g, r),
                                               Priority.FOREGROUND))
        self._kick()

    def _say_swap_in(self, generation_id: int, chat: Any) -> None:
        """Before a swapped-out chat's cache comes back from host memory (the reply's first wait; seconds for
        a large model): say so, so the bubble does not sit on "…"."""
        session = self._pool.get(chat) if self._pool is not None and chat is not None else self._session
        if session is not None and getattr(session, "offloaded", False):
            self.waiting.emit(generation_id, "this chat's cache to come back from host memory")

    @Slot(int)
    def cancel(self, generation_id: int = 0) -> None:
        """Stop the reply ``generation_id`` (0: whatever is running)."""
        if self._gen_id and generation_id in (0, self._gen_id):
            self._cancel_gen = generation_id
            self._cancel_flag.set()

    def request_cancel(self, generation_id: int = 0) -> None:
        """Thread-safe: ask reply ``generation_id`` (0: whichever runs) to stop at the next step boundary. Only
        the worker's thread reads which reply runs (``_pump``), so no other thread reads its generation id."""
        self._cancel_gen = generation_id
        self._cancel_flag.set()

    @Slot(object, object, object)
    def apply_cache_config(self, cache: CacheConfig, chat: Any = None, ask_ms: float | None = None) -> None:
        """``cache`` for ``chat`` (None: the active chat): applied now to its session when that is the active one (a
        reply running in it switches between two steps), else taken for the chat and given to its session when it
        next runs (another chat's reply running in the background keeps its own). ``ask_ms``: when the change would
        have the chat read tokens again for at least that long (at the model's measured prefill rate), nothing is
        applied and ``asked`` says how many (the GUI asks the user, then sends it again without a limit)."""
        pool = self._pool
        if pool is not None and chat is not None and chat != pool.active:
            if ask_ms is not None and self._ask(pool.get(chat), cache, chat, ask_ms):
                return
            self._cache = pool.cache = cache  # new sessions, and this chat's at its next reply (``activate``)
            self.applied_chat = chat
            self.applied.emit(cache, [NEXT_MESSAGE] if pool.get(chat) is not None or pool.active is not None else [])
            return
        target = pool if pool is not None else self._session
        if ask_ms is not None and target is not None and self._ask(
                pool.get(pool.active) if pool is not None else self._session, cache, chat, ask_ms):
            return
        self._cache = cache
        if target is None:
            self.applied.emit(cache, [])
            return
        self.applied_chat = getattr(target, "active", self._chat)  # the pool's active chat: whose cache changes
        try:
            notes = list(target.apply(cache) or [])
        except BaseException as exc:  # noqa: BLE001
            log(exc)
            self.failed.emit(Failure.from_exception(self._gen_id or 0, "apply", exc, "Cache settings not applied"))
            return
        self.applied.emit(cache, notes)
        if not self._gen_id:
            self._emit_idle_snapshot()
        else:
            reply = getattr(self._session, "turn_state", None)
            again = running_reprefill(reply) if reply is not None else None  # said before its first forward
            if again is not None:
                self.reprefilling.emit(self._gen_id, again)

    def _ask(self, session: Any, cache: CacheConfig, chat: Any, ask_ms: float) -> bool:
        """True (and ``asked`` sent) when ``cache`` would have ``session`` read tokens again for ``ask_ms`` or more."""
        estimate = getattr(session, "rereads", None)
        if estimate is None:
            return False
        try:
            tokens, ms = estimate(cache)
        except BaseException:  # noqa: BLE001 - an estimate is a nicety: the change goes ahead
            traceback.print_exc()
            return False
        if tokens > 0 and ms >= ask_ms:
            self.asked.emit(cache, chat, int(tokens), float(ms))
            return True
        return False

    @Slot(object)
    def speculate(self, cfg: SpecConfig) -> None:
        """Speculative decoding for every chat (``SpecConfig``): the active chat now, also mid-reply (between two
        steps), the others when they become active. A draft model is loaded here first and checked against the
        chat's model; a refusal (``failed``, stage "speculate") changes nothing."""
        try:
            notes = self._spec.apply(cfg, self._loaded, self._model_spec, self._pool)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message
            log(exc)
            self.failed.emit(Failure.from_exception(self._gen_id or 0, "speculate", exc,
                                                    "Speculative decoding not changed"))
            return
        self.speculated.emit(cfg, notes)

    def _speculate_new_model(self) -> None:
        """The speculation in force onto a newly loaded model's chats; a draft model that cannot draft for it
        turns speculation off, saying why."""
        cfg = self._spec.cfg
        if cfg.method == "off":
            return
        try:
            self.speculated.emit(cfg, self._spec.apply(cfg, self._loaded, self._model_spec, self._pool))
        except BaseException as exc:  # noqa: BLE001
            log(exc)
            self._spec.apply(SpecConfig(), self._loaded, self._model_spec, self._pool)
            self.speculated.emit(SpecConfig(), [f"speculative decoding off: {describe(exc)}"])

    @Slot(str)
    def set_fast_step(self, mode: str) -> None:
        """The compiled decode step (``engine.model.fast_step``): "auto" or "off", now and for models loaded later."""
        self._fast_mode = mode
        self._apply_fast_mode()
        fast = getattr(self._loaded, "fast_step", None)
        if fast is not None:
            self.fast_changed.emit(fast.describe())  # the timing caption says it now, not at the next reply

    def _apply_fast_mode(self) -> None:
        """The setting onto the loaded model's step, and its build started (after a load or when turned on; it
        runs in a child process: replies go on eager meanwhile)."""
        fast = getattr(self._loaded, "fast", None)
        if fast is None:
            return
        if self._fast_mode:
            fast.set_mode(self._fast_mode)
        fast.on_change = self.fast_changed.emit  # thread-safe: queued to the window's thread
        if self._core is not None:
            fast.waker = self._core.wake  # the build's end wakes a round, which takes the step up
        fast.start()

    @Slot(object)
    def forget_chat(self, chat: Any) -> None:
        """A chat was deleted: free its session's cache."""
        if self._pool is not None and chat in self._pool:
            if self._session is self._pool.get(chat):
                self._abort_running()
                self._session = None  # the next reply activates its own chat's session
            self._pool.drop(chat)

    @Slot(object, object)
    def describe_chat(self, chat: Any, messages: list[dict]) -> None:
        """The chat now on screen: its session's snapshot (None if it has no cache yet, or if the reply
        running in it sends its own) and its token count, so the panels and the context readout describe
        it."""
        snap = None
        session = self._pool.get(chat) if self._pool is not None else None
        if session is not None and not (self._gen_id and self._chat == chat):
            try:
                snap = session.snapshot() if getattr(session, "cached_tokens", 1) else None
            except BaseException:  # noqa: BLE001 - a description is a nicety; the chat is untouched
                traceback.print_exc()
        self.described.emit(chat, snap, self._count(messages, -2))

    @Slot(int, object, int)
    def measure(self, request: int, messages: list[dict], index: int = -1) -> None:
        """Count tokens: the prompt a reply to ``messages`` would have (``index`` -1), or the tokens of the
        message at ``index`` as it sits in the rendered chat."""
        self.measured.emit(request, self._count(messages, index))

    @Slot(int, object, object, object)
    def foresee(self, request: int, messages: list[dict], chat: Any, cache: CacheConfig) -> None:
        """What a reply to ``messages`` in ``chat`` would read and pass over unread to fit the context under
        ``cache`` (the chat's own cache counts what it holds): answered by ``foreseen``."""
        pool = self._pool
        session = (pool.get(chat) if chat is not None else None) if pool is not None else self._session
        self.foreseen.emit(request, counts.foresight(self._loaded, session, messages, cache))

    def _count(self, messages: list[dict], index: int) -> int:
        return counts.count(getattr(self._loaded, "tokenizer", None), messages, index)

    @Slot(int, object, object)
    def compare(self, comparison_id: int, messages: list[dict], sampling: SamplingConfig) -> None:
        """Generate the chat's next reply once per cache setting, in fresh sessions (the chats' own sessions
        and caches are untouched), one step per event-loop turn next to the chat's reply; rows arrive one by
        one through ``compared``. A new comparison replaces one still running."""
        self.comparisons.start(comparison_id, messages, sampling)

    @Slot(int)
    def cancel_compare(self, comparison_id: int = 0) -> None:
        """Stop comparison ``comparison_id`` (0: whichever runs) after its current step; its rows so far stay."""
        self.comparisons.cancel(comparison_id)

    @Slot()
    def serve(self) -> None:
        """The API server is starting: ``core_ready`` hands it the model and the core it submits to (the chats go
        on beside it)."""
        if self._loaded is not None:
            self._loaded.runner  # noqa: B018 - made here, on the engine thread, before the server reads it
        self.core_ready.emit(self._loaded, self._core if self._loaded is not None else None)

    @Slot(object)
    def run_call(self, call: Callable[[], Any]) -> None:
        """A command from the GUI thread (``EngineThread.call``), run here, on the worker's thread."""
        call()

    @Slot()
    def stop(self) -> None:
        """Last command: stop the pump and end the thread's event loop (runs on the worker thread, so the
        timer is stopped by its own thread)."""
        self._timer.stop()
        self._gen_id = 0
        self.comparisons.close("cancelled")
        self.fidelity.close("cancelled")
        fast = getattr(self._loaded, "fast_step", None)
        if fast is not None:
            fast.close()  # a build in flight stops with the app (the next launch builds it again)
        self.disk.detach()  # pages queued for the disk are written: the next launch restores them
        self.copies.restore()  # the environment as it started (another window of this process starts from it)
        QThread.currentThread().quit()

    # -- for the jobs it runs on its thread (a comparison, the fidelity check): the model, the chats' setting, the core's tasks ----
    @property
    def model(self) -> Any:
        """The loaded model (the backend's ``Loaded``); None until a model and its core are made."""
        return self._loaded if self._core is not None else None

    @property
    def cache_config(self) -> CacheConfig:
        """The cache setting the chats use now."""
        return self._cache

    def run_task(self, task: Task) -> None:
        """Run ``task`` as a background task of the core, a step per round from the next one (a model is loaded)."""
        self._core.add_task(task)
        self._kick()

    def drop_task(self, job: Any) -> None:
        """Stop stepping ``job``'s task (none runs: nothing to do)."""
        if self._core is not None:
            self._core.remove_task(job)

    # -- the round pump ---------------------------------------------------------------------------------
    @Slot()
    def _kick(self) -> None:
        if self._core is not None and self._core.busy and not self._timer.isActive():
            self._timer.start()

    def _pump(self) -> None:
        if self._cancel_flag.is_set() and self._request is not None:
            if self._cancel_gen in (0, self._gen_id):
                self._request.cancel()
            self._cancel_flag.clear()
        if self._core is not None:
            self._core.round()
        self._kick()

    def _on_step(self, gen: int, result: Any) -> None:
        """The core's result for reply ``gen``: a step, or the exception that ended it."""
        if gen != self._gen_id:
            return  # ended already (aborted by a newer message)
        if isinstance(result, BaseException):
            self._fail_reply(gen, "step", result)
            return
        if getattr(result, "reprefill", None) is not None:
            self.reprefilling.emit(gen, result.reprefill)
        if result.event is not None:
            self.token.emit(result.event)
        if result.snapshot is not None:
            self.snapshot.emit(result.snapshot)
            self._note(gen, getattr(result.snapshot, "notes", ()))
        self._text = result.text or self._text
        if result.done:
            self._note(gen, result.warnings)
            self._end(gen, result.stop_reason or "done", result.stats, self._text)

    def _note(self, gen: int, notes: Any) -> None:
        """Send the notes not sent yet for this reply (a snapshot repeats the pending ones every step)."""
        new = [n for n in dict.fromkeys(notes or ()) if n not in self._noted]
        if new:
            self._noted.update(new)
            self.noted.emit(gen, new)

    def _fail_reply(self, gen: int, stage: str, exc: BaseException) -> None:
        """End reply ``gen`` with ``failed`` then ``finished``; a session left in an unknown state is dropped."""
        log(exc)
        failure = Failure.from_exception(gen, stage, exc)
        self._gen_id = 0
        self._drop_request()
        if not failure.recoverable and self._loaded is not None:
            self._discard_session()
        self.failed.emit(failure)
        self.finished.emit(gen, "error", None, self._text if stage == "step" else "")

    def _discard_session(self) -> None:
        """Close the session that raised an untyped exception; its chat gets a fresh session (which re-reads
        the chat) with the next message, instead of going on from a cache nobody vouches for."""
        session, self._session = self._session, None
        try:
            if self._pool is not None:
                self._pool.drop(self._chat if self._chat is not None else self._pool.active)
            elif hasattr(session, "close"):
                session.close()
        except BaseException:  # noqa: BLE001 - it is being thrown away
            traceback.print_exc()

    def _abort_running(self) -> None:
        """End the running reply (if any) as cancelled, so the session is free for the next command."""
        gen = self._gen_id
        if not gen:
            return
        stats = None
        try:
            if self._request is not None:  # the core ends it now (no forward runs for a cancelled reply)
                last = self._core.abort(self._request)
                stats = last.stats if last is not None else None
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        self._end(gen, "cancelled", stats, self._text)

    def _end(self, gen: int, reason: str, stats: Any, text: str) -> None:
        self._gen_id = 0
        self._drop_request()
        reader, self._tool_reply = self._tool_reply, None
        turn = reader.read_end(self._session, self._loaded.stop_ids, stats, reason) if reader is not None else None
        if turn is not None:
            self.called.emit(gen, turn)
            text = turn.content
        places = miss_places(getattr(self._loaded, "tokenizer", None), self._messages, getattr(stats, "cache", None))
        if places:
            self.placed.emit(gen, places)
        self.finished.emit(gen, reason, stats, text)

    def _drop_request(self) -> None:
        """The chat's reply is over: the core forgets it (if it ended outside a round)."""
        request, self._request = self._request, None
        if request is not None and self._core is not None:
            self._core.finish(request, FinishReason.DONE)

    def _emit_idle_snapshot(self) -> None:
        try:
            snap = self._session.snapshot() if self._session is not None else None
        except BaseException:  # noqa: BLE001 - an idle snapshot is a nicety
            snap = None
        if snap is not None:
            self.snapshot.emit(snap)

