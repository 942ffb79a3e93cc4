"""The model card: shape of the attention (MHA/GQA/MQA), KV bytes per token, and what the same model would
need as MHA or MQA, with a bar chart of KV memory at the full context."""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSize
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea

from app.ground.format import human_bytes, human_count, info_weights_words
from app.panels.base import Panel, styled_plot
from app.ground.reuse_words import reuse_cost
from engine.kv.paged import sizes
from engine.model.builtin import is_builtin
from engine.snapshot import ModelInfo

BAR_COLOURS = ("#8a919c", "#4c9be8", "#43c59e")


def kv_comparison(info: ModelInfo) -> dict[str, int]:
    """KV bytes per token as loaded, as MHA (one KV head per Q head) and as MQA (one KV head)."""
    return {
        "MHA": info.kv_bytes_per_token_as(info.num_q_heads),
        "this model": info.kv_bytes_per_token,
        "MQA": info.kv_bytes_per_token_as(1),
    }


PRECISIONS = ("int4", "tq4", "tq3", "tq2")  # the card's "KV pages" row: K and V both held so


def kv_bytes_per_token_held_as(info: ModelInfo, kind: str, page_size: int) -> float:
    """Bytes per token the KV cache holds with K and V as ``kind`` pages (full pages: the formulas the engine's
    pages hold, ``engine.kv.paged.sizes``), over every attention layer."""
    k = (info.k_heads or info.num_kv_heads, info.k_dim or info.head_dim)
    v = (info.v_heads or k[0], info.v_dim or k[1])
    return info.attention_layers * sum(sizes.bytes_per_token(kind, role, h, d, page_size)
                                       for role, (h, d) in (("k", k), ("v", v)))


def _as_kinds(info: ModelInfo, page_size: int) -> str:
    return " · ".join(f"{kind} {human_bytes(round(kv_bytes_per_token_held_as(info, kind, page_size)))}"
                      for kind in PRECISIONS)


def _widths(info: ModelInfo) -> str:
    """Head dims (K and V apart when they differ, as in MLA) and the hidden size."""
    if info.v_dim and info.v_dim != info.k_dim:
        return f"K {info.k_dim} / V {info.v_dim} · {info.hidden_size}"
    return f"{info.head_dim} · {info.hidden_size}"


class ModelCardPanel(Panel):
    """Static facts about the loaded model; ``show_model(info)`` fills it, snapshots update 'in use'."""

    title = "Model card"

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.table = QLabel("No model loaded yet.")
        self.table.setObjectName("modelCard")
        self.table.setWordWrap(True)
        self.scroll = QScrollArea()  # a short dock (1280×720) scrolls the facts instead of cutting the last ones
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setWidget(self.table)
        self._layout.addWidget(self.scroll, 3)
        self.view = pg.PlotWidget()
        # (the rows above say "KV at full context"; in 90 px of chart the long title was cut to "KV MiB at full cont")
        self.plot = styled_plot(self.view.getPlotItem(), left="KV MiB")
        self.bars = pg.BarGraphItem(x=[0, 1, 2], height=[0, 0, 0], width=0.6, brushes=list(BAR_COLOURS), pen=None)
        self.plot.addItem(self.bars)
        self.plot.getAxis("bottom").setTicks([[(0, "as MHA"), (1, "this model"), (2, "as MQA")]])
        self.plot.setXRange(-0.6, 2.6, padding=0)
        self.plot.setYRange(0, 1, padding=0)
        self.view.setMinimumHeight(90)  # the table first: at 1280×720 a hybrid model's card has a row more
        self._layout.addWidget(self.view, 1)
        self.info: ModelInfo | None = None
        self.checkpoints, self.page_size = 8, 16  # the cache setting's (``set_reuse``): what reuse costs here
        self.caption.setText("<b>Model</b>")

    def watch(self, screen) -> None:
        """What reuse costs on the model under the cache setting applied to the chat on screen."""
        screen.connect("settings", lambda cfg: cfg is not None and self.set_reuse(cfg.checkpoints, cfg.page_size))

    def set_reuse(self, checkpoints: int, page_size: int) -> None:
        """The cache setting's checkpoints per chat and page size (the "reuse" row); redrawn if a model is shown."""
        if (checkpoints, page_size) != (self.checkpoints, self.page_size):
            self.checkpoints, self.page_size = int(checkpoints), int(page_size)
            if self.info is not None:
                self.show_model(self.info)

    def show_model(self, info: ModelInfo) -> None:
        self.info = info
        comp = kv_comparison(info)
        ctx = max(info.context_length, 1)
        at_ctx = info.kv_bytes_at(ctx)  # sliding layers hold only their window, state layers a fixed size
        scale = at_ctx / max(1, comp["this model"] * ctx)
        heights = np.array([comp["MHA"], comp["this model"], comp["MQA"]], dtype=np.float64) * ctx * scale / 2**20
        self.bars.setOpts(height=heights)
        self.plot.setYRange(0, max(heights.max(), 1e-6) * 1.15, padding=0)
        shipped = info.is_demo or is_builtin(info.source)
        demo = " <span style='color:#ffb347'>built-in, no download</span>" if shipped else ""
        rows = [
            ("architecture", f"{info.architecture} · attention {info.attn_impl}"),
            ("layers", html.escape(info.layer_summary)),
            *([("reuse", html.escape(reuse_cost(info, self.checkpoints, self.page_size)))]  # windowed / recurrent
              if any(not k.startswith("full") or "state" in k for k in info.layer_kinds) else []),
            ("attention", f"<b>{info.attention_kind}</b>: {info.num_q_heads} Q heads, {info.num_kv_heads} KV heads"),
            ("head dim · hidden", _widths(info)),
            ("context", f"{human_count(info.context_length)} tokens"),
            ("weights", f"{human_bytes(info.weights_bytes)} · {html.escape(info_weights_words(info))}"),
            ("KV per token", f"<b>{human_bytes(comp['this model'])}</b> ({info.kv_dtype}) · as MHA "
                             f"{human_bytes(comp['MHA'])} / MQA {human_bytes(comp['MQA'])}"),
            ("KV pages", _as_kinds(info, self.page_size)),
            ("KV at full context", human_bytes(at_ctx)),
            ("device", f"{info.device}<br><span style='color:#8a919c'>{html.escape(info.device_reason)}</span>"),
            *([("CPU threads", html.escape(info.threads_reason))] if info.device == "cpu" and info.threads_reason
              else []),
            *([("CPU", html.escape(" · ".join(x for x in (_cpu_note(info) if info.cpu_features else "",
                                                         f"linears {info.weights_kernel}" if info.weights_kernel else "")
                                             if x)))]
              if info.device == "cpu" and (info.cpu_features or info.weights_kernel) else []),
        ]  # one row each: at 1280×720 the card's table has 285 px above its chart
        body = "".join(
            f"<tr><td style='color:#8a919c; padding-right:10px'>{k}</td><td>{v}</td></tr>" for k, v in rows
        )
        self.caption.setText(f"<b>{html.escape(info.name)}</b>{demo}")
        self.table.setText(f"<table cellspacing='0' cellpadding='1'>{body}</table>")
        self._count()

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(280, 340)

    def show_snapshot(self, snapshot) -> None:
        self._count()

    def bar_heights(self) -> np.ndarray:
        return np.asarray(self.bars.opts["height"])


def _cpu_note(info) -> str:
    """The CPU's arithmetic, and the hint it implies for a float32 model on a CPU with native bf16."""
    note = info.cpu_features
    if "native bf16" in note and info.dtype == "float32" and info.quantization in ("none", ""):
        note += ": weights “bfloat16” (File ▸ Models) halve the bytes and speed up prompts"
    return note
