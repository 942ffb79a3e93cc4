"""A re-prefill says so while it runs: tokens a cache change mid-reply left to read again (StreamingLLM → H2O,
eviction off, the cache turned on), in the reply's bubble and the status bar — what, how many, how far, Stop.

The engine tracks it (``engine.core.reprefill``; the worker's ``reprefilling`` carries each step's
``engine.core.records.Reprefill``); this puts it into words (``app.ground.note_words``) when it is expected to take
longer than ``note_words.SHOW_AFTER_MS`` at the model's measured prefill rate, or turns out to. Its time is never
the reply's TTFT: the footer names it apart once the reply ends.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal, Slot

from app.ground import note_words


class ReprefillLine(QObject):
    """Shows the running reply's re-prefill on the chat pane's streaming bubble and the status bar.

    ``shown(generation_id, text)`` fires each time the line changes ("" when it goes), for tests and the self-test.
    """

    shown = Signal(int, str)

    def __init__(self, pane, status, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.pane, self.status = pane, status
        self.conversation = None
        self.generation_id = 0  # the reply whose line is up (0: none)
        self.text = ""

    def connect(self, conversation, worker) -> None:
        self.conversation = conversation
        worker.reprefilling.connect(self.on_progress)  # a bound slot: queued to this (the GUI) thread
        conversation.reply_finished.connect(self._on_finished)
        conversation.chat_opened.connect(lambda _chat: self._put(0, ""))

    @Slot(int, object)
    def on_progress(self, generation_id: int, r) -> None:
        """The engine moved reply ``generation_id``'s re-prefill on (or began one)."""
        if self.conversation is None or generation_id != self.conversation.generation_id:
            return  # a reply in another chat: not on screen
        show = r.running and note_words.reprefill_shown(r)
        self._put(generation_id, note_words.reprefill_progress(r) if show else "",
                  f"Re-prefilling: {r.done:,} of {r.tokens:,} tokens · Esc stops" if show else "")

    def _on_finished(self, generation_id: int, _reason: str) -> None:
        if generation_id == self.generation_id:
            self._put(0, "")

    def _put(self, generation_id: int, text: str, short: str = "") -> None:
        """The bubble's line ``text``, and ``short`` in the status bar (a field that shares the bar with others)."""
        if text == self.text:
            return
        gen = generation_id or self.generation_id
        self.generation_id, self.text = (generation_id if text else 0), text
        bubble = self.pane.streaming
        if bubble is not None:
            bubble.set_progress(text)
        self.status.show_wait(short)
        self.shown.emit(gen, text)
