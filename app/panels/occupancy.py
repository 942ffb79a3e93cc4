"""Per-layer cache occupancy: one stacked bar per layer (full precision, quantized, pinned) with the cache's
capacity drawn as a line. The bars are what each layer holds, so they never rise above the capacity; what
was evicted is counted in the caption (the same count as the red cells of the page map's token strip)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from app.ground.status_bar import evicted_counts
from app.panels.base import Panel, StickyRange, hover_tip, kv_words, legend_row, styled_plot
from engine.snapshot import TOKEN_NOT_CACHED, TOKEN_PARTIAL, TOKEN_PINNED, TOKEN_QUANTIZED, CacheSnapshot

# (name, colour) bottom to top
SEGMENTS = (
    ("full", "#4c9be8"),
    ("window", "#43c5c9"),  # a sliding-window layer's tokens (it keeps only its window)
    ("quantized", "#a470ff"),
    ("pinned", "#ffd84a"),
    ("state", "#8a919c"),
)


def occupancy_stack(snap: CacheSnapshot) -> dict[str, np.ndarray]:
    """Token counts per layer and segment, ``[L]`` each.

    ``tokens_per_layer`` is what each layer holds; the segments add up to it. Pinned and quantized counts
    come from the token strip (shared by all layers) and are clipped to what a layer holds.
    """
    held = np.asarray(snap.tokens_per_layer, dtype=np.int64)
    states = np.asarray(snap.token_state)
    n_pinned = int(np.count_nonzero(states == TOKEN_PINNED))
    n_quant = int(np.count_nonzero(states == TOKEN_QUANTIZED))
    pinned = np.minimum(held, n_pinned)
    quantized = np.minimum(held - pinned, n_quant)
    full = held - pinned - quantized
    sliding = np.array([k.startswith("sliding") for k in snap.layer_kinds], dtype=bool) \
        if len(snap.layer_kinds) == len(held) else np.zeros(len(held), dtype=bool)
    window = np.where(sliding, full, 0)
    return {"full": full - window, "window": window, "quantized": quantized, "pinned": pinned,
            "state": state_tokens(snap)}


def state_tokens(snap: CacheSnapshot) -> np.ndarray:
    """The fixed state of recurrent / conv layers, drawn in tokens' worth of KV (its bytes over what one
    token costs a KV layer of this snapshot), so it stands as a constant bar beside the growing ones."""
    kinds = snap.layer_kinds
    out = np.zeros(len(snap.tokens_per_layer), dtype=np.int64)
    if not kinds or not any("state" in k for k in kinds):
        return out
    held = np.asarray(snap.tokens_per_layer, dtype=np.int64)
    per_layer = np.asarray(snap.bytes_per_layer, dtype=np.int64)
    kv = [i for i, k in enumerate(kinds) if k in ("full", "sliding") and held[i] > 0]
    if not kv:
        return out
    per_token = max(1, int(per_layer[kv[0]] // held[kv[0]]))
    floor = max(1, int(held.max()) // 50)  # a state smaller than 2% of the tallest bar is drawn that tall: seen
    for i, k in enumerate(kinds):
        if k == "state":
            out[i] = max(per_layer[i] // per_token, floor)
    return out


EMPTY_CAPTION = "Tokens each layer holds, by state. Waiting for the model…"


def occupancy_caption(snap: CacheSnapshot, stack: dict[str, np.ndarray]) -> str:
    """'paged · 275 tokens cached (+1 just generated) · room for 2048 per layer · KV 272 KiB · ...'."""
    held = int(np.max(snap.tokens_per_layer, initial=0))
    layers = max(len(snap.tokens_per_layer), 1)
    states = np.asarray(snap.token_state)
    partial = int(np.count_nonzero(states == TOKEN_PARTIAL))  # a per-head eviction: held by some heads only
    waiting = snap.seq_len - held - snap.evicted_total if not partial else int(np.count_nonzero(
        states == TOKEN_NOT_CACHED))
    evicted, everywhere = evicted_counts(snap) if not partial else (snap.evicted_total, snap.evicted_total)
    if evicted != everywhere:  # each layer evicted its own tokens: the just-generated one is told apart as ever
        waiting = int(np.count_nonzero(states == TOKEN_NOT_CACHED))
    text = f"<b>{snap.mode}</b> · {held} tokens cached"
    if waiting == 1:  # the token just generated is fed (and cached) by the next step: not a lost token
        text += " (+1 just generated)"
    text += f" · room for {snap.capacity_tokens} per layer · {kv_words(snap)}"
    total_q = int(stack["quantized"].sum())
    if total_q:
        text += f" · {total_q // layers} quantized per layer"
    if evicted:  # the status bar's "dropped" (the fullest layer's); those no layer holds apart, where fewer
        text += f" · {evicted} evicted" + (f" ({everywhere} from every layer)" if everywhere != evicted else "")
    if partial:
        text += f" · {partial} kept by some heads only"
    kinds = snap.layer_kinds
    if any(k.startswith("sliding") for k in kinds):
        text += f" · {sum(k.startswith('sliding') for k in kinds)} sliding layers keep only their window (teal)"
    states_n = sum(k == "state" for k in kinds)
    if states_n:
        text += f" · {states_n} {'layer holds' if states_n == 1 else 'layers hold'} a fixed state (grey)"
    both = sum(k.endswith("+state") for k in kinds)
    if both:
        text += f" · {both} {'layer keeps' if both == 1 else 'layers keep'} a fixed state beside its tokens"
    return text


class OccupancyPanel(Panel):
    """Bars per layer stacked by token state; the dashed line is the capacity per layer."""

    title = "Layer occupancy"

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.view = pg.PlotWidget()
        self.plot = styled_plot(self.view.getPlotItem(), left="tokens", bottom="layer")
        self.bars: dict[str, pg.BarGraphItem] = {}
        for name, colour in SEGMENTS:
            bar = pg.BarGraphItem(x=[0], height=[0], y0=[0], width=0.75, brush=colour, pen=None, name=name)
            self.plot.addItem(bar)
            self.bars[name] = bar
        self.capacity = pg.InfiniteLine(
            pos=0, angle=0, pen=pg.mkPen("#e0e0e0", width=1, style=pg.QtCore.Qt.PenStyle.DashLine),
        )
        self.plot.addItem(self.capacity)
        self.plot.getAxis("bottom").setTickSpacing(major=1, minor=1)
        self._layout.addWidget(self.view, 1)
        self._layout.addWidget(legend_row([(c, n) for n, c in SEGMENTS] + [("#e0e0e0", "capacity (dashed line)")]))
        self.stack: dict[str, np.ndarray] = {}
        self.y_range = StickyRange(lambda top: self.plot.setYRange(0, top, padding=0), minimum=16, grow=1.25)
        self.y_range.fit(16)
        self.ranges = [self.y_range]
        self.plot.setXRange(-0.6, 3.6, padding=0)
        self.caption.setText(EMPTY_CAPTION)
        self._num_layers = 0
        self._model_layers = 0  # the loaded model's layers (``set_model``): the empty chart shows them all
        self._tip = hover_tip(self.view, [(self.plot, self.value_at)])

    def value_at(self, x: float) -> str:
        """Layer ``x`` (rounded): what it holds, by state, of its capacity."""
        i = int(round(x))
        if not self.stack or not 0 <= i < len(self.stack["full"]):
            return ""
        held = sum(int(self.stack[name][i]) for name, _ in SEGMENTS)
        parts = ", ".join(f"{int(self.stack[name][i])} {name}" for name, _ in SEGMENTS if self.stack[name][i])
        cap = self.last_snapshot.capacity_tokens if self.last_snapshot is not None else 0
        return f"layer {i}: {held} tokens" + (f" ({parts})" if parts else "") + (f" of {cap}" if cap else "")

    def set_model(self, info) -> None:
        """A model was loaded (``ModelInfo``): before its first snapshot the axis shows all its layers."""
        self._model_layers = int(info.num_layers)
        if not self.stack:
            self.clear()

    def _set_layers(self, n: int) -> None:
        if n != self._num_layers:
            self._num_layers = n
            self.plot.setXRange(-0.6, max(n - 0.4, 0.4), padding=0)

    def clear(self) -> None:
        layers = np.arange(max(self._model_layers, 1))
        for bar in self.bars.values():
            bar.setOpts(x=layers, height=np.zeros(len(layers)), y0=np.zeros(len(layers)), width=0.75)
        self._set_layers(len(layers))
        self.capacity.setVisible(False)
        self.stack = {}
        self.last_snapshot = None
        self.caption.setText("Nothing cached for this chat yet: the bars fill when you send a message.")

    def show_caption(self, snap: CacheSnapshot) -> None:
        self.caption.setText(occupancy_caption(snap, occupancy_stack(snap)))

    def show_snapshot(self, snap: CacheSnapshot) -> None:
        self.last_snapshot = snap
        stack = occupancy_stack(snap)
        layers = np.arange(len(stack["full"]))
        bottom = np.zeros(len(layers), dtype=np.int64)
        for name, _ in SEGMENTS:
            self.bars[name].setOpts(x=layers, height=stack[name], y0=bottom.copy(), width=0.75)
            bottom = bottom + stack[name]
        self.capacity.setValue(snap.capacity_tokens)
        self._set_layers(len(layers))
        # Scale to the bars; show the capacity line only when it is near enough to compare with them.
        top = max(int(bottom.max()) if len(bottom) else 0, 16)
        cap = int(snap.capacity_tokens)
        show_cap = 0 < cap <= top * 4
        self.capacity.setVisible(show_cap)
        self.y_range.fit(max(top, cap) if show_cap else top)
        self.stack = stack
        self.caption.setText(occupancy_caption(snap, stack))
        self._count()

    def bar_heights(self) -> dict[str, np.ndarray]:
        """The plotted heights per segment (for tests)."""
        return {name: np.asarray(self.bars[name].opts["height"]) for name, _ in SEGMENTS}

    def bar_bottoms(self) -> dict[str, np.ndarray]:
        return {name: np.asarray(self.bars[name].opts["y0"]) for name, _ in SEGMENTS}
