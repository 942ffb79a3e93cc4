"""Tools ▸ Compare cache settings: the chat's next reply generated once per cache setting, side by side.

Rows arrive from the worker one by one (``EngineWorker.compared``, plain dicts, tagged with the
comparison's id); the chat's own sessions and caches are not touched, and the worker runs the comparison
one step at a time next to the chat's reply, so the dialog is not modal: the chat goes on meanwhile.
"""

from __future__ import annotations

import itertools
from typing import Any

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QLabel,
    QProgressBar,
    QPushButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.compare.fidelity_tab import FidelityTab, put_row, results_table
from app.ground.format import human_bytes

_ids = itertools.count(1)  # comparison ids: rows of an earlier, replaced comparison never land here
COLUMNS = ("cache setting", "TTFT ms", "decode tok/s", "KV held", "tokens as in the reference", "stopped")


def eta_text(seconds: float) -> str:
    """'45 s', '3 min', '1 h 20 min'."""
    if seconds < 60:
        return f"{max(1, round(seconds))} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{int(seconds // 3600)} h {round(seconds % 3600 / 60)} min"


def same_words(same: int, generated: int, reference: int) -> str:
    """How a row's reply starts as the reference's: 'all 120 (identical)', 'the first 63 of 263, then it differs'
    ('63/263' read as 63 of 263 matching anywhere)."""
    if same == generated == reference:
        return f"all {same} (identical)"
    if same == generated:
        return f"all {same}, then it stopped (the reference wrote {reference})"
    if same == reference:
        return f"all the reference's {same}, then {generated - same} more"
    return f"the first {same} of {generated}, then it differs"


def row_cells(row: dict[str, Any], reference_tokens: int) -> list[str]:
    """The table cells of one comparison row."""
    if row.get("error"):
        return [row["label"], "—", "—", "—", "—", "error: " + row["error"]]
    same = same_words(row["same_tokens"], row["generated_tokens"], reference_tokens)
    decode = f"{row['decode_tokens_per_s']:.1f}"
    if row.get("speculative"):  # a speculative row: how many tokens each forward gave
        decode += f" ({row.get('tokens_per_forward', 1.0):.1f} per forward)"
    return [row["label"], f"{row['ttft_ms']:.0f}", decode, human_bytes(row["kv_bytes"]),
            same, row["stop_reason"].replace("_", " ")]


class CompareDialog(QDialog):
    """Shows rows as they arrive; Stop cancels the comparison (the rows so far stay). Not modal."""

    def __init__(self, engine, messages: list[dict], sampling, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Compare cache settings on this chat")
        self.resize(900, 520)
        self.engine = engine
        self.comparison_id = next(_ids)
        self.rows: list[dict[str, Any]] = []
        self.finished_reason = ""
        intro = QLabel(
            f"The reply to this chat ({len(messages)} message{'s' if len(messages) != 1 else ''}), generated "
            "once per cache setting with greedy "
            f"sampling and up to {sampling.max_new_tokens} new tokens, each in a fresh session (so each pays its "
            "own prefill). Every setting is warmed up first with a one-token reply, so every row is timed the "
            "same way. The first row is the reference: lossless settings give identical tokens; lossy ones "
            "show where they diverge. Cache off runs last: it recomputes the whole chat for every token. Your chat "
            "and its cache are not changed, and you can go on chatting meanwhile (the timings then share the "
            "machine with your chat).")
        intro.setWordWrap(True)
        self.table = results_table(COLUMNS, words=(0, 4, 5))
        self.status = QLabel("Running…")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        buttons = QDialogButtonBox()
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        buttons.addButton(self.stop_button, QDialogButtonBox.ButtonRole.ActionRole)
        self.copy_button = QPushButton("Copy as Markdown")
        self.copy_button.setToolTip("Copy the table (a Markdown table) to paste into a chat, a note or a report")
        self.copy_button.clicked.connect(self.copy_markdown)
        buttons.addButton(self.copy_button, QDialogButtonBox.ButtonRole.ActionRole)
        close = buttons.addButton(QDialogButtonBox.StandardButton.Close)
        close.clicked.connect(self.close)
        replies = QWidget()
        inner = QVBoxLayout(replies)
        inner.addWidget(intro)
        inner.addWidget(self.table, 1)
        inner.addWidget(self.progress)
        inner.addWidget(self.status)
        self.fidelity = FidelityTab(getattr(parent, "fidelity", None), _precisions())
        self.tabs = QTabWidget()
        self.tabs.addTab(replies, "Replies")
        self.tabs.addTab(self.fidelity, "Fidelity: bytes against quality")
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(buttons)
        engine.worker.compared.connect(self._on_row)
        engine.worker.compare_progress.connect(self._on_progress)
        engine.worker.compare_finished.connect(self._on_finished)
        engine.compare(self.comparison_id, messages, sampling)

    @property
    def running(self) -> bool:
        return not self.finished_reason

    def _on_row(self, comparison_id: int, row: dict[str, Any]) -> None:
        if comparison_id != self.comparison_id:
            return
        self.rows.append(row)
        reference = self.rows[0].get("generated_tokens", 0)
        r = self.table.rowCount()
        self.table.insertRow(r)
        put_row(self.table, r, row_cells(row, reference), bool(row.get("error")))

    def _on_progress(self, comparison_id: int, progress: tuple) -> None:
        """Progress bar and words: what runs now, how far, and about how long is left."""
        if comparison_id != self.comparison_id or self.finished_reason:
            return
        fraction, left, doing = progress
        self.progress.setValue(int(fraction * 1000))
        eta = f" · about {eta_text(left)} left" if left is not None else ""
        self.status.setText(f"Running: {doing} · {100 * fraction:.0f}%{eta}")

    def _on_finished(self, comparison_id: int, reason: str) -> None:
        if comparison_id != self.comparison_id:
            return
        self.finished_reason = reason
        self.stop_button.setEnabled(False)
        self.progress.setValue(1000 if reason == "done" else self.progress.value())
        if reason == "done":
            self.status.setText(f"Done: {len(self.rows)} settings.")
        elif reason == "cancelled":
            self.status.setText(f"Stopped after {len(self.rows)} settings.")
        else:
            self.status.setText(f"Could not compare: {reason}")
        self._disconnect()

    def stop(self) -> None:
        self.engine.cancel_compare(self.comparison_id)

    def markdown(self) -> str:
        """The table so far as a Markdown table."""
        reference = self.rows[0].get("generated_tokens", 0) if self.rows else 0
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(row_cells(r, reference)) + " |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def copy_markdown(self) -> None:
        QGuiApplication.clipboard().setText(self.markdown())
        self.copy_button.setText("Copied ✓")

    def _disconnect(self) -> None:
        for signal, slot in ((self.engine.worker.compared, self._on_row),
                             (self.engine.worker.compare_progress, self._on_progress),
                             (self.engine.worker.compare_finished, self._on_finished)):
            try:
                signal.disconnect(slot)
            except (RuntimeError, TypeError):
                pass

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt name
        self.fidelity.disconnect_all()  # a check it started goes on: its result is the Memory panel's
        if not self.finished_reason:
            self.engine.cancel_compare(self.comparison_id)  # rows that would still come have nowhere to go
            self.finished_reason = "cancelled"
            self._disconnect()
        super().closeEvent(event)


def _precisions() -> tuple[str, ...]:
    """The K/V precisions the engine offers, in its order (the plot's shapes)."""
    from engine.config import KV_DTYPES

    return tuple(KV_DTYPES)


def open_compare(parent: QWidget, engine, running: "CompareDialog | None", ready: bool, messages: list[dict],
                 sampling, show_error) -> "CompareDialog | None":
    """Tools ▸ Compare: the running comparison's dialog (raised), or a new one for the chat's last user
    message; None with a message (``show_error``) when there is nothing to compare yet."""
    if running is not None and running.running:
        running.raise_()
        running.activateWindow()
        return running
    if not ready:
        show_error("Load a model first.")
        return None
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if last_user < 0:
        show_error("Send a message first: the comparison regenerates the reply to it.")
        return None
    try:
        cfg = sampling()
    except ValueError as exc:
        show_error(str(exc))
        return None
    dialog = CompareDialog(engine, messages[:last_user + 1], cfg, parent)
    dialog.show()
    return dialog
