"""Cache-policy controls: mode, page size, prefix reuse, K/V precision, eviction policy with a form built
from the policy's ``Params`` dataclass, and context-overflow behaviour.

Every change emits ``changed(CacheConfig)`` (spin boxes are debounced), and the window forwards it to the
worker, which applies it between decode steps, also in the middle of a reply.
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
    QGroupBox,
    QLabel,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app import policies
from engine.config import CACHE_MODES, KV_DTYPES, MAX_PAGE_SIZE, OVERFLOWS, CacheConfig

MODE_HELP = {
    "off": "off — recompute the whole context every token (O(n²) per reply)",
    "contiguous": "contiguous — one growing buffer per layer",
    "paged": "paged — fixed-size pages from a pool, shared prefixes",
}
OVERFLOW_HELP = {
    "stop": "stop at the limit",
    "truncate_middle": "truncate middle (keep system + first message)",
    "rolling": "rolling window (drop oldest)",
    "policy": "let the eviction policy decide",
}


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
            editor.setToolTip(str(f.metadata.get("help", "")))
            self._editors[f.name] = (kind, editor)
            self.form.addRow(f.name.replace("_", " "), editor)

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


class CacheControls(QWidget):
    """The cache-policy form. ``config()`` is the current ``CacheConfig``; ``set_config`` shows one."""

    changed = Signal(object)

    def __init__(self, config: CacheConfig | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("CacheControls")
        self._building = False
        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(150)
        self._debounce.timeout.connect(self._emit)

        self.mode = QComboBox()
        for m in CACHE_MODES:
            self.mode.addItem(MODE_HELP[m].split(" — ")[0], m)
            self.mode.setItemData(self.mode.count() - 1, MODE_HELP[m], 3)  # tooltip role
        self.page_size = QSpinBox()
        self.page_size.setRange(1, MAX_PAGE_SIZE)
        self.page_size.setSuffix(" tokens")
        self.prefix_reuse = QCheckBox("reuse common prefix")
        self.prefix_reuse.setToolTip("Keep the cache across turns and prefill only what changed "
                                     "(regenerate and edit reuse the shared prefix)")
        self.k_dtype = QComboBox()
        self.v_dtype = QComboBox()
        for box in (self.k_dtype, self.v_dtype):
            for d in KV_DTYPES:
                box.addItem({"auto": "full (model dtype)"}.get(d, d), d)
        self.policy = QComboBox()
        self.params = PolicyParamsForm()
        self.policy_help = QLabel("")
        self.policy_help.setWordWrap(True)
        self.policy_help.setObjectName("hint")
        self.overflow = QComboBox()
        for o in OVERFLOWS:
            self.overflow.addItem(OVERFLOW_HELP[o], o)
        for box in (self.mode, self.k_dtype, self.v_dtype, self.policy, self.overflow):
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            box.setMinimumContentsLength(8)
        self.notes = QLabel("")
        self.notes.setWordWrap(True)
        self.notes.setObjectName("hint")

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        cache_box = QGroupBox("Cache")
        form = QFormLayout(cache_box)
        form.addRow("mode", self.mode)
        form.addRow("page size", self.page_size)
        form.addRow("", self.prefix_reuse)
        form.addRow("K precision", self.k_dtype)
        form.addRow("V precision", self.v_dtype)
        layout.addWidget(cache_box)
        policy_box = QGroupBox("Eviction and overflow")
        pform = QVBoxLayout(policy_box)
        row = QFormLayout()
        row.addRow("policy", self.policy)
        pform.addLayout(row)
        pform.addWidget(self.policy_help)
        pform.addWidget(self.params)
        row2 = QFormLayout()
        row2.addRow("when full", self.overflow)
        pform.addLayout(row2)
        layout.addWidget(policy_box)
        layout.addWidget(self.notes)
        layout.addStretch(1)

        self.refresh_policies()
        self.set_config(config or CacheConfig())
        self.mode.currentIndexChanged.connect(self._on_mode)
        self.page_size.valueChanged.connect(self._later)
        self.prefix_reuse.toggled.connect(self._now)
        self.k_dtype.currentIndexChanged.connect(self._now)
        self.v_dtype.currentIndexChanged.connect(self._now)
        self.policy.currentIndexChanged.connect(self._on_policy)
        self.params.edited.connect(self._later)
        self.overflow.currentIndexChanged.connect(self._now)

    def refresh_policies(self) -> None:
        current = self.policy.currentData()
        self._building = True
        self.policy.clear()
        for name in policies.policy_names():
            self.policy.addItem(name, name)
        idx = self.policy.findData(current) if current else 0
        self.policy.setCurrentIndex(max(idx, 0))
        self._building = False

    def set_config(self, cfg: CacheConfig) -> None:
        """Show ``cfg`` without emitting ``changed``."""
        self._building = True
        try:
            self.mode.setCurrentIndex(max(self.mode.findData(cfg.mode), 0))
            self.page_size.setValue(cfg.page_size)
            self.prefix_reuse.setChecked(cfg.prefix_reuse)
            self.k_dtype.setCurrentIndex(max(self.k_dtype.findData(cfg.k_dtype), 0))
            self.v_dtype.setCurrentIndex(max(self.v_dtype.findData(cfg.v_dtype), 0))
            if self.policy.findData(cfg.policy) < 0:
                self.policy.addItem(cfg.policy, cfg.policy)
            self.policy.setCurrentIndex(self.policy.findData(cfg.policy))
            self.params.build(cfg.policy, cfg.policy_params)
            self.policy_help.setText(policies.policy_doc(cfg.policy))
            self.overflow.setCurrentIndex(max(self.overflow.findData(cfg.overflow), 0))
            self._sync_enabled()
        finally:
            self._building = False

    def config(self) -> CacheConfig:
        return CacheConfig(
            mode=self.mode.currentData(),
            page_size=self.page_size.value(),
            prefix_reuse=self.prefix_reuse.isChecked(),
            k_dtype=self.k_dtype.currentData(),
            v_dtype=self.v_dtype.currentData(),
            policy=self.policy.currentData() or "none",
            policy_params=self.params.values(),
            overflow=self.overflow.currentData(),
        )

    def show_notes(self, notes: list[str]) -> None:
        self.notes.setText("\n".join(f"• {n}" for n in notes))

    def _sync_enabled(self) -> None:
        cached = self.mode.currentData() != "off"
        self.page_size.setEnabled(self.mode.currentData() == "paged")
        for w in (self.prefix_reuse, self.k_dtype, self.v_dtype, self.policy, self.params):
            w.setEnabled(cached)

    def _on_mode(self) -> None:
        self._sync_enabled()
        self._now()

    def _on_policy(self) -> None:
        if self._building:
            return
        name = self.policy.currentData() or "none"
        self.params.build(name)
        self.policy_help.setText(policies.policy_doc(name))
        self._now()

    def _later(self) -> None:
        if not self._building:
            self._debounce.start()

    def _now(self) -> None:
        if not self._building:
            self._debounce.stop()
            self._emit()

    def _emit(self) -> None:
        try:
            cfg = self.config()
        except ValueError as exc:
            self.show_notes([str(exc)])
            return
        self.changed.emit(cfg)


