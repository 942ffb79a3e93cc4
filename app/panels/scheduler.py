"""When the live panels redraw, and with which snapshot.

The worker sends a snapshot per step; the scheduler keeps only the latest. Panels draw in *frames*: a
frame is one snapshot, and every visible panel draws that same snapshot (one panel per tick, round robin)
before the next frame takes the newest snapshot. Captions are cheap: every panel's is set when the frame is
taken, in the same call as the status bar (``frame_taken``), so the words on screen always describe one
snapshot; the charts follow within one round.

Each panel's draw is timed: the next one may start only after ``PANEL_INTERVAL_S`` and after the panels
have used at most ``PANEL_BUDGET`` of the GUI thread, so on a slow machine panels redraw less often instead
of slowing the reply down. Paused (View ▸ Live panels off), frames still advance (the status bar stays
true) but nothing is drawn, and every panel says it is paused.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from PySide6.QtCore import QTimer

from app.ground.docks import on_screen
from app.panels.base import Panel
from engine.snapshot import CacheSnapshot

PANEL_INTERVAL_S = 0.08  # one live panel at most every 80 ms (12.5 Hz in all): each panel redraws at ~3 Hz
PANEL_BUDGET = 0.04  # ...and live panels (update + paint) get at most 4% of the GUI thread's time


class PanelScheduler:
    """Feeds ``panels`` from the latest snapshot; call ``tick()`` from the window's refresh timer."""

    def __init__(self, panels: Sequence[Panel], frame_taken: Callable[[CacheSnapshot], None]) -> None:
        self.panels = list(panels)
        self.frame_taken = frame_taken
        self.latest: CacheSnapshot | None = None
        self.frame: CacheSnapshot | None = None
        self.enabled = True
        self.seconds = 0.0  # time spent updating and painting live panels (self-test, benchmarks)
        self._shown: dict[str, CacheSnapshot] = {}  # the snapshot each panel drew last
        self._turn = 0
        self._next = 0.0  # perf_counter() time the next panel may draw
        self._screen = None  # the record it draws (``watch``)

    def watch(self, screen) -> None:
        """Draw the screen's record (``app.ground.screen.Screen``): another chat on screen starts over, its newest
        snapshot is offered (an idle chat's, or an API conversation's, drawn at once), and a reply that ended is
        drawn whole."""
        self._screen = screen
        # a remote chat's controller borrows the panels and draws them itself (``app.remote.panels``)
        screen.connect("chat", lambda chat: None if isinstance(chat, tuple) and chat[0] == "remote" else self.clear())
        screen.connect("latest", self._on_latest)
        screen.connect("generation", lambda gen: gen or QTimer.singleShot(0, self.refresh_all))

    def _on_latest(self, snap: CacheSnapshot | None) -> None:
        if snap is None:
            if self.latest is not None or self.frame is not None:
                self.clear()
            return
        self.offer(snap)
        if not self._screen.generation:
            self.refresh_all()

    def offer(self, snap: CacheSnapshot) -> None:
        """A new snapshot of the chat on screen."""
        self.latest = snap

    def clear(self) -> None:
        """The chat on screen has no cache (a new chat, or one not run since the app started)."""
        self.latest = self.frame = None
        self._shown.clear()
        for panel in self.panels:
            panel.clear()

    def set_enabled(self, on: bool) -> None:
        self.enabled = bool(on)
        for panel in self.panels:
            panel.set_paused(not self.enabled)
        if self.enabled:
            self.refresh_all()

    def _pending(self, panel: Panel) -> bool:
        return on_screen(panel) and self._shown.get(panel.objectName()) is not self.frame

    def _advance(self) -> None:
        """Take the latest snapshot as the frame once every visible panel drew the current one."""
        if self.latest is None or self.latest is self.frame:
            return
        if self.frame is None or not self.enabled or not any(self._pending(p) for p in self.panels):
            self._take(self.latest)
            for panel in self.panels:  # a series behind a tab keeps its points (the memory chart)
                if hasattr(panel, "record") and not on_screen(panel):
                    panel.record(self.frame)

    def _take(self, snap: CacheSnapshot) -> None:
        """``snap`` is the frame: every panel's caption and the status bar say it now, in one call (no paint
        between them); the charts follow, one per tick. Paused, the captions stay with the charts they describe."""
        self.frame = snap
        if self.enabled:
            for panel in self.panels:
                panel.show_caption(snap)
        self.frame_taken(snap)

    def tick(self) -> None:
        """Draw at most one panel (the next one in turn that has not drawn the frame)."""
        self._advance()
        now = time.perf_counter()
        if self.frame is None or not self.enabled or now < self._next:
            return
        for _ in range(len(self.panels)):
            self._turn = (self._turn + 1) % len(self.panels)
            panel = self.panels[self._turn]
            if self._pending(panel):  # hidden docks (closed, or a tab behind another) skip
                self._draw(panel, self.frame)
                panel.repaint()  # paint now, so its cost is counted here and not in a later event
                spent = time.perf_counter() - now
                self.seconds += spent
                self._next = now + max(PANEL_INTERVAL_S, spent / PANEL_BUDGET)
                return

    def refresh_all(self) -> None:
        """Every panel draws the latest snapshot now (a reply ended, a chat was opened)."""
        if self.latest is not None and self.latest is not self.frame:
            self._take(self.latest)
        if self.frame is None or not self.enabled:
            return
        for panel in self.panels:
            if self._shown.get(panel.objectName()) is not self.frame:
                self._draw(panel, self.frame)

    def _draw(self, panel: Panel, snap: CacheSnapshot) -> None:
        self._shown[panel.objectName()] = snap
        panel.show_snapshot(snap)
