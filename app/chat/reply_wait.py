"""A reply that waits says so: what it waits for and for how long, in its bubble and the status bar, with Stop as
the way out.

From the moment a reply is asked for until the engine's first step for it (a token or a prefill chunk's
snapshot) the reply is waiting, not working: for a chat's cache to come back from host memory, for a model
load, for the engine thread to finish what it was doing. The worker names the cause when it knows one
(``EngineWorker.waiting``); otherwise, once the wait has lasted a second, the bubble says the engine is busy.
The engine never counts this time in TTFT or prefill tok/s (``TurnState.waited_ms``), so the figures under the
reply are the model's work alone.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from app.chat.reprefill_line import ReprefillLine

TICK_MS = 500  # the seconds counter's refresh
GENERIC_AFTER_S = 1.0  # a wait of unknown cause is shown from here on (shorter ones are not worth a flicker)
GENERIC = "the engine to finish what it is doing"


def wait_text(what: str, seconds: float) -> str:
    """'waiting for this chat's cache to come back from host memory · 3 s · Stop (Esc) cancels'."""
    return f"waiting for {what} · {seconds:.0f} s · Stop (Esc) cancels"


class ReplyWait(QObject):
    """Watches the reply on screen from ``begin`` until the engine's first step for it (``step``) or its end.

    ``shown(generation_id, text)`` fires each time the wait's text is put on screen ("" when it is cleared), so
    tests and the self-test see exactly what the user saw.
    """

    shown = Signal(int, str)

    def __init__(self, pane, status, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.pane = pane
        self.status = status
        self.generation_id = 0
        self.what = ""  # the cause the worker named ("": none yet)
        self.text = ""  # what is on screen now
        self._t0 = 0.0
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self._show)

    def connect(self, conversation, worker) -> None:
        """Follow the conversation's replies and the worker's events (queued to this, the GUI thread)."""
        self.reprefill = ReprefillLine(self.pane, self.status, self)  # a wait mid-reply: tokens read again, said
        self.reprefill.connect(conversation, worker)
        conversation.reply_started.connect(self.begin)
        conversation.reply_finished.connect(self.step)
        worker.waiting.connect(self.cause)
        worker.token.connect(self._on_event)  # a bound slot: queued to this thread (a lambda would run on theirs)
        worker.snapshot.connect(self._on_event)

    @Slot(object)
    def _on_event(self, event) -> None:
        self.step(event.generation_id)

    def begin(self, generation_id: int, *_args) -> None:
        """A reply was asked for: it waits until its first step."""
        self.generation_id, self.what, self._t0 = generation_id, "", time.monotonic()
        self._timer.start()

    def cause(self, generation_id: int, what: str) -> None:
        """The worker says what the reply waits for (``EngineWorker.waiting``)."""
        if generation_id == self.generation_id and self._timer.isActive():
            self.what = what
            self._show()

    def step(self, generation_id: int) -> None:
        """The engine worked on the reply (a token, a prefill chunk) or ended it: the wait is over."""
        if generation_id != self.generation_id or not self._timer.isActive():
            return
        self._timer.stop()
        if self.text:
            self.text = ""
            self._put("")

    @property
    def waiting(self) -> bool:
        return self._timer.isActive()

    def _show(self) -> None:
        seconds = time.monotonic() - self._t0
        what = self.what or (GENERIC if seconds >= GENERIC_AFTER_S else "")
        if not what:
            return
        self.text = wait_text(what, seconds)
        self._put(self.text)

    def _put(self, text: str) -> None:
        bubble = self.pane.streaming
        if bubble is not None:
            bubble.set_waiting(text)
        self.status.show_wait(text)
        self.shown.emit(self.generation_id, text)
