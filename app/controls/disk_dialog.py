"""Settings ▸ KV disk cache: the form (a page of the Settings dialog, ``app.shell.settings_dialog``), and
``DiskController``, which keeps the setting, sends it to the worker (``app.link.disk_tier.DiskTierControl``)
and shows the tier's size in the status bar and on the form."""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QMessageBox, QPushButton, QWidget)

from app.link.disk_tier import DiskConfig, DiskState, disk_from_settings, resolve, save_disk
from app.ground.format import human_bytes
from app.settings.store import Settings

POLL_MS = 1000  # the writer thread writes after a reply ends: the readout follows it without being told


class DiskController(QObject):
    """The setting in force and the tier's size; ``changed`` after the worker applied a setting or a clear."""

    changed = Signal(object)  # DiskState, after the worker applied a setting or a clear

    def __init__(self, settings: Settings, engine: Any, status: Any, show_error: Callable[[str], None],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings, self.engine, self.status, self.show_error = settings, engine, status, show_error
        self.cfg, self.folder = disk_from_settings(settings)
        self.state = DiskState(None, self.folder)
        self.form: DiskForm | None = None  # the Settings dialog's page, once it was opened
        engine.worker.disk.changed.connect(self._on_changed)
        self._poll = QTimer(self)
        self._poll.setInterval(POLL_MS)
        self._poll.timeout.connect(self.refresh)
        engine.configure_disk(self.cfg, self.folder)  # before the model's load: applied as it loads

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def apply(self, cfg: DiskConfig) -> None:
        """A new setting: saved, and applied on the worker (also to the model loaded now)."""
        self.cfg, self.folder = cfg, resolve(cfg, self.settings)
        save_disk(self.settings, cfg)
        self.engine.configure_disk(cfg, self.folder)

    def clear(self, confirm: bool = True) -> bool:
        """Delete the tier's files after a confirmation. True if asked for."""
        if confirm:
            answer = QMessageBox.question(
                self.form.window() if self.form is not None else self.parent(), "Clear the KV disk cache",
                f"Delete the {human_bytes(self.nbytes)} of KV pages in {self.folder}?\nChats are kept; reopening "
                "one reads it again (once) instead of restoring its cache.")
            if answer != QMessageBox.StandardButton.Yes:
                return False
        self.engine.clear_disk()
        return True

    def refresh(self) -> None:
        """The status bar's readout from the tier's byte count."""
        self.status.show_disk(self.nbytes if self.state.tier is not None else -1, self.folder)
        if self.form is not None:
            self.form.show_size(self.nbytes, self.state.tier is not None)

    def _on_changed(self, state: DiskState) -> None:
        self.state = state
        for note in state.notes:
            self.show_error(note)
        if state.tier is not None:
            self._poll.start()
        else:
            self._poll.stop()
        self.refresh()
        self.changed.emit(state)

    def make_form(self) -> "DiskForm":
        """The Settings dialog's page, showing the setting in force and the tier's size."""
        self.form = DiskForm(self)
        self.form.load(self.cfg)
        self.refresh()
        return self.form

    def apply_form(self) -> None:
        """The Settings dialog applied: the form's setting, if it changed (else the tier is left alone: a new one
        would rescan the folder)."""
        if self.form is not None and self.form.config() != self.cfg:
            self.apply(self.form.config())


class DiskForm(QWidget):
    """On/off, budget, location, size and Clear."""

    def __init__(self, controller: DiskController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.enabled = QCheckBox("Keep the chats' KV cache on disk")
        self.enabled.setToolTip("Full pages of the cache are written to files, so a chat reopened after a restart "
                                "is restored from disk instead of read again by the model")
        self.budget = QDoubleSpinBox()
        self.budget.setRange(0.1, 4096.0)
        self.budget.setDecimals(1)
        self.budget.setSuffix(" GiB")
        self.budget.setToolTip("At most this much on disk; the pages used longest ago go first")
        self.folder = QLineEdit()
        self.folder.setPlaceholderText(resolve(DiskConfig(), controller.settings))  # empty: the data folder's kv/
        choose = QPushButton("Choose…")
        choose.clicked.connect(self._choose)
        row = QHBoxLayout()
        row.addWidget(self.folder, 1)
        row.addWidget(choose)
        self.size = QLabel("")
        self.clear_button = QPushButton("Clear…")
        self.clear_button.setToolTip("Delete the files of the KV disk cache (after a confirmation)")
        self.clear_button.clicked.connect(lambda: controller.clear())
        size_row = QHBoxLayout()
        size_row.addWidget(self.size, 1)
        size_row.addWidget(self.clear_button)
        form = QFormLayout()
        form.addRow(self.enabled)
        form.addRow("Budget", self.budget)
        form.addRow("Location", row)
        form.addRow("On disk", size_row)
        self.setLayout(form)

    def load(self, cfg: DiskConfig) -> None:
        self.enabled.setChecked(cfg.enabled)
        self.budget.setValue(cfg.budget_gib)
        self.folder.setText(cfg.folder)

    def config(self) -> DiskConfig:
        return DiskConfig(self.enabled.isChecked(), self.folder.text().strip(), float(self.budget.value()))

    def show_size(self, nbytes: int, on: bool) -> None:
        self.size.setText(human_bytes(nbytes) + ("" if on else " (off, or no model loaded)"))

    def _choose(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "KV disk cache folder", self.folder.text()
                                                  or self.folder.placeholderText())
        if folder:
            self.folder.setText(folder)
