"""Memory over time: weights vs KV cache bytes (and device memory in use on CUDA)."""

from __future__ import annotations

import html
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

from app.ground.format import human_bytes, info_weights_words
from app.panels.base import Panel, StickyRange, decade_ticks, hover_tip, kv_words, legend_row, styled_plot
from engine.snapshot import CacheSnapshot

MIB = 1024.0 * 1024.0
WEIGHTS_COLOUR = "#8a919c"
KV_COLOUR = "#43c59e"
DEVICE_COLOUR = "#ffb347"
IDLE_GAP_S = 1.0  # a longer pause between snapshots is idle time (drawn flat)
HISTORY = 4096  # points kept (ring)
EDGE_DECADES = 0.15  # the y range past its end decades, so their labels fit inside the plot (~8 px at 2 decades)


class SplitBar(QWidget):
    """A horizontal bar split into weights and KV cache, to scale."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.weights = 0
        self.kv = 0
        self.setFixedHeight(18)

    def set_bytes(self, weights: int, kv: int) -> None:
        self.weights, self.kv = int(weights), int(kv)
        self.update()

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt name
        p = QPainter(self)
        r = self.rect().adjusted(0, 1, -1, -1)
        total = max(self.weights + self.kv, 1)
        kv_w = int(round(r.width() * self.kv / total))
        if self.kv and kv_w < 2:
            kv_w = 2
        p.fillRect(r, QColor(WEIGHTS_COLOUR))
        p.fillRect(r.right() - kv_w + 1, r.top(), kv_w, r.height(), QColor(KV_COLOUR))
        p.setPen(QColor("#101216"))
        p.drawText(r.adjusted(6, 0, 0, 0), Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
                   f"weights {human_bytes(self.weights)}")
        p.setPen(QColor("#e8fff7"))
        p.drawText(r.adjusted(0, 0, -6, 0), Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight,
                   f"KV {human_bytes(self.kv)}")
        p.end()


def cache_bytes(snap: CacheSnapshot) -> int:
    """What the chat's cache holds on the device: its KV (and states) and its checkpoints' copies and pages."""
    return snap.kv_bytes + snap.checkpoint_bytes


def memory_caption(snap: CacheSnapshot) -> str:
    """'weights <b>1.0 MiB</b> · KV <b>272 KiB</b> (21.0%) · 1.2 KiB per token · device 3.0 MiB', with ' + 3
    checkpoints <b>12 KiB</b>' on a hybrid or sliding-window model (counted in the share, the bar and the chart)."""
    kv = int(sum(int(b) for b in snap.bytes_per_layer)) if snap.offloaded else snap.kv_bytes
    cps = snap.checkpoint_bytes
    share = (kv + cps) / max(kv + cps + snap.weights_bytes, 1)
    held = int(np.max(snap.tokens_per_layer, initial=0))
    n = len(snap.checkpoints)
    extra = f" + {n} checkpoint{'s' if n != 1 else ''} <b>{human_bytes(cps)}</b>" if cps else ""
    text = (f"weights <b>{human_bytes(snap.weights_bytes)}</b> · {kv_words(snap, bold=True)}{extra} "
            f"({100 * share:.1f}%)")
    slots = int(np.max(snap.pages_used_per_layer, initial=0)) * snap.page_size if snap.page_size else held
    if held and slots:  # bytes per token slot, as the model card counts: over tokens held, the last page's
        # empty slots made it read 1.3 KiB beside the card's 1.2 KiB
        text += f" · {human_bytes(kv / max(slots, held))} per token"
    if snap.device_bytes:
        text += f" · device {human_bytes(snap.device_bytes)}"
    return text


class MemoryPanel(Panel):
    """A weights-vs-KV split bar (to scale), and bytes over time on a log axis: weights (flat line),
    KV cache, device memory in use on CUDA (dashed). Time between replies is drawn flat (nothing changes
    while the chat is idle), and the legend sits under the chart, never over the data."""

    title = "Memory"
    fidelity_requested = Signal()  # "Check fidelity": what the cache setting costs on this chat
    fidelity_stop_requested = Signal()

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.split = SplitBar()
        self._layout.addWidget(self.split)
        self.view = pg.PlotWidget()
        self.plot = styled_plot(self.view.getPlotItem(), left="MiB (log)", bottom="seconds")
        self.plot.setLogMode(y=True)
        self.plot.disableAutoRange()
        self.x_range = StickyRange(lambda top: self.plot.setXRange(0, top, padding=0), minimum=10, grow=1.5)
        self.ranges = [self.x_range]
        self._decades: tuple[int, int] | None = None
        self.x_range.fit(10)
        self.plot.setYRange(-3 - EDGE_DECADES, 1 + EDGE_DECADES, padding=0)
        self.plot.getAxis("left").setTicks(decade_ticks(-3, 1))
        self.caption.setText("Weights and KV cache bytes over time.")
        self.weights = self.plot.plot(pen=pg.mkPen(WEIGHTS_COLOUR, width=1.5))
        self.total = self.plot.plot(pen=pg.mkPen(KV_COLOUR, width=1.5))
        self.device = self.plot.plot(pen=pg.mkPen(DEVICE_COLOUR, width=1, style=Qt.PenStyle.DashLine))
        self._layout.addWidget(self.view, 1)
        self.legend = legend_row([(WEIGHTS_COLOUR, "weights"), (KV_COLOUR, "KV cache"),
                                  (DEVICE_COLOUR, "device memory in use (CUDA only)")])
        self._layout.addWidget(self.legend)
        self._fidelity_row()
        self.t = np.zeros(HISTORY)
        self.kv = np.zeros(HISTORY)
        self.w = np.zeros(HISTORY)
        self.dev = np.zeros(HISTORY)
        self.n = 0
        self._t0: float | None = None
        self._has_device = False
        self.weights_words = ""  # how they are held (``set_model``)
        self.weights_bytes = 0  # the loaded model's (``set_model``): shown while no chat's cache is
        self._tip = hover_tip(self.view, [(self.plot, self.value_at)])

    def _fidelity_row(self) -> None:
        """The button that checks the chat's fidelity under the cache setting, and what the check found."""
        self.fidelity_button = QPushButton("Check fidelity")
        self.fidelity_button.setToolTip(
            "What the cache setting costs on this chat: its tokens read through a full-precision cache that keeps "
            "everything and through your setting; per-token KL divergence, top-1 agreement and perplexity over the "
            "last turn, the worst tokens tinted in the chat. Compare (Ctrl+K) plots every precision × eviction.")
        self.fidelity_button.clicked.connect(self._on_fidelity_button)
        self.fidelity_label = QLabel("")
        self.fidelity_label.setObjectName("legendChip")
        self.fidelity_label.setWordWrap(True)
        self.fidelity_label.setMinimumWidth(1)
        self.fidelity_running = False
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.fidelity_button, 0, Qt.AlignmentFlag.AlignTop)
        row.addWidget(self.fidelity_label, 1)
        self._layout.addLayout(row)

    def _on_fidelity_button(self) -> None:
        (self.fidelity_stop_requested if self.fidelity_running else self.fidelity_requested).emit()

    def set_fidelity(self, text: str, running: bool) -> None:
        """What the fidelity check says (its progress while ``running``, then its result)."""
        self.fidelity_running = running
        self.fidelity_button.setText("Stop check" if running else "Check fidelity")
        self.fidelity_label.setText(text)

    def value_at(self, x: float) -> str:
        """The bytes at the recorded moment nearest to ``x`` seconds."""
        n = self.n
        if not n:
            return ""
        i = int(np.argmin(np.abs(self.t[:n] - x)))
        text = f"{self.t[i]:.1f} s: weights {human_bytes(self.w[i] * MIB)} · KV {human_bytes(self.kv[i] * MIB)}"
        return text + (f" · device {human_bytes(self.dev[i] * MIB)}" if self.dev[i] else "")

    def _append(self, t: float, kv: float, w: float, dev: float) -> None:
        if self.n == HISTORY:  # drop the oldest half
            half = HISTORY // 2
            for a in (self.t, self.kv, self.w, self.dev):
                a[:half] = a[half:]
            self.n = half
        i = self.n
        self.t[i], self.kv[i], self.w[i], self.dev[i] = t, kv, w, dev
        self.n += 1

    def record(self, snap: CacheSnapshot, now: float | None = None) -> None:
        """Add the snapshot's bytes to the series without drawing (the panel is behind another tab, and
        the series must not miss that time)."""
        if snap is self.last_snapshot:
            return
        now = time.monotonic() if now is None else now
        if self._t0 is None:
            self._t0 = now
        t = now - self._t0
        if self.n and t - self.t[self.n - 1] > IDLE_GAP_S:
            # Idle time: the bytes held did not change, so hold the last values until now (a flat line and
            # a step) instead of letting the line slope across the gap.
            j = self.n - 1
            self._append(t - 1e-3, self.kv[j], self.w[j], self.dev[j])
        self._append(t, cache_bytes(snap) / MIB, snap.weights_bytes / MIB, snap.device_bytes / MIB)
        self.last_snapshot = snap

    def show_snapshot(self, snap: CacheSnapshot, now: float | None = None) -> None:
        self.record(snap, now)
        self._draw(snap)
        self._count()

    def _draw(self, snap: CacheSnapshot) -> None:
        n = self.n
        symbol = "o" if n < 3 else None  # one or two points draw no line: show them as dots
        for item in (self.weights, self.total):
            item.setSymbol(symbol)
            item.setSymbolSize(5)
        self.weights.setData(self.t[:n], self.w[:n])
        self.total.setData(self.t[:n], np.maximum(self.kv[:n], 1.0 / 1024))  # log axis: floor at 1 KiB
        self.split.set_bytes(snap.weights_bytes, cache_bytes(snap))
        self.x_range.fit(self.t[n - 1])
        values = np.concatenate([self.w[:n], np.maximum(self.kv[:n], 1.0 / 1024), self.dev[:n][self.dev[:n] > 0]])
        decades = (int(np.floor(np.log10(values.min()))), int(np.ceil(np.log10(values.max() * 1.2))))
        if decades != self._decades:  # y is log10(MiB): whole decades, so the axis rarely changes
            self._decades = decades
            top = max(decades[1], decades[0] + 1)
            # a little past the end decades: their labels are half outside the plot at its very edges, where the
            # axis drops them ("0.1" and "10" went, the axis said only "1")
            self.plot.setYRange(decades[0] - EDGE_DECADES, top + EDGE_DECADES, padding=0)
            self.plot.getAxis("left").setTicks(decade_ticks(decades[0], top))
        self._has_device = self._has_device or bool(snap.device_bytes)
        self.device.setData(self.t[:n], self.dev[:n]) if self._has_device else None
        self.show_caption(snap)

    def show_caption(self, snap: CacheSnapshot) -> None:
        self.caption.setText(memory_caption(snap))

    def reset_view(self) -> None:
        self.x_range.reset()
        self._decades = None
        if self.n and self.last_snapshot is not None:
            self._draw(self.last_snapshot)

    def clear(self) -> None:
        """Another chat (or one with nothing cached yet) is on screen: memory is the process's, so the series
        goes on (a chat switch is a moment on it, not a new chart); the bar shows the weights still loaded."""
        self.last_snapshot = None
        self.split.set_bytes(self.weights_bytes, 0)
        if self.weights_bytes:
            self.caption.setText(f"weights <b>{human_bytes(self.weights_bytes)}</b> ({html.escape(self.weights_words)})"
                                 " · KV <b>0 B</b>: this chat holds no cache yet")
        else:
            self.caption.setText("Weights and KV cache bytes over time.")

    def set_model(self, info) -> None:
        """A model was loaded (``ModelInfo``): a new series, with its weights."""
        self.weights_bytes = int(info.weights_bytes)
        self.weights_words = info_weights_words(info)  # the format as loaded: 'Q4_K_M, 4.85 bits per weight, ...'
        self.caption.setToolTip(f"weights: {self.weights_words}")
        self.x_range.reset()
        self.x_range.fit(10)
        self._decades = None
        self.n = 0
        self._t0 = None
        for item in (self.weights, self.total, self.device):
            item.setData([], [])
        self.clear()

    def series(self) -> dict[str, np.ndarray]:
        n = self.n
        return {"t": self.t[:n].copy(), "kv_mib": self.kv[:n].copy(), "weights_mib": self.w[:n].copy()}
