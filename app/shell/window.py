"""The main window: the chat in the centre, panels and controls in docks, the status bar below — and the
wiring between the parts that do the work (the one place that wires them; each part's logic lives in its own room,
and what callers ask of the window is ``app.shell.window_requests``'):

=====================  ==================================================================================
``Conversation``       chats and replies: history store ↔ chat pane ↔ engine worker (``app.chat.conversation``)
``ModelController``    loading models, fallback to the built-in model (``app.models.controller``)
``CacheController``    the cache settings in force (``app.controls.cache_controller``)
``SpecController``     speculative decoding's setting in force and the tint of its tokens (``app.controls.spec_controller``)
``PanelScheduler``     which snapshot the live panels draw, and when (``app.panels.scheduler``)
``Screen``             what the screen shows of the chat on screen, one evented record (``app.ground.screen``)
``ScreenWriter``       the worker's, conversation's, cache's and server's news → that record (``app.shell.readouts``)
``StatusBar``          the status bar in words (``app.ground.status_bar``)
``ServerController``   Server ▸ Start / Stop serving: the API server as a client of the worker's engine core (``app.server.controller``)
``Exporter``           File ▸ Export (``app.chat.exports``)
``DockLayout``         docks, default arrangements and sizes (``app.ground.docks``)
=====================  ==================================================================================

Snapshots of any reply but the one on screen are dropped (``app.shell.readouts``), so panels, captions and the
status bar always describe the chat on screen. The surfaces subscribe to the record (each its own ``watch``): no
part writes another's widgets.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QApplication, QMainWindow, QWidget

from app.shell import help as app_help
from app.server.api_view import ApiView
from app.controls.cache_controller import CacheController
from app.agent.loop import AgentLoop
from app.chat.chat_list import ChatList
from app.chat.pane import ChatPane
from app.chat.switch import ChatSwitch
from app.compare.fidelity import FidelityController
from app.settings.cache_settings import sampling_from_settings, save_sampling
from app.controls.cache_controls import CacheControls
from app.chat.conversation import Conversation
from app.controls.copies_dialog import CopiesController
from app.controls.disk_dialog import DiskController
from app.ground.docks import DockLayout, focus_unseen, initial_size
from app.chat.exports import Exporter
from app.ground.failure import Failure
from app.shell.gc_guard import MainThreadGC
from app.history.store import HistoryStore
from app.shell.menus import build_menus
from app.models.controller import ModelController
from app.panels.scheduler import PanelScheduler
from app.panels import MemoryPanel, ModelCardPanel, OccupancyPanel, PageMapPanel, TimingPanel, WhyPanel
from app.remote.chat import restore as restore_remote
from app.shell.readouts import ScreenWriter
from app.shell.window_requests import WindowRequests
from app.ground.screen import OnScreen, Screen
from app.chat.reply_wait import ReplyWait
from app.controls.sampling_form import SamplingForm
from app.server.controller import ApiList, ChatsBox, ServerController
from app.settings.store import Settings
from app.controls.spec_controller import SpecController
from app.controls.spec_controls import SpecControls
from app.ground.status_bar import StatusBar
from app.panels.trace import CacheTrace
from app.link.engine_thread import EngineThread
from app.link.worker import EngineBackend
from engine.model.builtin import BUILTIN_MODEL
from engine.config import SamplingConfig
from engine.snapshot import ModelInfo

REFRESH_MS = 40  # streaming text at 25 Hz; the scheduler decides when a panel may draw
DB_FLUSH_MS = 250  # streamed text reaches SQLite in batches


class MainWindow(WindowRequests, QMainWindow):
    """KV Scope's window. ``start()`` (after ``show()``) begins loading the model on the worker."""

    model_loaded = Signal(object)  # ModelInfo
    reply_finished = Signal(int, str)  # generation_id, stop_reason
    error_shown = Signal(str)
    api_snapshot_shown = Signal(int, object)  # session_id, CacheSnapshot: an API conversation in the panels

    def __init__(self, settings: Settings, history: HistoryStore, model: str | None = None,
                 backend: EngineBackend | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        MainThreadGC.acquire()  # from now on only this (GUI) thread collects cyclic garbage
        self.setObjectName("MainWindow")
        self.setWindowTitle("KV Scope")
        self.settings = settings
        self.history = history
        self.model_source = model or settings.get("model/last") or BUILTIN_MODEL
        self.sampling_override: SamplingConfig | None = None  # self-test and benchmarks: fixed sampling
        self.trace = CacheTrace()
        self._compare_dialog: Any = None  # Tools ▸ Compare: the last dialog opened
        self._closing = False
        self._build_widgets()
        self.status = StatusBar(self.statusBar())
        self.engine = EngineThread(backend, parent=self)
        self._build_parts()
        self._connect()
        self.menu_actions = build_menus(self)
        if not self.settings.get("engine/fast_step"):
            self.engine.set_fast_step("off")  # on: the engine's own default (auto; KVSCOPE_FAST_STEP may say off)
        self._start_timers()
        self.resize(initial_size(self))
        self.layout_docks.restore(settings.get("window/geometry"), settings.get("window/state"))
        self.conversation.load_chats()
        restore_remote(self)  # remote chats saved by earlier sessions, listed apart (not connected)

    # -- construction -------------------------------------------------------------------------------------
    def _build_widgets(self) -> None:
        self.chat = ChatPane()
        self.setCentralWidget(self.chat)
        self.chat_list = ChatList()
        self.api_list = ApiList()
        self.chats_box = ChatsBox(self.chat_list, self.api_list)
        self.sampling = SamplingForm()
        self.sampling.set_sampling(sampling_from_settings(self.settings))
        self.controls = CacheControls()
        self.spec_controls = SpecControls()
        self.occupancy = OccupancyPanel()
        self.page_map = PageMapPanel()
        self.timing = TimingPanel()
        self.memory = MemoryPanel()
        self.model_card = ModelCardPanel()
        self.why = WhyPanel()  # the last prompt's misses: why tokens were recomputed
        self.panels = [self.occupancy, self.page_map, self.timing, self.memory, self.model_card, self.why]
        for panel in self.panels:
            panel.help_requested.connect(app_help.show_panel_help)
            panel.view.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # charts take no keys: a Tab stop there showed nothing
        self.layout_docks = DockLayout(self, {
            "chats": self.chats_box, "sampling": self.sampling, "model": self.model_card, "controls": self.controls,
            "speculation": self.spec_controls,
            "occupancy": self.occupancy, "page_map": self.page_map, "timing": self.timing, "memory": self.memory,
            "why": self.why})
        self.docks = self.layout_docks.docks

    def _build_parts(self) -> None:
        self.cache = CacheController(self.settings, self.controls, self.engine, self.status, self, info=lambda: self.info,
                                     notes_on_screen=lambda: self.engine.worker.applied_chat in (None, self.chat_id),
                                     history=self.history)  # each chat's own settings, kept in its row
        self.speculation = SpecController(self.settings, self.spec_controls, self.engine, self, history=self.history)
        self.disk = DiskController(self.settings, self.engine, self.status, self.show_error, self)  # KV disk tier
        self.copies = CopiesController(self.settings, self.engine, self.show_error, self)  # quantized copies
        self.chat.set_tint(self.speculation.tint)
        self.models = ModelController(self, self.engine, self.settings, self.status, lambda: self.cache.applied,
                                      self.show_error)
        self.conversation = Conversation(
            self.history, self.settings, self.chat, self.chat_list, self.engine,
            sampling=lambda: self.sampling_override or self.sampling.sampling(),
            cache=lambda: self.cache.requested, parent=self,  # what a message sent now runs under
            apply_cache=lambda cfg: self.cache.apply(cfg, confirmed=True),  # a notice's "… and send"
            new_settings=lambda: self.cache.new_chat_settings(self.speculation.defaults))  # a new chat: the defaults
        self.on_screen = Screen()  # which chat is on screen: every request of the pane and the menus goes to it
        self.on_screen.register(OnScreen.LOCAL, self.conversation)
        self.conversation.chat_opened.connect(lambda _chat_id: self.on_screen.show(OnScreen.LOCAL))
        pane, screen = self.chat, self.on_screen
        for signal, action in ((pane.send_requested, screen.send), (pane.stop_requested, screen.stop),
                               (pane.regenerate_requested, screen.regenerate), (pane.edit_requested, screen.edit),
                               (pane.pin_requested, screen.pin), (pane.version_requested, screen.show_version),
                               (pane.system_prompt_changed, screen.set_system_prompt)):
            signal.connect(action)
        self.agent = AgentLoop(self.settings, self.conversation, self.engine.worker, self)  # MCP tools (off by default)
        self.reply_wait = ReplyWait(self.chat, self.status, self)  # a reply's wait said, with how long
        self.reply_wait.connect(self.conversation, self.engine.worker)
        self.server = ServerController(self, self.engine, self.settings, self.status, self.models,
                                       lambda: self.cache.applied, self.show_error, api_list=self.api_list)
        self.chat_switch = ChatSwitch(self.conversation, self.status, self)  # drafts and tok/s per chat
        self.api_view = ApiView(self.conversation, self.api_list, self.server, self.settings, self,
                                entered=self.chat_switch.api_opened, screen=self.on_screen)
        self.readouts = ScreenWriter(self.on_screen, self.conversation, self.engine, self.cache, lambda: self.info,
                                     lambda: self.api_list.selected, self)  # the news → the screen's record
        self.fidelity = FidelityController(self)  # Memory's "Check fidelity", its worst tokens, Compare's front
        self.scheduler = PanelScheduler([self.occupancy, self.page_map, self.timing, self.memory],
                                        self.readouts.on_frame)
        self.scheduler.set_enabled(bool(self.settings.get("panels/enabled")))
        self._watch(self.on_screen)
        self.exporter = Exporter(self, self.settings, self.history, self.trace, self.panels, self.status,
                                 chat=lambda: (self.chat_id, self.info.name if self.info else ""),
                                 flush=self.conversation.flush, show_error=self.show_error)

    def _watch(self, screen: Screen) -> None:
        """Every surface subscribes to the fields of the screen's record it shows."""
        for part in (self.status, self.scheduler, self.trace, self.timing, self.why, self.cache, self.speculation,
                     self.chat, self.model_card, self.conversation.check, self.api_list):
            part.watch(screen)
        screen.update(settings=self.cache.applied, shown_settings=self.cache.applied)

    def _connect(self) -> None:
        w = self.engine.worker
        r = self.readouts
        w.snapshot.connect(r.on_snapshot)
        w.described.connect(r.on_described)
        w.fast_changed.connect(self.timing.set_fast_step)
        w.failed.connect(self._on_failed)
        self.models.loaded.connect(self._on_loaded)
        self.models.ready_changed.connect(self._on_ready)
        self.cache.changed.connect(r.on_cache_applied)
        self.speculation.tint_changed.connect(self.chat.set_tint)
        c = self.conversation
        c.reply_started.connect(r.on_reply_started)
        c.token.connect(self.timing.add_token)
        c.reply_finished.connect(self._on_reply_finished)
        c.error.connect(self.show_error)
        c.failed.connect(self._on_failed)  # the history file's troubles (stage "history")
        c.noted.connect(r.on_reply_notes)
        c.chat_opened.connect(r.on_chat_opened)
        self.sampling.changed.connect(self._save_sampling)
        self.controls.default_requested.connect(self.speculation.make_default)  # "Make default for new chats"
        self.controls.model_default_requested.connect(lambda: self.cache.make_model_default(self.speculation.applied))
        self.chat.why_requested.connect(self.show_why)
        srv = self.server
        srv.serving.connect(self._on_serving)
        srv.snapshot.connect(self._on_api_snapshot)
        self.api_list.conversation_selected.connect(self._on_api_selected)

    def _start_timers(self) -> None:
        self._refresh = QTimer(self)
        self._refresh.setInterval(REFRESH_MS)
        self._refresh.timeout.connect(self._tick)
        self._refresh.start()
        self._db_timer = QTimer(self)
        self._db_timer.setInterval(DB_FLUSH_MS)
        self._db_timer.timeout.connect(self.conversation.flush)
        self._db_timer.start()

    def focusNextPrevChild(self, next: bool) -> bool:  # noqa: N802 - Qt name
        """Tab and Shift+Tab stop only where the focus can be seen: not in docks behind a tab, not on the empty
        tab bars QMainWindow keeps (``docks.focus_unseen``)."""
        start = QApplication.focusWidget()
        moved = super().focusNextPrevChild(next)
        for _ in range(256):  # at most once round the focus chain
            if not (moved and focus_unseen()) or QApplication.focusWidget() is start:
                break
            moved = super().focusNextPrevChild(next)
        return moved

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        self.layout_docks.window_resized()

    # -- the parts' state, for callers and tests ------------------------------------------------------------
    @property
    def info(self) -> ModelInfo | None:
        return self.models.info

    @property
    def panel_seconds(self) -> float:
        return self.scheduler.seconds

    @property
    def generation_id(self) -> int:
        """The reply in flight (0 when idle)."""
        return self.conversation.generation_id

    @property
    def chat_id(self) -> int | None:
        return self.conversation.chat_id

    @property
    def last_stats(self) -> dict[str, Any]:
        return self.conversation.last_stats

    def panels_by_name(self) -> dict[str, Any]:
        return {p.objectName(): p for p in self.panels}

    # -- events ---------------------------------------------------------------------------------------------
    def _on_loaded(self, info: ModelInfo) -> None:
        self.model_card.show_model(info)
        for panel in (self.memory, self.occupancy):  # what they show before a chat holds a cache
            panel.set_model(info)
        self.conversation.check.context_length = info.context_length
        self.setWindowTitle(f"KV Scope — {info.name}")
        self.readouts.describe_chat()
        self.model_loaded.emit(info)

    def _on_reply_finished(self, generation_id: int, reason: str) -> None:
        self.readouts.on_reply_finished(generation_id, reason)
        self.disk.refresh()  # the pages this reply wrote to the KV disk tier
        self.reply_finished.emit(generation_id, reason)

    def _on_api_selected(self, session_id: int) -> None:
        """An API conversation was selected (0: none): it takes the chat's place on screen, or the chat comes back."""
        self.api_view.show(session_id)
        self.readouts.on_api_selected(session_id)

    def _on_api_snapshot(self, session_id: int, snap) -> None:
        if session_id and session_id == self.api_list.selected:
            self.readouts.on_api_snapshot(session_id, snap)
            self.api_snapshot_shown.emit(session_id, snap)

    def show_why(self) -> None:
        """A reply footer's "Why?" (or View ▸ Why recomputed?): the readout in front."""
        dock = self.docks["why"]
        dock.show()
        dock.raise_()
        self.scheduler.refresh_all()

    def _on_ready(self, ready: bool, hint: str) -> None:
        if not ready and self.models.loading:
            self.server.stop()  # before the load reaches the worker: the API's requests end with the old model
            self.conversation.interrupt("another model was loaded")
        self.conversation.ready = ready
        self.chat.set_ready(ready, hint)

    def _on_failed(self, failure: Failure) -> None:
        """Route a worker failure by its stage: a reply's failure shows in that reply (the conversation saves
        it with the chat); the others leave the chat alone and show in the message area above it."""
        if failure.stage == "load":
            self.models.on_failed(failure)
        elif failure.ends_reply:
            if failure.generation_id == self.generation_id:  # a stale reply's failure is not news
                self.show_error(failure.message, notice=False)
        elif failure.stage == "compare":
            self.show_error(failure.message, notice=False)  # the comparison's dialog says it
        else:
            if failure.stage == "apply":
                self.cache.refused()
            elif failure.stage == "speculate":
                self.speculation.refused()
            self.show_error(failure.message)

    def _on_serving(self, url: str) -> None:
        self.chats_box.set_serving(bool(url))
        self.menu_actions["serve_start"].setEnabled(not url)
        self.menu_actions["serve_stop"].setEnabled(bool(url))
        if not url:
            self._on_api_selected(0)

    def _save_sampling(self) -> None:
        try:
            save_sampling(self.settings, self.sampling.sampling())
        except ValueError:
            pass

    def _tick(self) -> None:
        """One refresh: streamed text, then the scheduler's turn (at most one live panel)."""
        self.chat.render()
        self.scheduler.tick()

    # -- closing --------------------------------------------------------------------------------------------
    def save_layout(self) -> None:
        geometry, state = self.layout_docks.save()
        self.settings.set("window/geometry", geometry)
        self.settings.set("window/state", state)
        self.settings.sync()

    def shutdown(self, timeout_ms: int = 2000) -> bool:
        """Stop any reply, join the worker, flush history and save the layout. True if joined in time."""
        if self._closing:
            return True
        self._closing = True
        self._refresh.stop()
        self._db_timer.stop()
        self.server.stop()  # the API's requests end while the worker still runs rounds
        self.agent.close()  # the MCP servers' processes end
        if getattr(self, "remote", None) is not None:  # File ▸ Connect to a server… made it
            self.remote.shutdown()  # remote replies stop, their threads and event subscribers end
        joined = self.engine.shutdown(timeout_ms)
        # After the worker stopped: everything that streamed is saved, a reply cut short says the app
        # closed, and signals still queued from the worker no longer touch the (closing) history.
        self.conversation.close()
        self.save_layout()
        if joined:  # a worker still running must not start collections (see app/shell/gc_guard.py)
            MainThreadGC.release()
        return joined

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt name
        self.shutdown()
        super().closeEvent(event)

