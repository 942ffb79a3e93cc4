"""The page allocation map: every physical page as a cell, coloured by state and owner turn, plus a strip
of the conversation's tokens (kept / sink / evicted / quantized / pinned / not cached).

Active pages take their owner turn's colour; other states have one fixed colour each; brightness shows how
full a page is. Hover a cell for its page id, tokens, fill, ref count and owner, a strip cell for its token's state.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF
from PySide6.QtGui import QColor, QCursor
from PySide6.QtWidgets import QSizePolicy, QToolTip

from app.panels.base import Panel, legend_html, legend_row
from app.panels.strip import (CHECKPOINT_PAGE_COLOUR, TOKEN_COLOURS, CheckpointTicks, checkpoint_near,
                              checkpoint_text, reuse_legend, token_colours, token_words)
from app.ground.format import human_bytes
from app.ground.status_bar import evicted_counts
from app.ground.widgets import WordLabel
from engine import snapshot as S
from engine.snapshot import PAGE_STATE_NAMES, TOKEN_STATE_NAMES, CacheSnapshot

STATE_COLOURS = {  # PAGE_* code -> colour; PAGE_ACTIVE is replaced by the owner's turn colour
    S.PAGE_FREE: "#262a32",
    S.PAGE_ACTIVE: "#4c9be8",
    S.PAGE_SHARED: "#f0f0f0",
    S.PAGE_PINNED: "#ffd84a",
    S.PAGE_QUANTIZED: "#a470ff",
    S.PAGE_OFFLOADED: "#9a7650",
    S.PAGE_EVICTED: "#ff4b4b",  # just evicted
    S.PAGE_CACHED: "#6f8f72",  # no chat holds it: kept in the prefix cache for the next prompt that starts alike
}
OTHER_COLOUR = "#59647a"  # pages other chats hold in the same pool (API requests, other chats of the model)
# Turns alternate light and dark blues: a green or teal turn read as "cached" (grey-green), a violet one as
# "quantized"; blue is "in use" throughout.
TURN_COLOURS = ("#3d7fd9", "#8ab8f2", "#2b5fb3", "#a9cdf7", "#4a66d0", "#9cc0f0")
PAD = (16, 18, 23, 255)  # cells past the last page
VERIFY_COLOUR = "#ffb347"  # the frame of a page a speculative verification wrote provisional slots into
RESTORED_COLOUR = "#ff7ad9"  # the frame of a page whose K/V this turn read from the KV disk tier (engine.kv.tier.disk)
LOCAL_PAGES = ([(TURN_COLOURS[0], "active (by turn)"), (OTHER_COLOUR, "other chats")]
               + [(STATE_COLOURS[c], PAGE_STATE_NAMES[c]) for c in STATE_COLOURS if c != S.PAGE_ACTIVE]
               + [(VERIFY_COLOUR, "verified (frame)"),  # a speculative verification wrote into it
                  (RESTORED_COLOUR, "restored from disk (frame)")])  # K/V read from the KV disk tier
LOCAL_STRIP = [(TOKEN_COLOURS[c], TOKEN_STATE_NAMES[c]) for c in TOKEN_COLOURS]
# A remote chat's map is its server's block pool (app.remote.panels maps the view's slots to these states): only
# these states occur, and each means something else there, so they get the server's words.
REMOTE_STATES = {S.PAGE_ACTIVE: "this chat", S.PAGE_CACHED: "other requests", S.PAGE_FREE: "free",
                 S.PAGE_EVICTED: "evicted (2 s)"}
REMOTE_PAGES = [(TURN_COLOURS[0] if c == S.PAGE_ACTIVE else STATE_COLOURS[c], t) for c, t in REMOTE_STATES.items()]
REMOTE_TOKENS = {S.TOKEN_KEPT: "in its cached blocks", S.TOKEN_NOT_CACHED: "not in a full cached block"}
REMOTE_STRIP = [(TOKEN_COLOURS[c], t) for c, t in REMOTE_TOKENS.items()]


def _rgb(hex_colour: str) -> np.ndarray:
    c = QColor(hex_colour)
    return np.array([c.red(), c.green(), c.blue()], dtype=np.float64)


def grid_columns(num_pages: int, aspect: float = 2.0) -> int:
    """Columns of the map: at least 16, a multiple of 8, so the grid's width:height is about ``aspect``."""
    return max(16, int(math.ceil(math.sqrt(max(num_pages, 1) * max(aspect, 0.25)) / 8.0)) * 8)


def page_grid(snap: CacheSnapshot, cols: int | None = None) -> np.ndarray:
    """``[rows, cols]`` PAGE_* codes, row-major by page id; -1 past the last page."""
    cols = cols or grid_columns(snap.num_pages)
    rows = max(1, math.ceil(snap.num_pages / cols))
    grid = np.full(rows * cols, -1, dtype=np.int16)
    grid[: snap.num_pages] = np.asarray(snap.page_state[: snap.num_pages])
    return grid.reshape(rows, cols)


@functools.cache
def _tables() -> tuple[np.ndarray, np.ndarray]:
    """RGB rows of the page-state colours ``[S, 3]`` and of the turn colours ``[K, 3]`` (made once)."""
    return (np.stack([_rgb(STATE_COLOURS[i]) for i in range(len(STATE_COLOURS))]),
            np.stack([_rgb(c) for c in TURN_COLOURS]))


def page_colours(snap: CacheSnapshot, cols: int | None = None) -> np.ndarray:
    """``[rows, cols, 4]`` uint8 RGBA: state colour (owner turn colour for active pages) scaled by fill."""
    cols = cols or grid_columns(snap.num_pages)
    n = snap.num_pages
    state = np.asarray(snap.page_state[:n]).astype(np.int64)
    owner = np.asarray(snap.page_owner[:n]).astype(np.int64)
    fill = np.asarray(snap.page_fill[:n]).astype(np.float64)
    table, turns = _tables()  # [S, 3], [K, 3]
    rgb = table[np.clip(state, 0, len(table) - 1)]  # [n, 3]
    active = (state == S.PAGE_ACTIVE) & (owner >= 0)
    rgb[active] = turns[owner[active] % len(turns)]
    mine = snap.page_mine
    if mine is not None and len(mine) >= n:  # another chat's pages: one muted colour, whatever their turn
        other = (state == S.PAGE_ACTIVE) & ~np.asarray(mine[:n], dtype=bool)
        rgb[other] = _rgb(OTHER_COLOUR)
    held_back = [p for p in snap.checkpoint_pages if p < n]  # a sliding group's old windows, for its checkpoints
    rgb[held_back] = _rgb(CHECKPOINT_PAGE_COLOUR)
    holds = (state != S.PAGE_FREE) & (state != S.PAGE_EVICTED)  # free and just-evicted pages: not dimmed by fill
    scale = np.where(holds, 0.45 + 0.55 * np.clip(fill / max(snap.page_size, 1), 0, 1), 1.0)
    rgb = np.round(rgb * scale[:, None])
    rows = max(1, math.ceil(n / cols))
    out = np.empty((rows * cols, 4), dtype=np.uint8)
    out[:] = PAD
    out[:n, :3] = rgb.astype(np.uint8)
    out[:n, 3] = 255
    return out.reshape(rows, cols, 4)


def _group_spans(groups) -> list[tuple[str, int, int]]:
    """(label, first page, pages) of each pool in the map, in order."""
    out, start = [], 0
    for label, n in groups:
        out.append((label, start, n))
        start += n
    return out


def cell_pixels(num_pages: int) -> int:
    """Screen pixels per page cell in the drawn image (one of them is the gap between cells)."""
    return 6 if num_pages <= 4096 else 3 if num_pages <= 16384 else 1


def upscale(colours: np.ndarray, px: int) -> np.ndarray:
    """``[rows, cols, 4]`` -> ``[rows*px, cols*px, 4]`` with a 1-pixel gap (background) around cells."""
    if px <= 1:
        return colours
    big = np.repeat(np.repeat(colours, px, axis=0), px, axis=1)
    big[px - 1 :: px, :, :3] = PAD[:3]
    big[:, px - 1 :: px, :3] = PAD[:3]
    return big


def mark_written(big: np.ndarray, pages, cols: int, px: int) -> np.ndarray:
    """A white dot in the middle of each cell the last forward wrote (``big`` from ``upscale``, changed in place):
    with batched decoding, several chats' pages light up in the same step."""
    d = max(1, px // 3)  # 2x2 in a 6-pixel cell
    o = max(0, (px - 1 - d) // 2)
    for p in pages:
        r, c = divmod(int(p), cols)
        y, x = r * px + o, c * px + o
        if y + d <= big.shape[0] and x + d <= big.shape[1]:
            big[y:y + d, x:x + d, :3] = 255
    return big


def frame_verified(big: np.ndarray, pages, cols: int, px: int, colour: str = VERIFY_COLOUR) -> np.ndarray:
    """An amber frame in each cell a speculative verification wrote (its k + 1 provisional slots; the rejected
    ones were cut back after the forward), instead of the white dot of a plain step (``big`` changed in place).
    ``colour``: another frame (the pages restored from disk)."""
    rgb = _rgb(colour).astype(np.uint8)
    inner = max(1, px - 1)  # the cell without its gap
    for p in pages:
        r, c = divmod(int(p), cols)
        y, x = r * px, c * px
        if y + inner > big.shape[0] or x + inner > big.shape[1]:
            continue
        if inner < 3:  # too small for a frame: the whole cell
            big[y:y + inner, x:x + inner, :3] = rgb
            continue
        for ys, xs in ((slice(y, y + 1), slice(x, x + inner)), (slice(y + inner - 1, y + inner), slice(x, x + inner)),
                       (slice(y, y + inner), slice(x, x + 1)), (slice(y, y + inner), slice(x + inner - 1, x + inner))):
            big[ys, xs, :3] = rgb
    return big


def verify_text(snap: CacheSnapshot) -> str:
    """'verified 7 slots, 3 cut back' for a step that was a speculative verification ("" otherwise)."""
    if not snap.verified:
        return ""
    return f"verified {snap.verified} slot{'s' if snap.verified != 1 else ''}, {snap.rolled_back} cut back"


def page_caption(snap: CacheSnapshot) -> str:
    """'<b>12</b>/64 pages used · page size 16 · 3 cached · dots: 1 written this step'."""
    if snap.mode != "paged" and not snap.page_groups:
        return f"<b>{snap.mode}</b> cache: no page pool (switch to paged to see pages)"
    counts = np.bincount(np.asarray(snap.page_state, dtype=np.int64), minlength=len(PAGE_STATE_NAMES))
    used = snap.num_pages - int(counts[S.PAGE_FREE]) - int(counts[S.PAGE_EVICTED]) - int(counts[S.PAGE_CACHED])
    parts = [f"<b>{used}</b>/{snap.num_pages} pages used · page size {snap.page_size}"]
    if snap.page_groups:  # one pool per kind of layer: full layers first, then each sliding window
        parts.append(" · ".join(f"{label}: pages {start}–{start + n - 1}" for label, start, n in
                                _group_spans(snap.page_groups)))
    parts += [f"{counts[i]} {'page' if counts[i] == 1 else 'pages'} {PAGE_STATE_NAMES[i]}" for i in STATE_COLOURS
              if i not in (S.PAGE_FREE, S.PAGE_ACTIVE, S.PAGE_EVICTED) and counts[i]]
    if counts[S.PAGE_EVICTED] or snap.evicted_total:  # pages freed just now; tokens dropped over the whole chat
        pages = int(counts[S.PAGE_EVICTED])
        said = f"{pages} {'page' if pages == 1 else 'pages'} evicted this step · " if pages else ""
        per_layer, everywhere = evicted_counts(snap)  # (Layer occupancy's count, the strip's red)
        parts.append(f"{said}{everywhere:,} tokens evicted in all" if per_layer == everywhere else
                     f"{said}{everywhere:,} tokens evicted from every layer ({per_layer:,} from the fullest)")
    if snap.checkpoints:  # a hybrid / sliding-window model's: where a later prompt can cut the cache back to
        parts.append(f"{len(snap.checkpoints)} checkpoint{'s' if len(snap.checkpoints) != 1 else ''} "
                     f"({human_bytes(snap.checkpoint_bytes)})")
    if snap.written_pages and not snap.verified:
        parts.append(f"dots: {len(snap.written_pages)} written this step"
                     + (f" ({snap.batch_size} chats decoded together)" if snap.batch_size > 1 else ""))
    return " · ".join(parts)


class PageMapPanel(Panel):
    """Grid of physical pages (row-major by page id) and a strip of token states."""

    title = "Page map"

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self.view.ci.setContentsMargins(2, 2, 2, 2)
        self.strip_box = self.view.addViewBox(row=0, col=0, enableMouse=False)
        self.strip_box.setMaximumHeight(16)
        self.strip = pg.ImageItem(axisOrder="row-major")
        self.strip_box.addItem(self.strip)
        self.ticks = CheckpointTicks(self.strip_box)  # where the cache can be cut back to (hybrid, sliding models)
        self.strip_rows = 1  # +1 while this turn recomputed tokens for a reason (their reasons: the lower half), +1
        # for an API conversation's messages by kind (the top row)
        self.grid_box = self.view.addViewBox(row=1, col=0, enableMouse=False, invertY=True, lockAspect=True)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.grid_box.addItem(self.image)
        self.view.ci.layout.setRowStretchFactor(1, 10)
        self._layout.addWidget(self.view, 1)

        self.legend = legend_row(LOCAL_PAGES, prefix="pages:")
        self._layout.addWidget(self.legend)
        self.strip_legend = legend_row(LOCAL_STRIP, prefix="tokens (top strip):")
        self._layout.addWidget(self.strip_legend)
        self.reuse_legend = legend_row([])  # this turn's reasons for recomputing, and the checkpoints (if any)
        self.reuse_legend.setVisible(False)
        self._layout.addWidget(self.reuse_legend)
        self.remote = False  # a remote chat is on screen: the map is its server's block pool (set_legend_mode)
        self.help_key = ""  # the "?" help's entry when it is not the panel's own (app.shell.help)
        # Shortened at a word to the dock's width (the full text in its tooltip and the cursor's): a page's long
        # description must never widen the dock and reflow the chat.
        self.hover = WordLabel(" ")
        self.hover.setObjectName("hoverLine")
        self.hover.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._layout.addWidget(self.hover)
        self.readout = " "  # what the hover line says when the mouse is not on a page: the last verification
        self._hovering = False  # the hover line describes a page under the mouse (``hovering``)

        self.snapshot: CacheSnapshot | None = None
        self.cols = 16
        self.px = 6
        self.grid = np.zeros((0, 0), dtype=np.int16)
        self.colours = np.zeros((0, 0, 4), dtype=np.uint8)
        self._shape: tuple[int, int] | None = None
        self.caption.setText("Physical pages of the paged cache. Waiting for the model…")
        self._mouse = pg.SignalProxy(self.view.scene().sigMouseMoved, rateLimit=30, slot=self._on_mouse)

    def set_legend_mode(self, mode: str) -> None:
        """"remote": the legend, hover words and "?" help describe a server's block pool (a remote chat is on
        screen); "local": the local cache's, exactly as built."""
        self.remote = mode == "remote"
        if self.remote:
            self.legend.setText(legend_html(REMOTE_PAGES, prefix="blocks:"))
            self.strip_legend.setText(legend_html(REMOTE_STRIP, prefix="this chat's tokens (top strip):"))
        else:
            self.legend.setText(legend_html(LOCAL_PAGES, prefix="pages:"))
            self.strip_legend.setText(legend_html(LOCAL_STRIP, prefix="tokens (top strip):"))
        self.help_key = "RemotePageMap" if self.remote else ""

    def show_snapshot(self, snap: CacheSnapshot) -> None:
        self.snapshot = self.last_snapshot = snap
        self.cols = grid_columns(snap.num_pages, self._aspect())
        self.grid = page_grid(snap, self.cols)
        self.colours = page_colours(snap, self.cols)
        self.px = cell_pixels(snap.num_pages)
        big = upscale(self.colours, self.px)
        restored = [p for p in snap.restored_pages if 0 <= p < snap.num_pages]
        frame_verified(big, restored, self.cols, self.px, RESTORED_COLOUR)  # drawn first: a verification's frame wins
        if snap.verified:
            frame_verified(big, snap.written_pages, self.cols, self.px)
        else:
            mark_written(big, snap.written_pages, self.cols, self.px)
        self.image.setImage(big, autoLevels=False, levels=(0, 255))
        strip = token_colours(snap)
        self.strip.setImage(strip, autoLevels=False, levels=(0, 255))
        self.strip_rows = strip.shape[0]
        self.strip_box.setMaximumHeight(16 if self.strip_rows <= 2 else 24)  # an API chat's kinds: a third row
        self.ticks.show(snap, self.strip_rows)
        legend = "" if self.remote else reuse_legend(snap)
        self.reuse_legend.setText(legend)
        self.reuse_legend.setVisible(bool(legend))
        if self._shape != self.grid.shape:
            self._shape = self.grid.shape
            self.grid_box.setRange(xRange=(0, self.cols * self.px), yRange=(0, self.grid.shape[0] * self.px),
                                   padding=0.02)
        self.strip_box.setRange(xRange=(0, max(len(snap.token_state), 1)), yRange=(0, self.strip_rows), padding=0)
        said = [verify_text(snap) + " (pages framed)"] if snap.verified else []
        if restored:  # the chat's K/V read back from files instead of computed (a reopened chat)
            said.append(f"{len(restored)} page{'s' if len(restored) != 1 else ''} restored from disk (pink frames)")
        self.readout = " · ".join(said) or " "
        if not self._hovering:
            self.hover.setText(self.readout)
        self.show_caption(snap)
        self._count()

    def show_caption(self, snap: CacheSnapshot) -> None:
        self.caption.setText(page_caption(snap))

    def _aspect(self) -> float:
        """Width:height of the grid's box, in steps of 0.5 so the grid does not jitter while resizing."""
        w, h = self.grid_box.width(), self.grid_box.height()
        return 2.0 if w <= 0 or h <= 0 else max(0.5, round(2 * w / h) / 2)

    def clear(self) -> None:
        self.snapshot = self.last_snapshot = None
        self.grid = np.zeros((0, 0), dtype=np.int16)
        self.image.clear()
        self.strip.clear()
        self.ticks.show(None, 1)
        self.reuse_legend.setVisible(False)
        self.readout = " "
        self._hovering = False  # another chat (or none): a line about a page of the one before is not true here
        self.hover.setText(" ")
        self.caption.setText("Nothing cached for this chat yet: pages appear when you send a message.")

    def reset_view(self) -> None:
        self._shape = None  # the grid's range is set again from its shape
        super().reset_view()

    @property
    def hovering(self) -> bool:
        """The mouse is on a page or token: the hover line describes it (a readout must not overwrite it)."""
        return self._hovering

    def describe_page(self, page: int) -> str:
        """The hover text of one page."""
        s = self.snapshot
        if s is None or not 0 <= page < s.num_pages:
            return ""
        if self.remote:  # a server's block: whose it is is all the events tell (every drawn block is full)
            return f"block {page} · {REMOTE_STATES.get(int(s.page_state[page]), '?')} · {s.page_size} tokens a block"
        state = PAGE_STATE_NAMES[int(s.page_state[page])]
        if s.page_mine is not None and page < len(s.page_mine) and not s.page_mine[page] and state == "active":
            state = "another chat's"
        owner = int(s.page_owner[page])
        fill = int(s.page_fill[page])
        return (
            f"page {page} · {state} · {fill}/{s.page_size} tokens ({100 * fill // max(s.page_size, 1)}% full)"
            f" · ref count {int(s.page_refcount[page])} · owner {'turn ' + str(owner + 1) if owner >= 0 else '—'}"
            + (" · restored from disk" if page in s.restored_pages else "")
            + (" · held only by checkpoints (a window a later prompt may go back to)" if page in s.checkpoint_pages
               else "")
        )

    def page_at(self, x: float, y: float) -> int:
        """Page id under image pixel coordinates (x right, y down), -1 outside."""
        col, row = int(math.floor(x / self.px)), int(math.floor(y / self.px))
        if self.snapshot is None or not (0 <= col < self.cols and 0 <= row < self.grid.shape[0]):
            return -1
        page = row * self.cols + col
        return page if page < self.snapshot.num_pages else -1

    def describe_token(self, index: int) -> str:
        """The hover text of one cell of the token strip: 'token 37 of 120 · evicted'."""
        s = self.snapshot
        if s is None or not 0 <= index < len(s.token_state):
            return ""
        code = int(s.token_state[index])
        if self.remote:
            return f"token {index} of {len(s.token_state)} · {REMOTE_TOKENS.get(code, '?')}"
        return token_words(s, index, TOKEN_STATE_NAMES[code])

    def describe_checkpoint(self, x: float) -> str:
        """The hover text of a checkpoint's tick near strip position ``x`` ("" when none is within 3 pixels)."""
        s = self.snapshot
        if s is None or not s.checkpoints:
            return ""
        width = max(self.strip_box.width(), 1.0)
        i = checkpoint_near(s, x, 3.0 * max(len(s.token_state), 1) / width)
        return checkpoint_text(s, i) if i >= 0 else ""

    def _on_mouse(self, event) -> None:
        pos: QPointF = event[0]
        if self.strip.sceneBoundingRect().contains(pos):
            x = self.strip.mapFromScene(pos).x()
            text = self.describe_checkpoint(x) or self.describe_token(int(math.floor(x)))
        elif self.image.sceneBoundingRect().contains(pos):
            p = self.image.mapFromScene(pos)
            text = self.describe_page(self.page_at(p.x(), p.y()))
        else:
            text = ""
        self._hovering = bool(text)
        self.hover.setText(text or self.readout)
        if text:
            QToolTip.showText(QCursor.pos(), text, self.view)


