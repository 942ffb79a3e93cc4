"""The cache controls' parts: combo boxes whose greyed-out items say why (``fill_combo``, ``follow_tip``,
``offer``, ``enable``), the eviction policy's form built from its ``Params`` dataclass, the page-size box, and the
strip that asks before a change that costs a re-read (``AskStrip``). ``app.controls.cache_controls`` lays them out.
"""

from __future__ import annotations

import typing
from typing import Any

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.ground import glossary
from app.controls import policies
from app.ground.glossary import CONTROLS, Term


TOOLTIP_ROLE = 3  # Qt.ItemDataRole.ToolTipRole
TIP_ROLE = 257  # Qt.ItemDataRole.UserRole + 1: what the item does, before any reason it is greyed out


def fill_combo(box: QComboBox, ids, table: dict[str, Term], control: str) -> None:
    """Items with plain names (ids as data) and each item's tooltip; the box's own tooltip follows the
    chosen item (``follow_tip``)."""
    for key in ids:
        term = table.get(key)
        box.addItem(term.name if term else key, key)
        box.setItemData(box.count() - 1, term.tip if term else key, TOOLTIP_ROLE)
        box.setItemData(box.count() - 1, term.tip if term else key, TIP_ROLE)
    box.setProperty("control", control)
    box.currentIndexChanged.connect(lambda _i, b=box: follow_tip(b))
    follow_tip(box)


def follow_tip(box: QComboBox) -> None:
    """The combo's tooltip: what the control is for, then what the chosen item does."""
    head = CONTROLS[box.property("control")].tip
    item = box.currentData(TOOLTIP_ROLE) or ""
    box.setToolTip(f"{head}\n\n{box.currentText()}: {item}" if item else head)


def offer(box: QComboBox, why: dict[int, str]) -> None:
    """Grey out the items of ``box`` named in ``why`` (index → the reason, first in its tooltip); the rest can be
    chosen. The box's own tooltip says the reason too when its chosen item is one of them."""
    model = box.model()
    for i in range(box.count()):
        reason, tip = why.get(i, ""), box.itemData(i, TIP_ROLE) or ""
        model.item(i).setEnabled(not reason)
        box.setItemData(i, f"{reason}\n\n{tip}" if reason else tip, TOOLTIP_ROLE)
    follow_tip(box)


def enable(widget: QWidget, on: bool, reason: str, tip: str) -> None:
    """Enable ``widget``, or disable it with ``reason`` first in its tooltip (``tip``: what it does)."""
    widget.setEnabled(on)
    widget.setToolTip(tip if on else f"{reason}\n\n{tip}")


def param_label(name: str) -> str:
    return glossary.PARAMS.get(name, (name.replace("_", " ").capitalize(), ""))[0]


def param_tip(name: str, help_text: str) -> str:
    extra = glossary.PARAMS.get(name, ("", ""))[1]
    return "\n".join(t for t in (help_text, extra) if t) or name.replace("_", " ")


def _base_type(annotation: Any, default: Any) -> type:
    if isinstance(annotation, type):
        return annotation
    if isinstance(annotation, str):
        for name, t in (("bool", bool), ("int", int), ("float", float), ("str", str), ("tuple", tuple), ("list", list)):
            if annotation.startswith(name):
                return t
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        return origin
    return type(default) if default is not None else str


class PolicyParamsForm(QWidget):
    """A form for one policy's ``Params`` dataclass: int → spin box, float → double spin box,
    bool → check box, tuple/list of ints → comma-separated text, anything else → text."""

    edited = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.form = QFormLayout(self)
        self.form.setContentsMargins(0, 0, 0, 0)
        self.form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self._editors: dict[str, tuple[type, QWidget]] = {}

    def build(self, name: str, values: dict[str, Any] | None = None) -> None:
        while self.form.rowCount():
            self.form.removeRow(0)
        self._editors.clear()
        values = values or {}
        for f in policies.policy_params(name):
            default = values.get(f.name, policies.field_default(f))
            kind = _base_type(f.type, default)
            editor: QWidget
            if kind is bool:
                editor = QCheckBox()
                editor.setChecked(bool(default))
                editor.toggled.connect(self.edited)
            elif kind is int:
                editor = QSpinBox()
                lo, hi = f.metadata.get("min"), f.metadata.get("max")
                editor.setRange(int(lo) if lo is not None else 0, min(int(hi) if hi is not None else 1 << 30, 2**31 - 1))
                editor.setValue(int(default or 0))
                editor.valueChanged.connect(self.edited)
            elif kind is float:
                editor = QDoubleSpinBox()
                lo, hi = f.metadata.get("min"), f.metadata.get("max")
                editor.setRange(float(lo) if lo is not None else 0.0, float(hi) if hi is not None else 1e6)
                editor.setDecimals(3)
                editor.setValue(float(default or 0.0))
                editor.valueChanged.connect(self.edited)
            else:
                editor = QLineEdit(
                    ", ".join(str(v) for v in default) if isinstance(default, (tuple, list)) else str(default or "")
                )
                editor.editingFinished.connect(self.edited)
            editor.setObjectName(f"param_{f.name}")
            editor.setToolTip(param_tip(f.name, str(f.metadata.get("help", ""))))
            editor.setMinimumWidth(editor.sizeHint().width())  # every digit visible, never squashed
            self._editors[f.name] = (kind, editor)
            self.form.addRow(param_label(f.name), editor)

    def values(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (kind, ed) in self._editors.items():
            if isinstance(ed, QCheckBox):
                out[name] = ed.isChecked()
            elif isinstance(ed, (QSpinBox, QDoubleSpinBox)):
                out[name] = ed.value()
            else:
                text = ed.text().strip()
                if kind in (tuple, list):
                    items = [t.strip() for t in text.replace(";", ",").split(",") if t.strip()]
                    parsed = []
                    for t in items:
                        try:
                            parsed.append(int(t))
                        except ValueError:
                            parsed.append(t)
                    out[name] = kind(parsed)
                else:
                    out[name] = text
        return out


class PageSizeBox(QSpinBox):
    """Tokens per page: the arrows and the wheel double and halve (16 → 32, not 17: page sizes that are not powers
    of two are rarely what anyone wants); any size in range can still be typed."""

    def stepBy(self, steps: int) -> None:  # noqa: N802 - Qt name
        value = self.value()
        for _ in range(abs(steps)):
            power = value & (value - 1) == 0
            if steps > 0:
                value = 1 << value.bit_length()  # the next power of two above
            elif value > 1:
                value = 1 << (value.bit_length() - (2 if power else 1))  # the next one below
        self.setValue(max(self.minimum(), min(self.maximum(), value)))


class AskStrip(QFrame):
    """A question about the change just chosen, under the controls: what it costs, and a button to go ahead or keep
    the setting in force. Hidden when nothing is asked."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("notice")
        self.setProperty("tone", "info")
        self.text = QLabel("")
        self.text.setObjectName("noticeText")
        self.text.setWordWrap(True)
        self.yes = QPushButton("Use it")
        self.no = QPushButton("Cancel")
        self.no.setToolTip("Keep the setting in force")
        row = QHBoxLayout()
        row.addWidget(self.yes)
        row.addWidget(self.no)
        row.addStretch(1)
        box = QVBoxLayout(self)
        box.setContentsMargins(8, 6, 8, 6)
        box.addWidget(self.text)
        box.addLayout(row)
        self._actions: tuple = (None, None)
        self.yes.clicked.connect(lambda: self._answer(0))
        self.no.clicked.connect(lambda: self._answer(1))
        self.setVisible(False)

    def ask(self, text: str, yes: str, on_yes, on_no) -> None:
        self.text.setText(text)
        self.yes.setText(yes)
        self._actions = (on_yes, on_no)
        self.setVisible(True)
        QTimer.singleShot(0, self._scroll_into_view)

    def _scroll_into_view(self) -> None:
        """The question sits under the controls' form, below a short dock's fold (1280×720 with a policy's parameters
        shown), where the user who just chose the change did not see it: scrolled into view."""
        area = self.parentWidget()
        while area is not None and not isinstance(area, QScrollArea):
            area = area.parentWidget()
        if area is not None and self.isVisible():
            if area.widget().layout() is not None:
                area.widget().layout().activate()  # the strip was hidden: its place is known once the layout has run
            area.ensureWidgetVisible(self, 0, 6)

    def clear(self) -> None:
        self._actions = (None, None)
        self.setVisible(False)

    @property
    def holding(self) -> bool:
        """A question is open (its answer not given yet), shown or not."""
        return self._actions[0] is not None

    def _answer(self, which: int) -> None:
        action = self._actions[which]
        self.clear()
        if action is not None:
            action()
