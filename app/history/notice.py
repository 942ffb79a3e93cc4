"""What the conversation says about the history file: its troubles (damaged, read-only, gone, not writable)
as a ``Failure`` of stage "history", "saved again" when they are over, and which messages of the chat on
screen are not in the file yet (see ``app.history.store``)."""

from __future__ import annotations

from typing import Callable

from app.ground.failure import Failure
from app.history.store import HistoryStore


class HistoryNotices:
    """Subscribes to ``history.on_change``; ``fail(Failure)`` reports a problem (the window shows it)."""

    def __init__(self, history: HistoryStore, pane, fail: Callable[[Failure], None],
                 chat_id: Callable[[], int | None], closed: Callable[[], bool]) -> None:
        self.history = history
        self.pane = pane
        self._fail = fail
        self._chat_id = chat_id
        self._closed = closed
        self.notice = ""  # the notice shown about a standing history problem
        self.about_file = ""  # the last notice about the history file (standing or over: a damaged file set aside)
        history.on_change = self.changed

    def clear_notice(self) -> None:
        """Close the chat notice when another chat comes on screen; problems (the history file's among them) stay
        until dismissed (``app.ground.notice``)."""
        self.pane.notice.clear()

    def changed(self) -> None:
        """Say what happened to the history file and mark the unsaved messages."""
        if self._closed():
            return
        notices = self.history.take_notices()
        problems = [n for n in notices if n.kind != "saved"]
        if problems:
            text = "\n".join(n.message for n in problems)
            self.notice = text if self.history.problem else ""
            self.about_file = text
            kind = "".join(w.title() for w in problems[-1].kind.split("_"))
            self._fail(Failure(0, "history", text, f"History{kind}"))
        elif notices and self.notice and self.notice in self.pane.notice.problems:
            self.pane.notice.resolve(self.notice)  # "saved again" replaces the problem
            self.notice = ""
            self.about_file = notices[-1].message
            self.pane.notice.show_message(notices[-1].message, tone="info")
        self.show_unsaved()

    def show_unsaved(self) -> None:
        chat_id = self._chat_id()
        if chat_id is not None:
            self.pane.set_unsaved(self.history.unsaved_positions(chat_id))
