"""Sampling controls (temperature, top-k, top-p, min-p, repetition penalty, seed, max new tokens)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QSpinBox, QWidget

from app.ground.glossary import CONTROLS
from engine.config import SamplingConfig


class SamplingForm(QWidget):
    """Edits a ``SamplingConfig``; ``changed`` fires on any edit. Temperature 0 is greedy; seed -1 is random."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("SamplingForm")
        form = QFormLayout(self)
        form.setContentsMargins(6, 6, 6, 6)

        def dspin(lo: float, hi: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
            box = QDoubleSpinBox()
            box.setRange(lo, hi)
            box.setSingleStep(step)
            box.setDecimals(decimals)
            box.valueChanged.connect(self.changed)
            return box

        def ispin(lo: int, hi: int) -> QSpinBox:
            box = QSpinBox()
            box.setRange(lo, hi)
            box.valueChanged.connect(self.changed)
            return box

        self.temperature = dspin(0.0, 5.0, 0.05)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.top_k = ispin(0, 100000)
        self.top_k.setSpecialValueText("off")
        self.top_p = dspin(0.01, 1.0, 0.01)
        self.min_p = dspin(0.0, 0.99, 0.01)
        self.min_p.setSpecialValueText("off")
        self.repetition_penalty = dspin(0.5, 3.0, 0.05)
        self.seed = ispin(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.max_new_tokens = ispin(1, 32768)
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "max_new_tokens"):
            w, term = getattr(self, name), CONTROLS[name]
            w.setObjectName(name)
            w.setToolTip(term.tip)
            w.setMinimumWidth(w.sizeHint().width())  # every digit visible
            form.addRow(term.name, w)
        self.set_sampling(SamplingConfig())

    def set_sampling(self, s: SamplingConfig) -> None:
        self.blockSignals(True)
        self.temperature.setValue(s.temperature)
        self.top_k.setValue(s.top_k)
        self.top_p.setValue(s.top_p)
        self.min_p.setValue(s.min_p)
        self.repetition_penalty.setValue(s.repetition_penalty)
        self.seed.setValue(-1 if s.seed is None else s.seed)
        self.max_new_tokens.setValue(s.max_new_tokens)
        self.blockSignals(False)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            temperature=self.temperature.value(),
            top_k=self.top_k.value(),
            top_p=self.top_p.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition_penalty.value(),
            seed=None if self.seed.value() < 0 else self.seed.value(),
            max_new_tokens=self.max_new_tokens.value(),
        )
