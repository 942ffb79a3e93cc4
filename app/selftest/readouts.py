"""The self-test's checks of what a new user reads (the notice's check is in ``app.selftest.run``):

- a reply that waits says what for, in its bubble and the status bar, with Stop as the way out, and the wait is
  never in TTFT (the footer's TTFT is the timing panel's);
- no panel caption is cut at 1280×720 or 1920×1080, each panel brought to the front in turn;
- the status bar's 'Context used' is Layer occupancy's 'tokens cached' (+ the token just generated) of the same
  snapshot, never above the model's context.
"""

from __future__ import annotations

import re
from typing import Callable

from PySide6.QtWidgets import QLabel

from app.ground.status_bar import context_counts

Wait = Callable[[Callable[[], bool], float], bool]  # app.selftest.run.wait_until (passed in: no import cycle)
SIZES = ((1280, 720), (1920, 1080))


def cut_captions(window) -> list[str]:
    """Every shown panel label whose text does not fit it (wrapped: taller than its box; not wrapped: wider)."""
    from app.ground.docks import on_screen

    out = []
    for panel in window.panels:
        for label in [x for x in panel.findChildren(QLabel) if on_screen(x) and x.text().strip()]:
            probe = QLabel(label.text())
            probe.setFont(label.font())
            probe.setWordWrap(label.wordWrap())
            need = probe.heightForWidth(label.width()) if label.wordWrap() else probe.sizeHint().width()
            have = label.height() if label.wordWrap() else label.width()
            if need > have:
                out.append(f"{panel.objectName()}: {need} > {have} px: {label.text()[:60]}")
    return out


def check_captions(t, wait_until: Wait) -> None:
    """Item 7 at two window sizes; the size is restored after."""
    w = t.window
    size = (w.width(), w.height())
    cut: list[str] = []
    for wh in SIZES:
        w.resize(*wh)
        wait_until(lambda: False, 0.6)  # the docks refit 150 ms after the size settles
        for name in ("occupancy", "page_map", "timing", "memory", "model"):
            w.docks[name].raise_()
            wait_until(lambda: w.layout_docks.settled, 2)
            cut += [f"{wh[0]}×{wh[1]} {c}" for c in cut_captions(w)]
    w.resize(*size)
    t.check(not cut, "no panel text cut at 1280×720 and 1920×1080" + (f": {cut[0]}" if cut else ""))


def check_context(t, wait_until: Wait) -> None:
    """Item 9 on the chat on screen after its last reply."""
    w = t.window
    wait_until(lambda: w.occupancy.last_snapshot is not None, 2)
    wait_until(lambda: False, 0.4)  # the panels' last frame
    snap = w.occupancy.last_snapshot
    m = re.match(r"Context: ([\d,]+) of ([\d,]+)", w.status.context.text())
    if snap is None or m is None:
        t.check(False, f"status bar context and occupancy readable ({w.status.context.text()!r})")
        return
    used, total = (int(x.replace(",", "")) for x in m.groups())
    cached = max(int(x) for x in snap.tokens_per_layer)
    t.check(used == context_counts(snap)[0] and used - cached in (0, 1) and used <= total
            and f"{cached} tokens cached" in w.occupancy.caption.text(),
            f"readouts agree: status bar 'Context: {used} of {total}', occupancy '{cached} tokens cached'")


def check_wait(t, wait_until: Wait) -> None:
    """Item 4: a chat whose cache was swapped to host memory waits for it; the wait is said and not in TTFT."""
    w = t.window
    w.new_chat()
    t.reply("Once upon a time")
    first = w.chat_id
    w.new_chat()
    t.reply("A cat sat")  # this chat's turn swaps the first one's cache out
    w.open_chat(first)
    wait_until(lambda: w.chat_id == first and not w.generation_id, 10)
    seen: list[tuple[str, str, bool]] = []

    def saw(_gen: int, text: str) -> None:
        bubble = w.chat.streaming.body.text() if w.chat.streaming else ""
        seen.append((text, bubble, w.chat.stop_button.isEnabled()))

    w.reply_wait.shown.connect(saw)
    r = t.reply("Tell me more")
    said = [s for s in seen if s[0]]
    footer = w.chat.bubbles[-1].stats_label.text() if w.chat.bubbles else ""
    ttft = re.search(r"TTFT (\d+) ms", footer)
    wait_until(lambda: bool(seen) and seen[-1][0] == "", 2)  # the wait's end and the panel's last refresh land
    wait_until(lambda: ttft is not None and f"TTFT {ttft.group(1)} ms" in w.timing.caption.text(), 2)
    w.reply_wait.shown.disconnect(saw)
    parts = {"finished": t.finished_well(r), "said": bool(said), "in bubble": bool(said) and said[0][0] in said[0][1],
             "Stop": bool(said) and said[0][2], "cleared": bool(seen) and seen[-1][0] == "",
             "same TTFT": ttft is not None and f"TTFT {ttft.group(1)} ms" in w.timing.caption.text()}
    bad = [k for k, v in parts.items() if not v]
    t.check(not bad,
            f"a waiting reply says why ({said[0][0] if said else 'nothing said'}), then streams; the wait is not "
            f"in TTFT ({ttft.group(0) if ttft else 'no TTFT'} in the footer and the timing panel)"
            + (f"; not: {', '.join(bad)}" if bad else ""))
