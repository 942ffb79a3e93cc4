"""The user's own Pareto front: KV bytes per token of this chat (x) against fidelity (y: top-1 agreement with the
full-precision keep-everything cache) for every precision × eviction policy, from a fidelity check's rows.

pyqtgraph items are made once and fed by setters: one scatter of the settings (colour: policy, shape: precision),
one ring on the user's own setting, one line along the front, and a fixed pool of labels for the front's points.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QVBoxLayout, QWidget

from app.panels.base import hover_tip, legend_row, styled_plot
from app.ground.format import human_bytes

LABEL_CHAR_PX = 7  # a label's character, about, at the chart's font: its box, to keep labels apart
LABEL_LINE_PX = 15

POLICY_COLOURS = {"none": "#c3c9d2", "streaming": "#ffb347", "h2o": "#4c9be8", "expected": "#43c59e",
                  "priority": "#b48ead"}
OTHER_COLOUR = "#e06c75"
SYMBOLS = ("o", "s", "t", "d", "p", "h", "star", "t1", "t2", "t3")  # by precision, in the registry's order
FRONT_COLOUR = "#ffd866"
LABELS = 16  # front points named on the chart (the rest on hover)
FOREGROUND_LABEL = "#e6e9ee"


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats (no more bytes and at least the fidelity, one of them strictly),
    by bytes ascending."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -np.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


class FidelityPlot(QWidget):
    """Bytes per token against top-1 agreement; ``set_rows`` redraws from fidelity rows (dicts)."""

    def __init__(self, precisions: tuple[str, ...] = (), parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.precisions = tuple(precisions)
        self.view = pg.PlotWidget()
        self.plot = styled_plot(self.view.getPlotItem(), left="top-1 agreement %", bottom="KV bytes per chat token")
        self.plot.disableAutoRange()
        self.scatter = pg.ScatterPlotItem(size=9, pen=pg.mkPen("#101216", width=0.5))
        self.mine = pg.ScatterPlotItem(size=18, symbol="o", pen=pg.mkPen("#ffffff", width=2),
                                       brush=pg.mkBrush(0, 0, 0, 0))
        self.front_line = pg.PlotCurveItem(pen=pg.mkPen(FRONT_COLOUR, width=1.5))
        for item in (self.front_line, self.scatter, self.mine):
            self.plot.addItem(item)
        self.labels = [pg.TextItem("", color=FOREGROUND_LABEL, anchor=(0, 1)) for _ in range(LABELS)]
        for label in self.labels:
            self.plot.addItem(label)
        self.rows: list[dict[str, Any]] = []
        self.front: list[int] = []
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.view, 1)
        chips = [(c, "keep everything" if p == "none" else p) for p, c in POLICY_COLOURS.items()]
        self.legend = legend_row(chips + [(FRONT_COLOUR, "Pareto front")],
                                 prefix="colour: eviction · shape: precision · ")
        layout.addWidget(self.legend)
        self._tip = hover_tip(self.view, [(self.plot, self.value_at)])
        self.set_rows([])

    def set_rows(self, rows: list[dict[str, Any]], mine: str = "") -> None:
        """The settings measured so far (``FidelityRow.as_dict``; rows with an error and the reference left out);
        ``mine``: the label of the user's own setting (ringed)."""
        self.rows = [r for r in rows if not r.get("error") and r.get("label") != "reference"]
        xs = np.array([r["bytes_per_token"] for r in self.rows], dtype=float)
        ys = np.array([100.0 * r["top1_agreement"] for r in self.rows], dtype=float)
        spots = [{"pos": (x, y), "brush": pg.mkBrush(POLICY_COLOURS.get(r["policy"], OTHER_COLOUR)),
                  "symbol": self._symbol(r)} for x, y, r in zip(xs, ys, self.rows)]
        self.scatter.setData(spots)
        own = [(x, y) for x, y, r in zip(xs, ys, self.rows) if r["label"] == mine]
        self.mine.setData([p[0] for p in own], [p[1] for p in own])
        self.front = pareto_front(list(zip(xs.tolist(), ys.tolist())))
        self.front_line.setData(xs[self.front], ys[self.front]) if self.front else self.front_line.setData([], [])
        self._fit(xs, ys)
        self._name_front(xs, ys)

    def _name_front(self, xs: np.ndarray, ys: np.ndarray) -> None:
        """Labels on the front's points, from the cheapest on, each only where it does not crowd the last one
        named; right of its point, or left of it where it would run off the chart's right edge; none that fits
        neither way."""
        box = self.plot.getViewBox()
        (x0, x1), (y0, y1) = box.viewRange()
        per_px = ((x1 - x0) / max(box.width(), 1.0), (y1 - y0) / max(box.height(), 1.0))
        taken: list[tuple[float, float, float, float]] = []  # the named labels' boxes in data units
        used = 0
        for j in self.front:
            if used == len(self.labels):
                break
            text = self.rows[j]["label"]
            w, h = len(text) * LABEL_CHAR_PX * per_px[0], LABEL_LINE_PX * per_px[1]
            left = xs[j] + w > x1
            rect = (xs[j] - w if left else xs[j], ys[j], xs[j] if left else xs[j] + w, ys[j] + h)
            if rect[0] < x0 or rect[3] > y1:
                continue  # it would run off the chart on either side (it was cut at the right edge)
            if any(rect[0] < b[2] and b[0] < rect[2] and rect[1] < b[3] and b[1] < rect[3] for b in taken):
                continue  # it would overlap a label already there (drawn anyway, labels sat on each other)
            label = self.labels[used]
            label.setText(text)
            label.setAnchor((1, 1) if left else (0, 1))
            label.setPos(xs[j], ys[j])
            label.setVisible(True)
            taken.append(rect)
            used += 1
        for label in self.labels[used:]:
            label.setVisible(False)

    def _symbol(self, row: dict) -> str:
        kind = row.get("k_dtype", "auto")
        i = self.precisions.index(kind) if kind in self.precisions else len(self.precisions)
        return SYMBOLS[i % len(SYMBOLS)]

    def _fit(self, xs: np.ndarray, ys: np.ndarray) -> None:
        if not len(xs):
            self.plot.setXRange(0, 1, padding=0)
            self.plot.setYRange(0, 100, padding=0)
            return
        self.plot.setXRange(0, float(xs.max()) * 1.08, padding=0)
        low = float(ys.min())
        room = max(2.0, (100.0 - low) * 0.15)  # above 100%: the labels of the exact settings
        self.plot.setYRange(max(0.0, low - room), 100.0 + room, padding=0)

    def value_at(self, x: float) -> str:
        """The setting nearest to ``x`` bytes per token: its label, bytes, top-1, KL and perplexity."""
        if not self.rows:
            return ""
        i = int(np.argmin([abs(r["bytes_per_token"] - x) for r in self.rows]))
        r = self.rows[i]
        return html.escape(f"{r['label']}: {human_bytes(r['bytes_per_token'])} held per token · top-1 "
                           f"{100 * r['top1_agreement']:.1f}% "
                           f"· KL {r['mean_kl']:.4f} · perplexity ×{r['perplexity_ratio']:.3f}")

    def points(self) -> list[tuple[float, float, str]]:
        """(bytes per token, top-1 %, label) of every point drawn (for tests: what the user sees)."""
        xs, ys = self.scatter.getData()
        return [(float(x), float(y), r["label"]) for x, y, r in zip(xs, ys, self.rows)]

    def front_labels(self) -> list[str]:
        return [self.rows[i]["label"] for i in self.front]

