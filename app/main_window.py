"""The main window: chat pane in the centre, live panels and controls in docks, status bar below.

The window is the controller between the chat pane, the history store and the engine worker. It keeps
only the *latest* snapshot and pushes it to the panels from one ≤30 Hz timer; streamed text is appended
to the store in batches by a second timer. Events whose ``generation_id`` is not the current reply's are
dropped, so a stopped or replaced reply never writes into the pane.
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QByteArray, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QToolButton,
    QWidget,
)

from app.chat_list import ChatList
from app.chat_pane import ChatPane
from app.controls import CacheControls
from app.conversation import Conversation
from app.exports import ExportActions
from app.failure import Failure
from app.gc_guard import MainThreadGC
from app.history import HistoryStore
from app.model_actions import ModelActions
from app.panels import MemoryPanel, ModelCardPanel, OccupancyPanel, PageMapPanel, TimingPanel
from app.sampling_form import SamplingForm
from app.settings import Settings
from app.trace import CacheTrace
from app.worker import EngineBackend, EngineThread
from engine.config import CacheConfig, SamplingConfig
from engine.snapshot import CacheSnapshot, ModelInfo

REFRESH_MS = 40  # streaming text at 25 Hz
PANEL_INTERVAL_S = 0.08  # one live panel at most every 80 ms (12.5 Hz in all): each panel redraws at ~3 Hz
PANEL_BUDGET = 0.04  # ...and live panels (update + paint) get at most 4% of the GUI thread's time
CONTEXT_FILLING, CONTEXT_FULL = "#ffb347", "#ff6b6b"  # the context field from 75% and from 90% used
CONTEXT_OVERFLOW_TEXT = {
    "stop": "the reply stops with a message saying so; nothing is dropped",
    "truncate_middle": "the middle of the chat is dropped, keeping the system prompt and the first message",
    "rolling": "the oldest tokens are dropped (a rolling window)",
    "policy": "the eviction policy chooses which tokens to drop",
}
DB_FLUSH_MS = 250  # streamed text reaches SQLite in batches


class MainWindow(ModelActions, ExportActions, QMainWindow):
    """KV Scope's window. ``start()`` (after ``show()``) begins loading the model on the worker."""

    model_loaded = Signal(object)  # ModelInfo
    reply_finished = Signal(int, str)  # generation_id, stop_reason
    error_shown = Signal(str)

    def __init__(self, settings: Settings, history: HistoryStore, model: str | None = None,
                 backend: EngineBackend | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        MainThreadGC.acquire()  # from now on only this (GUI) thread collects cyclic garbage
        self.setObjectName("MainWindow")
        self.setWindowTitle("KV Scope")
        self.settings = settings
        self.history = history
        self.model_source = model or settings.get("model/last") or "demo"
        self.info: ModelInfo | None = None
        self.environment: dict = {}
        self._latest: CacheSnapshot | None = None
        self._snapshot_dirty = False
        self._panels_enabled = bool(settings.get("panels/enabled"))
        self._applied_cache = self._cache_from_settings()
        self._loading = False
        self._turn = 0
        self._panel_next = 0.0  # perf_counter() time the next live panel may redraw
        self.panel_seconds = 0.0  # time spent updating and painting live panels (self-test, benchmarks)
        self._shown: dict[str, CacheSnapshot] = {}  # the snapshot each live panel drew last
        self._closing = False
        self.trace = CacheTrace()
        self.sampling_override: SamplingConfig | None = None  # self-test and benchmarks: fixed sampling
        self._compare_dialog: Any = None  # Tools ▸ Compare: the last dialog opened

        self.chat = ChatPane()
        self.setCentralWidget(self.chat)
        self.chat_list = ChatList()
        self.sampling = SamplingForm()
        self.sampling.set_sampling(self._sampling_from_settings())
        self.controls = CacheControls(self._applied_cache)
        self.occupancy = OccupancyPanel()
        self.page_map = PageMapPanel()
        self.timing = TimingPanel()
        self.memory = MemoryPanel()
        self.model_card = ModelCardPanel()
        self.panels = [self.occupancy, self.page_map, self.timing, self.memory, self.model_card]
        self._build_docks()
        self._build_status_bar()
        self._build_menus()

        self.engine = EngineThread(backend, parent=self)
        w = self.engine.worker
        w.progress.connect(self._on_progress)
        w.loaded.connect(self._on_loaded)
        w.environment.connect(self._on_environment)
        w.snapshot.connect(self._on_snapshot)
        w.failed.connect(self._on_failed)
        w.applied.connect(self._on_applied)

        self.conversation = Conversation(
            history, settings, self.chat, self.chat_list, self.engine,
            sampling=lambda: self.sampling_override or self.sampling.sampling(),
            cache_mode=lambda: self._applied_cache.mode, parent=self)
        c = self.conversation
        c.reply_started.connect(self._on_reply_started)
        c.token.connect(self.timing.add_token)
        c.reply_finished.connect(self._on_reply_finished)
        c.error.connect(self.show_error)
        c.failed.connect(self._on_failed)  # the history file's troubles (stage "history")
        c.noted.connect(self._on_reply_notes)
        self.controls.changed.connect(self.apply_cache_config)
        self.sampling.changed.connect(self._save_sampling)

        self._refresh = QTimer(self)
        self._refresh.setInterval(REFRESH_MS)
        self._refresh.timeout.connect(self._tick)
        self._refresh.start()
        self._db_timer = QTimer(self)
        self._db_timer.setInterval(DB_FLUSH_MS)
        self._db_timer.timeout.connect(self.conversation.flush)
        self._db_timer.start()

        self.resize(1600, 960)
        self._restore_layout()
        self.conversation.load_chats()

    # -- construction -------------------------------------------------------------------------------------
    def _dock(self, title: str, widget: QWidget, name: str) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)
        dock.setWidget(widget)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                         | QDockWidget.DockWidgetFeature.DockWidgetClosable)
        return dock

    def _build_docks(self) -> None:
        self.setDockNestingEnabled(True)
        self.docks: dict[str, QDockWidget] = {
            "chats": self._dock("Chats", self.chat_list, "dock_chats"),
            "sampling": self._dock("Sampling", self.sampling, "dock_sampling"),
            "model": self._dock("Model", self.model_card, "dock_model"),
            "controls": self._dock("Cache policy", self.controls, "dock_controls"),
            "occupancy": self._dock("Layer occupancy", self.occupancy, "dock_occupancy"),
            "page_map": self._dock("Page map", self.page_map, "dock_page_map"),
            "timing": self._dock("Token timing", self.timing, "dock_timing"),
            "memory": self._dock("Memory", self.memory, "dock_memory"),
        }
        self._default_layout()

    def _default_layout(self) -> None:
        d = self.docks
        for dock in d.values():
            dock.setFloating(False)
            dock.show()
        left, right = Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea
        H, V = Qt.Orientation.Horizontal, Qt.Orientation.Vertical
        # [chats / sampling] [chat pane] [occupancy / page map / timing / memory] [cache policy / model]
        self.addDockWidget(left, d["chats"])
        self.splitDockWidget(d["chats"], d["sampling"], V)
        self.addDockWidget(right, d["occupancy"])
        self.splitDockWidget(d["occupancy"], d["controls"], H)
        self.splitDockWidget(d["controls"], d["model"], V)
        self.splitDockWidget(d["occupancy"], d["page_map"], V)
        self.splitDockWidget(d["page_map"], d["timing"], V)
        self.splitDockWidget(d["timing"], d["memory"], V)
        self._sized = False
        if self.isVisible():
            self._size_docks()

    def _size_docks(self) -> None:
        """Default dock sizes as fractions of the window (chat pane gets what is left, about a third)."""
        d, W, Hh = self.docks, max(self.width(), 800), max(self.height(), 600)
        H, V = Qt.Orientation.Horizontal, Qt.Orientation.Vertical
        self.resizeDocks([d["chats"], d["occupancy"], d["controls"]],
                         [int(W * 0.14), int(W * 0.35), int(W * 0.19)], H)
        self.resizeDocks([d["chats"], d["sampling"]], [int(Hh * 0.5), int(Hh * 0.4)], V)
        self.resizeDocks([d["controls"], d["model"]], [int(Hh * 0.45), int(Hh * 0.5)], V)
        self.resizeDocks([d["occupancy"], d["page_map"], d["timing"], d["memory"]],
                         [int(Hh * f) for f in (0.21, 0.25, 0.27, 0.21)], V)
        self._sized = True

    def showEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().showEvent(event)
        if not self._sized and not self._restored:
            QTimer.singleShot(0, self._size_docks)

    def _build_status_bar(self) -> None:
        bar = self.statusBar()
        self.status_model = QLabel("model: —")
        self.status_device = QLabel("device: —")
        self.status_mode = QLabel("cache: —")
        self.status_context = QLabel("context: —")
        self.status_speed = QLabel("— tok/s")
        self.load_progress = QProgressBar()
        self.load_progress.setMaximumWidth(180)
        self.load_progress.setTextVisible(False)
        self.load_progress.setVisible(False)
        for w in (self.status_model, self.status_device, self.status_mode, self.status_context, self.status_speed):
            w.setObjectName("statusField")
            bar.addPermanentWidget(w)
        self.load_cancel = QToolButton()
        self.load_cancel.setText("Cancel")
        self.load_cancel.setToolTip("Stop loading this model (the model loaded before stays in use)")
        self.load_cancel.setVisible(False)
        self.load_cancel.clicked.connect(self.cancel_load)
        # Permanent widgets: a normal status-bar widget is hidden while a message shows, and every
        # progress step of a load is a message.
        bar.insertPermanentWidget(0, self.load_progress)
        bar.insertPermanentWidget(1, self.load_cancel)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        self.act_models = QAction("&Models…", self, shortcut=QKeySequence("Ctrl+M"), triggered=self.open_models_dialog)
        self.act_open = QAction("&Open model folder…", self, shortcut=QKeySequence.StandardKey.Open,
                                triggered=self._open_folder)
        self.act_new = QAction("&New chat", self, shortcut=QKeySequence.StandardKey.New, triggered=self.new_chat)
        file_menu.addActions([self.act_models, self.act_open])
        self.recent_menu = file_menu.addMenu("&Recent models")
        self.recent_menu.aboutToShow.connect(self._fill_recent_menu)
        file_menu.addAction(self.act_new)
        file_menu.addSeparator()
        export = file_menu.addMenu("&Export")
        export.addAction(QAction("Cache trace as &JSON…", self, triggered=lambda: self._export_trace("json")))
        export.addAction(QAction("Cache trace as &CSV…", self, triggered=lambda: self._export_trace("csv")))
        export.addAction(QAction("Panels as &PNG…", self, triggered=self._export_pngs))
        export.addAction(QAction("Chat as &Markdown…", self, triggered=self._export_chat))
        file_menu.addSeparator()
        file_menu.addAction(QAction("&Quit", self, shortcut=QKeySequence.StandardKey.Quit, triggered=self.close))
        view = self.menuBar().addMenu("&View")
        for dock in self.docks.values():
            view.addAction(dock.toggleViewAction())
        view.addSeparator()
        self.act_panels = QAction("Live panels", self, checkable=True, checked=self._panels_enabled,
                                  toggled=self.set_panels_enabled)
        view.addAction(self.act_panels)
        view.addAction(QAction("Reset layout", self, triggered=self._default_layout))
        tools = self.menuBar().addMenu("&Tools")
        self.act_compare = QAction("&Compare cache settings on this chat…", self, shortcut=QKeySequence("Ctrl+K"),
                                   triggered=self.open_compare)
        tools.addAction(self.act_compare)
        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction(QAction("About KV Scope", self, triggered=self._about))

    # -- settings -----------------------------------------------------------------------------------------
    def _cache_from_settings(self) -> CacheConfig:
        s = self.settings
        try:
            return CacheConfig(mode=s.get("cache/mode"), page_size=s.get("cache/page_size"),
                               prefix_reuse=s.get("cache/prefix_reuse"), k_dtype=s.get("cache/k_dtype"),
                               v_dtype=s.get("cache/v_dtype"), policy=s.get("cache/policy"),
                               policy_params=s.get("cache/policy_params"), overflow=s.get("cache/overflow"))
        except ValueError:
            return CacheConfig()

    def _sampling_from_settings(self) -> SamplingConfig:
        s = self.settings
        seed = s.get("sampling/seed")
        try:
            return SamplingConfig(temperature=s.get("sampling/temperature"), top_k=s.get("sampling/top_k"),
                                  top_p=s.get("sampling/top_p"), min_p=s.get("sampling/min_p"),
                                  repetition_penalty=s.get("sampling/repetition_penalty"),
                                  seed=None if seed < 0 else seed, max_new_tokens=s.get("sampling/max_new_tokens"))
        except ValueError:
            return SamplingConfig()

    def _save_sampling(self) -> None:
        try:
            sc = self.sampling.sampling()
        except ValueError:
            return
        for key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens"):
            self.settings.set(f"sampling/{key}", getattr(sc, key))
        self.settings.set("sampling/seed", -1 if sc.seed is None else sc.seed)

    def _save_cache(self, cfg: CacheConfig) -> None:
        for key in ("mode", "page_size", "prefix_reuse", "k_dtype", "v_dtype", "policy", "policy_params", "overflow"):
            self.settings.set(f"cache/{key}", getattr(cfg, key))

    def _restore_layout(self) -> None:
        geometry, state = self.settings.get("window/geometry"), self.settings.get("window/state")
        self._restored = False
        try:
            if geometry:
                self.restoreGeometry(QByteArray(geometry))
            if state:
                self._restored = bool(self.restoreState(QByteArray(state)))
                if not self._restored:
                    self._default_layout()
        except Exception:  # noqa: BLE001 - a bad saved layout must never stop the app
            self._default_layout()

    def save_layout(self) -> None:
        self.settings.set("window/geometry", bytes(self.saveGeometry().data()))
        self.settings.set("window/state", bytes(self.saveState().data()))
        self.settings.sync()

    # -- the conversation (see app.conversation) -------------------------------------------------------
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

    def send(self, text: str) -> None:
        self.conversation.send(text)

    def stop(self) -> None:
        self.conversation.stop()

    def new_chat(self) -> None:
        self.conversation.new_chat()

    def open_chat(self, chat_id: int) -> None:
        self.conversation.open_chat(chat_id)

    def _on_reply_started(self, generation_id: int, mode: str) -> None:
        self.trace.begin(generation_id)
        self.timing.begin_reply(generation_id, f"cache {mode}")

    def _on_reply_finished(self, generation_id: int, reason: str) -> None:
        QTimer.singleShot(0, self._refresh_all)  # every panel shows the reply's final state
        speed = self.conversation.last_stats.get("decode_tokens_per_s")
        if speed:
            self.status_speed.setText(f"{speed:.1f} tok/s")
        self.reply_finished.emit(generation_id, reason)

    def _on_snapshot(self, snap: CacheSnapshot) -> None:
        gen = self.conversation.generation_id
        if gen and snap.generation_id != gen:
            return
        self._latest = snap
        self._snapshot_dirty = True
        self.trace.add(snap)

    def _on_failed(self, failure: Failure) -> None:
        """Route a worker failure by its stage: a reply's failure shows in that reply (the conversation saves
        it with the chat); the others leave the chat alone and show in the message area above it."""
        if failure.stage == "load":
            self._on_load_failed(failure)
        elif failure.ends_reply:
            if failure.generation_id == self.generation_id:  # a stale reply's failure is not news
                self.show_error(failure.message, notice=False)
        elif failure.stage == "compare":
            self.show_error(failure.message, notice=False)  # the comparison's dialog says it
        else:
            if failure.stage == "apply":
                self.controls.set_config(self._applied_cache)  # the controls show what is really applied
            self.show_error(failure.message)

    def show_error(self, message: str, notice: bool = True) -> None:
        """Every failure ends here: the status bar, and (``notice``) the message area above the transcript.
        Nothing here is saved; a reply's own failure is shown and saved with the reply."""
        if notice:
            self.chat.notice.show_message(message)
        self.statusBar().showMessage(message.splitlines()[0], 8000)
        self.error_shown.emit(message)

    def _on_reply_notes(self, notes: list) -> None:
        """Notes of the reply in flight (also shown under it): like applied notes, in the status bar and trace."""
        self.trace.notes.extend(notes)
        self.statusBar().showMessage("; ".join(notes), 6000)

    # -- cache policy ---------------------------------------------------------------------------------------
    def apply_cache_config(self, cfg: CacheConfig) -> None:
        """Send a new cache configuration; the worker applies it between steps (also mid-reply)."""
        self.engine.apply_cache_config(cfg)

    def _on_applied(self, cfg: CacheConfig, notes: list) -> None:
        self._applied_cache = cfg
        if self.generation_id:
            self.conversation.note_mode(cfg.mode)  # the reply's stats line shows e.g. "cache paged → off"
            self.timing.current.label = "cache " + " → ".join(self.conversation.modes)
        self._save_cache(cfg)
        self.controls.show_notes(list(notes))
        self.trace.notes.extend(notes)
        self.status_mode.setText(self._mode_text(cfg))
        if notes:
            self.statusBar().showMessage("; ".join(notes), 6000)

    @staticmethod
    def _mode_text(cfg: CacheConfig) -> str:
        text = f"cache: <b>{cfg.mode}</b>"
        if cfg.mode == "paged":
            text += f" · page {cfg.page_size}"
        if cfg.quantized:
            text += f" · K {cfg.k_dtype} V {cfg.v_dtype}"
        if cfg.policy != "none":
            text += f" · {cfg.policy}"
        return text

    def _refresh_all(self) -> None:
        snap = self._latest
        if snap is None or not self._panels_enabled:
            return
        for panel in (self.occupancy, self.page_map, self.timing, self.memory):
            if self._shown.get(panel.objectName()) is not snap:
                self._shown[panel.objectName()] = snap
                panel.show_snapshot(snap)

    def panels_by_name(self) -> dict[str, Any]:
        return {p.objectName(): p for p in self.panels}

    # -- the refresh timer ----------------------------------------------------------------------------------
    def set_panels_enabled(self, on: bool) -> None:
        self._panels_enabled = bool(on)
        self.settings.set("panels/enabled", self._panels_enabled)

    def _tick(self) -> None:
        """One refresh: streamed text, then at most ONE live panel (round robin) gets the latest snapshot.

        Spreading the panels over ticks keeps each tick short, so the event loop stays responsive while
        the worker thread (which competes for the GIL) streams tokens. The panel is painted right away and
        the time it took sets when the next one may draw (``PANEL_BUDGET``): on a slow or busy machine the
        panels redraw less often instead of slowing the reply down.
        """
        self.chat.render()
        snap = self._latest
        if snap is None:
            return
        now = time.perf_counter()
        if self._panels_enabled and now >= self._panel_next:
            live = (self.occupancy, self.page_map, self.timing, self.memory)
            for _ in range(len(live)):
                self._turn = (self._turn + 1) % len(live)
                panel = live[self._turn]
                if panel.isVisible() and self._shown.get(panel.objectName()) is not snap:  # hidden docks skip
                    self._shown[panel.objectName()] = snap
                    panel.show_snapshot(snap)
                    panel.repaint()  # paint now, so its cost is counted here and not in a later event
                    spent = time.perf_counter() - now
                    self.panel_seconds += spent
                    self._panel_next = now + max(PANEL_INTERVAL_S, spent / PANEL_BUDGET)
                    break
        if not self._snapshot_dirty:
            return
        self._snapshot_dirty = False
        self.status_mode.setText(self._mode_text(self._applied_cache))
        self._show_context(snap.seq_len, snap.context_length)
        if self.generation_id and snap.decode_tokens_per_s:
            self.status_speed.setText(f"{snap.decode_tokens_per_s:.1f} tok/s")

    def _show_context(self, used: int, total: int) -> None:
        """'context used/total', amber from 75% and red from 90%, with what happens when it is full."""
        frac = used / total if total else 0.0
        colour = CONTEXT_FULL if frac >= 0.9 else CONTEXT_FILLING if frac >= 0.75 else ""
        text = f"context {used}/{total}"
        self.status_context.setText(f"<span style='color:{colour}'>{text}</span>" if colour else text)
        overflow = self._applied_cache.overflow
        self.status_context.setToolTip(
            f"{used} of the model's {total} context tokens are in use ({100 * frac:.0f}%).\n"
            f"When it is full: {CONTEXT_OVERFLOW_TEXT.get(overflow, overflow)} "
            "(Cache policy ▸ when full). Every dropped token shows in the page map and the occupancy panel.")

    # -- tools ----------------------------------------------------------------------------------------------
    def open_compare(self) -> Any:
        """Generate this chat's next reply once per cache setting and show them side by side in a non-modal
        dialog; the comparison runs on the worker step by step next to the chat, so the chat goes on
        meanwhile. Returns the dialog (the running one, raised, if there is one), or None with a message
        when there is nothing to compare yet."""
        from app.compare_dialog import CompareDialog

        running = self._compare_dialog
        if running is not None and running.running:
            running.raise_()
            running.activateWindow()
            return running
        if self.info is None or self._loading:
            self.show_error("Load a model first.")
            return None
        messages = self.conversation.engine_messages()
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        if last_user < 0:
            self.show_error("Send a message first: the comparison regenerates the reply to it.")
            return None
        try:
            sampling = self.sampling_override or self.sampling.sampling()
        except ValueError as exc:
            self.show_error(str(exc))
            return None
        self._compare_dialog = CompareDialog(self.engine, messages[:last_user + 1], sampling, self)
        self._compare_dialog.show()
        return self._compare_dialog

    def _about(self) -> None:
        QMessageBox.about(self, "About KV Scope",
                          "<b>KV Scope</b><br>Chat with a local model and watch its KV cache work: per-layer "
                          "occupancy, the page map, per-token timing and memory, with cache policies you can "
                          "change while it talks.")

    # -- closing --------------------------------------------------------------------------------------------
    def shutdown(self, timeout_ms: int = 2000) -> bool:
        """Stop any reply, join the worker, flush history and save the layout. True if joined in time."""
        if self._closing:
            return True
        self._closing = True
        self._refresh.stop()
        self._db_timer.stop()
        joined = self.engine.shutdown(timeout_ms)
        self.conversation.flush()  # after the worker stopped: everything that streamed is saved
        self.conversation.closed = True  # a cancelled reply's queued signals must not touch closed history
        self.save_layout()
        if joined:  # a worker still running must not start collections (see app/gc_guard.py)
            MainThreadGC.release()
        return joined

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt name
        self.shutdown()
        super().closeEvent(event)

