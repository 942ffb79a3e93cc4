"""Settings ▸ Quantized copies: the form (a page of the Settings dialog, ``app.shell.settings_dialog``), and
``CopiesController``, which keeps the setting, sends it to the worker (``app.link.copies.CopiesControl``) before the
loads it applies to, and shows what the copies take on the form."""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QMessageBox, QPushButton, QWidget)

from app.ground.format import copies_words, count, human_bytes
from app.link.copies import CopiesConfig, CopiesState, copies_from_settings, engine_default, save_copies
from app.settings.store import Settings

# a copy is renamed to its final name on a thread after the load returns (a 1 GB copy: ~0.3 s): the open form
# counts again while it is shown, as the KV disk form follows its writer
POLL_MS = 2000


class CopiesController(QObject):
    """The setting in force and the copies' count; ``changed`` after the worker counted or cleared them."""

    changed = Signal(object)  # CopiesState

    def __init__(self, settings: Settings, engine: Any, show_error: Callable[[str], None],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings, self.engine, self.show_error = settings, engine, show_error
        self.cfg = copies_from_settings(settings)
        self.state: CopiesState | None = None  # not counted yet (counting imports the engine: at the form's first use)
        self.form: CopiesForm | None = None
        engine.worker.copies.changed.connect(self._on_changed)
        engine.worker.loaded.connect(self._on_loaded)  # (a method: queued to this thread, not run on the worker's)
        self._poll = QTimer(self)
        self._poll.setInterval(POLL_MS)
        self._poll.timeout.connect(self.measure)
        engine.configure_copies(self.cfg)  # before the model's load: the first load runs under it

    def apply(self, cfg: CopiesConfig) -> None:
        """A new setting: saved, and in force for the next load."""
        self.cfg = cfg
        save_copies(self.settings, cfg)
        self.engine.configure_copies(cfg)
        self.measure()

    def measure(self) -> None:
        """Count the copies again, where the form is open (else nothing: counting is for the form)."""
        if self.form is not None and self.form.isVisible():
            self.engine.measure_copies()
        else:
            self._poll.stop()

    def clear(self, confirm: bool = True) -> bool:
        """Delete the copies after a confirmation. True if asked for."""
        if confirm:
            state = self.state
            what = (f"{count(state.count, 'quantized copy', 'quantized copies')} ({human_bytes(state.nbytes)})"
                    if state is not None else "the quantized copies")
            where = state.folder if state is not None else "their folder"
            answer = QMessageBox.question(
                self.form.window() if self.form is not None else self.parent(), "Clear the quantized copies",
                f"Delete {what}?\nIn {where}\n\nNothing else in that folder is touched. The next 8-bit or 4-bit "
                "load of each model quantizes it again (a few seconds) and keeps a new copy.")
            if answer != QMessageBox.StandardButton.Yes:
                return False
        self.engine.clear_copies()
        return True

    def _on_loaded(self, _info: Any) -> None:
        self.measure()  # the load may have kept a copy

    def _on_changed(self, state: CopiesState) -> None:
        self.state = state
        for note in state.notes:
            self.show_error(note)
        if self.form is not None:
            self.form.show_state(state, self.cfg.enabled)
            if self.form.isVisible():
                self._poll.start()
        self.changed.emit(state)

    def make_form(self) -> "CopiesForm":
        """The Settings dialog's page, showing the setting in force; counted once it is shown."""
        self.form = CopiesForm(self)
        self.form.load(self.cfg)
        return self.form

    def apply_form(self) -> None:
        """The Settings dialog applied: the form's setting, if it changed."""
        if self.form is not None and self.form.config() != self.cfg:
            self.apply(self.form.config())


class CopiesForm(QWidget):
    """On/off, budget, location, what the copies take, and Clear."""

    def __init__(self, controller: CopiesController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.enabled = QCheckBox("Keep a quantized copy of models loaded with 8-bit or 4-bit weights")
        self.enabled.setToolTip("A Hugging Face folder loaded as 8-bit (int8) or 4-bit (NF4) is quantized at its "
                                "first load and the result kept here: the next load of the same files maps it "
                                "(a 1B model: ~0.1 s instead of 2-5 s)")
        self.budget = QDoubleSpinBox()
        self.budget.setRange(0.5, 4096.0)
        self.budget.setDecimals(1)
        self.budget.setSuffix(" GiB")
        self.budget.setToolTip("At most this much on disk; the copies loaded longest ago go first (an 8B model's "
                               "8-bit copy: ~7 GiB)")
        self.folder = QLineEdit()
        self.folder.setPlaceholderText(engine_default(controller.engine.worker.copies.base))  # empty: the default
        self.folder.setToolTip("Empty: " + self.folder.placeholderText())
        choose = QPushButton("Choose…")
        choose.clicked.connect(self._choose)
        row = QHBoxLayout()
        row.addWidget(self.folder, 1)
        row.addWidget(choose)
        self.size = QLabel(copies_words(None, True))
        self.clear_button = QPushButton("Clear…")
        self.clear_button.setToolTip("Delete the quantized copies in this folder (after a confirmation); nothing "
                                     "else there")
        self.clear_button.clicked.connect(lambda: controller.clear())
        size_row = QHBoxLayout()
        size_row.addWidget(self.size, 1)
        size_row.addWidget(self.clear_button)
        hint = QLabel("Used when a model folder is loaded with 8-bit or 4-bit weights; applies from the next load. "
                      "GGUF files need none: they are quantized already.")
        hint.setWordWrap(True)
        form = QFormLayout()
        form.addRow(self.enabled)
        form.addRow("Budget", self.budget)
        form.addRow("Location", row)
        form.addRow("On disk", size_row)
        form.addRow(hint)
        self.setLayout(form)

    def load(self, cfg: CopiesConfig) -> None:
        self.enabled.setChecked(cfg.enabled)
        self.budget.setValue(cfg.budget_gib)
        self.folder.setText(cfg.folder)

    def config(self) -> CopiesConfig:
        return CopiesConfig(self.enabled.isChecked(), self.folder.text().strip(), round(self.budget.value(), 1))

    def show_state(self, state: CopiesState, enabled: bool) -> None:
        self.size.setText(copies_words(state, enabled))
        self.clear_button.setEnabled(state.nbytes > 0)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().showEvent(event)
        self.controller.measure()

    def _choose(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Quantized copies folder", self.folder.text()
                                                  or self.folder.placeholderText())
        if folder:
            self.folder.setText(folder)
