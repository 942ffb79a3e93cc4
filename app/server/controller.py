"""Server ▸ Start serving / Stop serving: the loaded model behind the OpenAI API (``engine.server``), its URL in
the status bar, and the API's conversations in their own list under the chats.

Design — the server is one more client of the worker's engine core (``engine.core.scheduler.EngineCore``). Torch
runs on one thread, the worker's: Start serving asks the worker for its model and core (``worker.core_ready``),
then starts ``ServerThread(KVServer(model, cache, core=core))`` at the saved address (``app.server.address``:
127.0.0.1 unless the user let other machines in, with API keys). The HTTP thread queues requests
and wakes the core; the worker's rounds step them next to the chat's own reply (the chat on screen first,
one-token decodes in one batched forward), so the user chats, compares and changes the cache while the
model serves, and the page map draws the chats' and the API's pages in one pool. Stop serving ends the API's
requests (503) and idle conversations on the engine thread, then the HTTP server; the chats go on.

Loading another model, quitting and the window closing stop the server first. The API conversations list
(``ApiList``) is refreshed twice a second from the scheduler (``Scheduler.conversations`` through
``Scheduler.call``: on the server's engine thread); selecting one feeds the panels that session's snapshot,
taken on the server's engine thread too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import QLabel, QListWidget, QListWidgetItem, QVBoxLayout, QWidget

from app.server.address import PortState, ServerAddress, address_from_settings, check, port_state, save_address
from engine.config import CacheConfig

POLL_MS = 500
MAX_STEPS = 50  # a conversation's requests listed in its tooltip (the latest)


class ApiList(QListWidget):
    """The server's conversations: one row per session holding a cache; ``conversation_selected(session_id)``
    (0: none selected)."""

    conversation_selected = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ApiList")
        self._filling = False
        self._numbers: dict[int, int] = {}  # session id → the number shown (1, 2, … in the order they came)
        self.setUniformItemSizes(True)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.currentItemChanged.connect(self._on_current)

    def set_conversations(self, rows: list[dict]) -> None:
        current = self.selected
        self._filling = True
        self.clear()
        for row in rows:
            state = "replying…" if row["running"] else f"{row['tokens']:,} tokens"
            steps = row.get("steps") or []
            last = f" · step {len(steps)}: {step_words(steps[-1])}" if steps else ""
            item = QListWidgetItem(f"API #{self.number(row['session_id'])} — {state}{last}")
            item.setData(Qt.ItemDataRole.UserRole, row["session_id"])
            tip = "\n".join(f"step {i + 1}: {step_words(s)}" for i, s in enumerate(steps))
            item.setToolTip((tip + "\n\n" if tip else "") + row.get("text", ""))
            self.addItem(item)
            if row["session_id"] == current:
                self.setCurrentItem(item)
        self._filling = False
        if current and self.selected != current:  # its session was closed
            self.conversation_selected.emit(0)

    def number(self, session_id: int) -> int:
        """The conversation's number as shown: 1 for the first this list saw (the engine's session ids count every
        session the app made, its chats' too: the first read "API #55")."""
        return self._numbers.setdefault(session_id, len(self._numbers) + 1)

    def session_ids(self) -> list[int]:
        return [self.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.count())]

    @property
    def selected(self) -> int:
        item = self.currentItem()
        return int(item.data(Qt.ItemDataRole.UserRole)) if item is not None and item.isSelected() else 0

    def watch(self, screen) -> None:
        """A chat on screen (not an API conversation): none of these is selected."""
        screen.connect("chat", lambda chat: chat is not None and not (isinstance(chat, tuple) and chat[0] == "api")
                       and self.deselect())

    def deselect(self) -> None:
        self._filling = True
        self.setCurrentRow(-1)
        self.clearSelection()
        self._filling = False

    def _on_current(self, item: QListWidgetItem | None, _prev) -> None:
        if not self._filling:
            self.conversation_selected.emit(int(item.data(Qt.ItemDataRole.UserRole)) if item is not None else 0)


class ChatsBox(QWidget):
    """The chats dock's widget: the user's chats, and under them (while serving) the API's conversations."""

    def __init__(self, chat_list: QWidget, api_list: ApiList, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ChatsBox")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(chat_list, 3)
        self.api_label = QLabel("API conversations")
        self.api_label.setToolTip("Conversations of requests to the server (Server ▸ Start serving); select one "
                                  "to see its cache in the panels")
        lay.addWidget(self.api_label)
        lay.addWidget(api_list, 1)
        self.api_list = api_list
        self.set_serving(False)

    def set_serving(self, on: bool) -> None:
        self.api_label.setVisible(on)
        self.api_list.setVisible(on)

    def sizeHint(self):  # noqa: N802 - Qt name
        return self.layout().itemAt(0).widget().sizeHint()


def step_words(step: dict) -> str:
    """One request of a conversation: '3,120 reused, 208 recomputed' (its prompt's tokens)."""
    return f"{step['reused']:,} reused, {step['recomputed']:,} recomputed"


def _describe(scheduler) -> list[dict]:
    """The server's conversations (engine thread), each with its requests so far (``steps``: reused and
    recomputed prompt tokens of each, oldest first — an agent's loop, step by step)."""
    rows = []
    tok = scheduler.lm.tokenizer
    steps: dict[int, list[dict]] = {}
    for r in scheduler.records:
        steps.setdefault(r.session_id, []).append({"reused": r.reused_tokens, "recomputed": r.recomputed_tokens})
    for s, running in scheduler.conversations():
        text = ""
        try:
            text = tok.decode(list(s.seq[-200:])) if tok is not None else ""
        except Exception:  # noqa: BLE001 - a tooltip
            pass
        rows.append({"session_id": s.session_id, "tokens": len(s.seq), "running": running, "text": text,
                     "steps": steps.get(s.session_id, [])[-MAX_STEPS:]})
    return rows


def _snapshot(scheduler, session_id: int):
    """That conversation's snapshot, with where its messages sit and their kinds (tool calls and results among
    them: the token strip colours them), and its tokens as text (engine thread); None once its session is gone."""
    for s, _running in scheduler.conversations():
        if s.session_id == session_id:
            tok = scheduler.lm.tokenizer
            try:
                text = tok.decode(list(s.seq)) if tok is not None else ""
            except Exception:  # noqa: BLE001 - the transcript says what it can
                text = ""
            snap = s.snapshot()
            spans = scheduler.kinds.spans(tok, session_id, len(snap.token_state))
            return dataclasses.replace(snap, messages=tuple(m.as_tuple() for m in spans)), text, len(s.seq)
    return None


def start_problem(addr: ServerAddress) -> str:
    """Why the server cannot listen at ``addr`` now, as the end of "The server did not start: …"; "" if it can."""
    state = port_state(addr.listen_host, addr.port)
    if state is PortState.BUSY:
        return f"port {addr.port} is in use by another program."
    if state is PortState.DENIED:
        return f"port {addr.port} needs administrator rights (ports from 1024 up do not)."
    if state is PortState.NO_ADDRESS:
        return f"this machine has no address {addr.listen_host}."
    return ""


class ServerController(QObject):
    """Starts and stops the server on the worker's model. ``serving(url)`` ("" once stopped);
    ``conversations(rows)`` (the list is filled already) on the GUI thread; ``snapshot(session_id, CacheSnapshot)``
is emitted on the server's engine thread (connect it to a QObject's method: it is queued)."""

    serving = Signal(str)
    conversations = Signal(object)
    snapshot = Signal(int, object)
    transcript = Signal(int, str, int)  # session_id, its tokens as text, how many (engine thread, like snapshot)
    _listed_rows = Signal(object)

    def __init__(self, parent: QObject, engine, settings, status, models, cache: Callable[[], CacheConfig],
                 show_error: Callable[[str], None], api_list: ApiList | None = None) -> None:
        super().__init__(parent)
        self.engine = engine
        self.settings = settings
        self.status = status
        self.models = models
        self._cache = cache
        self._show_error = show_error
        self.thread: Any = None  # the ServerThread while serving
        self.serving_at: ServerAddress | None = None  # the address the running server listens on
        self.choose_address: Callable[[], None] | None = None  # opens Settings ▸ Server (the window sets it)
        self.url = ""
        self.starting = False
        self.api_list = api_list if api_list is not None else ApiList()
        self._polling = False
        self._poll = QTimer(self)
        self._poll.setInterval(POLL_MS)
        self._poll.timeout.connect(self.refresh)
        engine.worker.core_ready.connect(self._on_core)
        self._listed_rows.connect(self._on_listed)  # emitted on the server's engine thread: queued to this one
        self.api_list.conversation_selected.connect(self._on_selected)

    @property
    def running(self) -> bool:
        return self.thread is not None

    @property
    def port(self) -> int:
        return self.address.port

    @property
    def address(self) -> ServerAddress:
        """The saved address: where the next Start serving listens."""
        return address_from_settings(self.settings)

    def apply_address(self, addr: ServerAddress) -> None:
        """Settings ▸ Server applied: saved; a running server at another address starts again there (its
        requests in progress end, as with Stop serving)."""
        save_address(self.settings, addr)
        if self.running and addr != self.serving_at:
            self.stop()
            self.start()

    def start(self) -> None:
        """Server ▸ Start serving: the worker hands over its model and core (``_on_core`` starts the server)."""
        if self.running or self.starting:
            return
        if self.models.info is None or self.models.loading:
            self._show_error("Load a model before serving it.")
            return
        self.starting = True
        self.status.message("Starting the server…")
        self.engine.serve()

    def _on_core(self, loaded: Any, core: Any) -> None:
        if not self.starting:
            return
        self.starting = False
        if loaded is None:
            self._show_error("No model is loaded: nothing to serve.")
            return
        if getattr(loaded, "tokenizer", None) is None:
            self._show_error("This model has no tokenizer: the server needs one.")
            return
        from engine.server import KVServer, ServerOptions, ServerThread

        addr = self.address
        if check(addr):
            self._refuse(f"The server did not start. {check(addr)}")
            return
        if start_problem(addr):  # one line, and the notice's button opens Settings ▸ Server
            self._refuse(f"The server did not start: {start_problem(addr)}")
            return
        keys = addr.api_keys
        options = ServerOptions(host=addr.listen_host, port=addr.port, api_key=keys[0] if keys else None,
                                api_keys=keys[1:])
        try:
            server = KVServer(loaded, self._cache(), options,
                              source=self.models.info.source if self.models.info else None, core=core)
            thread = ServerThread(server, addr.listen_host, addr.port)
        except ValueError as e:  # the port is busy, or the address is not this machine's
            self._refuse(f"The server did not start: {e}.")
            return
        try:
            self.url = thread.start()
        except Exception as e:  # noqa: BLE001
            self._show_error(f"Could not start the server: {e}")
            return
        self.thread = thread
        self.serving_at = addr
        self._polling = False
        self.status.show_server(self.url + "/v1", server.model_id)
        self.status.message(f"Serving {server.model_id} at {self.url}/v1 — chats go on beside the API's requests",
                            6000)
        self._poll.start()
        self.serving.emit(self.url)

    def _refuse(self, message: str) -> None:
        """A start that cannot be: said once, with the way to another address (Settings ▸ Server)."""
        if self.choose_address is None:
            self._show_error(message)
        else:
            self._show_error(message, actions=[("Choose another port…", self.choose_address)])

    def stop(self) -> None:
        """Stop serving: the API's requests end (503) and its idle conversations close, then the HTTP server;
        the chats go on."""
        thread, self.thread = self.thread, None
        if thread is None:
            return
        self.serving_at = None
        self._poll.stop()
        thread.stop()
        self.url = ""
        self.api_list.clear()
        self.status.show_server("")
        self.status.message("The server stopped", 4000)
        self.serving.emit("")

    # -- the API conversations ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """Ask the server's engine thread for its conversations, and the selected one's snapshot."""
        if self.thread is None or self._polling:
            return
        sched = self.thread.server.scheduler
        self._polling = True
        fut = sched.call(lambda: _describe(sched))
        fut.add_done_callback(self._listed)  # runs on the engine thread: the signal is queued to the GUI
        sid = self.api_list.selected
        if sid:
            self.request_snapshot(sid)

    def _listed(self, fut) -> None:
        self._polling = False
        if not fut.cancelled() and fut.exception() is None:
            self._listed_rows.emit(fut.result())

    def _on_listed(self, rows: list) -> None:
        if self.thread is not None:  # a list that arrives after Stop is stale
            self.api_list.set_conversations(rows)
            self.conversations.emit(rows)

    def request_snapshot(self, session_id: int) -> None:
        if self.thread is None:
            return
        sched = self.thread.server.scheduler
        fut = sched.call(lambda: _snapshot(sched, session_id))

        def done(f) -> None:
            if not f.cancelled() and f.exception() is None and f.result() is not None:
                snap, text, tokens = f.result()
                self.snapshot.emit(session_id, snap)
                self.transcript.emit(session_id, text, tokens)
            elif not f.cancelled() and f.exception() is not None:
                print(f"KV Scope: snapshot of API conversation {session_id} failed: {f.exception()}")

        fut.add_done_callback(done)

    def _on_selected(self, session_id: int) -> None:
        if session_id:
            self.request_snapshot(session_id)
