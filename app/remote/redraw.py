"""When the remote panels redraw: 4 times a second while a remote chat is on screen (evicted blocks fade, the
caption's counters move), and ``EVENT_DRAW_MS`` after a KV event batch arrives — batches come per engine step,
milliseconds apart, so those that arrive together are drawn together, within the 100 ms a change should take
to show. Each redraw that shows a new batch records the delay from its server time (``delays``, for measures).
"""

from __future__ import annotations

import time
from typing import Callable

from PySide6.QtCore import QObject, QTimer

DRAW_MS = 250
EVENT_DRAW_MS = 30


class Redraw(QObject):
    """Calls ``draw(force)`` on its timers; ``view()`` gives the engine view on screen (None: nothing to draw)."""

    def __init__(self, parent: QObject, draw: Callable[[bool], None], view: Callable[[], object]) -> None:
        super().__init__(parent)
        self._draw, self._view = draw, view
        self.delays: list[float] = []  # seconds from the newest batch's server time to its drawing (last 4096)
        self._drawn_batches = -1
        self.timer = QTimer(self)
        self.timer.setInterval(DRAW_MS)
        self.timer.timeout.connect(self.now)
        self.soon = QTimer(self)
        self.soon.setSingleShot(True)
        self.soon.setInterval(EVENT_DRAW_MS)
        self.soon.timeout.connect(self.now)

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()
        self.soon.stop()

    def events_arrived(self) -> None:
        """A batch reached the view on screen (a queued signal from the subscriber's thread)."""
        if self.timer.isActive() and not self.soon.isActive():
            self.soon.start()

    def now(self, force: bool = False) -> None:
        view = self._view()
        if view is None:
            return
        fresh = view.batches != self._drawn_batches
        self._draw(force)
        if fresh:
            self._drawn_batches = view.batches
            with view.lock:
                newest = max((p.last_ts for p in view.pools.values()), default=0.0)
            if newest:
                self.delays = (self.delays + [max(0.0, time.time() - newest)])[-4096:]
