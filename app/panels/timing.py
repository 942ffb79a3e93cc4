"""Per-token timing of the current reply: prefill (TTFT) apart from decode, per-token latency, rolling
tok/s, and the previous reply overlaid, so cache off (latency grows with position: O(n²) for the reply)
is visibly different from cache on (flat: O(n))."""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import QLabel

from app.panels.base import Panel, StickyRange, hover_tip, styled_plot
from app.panels.token_series import ROLLING, TokenSeries, p98, saved_text, series_speed, step_text
from engine.snapshot import TokenEvent

LATENCY_LABEL = "ms / token"  # the latency chart's side ("ms" on a chart shorter than these words)
NARROW_PX = 340  # a panel narrower than this gives the prefill bars' room to the curves (the caption says the TTFT)
KEPT_REPLIES = 4  # replies whose tokens are kept for ``show_reply`` (their chats may be off screen)
CURRENT = "#4c9be8"
PREVIOUS = "#8a919c"
PREFILL = "#ffb347"


class TimingPanel(Panel):
    """Left: prefill time (this reply and the previous). Right: decode latency per token and rolling
    tok/s, with the previous reply dashed. Fed by ``add_token`` (cheap) and drawn by ``refresh``."""

    title = "Token timing"

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.prefill_plot = styled_plot(self.view.addPlot(row=0, col=0, rowspan=2), left="prefill ms")
        self.prefill_plot.setFixedWidth(136)
        self.prefill_plot.getAxis("bottom").setTicks([[(0, "prev"), (1, "now")]])
        self.prefill_plot.setXRange(-0.7, 1.7, padding=0)
        self.prefill_bars = pg.BarGraphItem(x=[0, 1], height=[0, 0], width=0.7, brushes=[PREVIOUS, PREFILL], pen=None)
        self.prefill_plot.addItem(self.prefill_bars)
        self.ttft_text = pg.TextItem("", color=PREFILL, anchor=(0.5, 1.0))
        self.prefill_plot.addItem(self.ttft_text)

        self.latency_plot = styled_plot(self.view.addPlot(row=0, col=1), left=LATENCY_LABEL)
        self.prev_latency = self.latency_plot.plot(pen=pg.mkPen(PREVIOUS, width=1, style=Qt.PenStyle.DashLine))
        self.latency = self.latency_plot.plot(pen=pg.mkPen(CURRENT, width=1.5))
        self.latency_label = LATENCY_LABEL
        self.latency_plot.geometryChanged.connect(self._fit_latency_label)
        self.tps_plot = styled_plot(self.view.addPlot(row=1, col=1), left="tok/s", bottom="token in reply")
        self.tps_plot.setXLink(self.latency_plot)
        self.prev_tps = self.tps_plot.plot(pen=pg.mkPen(PREVIOUS, width=1, style=Qt.PenStyle.DashLine))
        self.tps = self.tps_plot.plot(pen=pg.mkPen("#43c59e", width=1.5))
        for plot in (self.latency_plot, self.tps_plot):
            plot.setClipToView(True)
            plot.setDownsampling(auto=True, mode="peak")
            plot.disableAutoRange()
        # Ranges grow in steps (x is linked: the tok/s plot follows the latency plot).
        self.x_range = StickyRange(lambda top: self.latency_plot.setXRange(0, top, padding=0), minimum=32, grow=1.5)
        self.y_latency = StickyRange(lambda top: self.latency_plot.setYRange(0, top, padding=0), minimum=1, grow=1.3)
        self.y_tps = StickyRange(lambda top: self.tps_plot.setYRange(0, top, padding=0), minimum=1, grow=1.3)
        self.y_prefill = StickyRange(lambda top: self.prefill_plot.setYRange(0, top, padding=0), minimum=1, grow=1.3)
        self.ranges = [self.x_range, self.y_latency, self.y_tps, self.y_prefill]
        for rng, start in zip(self.ranges, (32, 1, 1, 1)):
            rng.fit(start)
        self.caption.setText("Per-token latency of each reply; the previous reply is dashed.")
        self._layout.addWidget(self.view, 1)
        self.spec_line = QLabel("")  # speculative decoding's yield, shown only for a reply that speculated
        self.spec_line.setObjectName("hoverLine")
        self.spec_line.setWordWrap(True)
        self.spec_line.setVisible(False)
        self._layout.addWidget(self.spec_line)

        self._tip = hover_tip(self.view, [(self.latency_plot, self.value_at), (self.tps_plot, self.value_at),
                                          (self.prefill_plot, self.prefill_at)])
        self.current = TokenSeries()
        self.previous: TokenSeries | None = None
        self._dirty = False
        self._generation_id = 0
        self._replies: dict[int, tuple[TokenSeries, TokenSeries | None]] = {}  # the last replies begun, any chat's
        self._idle = ""  # the caption before any reply ("": the local one, with the compiled decode step)
        self._prev_drawn: TokenSeries | None = None  # the previous reply never changes: drawn once
        self._prev_top = (0.0, 0.0)  # its 98th-percentile latency and tok/s
        self._fast = ""  # the model's compiled decode step in words (CacheSnapshot.fast_step)
        self._saved = ""  # the chat's last reply as saved (an earlier run's: no token times to draw)
        self._accounts: dict[int, tuple[int, int]] = {}  # generation id → (prompt tokens computed, prompt tokens)
        self.narrow = False  # the prefill chart is left out (``resizeEvent``)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        narrow = 0 < event.size().width() < NARROW_PX
        if narrow != self.narrow:  # at 1024×768 the curves were left ~50 px beside the bars, their labels cut
            self.narrow = narrow
            if narrow:
                self.view.ci.removeItem(self.prefill_plot)
            else:
                self.view.ci.addItem(self.prefill_plot, row=0, col=0, rowspan=2)
            self.prefill_plot.setVisible(not narrow)

    def _fit_latency_label(self) -> None:
        """'ms / token' up the latency chart's side, or 'ms' where the chart is shorter than those words (1280×720
        with a six-line caption: ~45 px, drawn as 'ms / toker')."""
        axis = self.latency_plot.getAxis("left")
        needed = QFontMetrics(axis.label.font()).horizontalAdvance(LATENCY_LABEL) + 6
        label = LATENCY_LABEL if self.latency_plot.getViewBox().height() >= needed else "ms"
        if label != self.latency_label:
            self.latency_label = label
            self.latency_plot.setLabel("left", label)

    # data in ------------------------------------------------------------------------------------------
    def watch(self, screen) -> None:
        """Follow the screen's record (``app.ground.screen.Screen``): the reply it shows for the chat on screen — one
        beginning, one running (its label follows cache switches), one finished with the figures saved with it, or
        the chat's last reply from an earlier run (its saved figures only: its tokens' times were not kept)."""
        screen.connect("reply", self._on_reply)
        screen.connect("account", self._on_account)

    def _on_account(self, account: dict | None) -> None:
        """The prompt's cache account of the reply shown: its caption counts the prompt tokens it computed (every
        chunk; the first token's event counts only the last chunk's: it said "(1 prompt tokens)" of 20)."""
        if account and account.get("prompt"):
            self._accounts[int(account.get("generation_id") or 0)] = (int(account.get("recomputed", 0)),
                                                                     int(account["prompt"]))
            while len(self._accounts) > KEPT_REPLIES * 2:
                self._accounts.pop(next(iter(self._accounts)))
            self._dirty = True

    def _on_reply(self, view) -> None:
        gen = view.generation_id
        if view.running:
            if gen not in self._replies:
                self.begin_reply(gen, view.label)
                return
            self.show_reply(gen)
            if view.label and self.current.label != view.label:
                self.current.label, self._dirty = view.label, True
                self.refresh()
            return
        stats = view.stats or {}
        if gen in self._replies:
            self.show_reply(gen)
            self.finish_reply(gen, float(stats.get("ttft_ms") or 0.0), float(stats.get("decode_tokens_per_s") or 0.0))
            return
        self.clear()
        self._saved = saved_text(stats)
        self._dirty = True
        self.refresh()

    def begin_reply(self, generation_id: int, label: str) -> None:
        """A new reply starts: the current one becomes the dashed 'previous'. Its tokens are counted from now on,
        also while its chat is off screen (``show_reply`` brings the whole reply back)."""
        self._saved = ""
        if self.current.n or self.current.prefill_ms:
            self.previous = self.current
        self.current = TokenSeries()
        self.current.label = label
        self._generation_id = generation_id
        self._replies[generation_id] = (self.current, self.previous)
        while len(self._replies) > KEPT_REPLIES:
            self._replies.pop(next(iter(self._replies)))
        self._dirty = True

    def add_token(self, event: TokenEvent) -> None:
        """A token of any reply begun here (another chat's is counted, not drawn)."""
        kept = self._replies.get(event.generation_id)
        if kept is None and self._generation_id:
            return
        series = kept[0] if kept is not None else self.current
        series.add(event)
        self._dirty = self._dirty or series is self.current

    def show_reply(self, generation_id: int) -> None:
        """The chat of reply ``generation_id`` is on screen again: its whole reply so far, and the one before."""
        kept = self._replies.get(generation_id)
        if kept is not None:
            self._saved = ""
            self.current, self.previous = kept
            self._generation_id = generation_id
            self._dirty = True
            self.refresh()

    def finish_reply(self, generation_id: int, ttft_ms: float, speed: float) -> None:
        """The reply's final stats (the ones saved with it and shown in the status bar)."""
        kept = self._replies.get(generation_id)
        if kept is not None:
            series = kept[0]
            series.ttft_ms, series.speed, series.final = ttft_ms or series.ttft_ms, speed or series.speed, True
            if series is self.current:  # now, with the status bar's speed (not at the panel's next turn)
                self._dirty = True
                self.refresh()

    def _take(self, snapshot) -> None:
        """The engine's own prefill time, TTFT and decode speed for the reply (a prompt read in chunks: every chunk,
        where the first token's event times only the last; waits before the first forward are in neither)."""
        self.set_fast_step(getattr(snapshot, "fast_step", ""), redraw=False)
        cur = self.current
        if snapshot.generation_id != self._generation_id or cur.final:
            return
        if snapshot.ttft_ms > 0 and cur.prefill_tokens:
            if (snapshot.prefill_ms, snapshot.ttft_ms) != (cur.prefill_ms, cur.ttft_ms):
                cur.prefill_ms, cur.ttft_ms, self._dirty = snapshot.prefill_ms, snapshot.ttft_ms, True
        speed = getattr(snapshot, "decode_tokens_per_s", 0.0)
        if speed and speed != cur.speed:
            cur.speed, self._dirty = speed, True
        policy = (getattr(snapshot, "policy_prefill_ms", 0.0), getattr(snapshot, "policy_decode_ms", 0.0))
        if policy != (cur.policy_prefill_ms, cur.policy_decode_ms):
            cur.policy_prefill_ms, cur.policy_decode_ms = policy
            self._dirty = True

    def show_caption(self, snapshot) -> None:
        self._take(snapshot)
        self.caption.setText(self.caption_text())

    def show_snapshot(self, snapshot) -> None:
        self._take(snapshot)
        self.refresh()

    def set_idle_text(self, text: str) -> None:
        """The caption before any reply ("": the local one, which names the compiled decode step)."""
        self._idle, self._dirty = text, True
        self.refresh()

    def set_fast_step(self, text: str, redraw: bool = True) -> None:
        """The model's compiled decode step in words (a snapshot's ``fast_step``, or the worker after the
        setting changed): in the caption's tooltip, and in the caption itself before any reply."""
        if text != self._fast:
            self._fast, self._dirty = text, True
            self.caption.setToolTip(f"Compiled decode step: {text}" if text else "")
            if redraw:
                self.refresh()

    # hover values -------------------------------------------------------------------------------------
    def value_at(self, x: float) -> str:
        """The latency and tok/s charts' values at token ``x`` (rounded), this reply's and the previous one's."""
        i = int(round(x))
        parts = []
        for name, series in (("this reply", self.current), ("previous", self.previous)):
            if series is not None and 1 <= i <= series.n:
                tps = series.rolling_tps()[i - 1]
                parts.append(f"{name}: {series.decode_ms[i - 1]:.1f} ms, {tps:.1f} tok/s (last {ROLLING})")
        return f"token {i} · " + " · ".join(parts) if parts else ""

    def prefill_at(self, x: float) -> str:
        """The prefill chart's bar at ``x`` (0: the previous reply, 1: this one)."""
        series = {0: self.previous, 1: self.current}.get(int(round(x)))
        if series is None or not series.prefill_ms:
            return ""
        which = "this reply" if series is self.current else "previous reply"
        ttft = f", TTFT {series.ttft_ms:.0f} ms" if series.ttft_ms else ""
        return f"{which}: prefill {series.prefill_ms:.1f} ms for {series.prefill_tokens} prompt tokens{ttft}"

    # drawing ------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        cur, prev = self.current, self.previous
        x, cur_tps = cur.x(), cur.rolling_tps()
        self.latency.setData(x, cur.decode_ms)
        self.tps.setData(x, cur_tps)
        if prev is not self._prev_drawn:
            self._prev_drawn = prev
            if prev is not None:
                prev_tps = prev.rolling_tps()
                self.prev_latency.setData(prev.x(), prev.decode_ms)
                self.prev_tps.setData(prev.x(), prev_tps)
                self._prev_top = (p98(prev.decode_ms), p98(prev_tps))
            else:
                self.prev_latency.setData([], [])
                self.prev_tps.setData([], [])
                self._prev_top = (0.0, 0.0)
        prev_prefill = prev.prefill_ms if prev is not None else 0.0
        self.prefill_bars.setOpts(x=[0, 1], height=[prev_prefill, cur.prefill_ms])
        spec = cur.spec_text()
        self.spec_line.setText(spec)
        self.spec_line.setVisible(bool(spec))
        self.spec_line.setToolTip("\n".join(f"draft position {i + 1}: {a} of {t} kept" for i, (a, t) in
                                            enumerate(zip(cur.accepted, cur.tried))))
        self.ttft_text.setText(f"{cur.prefill_ms:.0f} ms" if cur.prefill_ms else "")
        self.ttft_text.setPos(1, cur.prefill_ms)
        self.y_prefill.fit(max(prev_prefill, cur.prefill_ms))
        decode = cur.decode_ms
        n_max = max(cur.n, prev.n if prev is not None else 0)
        self.x_range.fit(n_max + 1)
        # the 98th percentile, so one slow outlier token does not flatten the curve
        self.y_latency.fit(max(p98(decode), self._prev_top[0]) * 1.05)
        self.y_tps.fit(max(p98(cur_tps), self._prev_top[1]) * 1.05)
        self.caption.setText(self.caption_text())
        self._count()

    def caption_text(self) -> str:
        """The caption of the reply shown: its TTFT and decode speed as the engine gave them (the status bar's
        figures), from the tokens' own times until it did."""
        cur, prev = self.current, self.previous
        if not cur.n and not cur.prefill_ms and prev is None:
            if self._saved:
                return self._saved
            fast = f" Compiled decode step: {html.escape(self._fast)}." if self._fast else ""
            return self._idle or "Per-token latency of each reply; the previous reply is dashed." + fast
        computed, prompt = self._accounts.get(self._generation_id, (cur.prefill_tokens, cur.prefill_tokens))
        text = (f"<b>{cur.label or 'reply'}</b> · {step_text(cur.paths, cur.n)} · TTFT "
                f"{cur.ttft_ms or cur.prefill_ms:.0f} ms ({computed:,} of {prompt:,} prompt tokens computed) · "
                f"{cur.n} decode tokens at <b>{series_speed(cur):.1f} tok/s</b>")
        per_token = cur.policy_decode_ms / max(1, cur.n)
        # what the eviction policy's scoring costs (H2O, expected); StreamingLLM's bookkeeping (under 0.005 ms a token)
        # read "eviction scoring 0.00 ms a token, 0 ms in the prefill": a figure that rounds to nothing is not said
        if round(per_token, 2) or round(cur.policy_prefill_ms):
            text += f" · eviction scoring {per_token:.2f} ms a token, {cur.policy_prefill_ms:.0f} ms in the prefill"
        if prev is not None and prev.n:
            text += (f" · <span style='color:{PREVIOUS}'>previous ({prev.label}): {series_speed(prev):.1f} "
                     "tok/s</span>")
        return text

    def reset_view(self) -> None:
        for rng in self.ranges:
            rng.reset()
        self._dirty = True
        self.refresh()

    def clear(self) -> None:
        for rng in self.ranges:
            rng.reset()
        self._saved = ""
        self.current = TokenSeries()
        self.previous = None
        self._dirty = True
        self.refresh()

    def curves(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Plotted (x, y) per curve (for tests)."""
        out = {}
        for name, item in (("latency", self.latency), ("tps", self.tps),
                           ("prev_latency", self.prev_latency), ("prev_tps", self.prev_tps)):
            x, y = item.getData()
            out[name] = (np.asarray(x if x is not None else []), np.asarray(y if y is not None else []))
        return out
