"""SIGTERM (and Ctrl+C's SIGINT) quit the app the way its Quit does: the running reply is saved as stopped.

By default SIGTERM ends the process at once, so a reply being written lost its "stopped" line (and
whatever streamed since the last 250 ms flush). Python runs a signal handler only when the interpreter
gets control, and inside Qt's C++ event loop that can be never while the app is idle; ``set_wakeup_fd``
makes the signal write a byte to a socket that a ``QSocketNotifier`` watches, so the loop wakes at once,
the handler runs, and it asks the event loop to quit. ``app.main`` then shuts the window down as for any
quit (``MainWindow.shutdown``: the reply stopped, its text and stats saved).
"""

from __future__ import annotations

import signal
import socket

from PySide6.QtCore import QObject, QSocketNotifier, QTimer
from PySide6.QtWidgets import QApplication

QUIT_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), signal.SIGINT) if s is not None)


class QuitOnSignals(QObject):
    """While it lives (parented to ``app``), SIGTERM / SIGINT make ``app`` leave its event loop; ``received``
    lists the signals that did."""

    def __init__(self, app: QApplication) -> None:
        super().__init__(app)
        self.app = app
        self.received: list[int] = []
        self._read, self._wake = socket.socketpair()
        for s in (self._read, self._wake):
            s.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._wake.fileno())
        self._notifier = QSocketNotifier(self._read.fileno(), QSocketNotifier.Type.Read, self)
        self._notifier.activated.connect(self._drain)
        self._previous = {s: signal.signal(s, self._on_signal) for s in QUIT_SIGNALS}

    def _drain(self) -> None:
        """The wake-up byte: reading it lets the interpreter run the pending handler (``_on_signal``)."""
        try:
            self._read.recv(64)
        except OSError:  # nothing left (another wake-up read it)
            pass

    def _on_signal(self, signum: int, _frame) -> None:
        # a handler runs between two bytecodes of whatever Python code was running: quitting from the event
        # loop's next turn, not from inside that code
        self.received.append(signum)
        QTimer.singleShot(0, self.app.quit)

    def uninstall(self) -> None:
        """The handlers and wake-up fd that were there before."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._previous_fd)
        self._notifier.setEnabled(False)
        self._read.close()
        self._wake.close()
