"""The network side of a remote server (``engine.remote.attach.RemoteEngine``), never on the GUI thread.

One ``RemoteLink`` per server: a chat thread that opens the connection and streams replies, and a poll thread
that re-reads ``/metrics``. They are separate so a long reply never delays the occupancy and hit-rate readout,
and a slow ``/metrics`` never delays a token. The KV event subscriber has its own thread already (inside
``RemoteEngine``); the window only ever reads its view, which is guarded by the view's lock.

Requests go to the workers as queued signals; results come back as signals (queued to the GUI thread). Stop is a
``threading.Event`` per reply, set from the GUI thread: the client checks it between streamed chunks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.remote.attach import RemoteEngine
from engine.remote.client import RemoteClient, RemoteError, Reply

BACKOFF_MAX_S = 30.0  # the longest wait between /metrics reads of a server that does not answer
JOIN_MS = 3000  # how long closing waits for a thread (a reply in flight stops at its next chunk)
_LINGERING: list = []  # links whose thread did not stop in time: kept alive, never destroyed while running


def one_line(error: BaseException | str) -> str:
    """A failure as the one line the user sees."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


class RemoteWorker(QObject):
    """The calls of one server, run on the thread this object was moved to.

    Signals: ``opened(RemoteEngine)`` / ``open_failed(message)``; ``prompt(generation, prompt ids)`` once the
    stream gave them (so the chat's blocks are found while it streams); ``delta(generation, text, ids, arrival,
    together)`` per streamed chunk (arrival: ``time.monotonic()`` here, so queueing to the GUI does not skew the
    timing; together: it came in the same socket read as the chunk before, ``Reply.together``);
    ``finished(generation, Reply)`` — a failure is a ``Reply`` whose ``error`` says why (text kept);
    ``refreshed(Metrics)`` / ``refresh_failed(message)``.
    """

    opened = Signal(object)
    open_failed = Signal(str)
    prompt = Signal(int, object)  # generation, the prompt's token ids (once, with the first chunk that has them)
    delta = Signal(int, str, object, float, bool)
    finished = Signal(int, object)
    refreshed = Signal(object)
    refresh_failed = Signal(str)

    def __init__(self) -> None:
        super().__init__()
        self.engine: RemoteEngine | None = None

    @Slot(str, str, str)
    def open(self, url: str, api_key: str, events: str) -> None:
        try:
            engine = RemoteEngine(url, api_key or None, events or None)
        except RemoteError as e:
            self.open_failed.emit(one_line(e))
            return
        except Exception as e:  # noqa: BLE001 - whatever it was, the dialog says it in one line
            self.open_failed.emit(f"{url}: {one_line(f'{type(e).__name__}: {e}')}")
            return
        self.engine = engine
        self.opened.emit(engine)

    @Slot(int, str, object, int, float, object, object)
    def chat(self, generation: int, model: str, messages: list, max_tokens: int, temperature: float,
             cancel: Any, before: Any = None) -> None:
        reply = Reply()  # filled by the client: its prompt ids are read here as soon as they arrive

        def on_delta(text: str, ids: list) -> None:
            if reply.prompt_ids and not told:
                told.append(True)
                self.prompt.emit(generation, list(reply.prompt_ids))
            self.delta.emit(generation, text, list(ids), time.monotonic(), reply.together(len(reply.token_times) - 1))

        told: list = []
        if cancel.is_set():  # stopped while it waited for another chat's reply on this thread: never sent
            self.finished.emit(generation, Reply(finish_reason="cancelled"))
            return
        try:
            reply = self.engine.chat(messages, max_tokens or None, temperature, on_delta, cancel, reply, model or None)
        except RemoteError as e:  # refused or gone before the first byte
            reply = Reply(error=one_line(e))
        except Exception as e:  # noqa: BLE001 - a reply always ends, with the reason
            reply = Reply(error=one_line(f"{type(e).__name__}: {e}"))
        self._account(reply, before, messages, model)
        self.finished.emit(generation, reply)

    def _account(self, reply: Reply, before, messages: list, model: str) -> None:
        """Why its prompt was recomputed (``engine.remote.why``), from the events and this chat's last request."""
        try:
            reply.cache = self.engine.account(reply, before, messages, model or None) if reply.prompt_ids else None
        except Exception:  # noqa: BLE001 - the account is a readout: a reply never fails for it
            reply.cache = None

    @Slot()
    def refresh(self) -> None:
        try:
            self.engine.refresh()
        except Exception as e:  # noqa: BLE001 - RemoteError or a garbled page: said, and polled again later
            self.refresh_failed.emit(one_line(e))
            return
        self.refreshed.emit(self.engine.metrics)


class RemoteLink(QObject):
    """The GUI's handle on one server: ``open`` it, then ``chat`` and ``refresh``; ``shutdown`` at the end.

    ``engine`` is set once ``opened`` fired (then the view can be read from the GUI thread). ``polling``: a
    refresh is in flight (the window asks for the next one only after it came back).
    """

    opened = Signal(object)  # this link
    events = Signal()  # a KV event batch reached the view (emitted on the subscriber's thread, received queued)
    open_failed = Signal(str)
    _open = Signal(str, str, str)
    _chat = Signal(int, str, object, int, float, object, object)
    _refresh = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.engine: RemoteEngine | None = None
        self.url = ""
        self.events_given = ""  # the events endpoint the user gave ('' : the server's /kv_event_sources says)
        self.polling = False
        self.error = ""  # why the last /metrics poll failed ("" when it answered): the server may be gone
        self.failures = 0  # /metrics reads failed in a row
        self._next_poll = 0.0  # monotonic time before which no read is asked (backoff)
        self.closed = False
        self.threads: list[QThread] = []
        self.worker, self.poller = RemoteWorker(), RemoteWorker()
        for worker, name in ((self.worker, "kvscope-remote-chat"), (self.poller, "kvscope-remote-poll")):
            thread = QThread()
            thread.setObjectName(name)
            worker.moveToThread(thread)
            thread.start()
            self.threads.append(thread)
        self._open.connect(self.worker.open)
        self._chat.connect(self.worker.chat)
        self._refresh.connect(self.poller.refresh)
        self.worker.opened.connect(self._on_opened)
        self.worker.open_failed.connect(self.open_failed)
        self.poller.refreshed.connect(self._on_polled)
        self.poller.refresh_failed.connect(self._on_polled)

    def serves(self, url: str, api_key: str) -> bool:
        """This link is open to ``url`` (as the client spells it) with the same key."""
        try:
            client = RemoteClient(url, api_key or None)  # only parses the address: no network
        except RemoteError:
            return False
        own = self.engine.client if self.engine is not None else None
        return own is not None and (own.url, own.api_key) == (client.url, client.api_key)

    def open(self, url: str, api_key: str = "", events: str = "") -> None:
        self.url, self.events_given = url, events
        self._open.emit(url, api_key, events)

    def _on_opened(self, engine: RemoteEngine) -> None:
        if self.closed:  # the dialog was cancelled while it connected
            engine.close()
            return
        self.engine = self.poller.engine = engine
        engine.view.on_change = self.events.emit  # the window redraws on arrival, not only on its 4 Hz timer
        self.opened.emit(self)

    def chat(self, generation: int, model: str, messages: list[dict], max_tokens: int, temperature: float,
             cancel: threading.Event, before=None) -> None:
        """Stream a reply from ``model`` (one of ``engine.models``) on the chat thread; ``before``: the chat's last
        request (``engine.remote.why.Before``: the reply's ``cache`` account says what changed since)."""
        self._chat.emit(generation, model, messages, max_tokens, temperature, cancel, before)

    def refresh(self, now: bool = False) -> None:
        """Re-read ``/metrics`` on the poll thread, unless a read is in flight or the server failed recently
        (``now``: a reply just came from it, so it is back: ask at once)."""
        if now:
            self._next_poll = 0.0
        if self.engine is None or self.polling or self.closed or time.monotonic() < self._next_poll:
            return
        self.polling = True
        self._refresh.emit()

    @property
    def retry_in(self) -> float:
        """Seconds until the next ``/metrics`` read after a failure (0: at the next tick)."""
        return max(0.0, self._next_poll - time.monotonic())

    def _on_polled(self, result: Any) -> None:
        self.polling = False
        if isinstance(result, str):  # backoff: a server that went away is asked after 1, 2, 4 … 30 s
            self.error, self.failures = result, self.failures + 1
            self._next_poll = time.monotonic() + min(BACKOFF_MAX_S, 2.0 ** (self.failures - 1))
        else:
            if self.failures and self.engine is not None:
                self.engine.came_back()  # it may have restarted: its event numbers begin again
            self.error, self.failures, self._next_poll = "", 0, 0.0

    def abandon(self) -> None:
        """Drop a connection still being tried without waiting for it (the window never waits on the network):
        its threads end once the attempt does, and an engine it opened late is closed (``_on_opened``)."""
        self.closed = True
        for thread in self.threads:
            thread.quit()
        _LINGERING.append(self)

    def release(self, busy: bool) -> None:
        """No chat uses this server any more. ``busy``: a reply is still stopping (its cancel is set), so the
        threads are not waited for; the event subscribers stop either way."""
        if busy:
            self.abandon()
            if self.engine is not None:
                self.engine.close()
        else:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the threads and the event subscribers. Replies in flight must have been cancelled first."""
        if self.closed:
            return
        self.closed = True
        for thread in self.threads:
            thread.quit()
        joined = all(thread.wait(JOIN_MS) for thread in self.threads)
        if not joined:  # a reply stuck in a read: its thread must outlive this object, never be destroyed running
            _LINGERING.append(self)
        if self.engine is not None:
            self.engine.close()
