"""The engine's thread: ``EngineWorker`` (a QObject living on a QThread) and ``EngineThread`` (its owner).

The worker owns the loaded model and the ``ChatSession``; the GUI thread never runs torch. Generation runs
as steps: one ``session.step()`` per turn of the worker's event loop, so queued commands (cancel, a new
cache config, a new message) are handled between steps and never land in the middle of a forward pass.

Signals (every reply event carries its ``generation_id``; load failures use ``generation_id == -1``)::

    progress(str, float)            load progress, fraction in [0, 1] or -1 when unknown
    loaded(ModelInfo)
    environment(dict)               device facts found after torch is imported
    started(int)                    a reply began
    token(TokenEvent)
    snapshot(CacheSnapshot)
    finished(int, str, object, str) generation_id, stop_reason, TurnStats | None, full text
    failed(int, str)                generation_id, one-line message
    applied(object, object)         CacheConfig, list of notes

For one reply the order is strict: ``started``, then ``token``/``snapshot`` events, then (``failed`` if
something raised) ``finished`` — ``finished`` always fires, so the GUI can always leave "generating".
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.errors import EngineError, LoadCancelled


def _log(exc: BaseException) -> None:
    """Print the traceback of unexpected failures (user errors are just messages)."""
    if not isinstance(exc, (EngineError, ValueError)):
        traceback.print_exception(exc)


def _describe(exc: BaseException) -> str:
    """One line a user can act on."""
    if isinstance(exc, (EngineError, ValueError)):
        return str(exc) or exc.__class__.__name__
    if isinstance(exc, MemoryError):
        return "out of memory"
    name = exc.__class__.__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if "out of memory" in text.lower():
        return f"out of memory: {text}"
    return f"{name}: {text}" if text else name


@dataclass
class EngineBackend:
    """How the worker reaches the engine. Injected in tests; the default imports torch lazily."""

    load: Callable[[ModelSpec, Callable[..., None], threading.Event], Any]  # (spec, progress, cancel)
    make_session: Callable[[Any, CacheConfig], Any]
    probe: Callable[[], dict] = lambda: {}
    # One session per chat (``engine.session_pool.SessionPool``); None: one session for every chat.
    make_pool: Callable[[Any, CacheConfig], Any] | None = None
    # (loaded, messages, sampling, on_row(dict), cancel) -> None: the chat's next reply under each cache
    # setting (``engine.compare``); None: comparing is not offered.
    compare: Callable[..., None] | None = None


def default_backend() -> EngineBackend:
    """The real engine. Imports torch/transformers on the calling (worker) thread."""

    def load(spec: ModelSpec, progress: Callable[..., None], cancel: threading.Event) -> Any:
        from engine.loader import load_model

        return load_model(spec, progress=progress, cancel=cancel)

    def make_session(loaded: Any, cache: CacheConfig) -> Any:
        from engine.session import ChatSession

        return ChatSession(loaded, cache)

    def make_pool(loaded: Any, cache: CacheConfig) -> Any:
        from engine.session_pool import SessionPool

        return SessionPool(loaded, cache)

    def compare(loaded: Any, messages: list[dict], sampling: SamplingConfig, on_row: Callable[[dict], None],
                cancel: threading.Event) -> None:
        from engine.compare import compare_settings

        compare_settings(loaded, messages, sampling, on_row=lambda row: on_row(row.as_dict()), cancel=cancel)

    def probe() -> dict:
        import torch

        info: dict[str, Any] = {"cuda": bool(torch.cuda.is_available()), "device_total_bytes": 0}
        if info["cuda"]:
            free, total = torch.cuda.mem_get_info()
            info.update(device_total_bytes=int(total), device_free_bytes=int(free),
                        device_name=torch.cuda.get_device_name(0))
        return info

    return EngineBackend(load=load, make_session=make_session, probe=probe, make_pool=make_pool, compare=compare)


class EngineWorker(QObject):
    """Owns the engine on its thread. Use through :class:`EngineThread`; slots are called queued."""

    progress = Signal(str, float)
    loaded = Signal(object)
    environment = Signal(object)
    started = Signal(int)
    token = Signal(object)
    snapshot = Signal(object)
    finished = Signal(int, str, object, str)
    failed = Signal(int, str)
    applied = Signal(object, object)
    compared = Signal(object)  # one row (a dict) of a cache-settings comparison
    compare_finished = Signal(str)  # "done", "cancelled", or why it failed

    def __init__(self, backend: EngineBackend | None = None) -> None:
        super().__init__()
        self._backend = backend or default_backend()
        self.load_cancel = threading.Event()  # set from the GUI thread: the running load stops at its next tensor
        self.compare_cancel = threading.Event()  # likewise for a running comparison (at its next step)
        self._loaded: Any = None
        self._session: Any = None  # the active chat's session
        self._pool: Any = None  # sessions by chat (when the backend has a pool)
        self._cache = CacheConfig()
        self._gen_id = 0  # the reply being generated, 0 when idle
        self._text = ""
        self._cancel_flag = threading.Event()  # set from any thread; checked between steps
        self._timer = QTimer(self)  # moves with the worker; pumps one step per event-loop turn
        self._timer.setSingleShot(True)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self._pump)

    # -- commands (queued slots) ------------------------------------------------------------------------
    @Slot(object, object)
    def load(self, spec: ModelSpec, cache: CacheConfig | None = None) -> None:
        self._abort_running()
        if cache is not None:
            self._cache = cache
        try:
            self.progress.emit("starting the engine (torch, transformers)", -1.0)

            def report(*args: Any, **kwargs: Any) -> None:
                msg = next((a for a in args if isinstance(a, str)), kwargs.get("message", "loading"))
                frac = next((float(a) for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)), -1.0)
                self.progress.emit(str(msg), frac)

            self.load_cancel.clear()  # a cancel meant for an earlier load does not stop this one
            loaded = self._backend.load(spec, report, self.load_cancel)
            try:
                self.environment.emit(self._backend.probe())
            except Exception:  # noqa: BLE001 - facts are optional
                pass
            old = self._pool if self._pool is not None else self._session
            if self._backend.make_pool is not None:
                pool = self._backend.make_pool(loaded, self._cache)
                session, _ = pool.activate(0)  # chat 0: the session shown before any chat is active
            else:
                pool, session = None, self._backend.make_session(loaded, self._cache)
            self._loaded, self._pool, self._session = loaded, pool, session
            if old is not None and hasattr(old, "close"):
                old.close()  # the previous model's pages go back; its tensors go with the last reference
            self.loaded.emit(getattr(loaded, "info", None))
            self._emit_idle_snapshot()
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message
            _log(exc)
            if isinstance(exc, LoadCancelled):
                self.failed.emit(-1, f"Loading {spec.source} was cancelled.")
            else:
                self.failed.emit(-1, f"Could not load {spec.source}: {_describe(exc)}")

    @Slot(int, object, object, object)
    def submit(self, generation_id: int, messages: list[dict], sampling: SamplingConfig, chat: Any = None) -> None:
        """Start a reply in ``chat``'s session (each chat keeps its own cache; idle ones go to host memory)."""
        self._abort_running()
        self._cancel_flag.clear()
        self.started.emit(generation_id)
        if self._session is None:
            self.failed.emit(generation_id, "No model is loaded yet.")
            self.finished.emit(generation_id, "error", None, "")
            return
        try:
            if self._pool is not None and chat is not None:
                self._session, notes = self._pool.activate(chat)
                if notes:
                    self.applied.emit(self._cache, list(notes))
            self._session.start(messages, sampling, generation_id)
        except BaseException as exc:  # noqa: BLE001
            _log(exc)
            self.failed.emit(generation_id, _describe(exc))
            self.finished.emit(generation_id, "error", None, "")
            return
        self._gen_id = generation_id
        self._text = ""
        self._timer.start()

    @Slot(int)
    def cancel(self, generation_id: int = 0) -> None:
        """Stop the reply ``generation_id`` (0: whatever is running)."""
        if self._gen_id and generation_id in (0, self._gen_id):
            self._cancel_flag.set()

    def request_cancel(self) -> None:
        """Thread-safe: ask the running reply to stop at the next step boundary."""
        self._cancel_flag.set()

    @Slot(object)
    def apply_cache_config(self, cache: CacheConfig) -> None:
        self._cache = cache
        if self._session is None:
            self.applied.emit(cache, [])
            return
        try:
            target = self._pool if self._pool is not None else self._session
            notes = list(target.apply(cache) or [])
        except BaseException as exc:  # noqa: BLE001
            _log(exc)
            self.failed.emit(self._gen_id or 0, f"Cache settings not applied: {_describe(exc)}")
            return
        self.applied.emit(cache, notes)
        if not self._gen_id:
            self._emit_idle_snapshot()

    @Slot(object)
    def forget_chat(self, chat: Any) -> None:
        """A chat was deleted: free its session's cache."""
        if self._pool is not None and chat in self._pool:
            if self._session is self._pool.get(chat):
                self._abort_running()
            self._pool.drop(chat)

    @Slot(object, object)
    def compare(self, messages: list[dict], sampling: SamplingConfig) -> None:
        """Generate the chat's next reply once per cache setting, in fresh sessions (the chats' own sessions
        and caches are untouched); rows arrive one by one through ``compared``."""
        self.compare_cancel.clear()
        if self._loaded is None or self._backend.compare is None:
            self.compare_finished.emit("no model is loaded" if self._loaded is None else "comparing is not available")
            return
        try:
            self._backend.compare(self._loaded, messages, sampling, self.compared.emit, self.compare_cancel)
            self.compare_finished.emit("cancelled" if self.compare_cancel.is_set() else "done")
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message
            _log(exc)
            self.compare_finished.emit(_describe(exc))

    @Slot()
    def stop(self) -> None:
        """Last command: stop the pump and end the thread's event loop (runs on the worker thread, so the
        timer is stopped by its own thread)."""
        self._timer.stop()
        self._gen_id = 0
        QThread.currentThread().quit()

    # -- the step pump ----------------------------------------------------------------------------------
    def _pump(self) -> None:
        gen = self._gen_id
        if not gen:
            return
        if self._cancel_flag.is_set():
            try:
                self._session.cancel()
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            self._cancel_flag.clear()
        try:
            result = self._session.step()
        except BaseException as exc:  # noqa: BLE001
            _log(exc)
            self._gen_id = 0
            self.failed.emit(gen, _describe(exc))
            self.finished.emit(gen, "error", None, self._text)
            return
        if result.event is not None:
            self.token.emit(result.event)
        if result.snapshot is not None:
            self.snapshot.emit(result.snapshot)
        self._text = result.text or self._text
        if result.done:
            self._end(gen, result.stop_reason or "done", result.stats, self._text)
        else:
            self._timer.start()

    def _abort_running(self) -> None:
        """End the running reply (if any) as cancelled, so the session is free for the next command."""
        gen = self._gen_id
        if not gen:
            return
        stats = None
        try:
            self._session.cancel()
            result = self._session.step()
            stats = result.stats
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        self._end(gen, "cancelled", stats, self._text)

    def _end(self, gen: int, reason: str, stats: Any, text: str) -> None:
        self._gen_id = 0
        self._timer.stop()
        self.finished.emit(gen, reason, stats, text)

    def _emit_idle_snapshot(self) -> None:
        try:
            snap = self._session.snapshot() if self._session is not None else None
        except BaseException:  # noqa: BLE001 - an idle snapshot is a nicety
            snap = None
        if snap is not None:
            self.snapshot.emit(snap)


class EngineThread(QObject):
    """Owns the QThread and the worker; the GUI talks to the engine only through this object.

    Requests are signals connected (queued) to the worker's slots, wired before the thread starts.
    ``shutdown()`` stops any reply and joins the thread.
    """

    _load = Signal(object, object)
    _submit = Signal(int, object, object, object)
    _forget = Signal(object)
    _cancel = Signal(int)
    _apply = Signal(object)
    _compare = Signal(object, object)
    _stop = Signal()

    def __init__(self, backend: EngineBackend | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("kvscope-engine")
        self.worker = EngineWorker(backend)
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._submit.connect(self.worker.submit)
        self._cancel.connect(self.worker.cancel)
        self._apply.connect(self.worker.apply_cache_config)
        self._compare.connect(self.worker.compare)
        self._stop.connect(self.worker.stop)
        self._forget.connect(self.worker.forget_chat)
        self.thread.finished.connect(self.worker.deleteLater)  # deleted on its own thread
        self.thread.start()

    def load(self, spec: ModelSpec, cache: CacheConfig | None = None) -> None:
        self._load.emit(spec, cache)

    def submit(self, generation_id: int, messages: list[dict], sampling: SamplingConfig, chat: Any = None) -> None:
        self._submit.emit(generation_id, messages, sampling, chat)

    def forget_chat(self, chat: Any) -> None:
        self._forget.emit(chat)

    def cancel(self, generation_id: int = 0) -> None:
        # Set the flag now (thread-safe) so Stop takes effect at the very next step boundary.
        if generation_id in (0, self.worker._gen_id):
            self.worker.request_cancel()
        self._cancel.emit(generation_id)

    def apply_cache_config(self, cache: CacheConfig) -> None:
        self._apply.emit(cache)

    def compare(self, messages: list[dict], sampling: SamplingConfig) -> None:
        self._compare.emit(messages, sampling)

    def cancel_compare(self) -> None:
        """Stop a running comparison at its next step (thread-safe)."""
        self.worker.compare_cancel.set()

    def cancel_load(self) -> None:
        """Stop a model load in progress (thread-safe, takes effect at its next stage or tensor). The model
        loaded before, if any, stays in use."""
        self.worker.load_cancel.set()

    def shutdown(self, timeout_ms: int = 2000) -> bool:
        """Cancel any reply, stop the thread's loop and join it. True if the thread ended in time."""
        if not self.thread.isRunning():
            return True
        self.worker.request_cancel()
        self.worker.load_cancel.set()  # a load in progress ends at its next tensor, not after the whole model
        self.worker.compare_cancel.set()
        self._stop.emit()  # queued behind at most one step
        return self.thread.wait(timeout_ms)
