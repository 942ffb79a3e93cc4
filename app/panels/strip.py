"""The page map's token strip: the conversation's tokens from first to last, coloured by state (kept / sink /
evicted / quantized / pinned / not cached) — and, for this turn's prompt, why tokens the cache had held were
computed again (the cache account's misses, ``engine.snapshot.CacheAccount``), and where the checkpoints of a
hybrid or sliding-window model's cache sit.

A turn whose prompt recomputed tokens for a reason (anything but new tokens) draws the strip in two halves: the
upper one the tokens' states as always, the lower one those tokens in their reason's colour (reused and new
tokens keep their state's colour there too, so the strip of a plain follow-up is drawn as before). Checkpoints
are white ticks at the token they were taken before; hover one for what it holds and its bytes. The words are
``app.chat.reuse_words``'.
"""

from __future__ import annotations

import bisect

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QColor

from app.ground.reuse_words import (KIND_NAMES, REASONS, MissRow, checkpoint_words, explained, hover_words,
                                    kind_words, misses_of, reason_label)
from app.panels.base import legend_html
from engine import snapshot as S
from engine.snapshot import CacheSnapshot

TOKEN_COLOURS = {  # TOKEN_* code -> colour
    S.TOKEN_KEPT: "#4c9be8",
    S.TOKEN_SINK: "#ffb347",
    S.TOKEN_EVICTED: "#ff4b4b",
    S.TOKEN_QUANTIZED: "#a470ff",
    S.TOKEN_PINNED: "#ffd84a",
    S.TOKEN_NOT_CACHED: "#5a606b",
    S.TOKEN_PARTIAL: "#f29a9a",
}
REASON_COLOURS = {  # MissReason value -> colour of its recomputed tokens (the strip's lower half, the readout)
    "new": "#43c59e",
    "diverged": "#ff8f3f",
    "evicted": "#e84855",
    "policy": "#b0413e",
    "partial_page": "#b5d33d",
    "settings": "#5bc0eb",
    "window": "#f9e04b",
    "state": "#ff6fcf",
    "disk": "#b07d48",
    "off": "#8a919c",
}
# An API conversation's messages by kind (the strip's top row, ``CacheSnapshot.messages``): an agent's calls and the
# results it was given read apart from the user's words and the model's own
KIND_COLOURS = {
    "system": "#9aa4b2",
    "user": "#5b8def",
    "assistant": "#43c59e",
    "tool_call": "#ffb347",
    "tool_result": "#c38cf5",
    "reply": "#2a7d64",
}
CHECKPOINT_COLOUR = "#ffffff"  # the strip's ticks
CHECKPOINT_PAGE_COLOUR = "#d9c6f5"  # pages of the map that only checkpoints hold (a sliding group's old windows)
PAD = (16, 18, 23, 255)


def _rgb(hex_colour: str) -> np.ndarray:
    c = QColor(hex_colour)
    return np.array([c.red(), c.green(), c.blue()], dtype=np.float64)


def recomputed(snap: CacheSnapshot) -> list[MissRow]:
    """This turn's misses with a reason (not new tokens), within the strip."""
    return [m for m in explained(misses_of(snap.account)) if m.start < len(snap.token_state)]


def token_colours(snap: CacheSnapshot) -> np.ndarray:
    """``[rows, T, 4]`` uint8 RGBA: one row of states, or (``recomputed``) the reasons' row under it (row 0 is
    drawn at the bottom)."""
    states = np.asarray(snap.token_state).astype(np.int64)
    table = np.stack([_rgb(TOKEN_COLOURS[i]) for i in range(len(TOKEN_COLOURS))])
    row = np.full((max(len(states), 1), 4), 255, dtype=np.uint8)
    if len(states):
        row[:, :3] = table[np.clip(states, 0, len(table) - 1)].astype(np.uint8)
    else:
        row[0] = PAD
    rows = [row]
    misses = recomputed(snap)
    if misses:
        lower = row.copy()
        for m in misses:
            lower[m.start:m.end, :3] = _rgb(REASON_COLOURS.get(m.reason, "#ffffff")).astype(np.uint8)
        rows.insert(0, lower)
    if snap.messages:  # the messages' kinds on top
        top = np.full_like(row, 255)
        top[:, :3] = PAD[:3]
        for a, b, kind, _n in snap.messages:
            top[a:b, :3] = _rgb(KIND_COLOURS.get(kind, "#ffffff")).astype(np.uint8)
        rows.append(top)
    return np.stack(rows)


def message_at(snap: CacheSnapshot, index: int) -> tuple[int, int, str, int] | None:
    """The message (start, end, kind, number) token ``index`` belongs to, where the snapshot knows them."""
    starts = [m[0] for m in snap.messages]
    i = bisect.bisect_right(starts, index) - 1
    return snap.messages[i] if i >= 0 and snap.messages[i][0] <= index < snap.messages[i][1] else None


def miss_at(snap: CacheSnapshot, index: int) -> MissRow | None:
    """The miss (new tokens too) that computed prompt token ``index`` this turn, if one did."""
    misses = misses_of(snap.account)
    i = bisect.bisect_right([m.start for m in misses], index) - 1
    return misses[i] if i >= 0 and misses[i].start <= index < misses[i].end else None


def token_words(snap: CacheSnapshot, index: int, name: str) -> str:
    """'token 37 of 120 · kept', and how this turn's prompt got it when it was recomputed for a reason (or
    computed new, in a turn that recomputed some)."""
    text = f"token {index} of {len(snap.token_state)} · {name}"
    message = message_at(snap, index)
    if message is not None:
        a, b, kind, n = message
        text += f" · {kind_words(kind, n)} (tokens {a:,}–{b - 1:,})"
    m = miss_at(snap, index)
    if m is not None and recomputed(snap):
        text += " · " + hover_words(m)
    return text


def checkpoint_near(snap: CacheSnapshot, x: float, slack: float) -> int:
    """Index of the checkpoint within ``slack`` tokens of strip position ``x`` (-1: none)."""
    best, far = -1, slack
    for i, pos in enumerate(snap.checkpoints):
        if abs(pos - x) <= far:
            best, far = i, abs(pos - x)
    return best


def checkpoint_text(snap: CacheSnapshot, i: int) -> str:
    stateful = any(k == "state" or k.endswith("+state") for k in snap.layer_kinds)
    size = snap.checkpoint_sizes[i] if i < len(snap.checkpoint_sizes) else 0
    return checkpoint_words(snap.checkpoints[i], size, stateful)


def reuse_legend(snap: CacheSnapshot | None) -> str:
    """The line under the strip's legend: the messages' kinds (an API conversation's), the reasons this turn recomputed
    tokens for, and the checkpoints ("" when none of them)."""
    if snap is None:
        return ""
    parts = []
    kinds = list(dict.fromkeys(m[2] for m in snap.messages))
    if kinds:
        parts.append(legend_html([(KIND_COLOURS.get(k, "#ffffff"), KIND_NAMES.get(k, k)) for k in kinds],
                                 prefix="messages (top row):"))
    reasons = list(dict.fromkeys(m.reason for m in recomputed(snap)))
    if reasons:
        parts.append(legend_html([(REASON_COLOURS.get(r, "#ffffff"), reason_label(r)) for r in reasons],
                                 prefix="recomputed this turn (lower half):"))
    if snap.checkpoints:
        n = len(snap.checkpoints)
        parts.append(f'<span style="color:{CHECKPOINT_COLOUR}">│</span>&nbsp;{n} checkpoint{"s" if n != 1 else ""} '
                     "(hover a tick)" + (f' &nbsp; <span style="color:{CHECKPOINT_PAGE_COLOUR}; font-size:13px">■'
                                         "</span>&nbsp;pages only checkpoints hold" if snap.checkpoint_pages else ""))
    return " &nbsp;·&nbsp; ".join(parts)


def reason_chips() -> list[tuple[str, str]]:
    """Every reason's (colour, label) pair, for the help."""
    return [(REASON_COLOURS[r], "recomputed: " + label) for r, (label, _) in REASONS.items() if r in REASON_COLOURS]


class CheckpointTicks:
    """White ticks on the strip at each checkpoint (``strip_box``: the strip's view box)."""

    def __init__(self, box: pg.ViewBox) -> None:
        self.item = pg.ScatterPlotItem(symbol="|", size=16, pen=pg.mkPen(CHECKPOINT_COLOUR, width=2), brush=None)
        box.addItem(self.item)

    def show(self, snap: CacheSnapshot | None, rows: int) -> None:
        xs = list(snap.checkpoints) if snap is not None else []
        self.item.setData(x=xs, y=[rows / 2] * len(xs))
