"""Settings ▸ Settings…: one dialog for what is not in the docks — the server's address and keys, speculation's
auto-off, the KV disk cache, quantized copies, and what a new chat starts with.

Each page edits a copy; Apply (or OK) hands each changed value to its owner (``ServerController.apply_address``,
``SpecController.apply``, ``DiskController.apply_form``, ``CopiesController.apply_form``, the settings store), which
saves it and puts it in force.
A server address that cannot be used keeps the dialog open on the Server page with one line saying why.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtWidgets import (QCheckBox, QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit,
                               QPushButton, QSpinBox, QTabWidget, QVBoxLayout, QWidget)

from app.settings.cache_settings import save_sampling
from app.agent.tools_page import ToolsPage
from app.server.settings_page import ServerPage
from app.settings.store import SAMPLING_DEFAULTS
from engine.config import SamplingConfig, SpecConfig

PAGES = ("server", "speculation", "disk", "copies", "chats", "tools")


class SpecPage(QWidget):
    """What the Speculation dock does not show: auto-off and the longest n-gram prompt lookup matches."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.auto_off = QCheckBox("Stop speculating for a reply where it measures slower (auto-off)")
        self.auto_off.setToolTip("Speculation checks its own speed against plain decoding early in a reply and turns "
                                 "itself off for that reply when drafts cost more than they save")
        self.max_ngram = QSpinBox()
        self.max_ngram.setRange(1, 8)
        self.max_ngram.setToolTip("Prompt lookup drafts the tokens that followed the last n tokens earlier in the "
                                  "chat; this is the longest n it tries")
        form = QFormLayout(self)
        form.addRow(self.auto_off)
        form.addRow("Longest n-gram (prompt lookup)", self.max_ngram)
        hint = QLabel("Method and draft tokens are in the Speculation dock.")
        hint.setWordWrap(True)
        form.addRow(hint)

    def load(self, cfg: SpecConfig) -> None:
        self.auto_off.setChecked(cfg.auto_off)
        self.max_ngram.setValue(cfg.max_ngram)

    def config(self, applied: SpecConfig) -> SpecConfig:
        return dataclasses.replace(applied, auto_off=self.auto_off.isChecked(), max_ngram=self.max_ngram.value())


class ChatsPage(QWidget):
    """What a new chat starts with: its system prompt; and the Sampling dock's values back to the defaults."""

    def __init__(self, window, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.window_ = window
        self.system_prompt = QLineEdit()  # one line, as the chat's own field above its messages
        self.system_prompt.setPlaceholderText("e.g. You are a helpful assistant. (empty: none)")
        self.system_prompt.setToolTip("Each new chat starts with this system prompt; change it per chat above its "
                                      "messages")
        self.restore = QPushButton("Restore the sampling defaults")
        self.restore.setToolTip("Temperature, top-k, top-p, min-p, repetition penalty, seed and max new tokens in "
                                "the Sampling dock back to KV Scope's defaults (for every reply from now on)")
        self.restore.clicked.connect(self.restore_sampling)
        self.restored = QLabel("")
        form = QFormLayout(self)
        form.addRow("System prompt for new chats", self.system_prompt)
        form.addRow(self.restore, self.restored)

    def load(self, settings) -> None:
        self.system_prompt.setText(settings.get("chat/system_prompt"))
        self.restored.setText("")

    def restore_sampling(self) -> None:
        """At once, not on Apply: the Sampling dock shows the values, and they are saved as it saves its own."""
        cfg = SamplingConfig(**SAMPLING_DEFAULTS)
        self.window_.sampling.set_sampling(cfg)
        save_sampling(self.window_.settings, cfg)
        self.restored.setText("Restored (the Sampling dock shows them)")


class SettingsDialog(QDialog):
    """Pages ``server``, ``speculation``, ``disk``, ``copies``, ``chats`` and ``tools`` of ``window`` (a
    ``MainWindow``); non-modal."""

    def __init__(self, window) -> None:
        super().__init__(window)
        self.setObjectName("SettingsDialog")
        self.setWindowTitle("Settings")
        self.window_ = window
        self.server = ServerPage(window.server)
        self.speculation = SpecPage()
        self.disk = window.disk.make_form()
        self.copies = window.copies.make_form()
        self.chats = ChatsPage(window)
        self.tools = ToolsPage(window.agent)
        self.tabs = QTabWidget()
        for page, title in ((self.server, "Server"), (self.speculation, "Speculation"), (self.disk, "KV disk cache"),
                            (self.copies, "Quantized copies"), (self.chats, "New chats"), (self.tools, "Tools")):
            self.tabs.addTab(page, title)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Apply
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        self.apply_button = buttons.button(QDialogButtonBox.StandardButton.Apply)
        self.apply_button.clicked.connect(self.apply)
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs)
        layout.addWidget(buttons)
        self.resize(560, 420)

    def load(self) -> None:
        """Every page from the settings in force."""
        w = self.window_
        self.server.load(w.server.address)
        self.speculation.load(w.speculation.applied)
        self.disk.load(w.disk.cfg)
        w.disk.refresh()
        self.copies.load(w.copies.cfg)
        self.chats.load(w.settings)
        self.tools.load(w.settings)

    def open_page(self, page: str = "server") -> "SettingsDialog":
        self.load()
        self.tabs.setCurrentIndex(PAGES.index(page))
        self.show()
        self.raise_()
        self.activateWindow()
        return self

    def apply(self) -> bool:
        """Hand each changed value to its owner; False (nothing applied) when the server's address cannot be
        used: the Server page shows why."""
        w = self.window_
        for name, page in (("server", self.server), ("tools", self.tools)):
            problem = page.problem()
            if problem:
                self.tabs.setCurrentIndex(PAGES.index(name))
                page.problem_line.setText(problem)
                page.problem_line.setVisible(True)
                return False
        if self.server.address() != w.server.address or (w.server.running and
                                                         w.server.serving_at != self.server.address()):
            w.server.apply_address(self.server.address())
        spec = self.speculation.config(w.speculation.applied)
        if spec != w.speculation.applied:
            w.speculation.apply(spec)
        defaults = self.speculation.config(w.speculation.defaults)  # new chats' too: this page is not one chat's
        if defaults != w.speculation.defaults:
            w.speculation.set_defaults(defaults)
        w.disk.apply_form()
        w.copies.apply_form()
        w.settings.set("chat/system_prompt", self.chats.system_prompt.text().strip())
        if self.tools.save(w.settings):
            w.agent.configure()  # the servers start again with what the page says
        w.settings.sync()
        self.server.load(self.server.address())  # the port line now says what runs
        return True

    def accept(self) -> None:
        if self.apply():
            super().accept()


def open_settings(window, page: str = "server") -> SettingsDialog:
    """Settings ▸ Settings… (or one of its pages): the window's one dialog, made at first use."""
    dialog = getattr(window, "settings_dialog", None)
    if dialog is None:
        dialog = window.settings_dialog = SettingsDialog(window)
    return dialog.open_page(page)
