"""The "Speculative decoding" controls, under the cache controls: who guesses the next tokens (off, prompt lookup,
a draft model chosen as a folder), how many per check, and whether the replies tint the guesses the model kept.

A change emits ``changed(SpecConfig)`` (the draft-token spin box debounced); the window sends it to the worker,
which applies it between two steps, also mid-reply. ``set_config`` shows the setting in force without emitting
(also after a refusal). The tint is a view setting: ``tint_changed(bool)``.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.ground import glossary
from app.controls.cache_parts import fill_combo
from app.ground.glossary import CONTROLS
from app.ground.widgets import DebouncedForm
from engine.config import MAX_DRAFT, SPEC_METHODS, SpecConfig

NO_DRAFT = "no draft model chosen"


class SpecControls(DebouncedForm, QWidget):
    """``config()`` is the setting the controls show; ``draft_path`` the chosen draft model's folder."""

    changed = Signal(object)  # SpecConfig
    tint_changed = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("SpecControls")
        self._building = False
        self._base = SpecConfig()  # the fields these controls do not show (n-gram length, auto-off) come from it
        self.draft_path = ""
        self._init_debounce()

        self.method = QComboBox()
        self.method.setObjectName("spec_method")
        fill_combo(self.method, SPEC_METHODS, glossary.SPECULATION, "speculation")
        self.method.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.draft_label = QLabel(NO_DRAFT)
        self.draft_label.setObjectName("hint")
        self.draft_label.setWordWrap(True)
        self.choose = QPushButton("Choose draft model…")
        self.choose.setObjectName("spec_choose")
        self.choose.setToolTip(CONTROLS["draft_path"].tip)
        self.draft_tokens = QSpinBox()
        self.draft_tokens.setObjectName("spec_draft_tokens")
        self.draft_tokens.setRange(0, MAX_DRAFT)
        self.draft_tokens.setSpecialValueText("adapts")
        self.draft_tokens.setToolTip(CONTROLS["draft_tokens"].tip)
        self.draft_tokens.setMinimumWidth(self.draft_tokens.sizeHint().width())
        self.tint = QCheckBox(CONTROLS["spec_tint"].name)
        self.tint.setObjectName("spec_tint")
        self.tint.setToolTip(CONTROLS["spec_tint"].tip)
        self.notes = QLabel("")
        self.notes.setObjectName("hint")
        self.notes.setWordWrap(True)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)  # as the cache controls: the group's title is never cut
        box = QGroupBox("Speculative decoding")
        layout.addWidget(box)
        layout.addStretch(1)
        form = QFormLayout(box)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        form.addRow(CONTROLS["speculation"].name, self.method)
        form.addRow(CONTROLS["draft_path"].name, self.draft_label)
        form.addRow(self.choose)
        form.addRow(CONTROLS["draft_tokens"].name, self.draft_tokens)
        form.addRow(self.tint)
        form.addRow(self.notes)
        self.method.currentIndexChanged.connect(self._on_method)
        self.draft_tokens.valueChanged.connect(self._later)
        self.choose.clicked.connect(self._browse)
        self.tint.toggled.connect(self.tint_changed)
        self._sync()

    def set_config(self, cfg: SpecConfig) -> None:
        """Show ``cfg`` without emitting ``changed``."""
        self._building = True
        try:
            self._base = cfg
            self.method.setCurrentIndex(max(self.method.findData(cfg.method), 0))
            if cfg.draft_path:
                self.draft_path = cfg.draft_path
            self.draft_tokens.setValue(cfg.draft_tokens)
            self._sync()
        finally:
            self._building = False

    def set_tint(self, on: bool) -> None:
        """Show the tint setting without emitting ``tint_changed``."""
        self.tint.blockSignals(True)
        self.tint.setChecked(bool(on))
        self.tint.blockSignals(False)

    def config(self) -> SpecConfig:
        """What the controls ask for (ValueError: a draft model is asked for but none was chosen)."""
        method = self.method.currentData()
        return SpecConfig(method=method, draft_path=self.draft_path if method == "draft" else "",
                          draft_tokens=self.draft_tokens.value(), max_ngram=self._base.max_ngram,
                          auto_off=self._base.auto_off)

    def choose_draft(self, folder: str) -> None:
        """A draft model's folder was chosen: speculate with it (the worker loads and checks it)."""
        if not folder:
            return
        self.draft_path = str(folder)
        self._building = True
        self.method.setCurrentIndex(self.method.findData("draft"))
        self._building = False
        self._sync()
        self._now()

    def show_notes(self, notes: list[str]) -> None:
        self.notes.setText("\n".join(f"• {n}" for n in notes))

    def _browse(self) -> None:
        start = self.draft_path if self.draft_path and Path(self.draft_path).is_dir() else ""
        folder = QFileDialog.getExistingDirectory(self, "Choose a draft model (a folder with config.json)", start)
        self.choose_draft(folder)

    def _sync(self) -> None:
        """The draft model's row says which folder (its name; the whole path in the tooltip)."""
        draft = self.method.currentData() == "draft"
        self.draft_label.setText(Path(self.draft_path).name or self.draft_path if self.draft_path else NO_DRAFT)
        self.draft_label.setToolTip(self.draft_path)
        self.draft_label.setEnabled(draft)
        self.draft_tokens.setEnabled(self.method.currentData() != "off")

    def _on_method(self) -> None:
        self._sync()
        if self._building:
            return
        if self.method.currentData() == "draft" and not self.draft_path:
            self.show_notes(["Choose a draft model: a smaller model with the same tokenizer as the chat's model."])
            return  # nothing to apply until a folder is chosen
        self._now()

    def _emit(self) -> None:
        try:
            cfg = self.config()
        except ValueError as exc:
            self.show_notes([str(exc)])
            return
        self.changed.emit(cfg)

