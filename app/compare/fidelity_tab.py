"""Compare ▸ Fidelity: every K/V precision × eviction policy measured on this chat (``engine.tools.fidelity``), as
a table and as the user's own Pareto front (``FidelityPlot``). The check is the window's ``FidelityController``'s:
one at a time, a background task of the engine, so the chat and the replies' comparison go on meanwhile."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.compare.fidelity_plot import FidelityPlot
from app.ground.format import human_bytes
from app.link.fidelity_task import LABEL_SUFFIX

COLUMNS = ("setting", "KV held / token", "top-1", "KL", "perplexity", "s")
WORDS_MIN = 110  # px a column of words keeps however narrow the table (about 14 characters a line)
HELD_TIP = ("What the cache held at the end of the check over the chat's tokens, formatted as the model card's 'KV per "
            "token': the page being filled counts whole, so full precision reads a little above the card's figure "
            "(which counts full pages only)")


def row_cells(row: dict[str, Any]) -> list[str]:
    if row.get("error"):
        return [row["label"], "—", "—", "—", "—", "error: " + row["error"]]
    return [row["label"], human_bytes(row["bytes_per_token"]), f"{100 * row['top1_agreement']:.1f}%",
            f"{row['mean_kl']:.4f}", f"×{row['perplexity_ratio']:.3f}", f"{row['seconds']:.1f}"]



class ResultsTable(QTableWidget):
    """A results table that knows its columns of words (``words``: they share the width and wrap)."""

    def __init__(self, columns: tuple[str, ...], words: tuple[int, ...]) -> None:
        super().__init__(0, len(columns))
        self.words = tuple(words)


def results_table(columns: tuple[str, ...], words: tuple[int, ...] = (0,)) -> ResultsTable:
    """A read-only table of one row per setting under ``columns``: Compare's timings and its fidelity rows. The
    columns of words (``words``) share the width the numbers leave and wrap; the numbers fit their contents; no
    column runs off the edge at any width (a long setting's label pushed 'stopped' out of Compare's 900 px)."""
    table = ResultsTable(columns, words)
    table.setHorizontalHeaderLabels([_two_lines(c) for c in columns])
    table.verticalHeader().setVisible(False)
    table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    table.setWordWrap(True)
    table.setTextElideMode(Qt.TextElideMode.ElideNone)
    table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)  # the numbers' widths: ``fit_columns``
    for c in words:
        header.setSectionResizeMode(c, QHeaderView.ResizeMode.Stretch)
    header.setStretchLastSection(False)
    fit_columns(table)
    return table


def fit_columns(table: ResultsTable) -> None:
    """The number columns as wide as their header and cells (a failed row's error, across them, not counted: it
    wraps), the table never narrower than those and ``WORDS_MIN`` px per column of words."""
    fm, pad = table.fontMetrics(), 2 * table.style().pixelMetric(table.style().PixelMetric.PM_HeaderMargin) + 12
    fixed = 0
    for c in range(table.columnCount()):
        if c in table.words:
            continue
        head = table.horizontalHeaderItem(c).text().split("\n")
        cells = [table.item(r, c).text() for r in range(table.rowCount())
                 if table.item(r, c) is not None and table.columnSpan(r, c) == 1]
        width = max(fm.horizontalAdvance(t) for t in head + cells) + pad
        table.setColumnWidth(c, width)
        fixed += width
    table.setMinimumWidth(fixed + WORDS_MIN * len(table.words) + 2 * table.frameWidth()
                          + table.verticalScrollBar().sizeHint().width())


def _two_lines(label: str) -> str:
    """A header label over 12 characters on two lines (a header does not wrap by itself: it was cut)."""
    if len(label) <= 12 or " " not in label:
        return label
    words = label.split(" ")
    cut = min(range(1, len(words)), key=lambda i: abs(len(" ".join(words[:i])) - len(label) / 2))
    return " ".join(words[:cut]) + "\n" + " ".join(words[cut:])


def put_row(table: QTableWidget, r: int, cells: list[str], error: bool) -> None:
    """Row ``r``'s cells, numbers to the right; a row that failed has its error across the columns after its label
    (in one narrow column it was cut)."""
    if error:
        cells = [cells[0], cells[-1]]
        table.setSpan(r, 1, 1, table.columnCount() - 1)
    for c, text in enumerate(cells):
        item = QTableWidgetItem(text)
        if c and not error:
            item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        table.setItem(r, c, item)
    fit_columns(table)


class FidelityTab(QWidget):
    """The button that measures every setting, its progress, the Pareto plot and the rows."""

    def __init__(self, controller, precisions: tuple[str, ...] = (), parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        intro = QLabel(
            "What each setting costs on this chat: its tokens are read through a full-precision cache that keeps "
            "everything and through every KV precision × eviction policy (policies keep half the chat), and each "
            "is scored over the last turn — top-1 agreement (the same most likely next token) and KL divergence per "
            "token — against the KV bytes it holds per token of the chat. The line joins the settings no other "
            "beats (the Pareto front); your own setting is ringed.")
        intro.setWordWrap(True)
        self.run_button = QPushButton("Measure every precision × policy")
        self.run_button.clicked.connect(self.run)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        self.plot = FidelityPlot(precisions)
        self.table = results_table(COLUMNS)
        self.table.horizontalHeaderItem(1).setToolTip(HELD_TIP)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.plot)
        split.addWidget(self.table)
        split.setSizes([480, 400])
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addLayout(buttons)
        layout.addWidget(split, 1)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        if controller is None:
            self.run_button.setEnabled(False)
            self.status.setText("Fidelity checks run from the main window.")
            return
        controller.rows_changed.connect(self.show_rows)
        controller.progress_changed.connect(self._on_progress)
        controller.finished.connect(self._on_finished)
        if controller.report and controller.report.get("grid"):  # the last grid measured: shown until a new one
            report = controller.report
            self.show_rows([report["reference"], report["setting"], *report["grid"]])
            self.status.setText(f"Measured earlier on this chat in {report['seconds']:.0f} s.")

    def run(self) -> None:
        self.show_rows([])
        if self.controller.check(grid=True):
            self.run_button.setEnabled(False)
            self.stop_button.setEnabled(True)
            self.progress.setValue(0)
            self.status.setText("Running: the reference first…")
        else:
            self.status.setText(self.controller.w.memory.fidelity_label.text())

    def stop(self) -> None:
        self.controller.cancel()

    def show_rows(self, rows: list) -> None:
        rows = [r for r in rows if r]
        mine = next((r["label"] for r in rows if r.get("label", "").endswith(LABEL_SUFFIX)), "")
        self.plot.set_rows(rows, mine)
        shown = [r for r in rows if r.get("label") != "reference"]
        self.table.setRowCount(len(shown))
        self.table.clearSpans()
        for i, row in enumerate(shown):
            put_row(self.table, i, row_cells(row), bool(row.get("error")))

    def _on_progress(self, progress: tuple) -> None:
        fraction, left, doing = progress
        self.progress.setValue(int(fraction * 1000))
        eta = f" · about {max(1, round(left))} s left" if left is not None else ""
        self.status.setText(f"Running: {doing} · {100 * fraction:.0f}%{eta}")

    def _on_finished(self, reason: str, report: Any) -> None:
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        n = len(self.controller.rows)
        if reason == "done":
            self.progress.setValue(1000)
            secs = report.get("seconds", 0.0) if report else 0.0
            self.status.setText(f"Done: {max(0, n - 1)} settings on {report['scored_tokens'] if report else 0} tokens "
                                f"of the last turn in {secs:.1f} s.")
        elif reason == "cancelled":
            self.status.setText(f"Stopped after {max(0, n - 1)} settings.")
        else:
            self.status.setText(f"Could not measure: {reason}")

    def disconnect_all(self) -> None:
        if self.controller is None:
            return
        for signal, slot in ((self.controller.rows_changed, self.show_rows),
                             (self.controller.progress_changed, self._on_progress),
                             (self.controller.finished, self._on_finished)):
            try:
                signal.disconnect(slot)
            except (RuntimeError, TypeError):
                pass
