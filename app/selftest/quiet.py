"""The self-test's view of the event loop: how late a 10 ms timer runs while a reply streams and between replies
(``LatencyProbe``), and Qt's messages — the offscreen platform's "This plugin does not support
propagateSizeHints()" (66 of them before the report: once per dock or tool window shown; the offscreen platform has
no window manager to pass size hints to, so nothing is lost) is dropped; every other message goes on as Qt would
print it (``QuietOffscreen``)."""

from __future__ import annotations

import sys
import time
from typing import Callable

import numpy as np
from PySide6.QtCore import QTimer, QtMsgType, qInstallMessageHandler

NOISE = "This plugin does not support propagateSizeHints()"
_LEVELS = {QtMsgType.QtDebugMsg: "debug", QtMsgType.QtInfoMsg: "info", QtMsgType.QtWarningMsg: "warning",
           QtMsgType.QtCriticalMsg: "critical", QtMsgType.QtFatalMsg: "fatal"}


class QuietOffscreen:
    """Installed for the self-test's run (``with QuietOffscreen(): ...``); counts what it dropped."""

    def __init__(self) -> None:
        self.dropped = 0
        self._previous = None

    def __enter__(self) -> "QuietOffscreen":
        self._previous = qInstallMessageHandler(self._handle)
        return self

    def __exit__(self, *exc) -> None:
        qInstallMessageHandler(self._previous)

    def _handle(self, kind, context, message: str) -> None:
        if message == NOISE:
            self.dropped += 1
            return
        if self._previous is not None:
            self._previous(kind, context, message)
        else:
            print(f"Qt {_LEVELS.get(kind, 'message')}: {message}", file=sys.stderr)


class LatencyProbe:
    """A 10 ms QTimer that records how late each tick runs: while ``active()`` is true (a reply streams) in
    ``samples``, otherwise (idle, or the window's own work between replies) in ``idle``."""

    def __init__(self, active: Callable[[], bool], interval_ms: int = 10) -> None:
        self.active = active
        self.interval = interval_ms
        self.samples: list[float] = []
        self.idle: list[float] = []
        self._last = time.perf_counter()
        self.timer = QTimer()
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    def _tick(self) -> None:
        now = time.perf_counter()
        (self.samples if self.active() else self.idle).append(max(0.0, (now - self._last) * 1000.0 - self.interval))
        self._last = now

    def p95(self, idle: bool = False) -> float:
        samples = self.idle if idle else self.samples
        return float(np.percentile(samples, 95)) if samples else 0.0

    def stop(self) -> None:
        self.timer.stop()
