"""The conversation controller: the current chat, its replies, and the three places they live — the history
store, the chat pane and the engine worker.

It turns user requests (send, regenerate, edit-and-resend, stop, switch chat) into engine submissions
with a fresh ``generation_id``, and engine events back into the pane and the store. Events of any other
generation are dropped, so output of a stopped or replaced reply never reaches the pane. Streamed text
reaches SQLite in batches (``flush``), never as a rewrite of the chat.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

from app.chat_list import ChatList
from app.chat_pane import ChatPane
from app.failure import Failure
from app.history import HistoryStore
from app.settings import Settings
from app.worker import EngineThread
from engine.config import SamplingConfig
from engine.snapshot import TokenEvent


def title_from(text: str, limit: int = 40) -> str:
    """A chat title from its first message."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


class Conversation(QObject):
    """Chats and replies. ``generation_id`` is the reply in flight (0 when idle).

    Signals: ``reply_started(generation_id, cache_mode)``, ``token(TokenEvent)`` (current reply only),
    ``noted(list[str])`` (new notes of the current reply), ``reply_finished(generation_id, stop_reason)``,
    ``error(message)`` (a request that could not be made; nothing was saved), ``failed(Failure)`` (stage
    "history": the history file is damaged, read-only, gone or cannot be written; see ``app.history``).

    While the history file cannot be written, the messages not in it yet say so under them, and the
    notice about it stays above the chat until it is resolved or dismissed.

    A reply an engine error ended keeps its bubble and its row in the history: its stats hold
    ``stop_reason "error"`` and ``error`` (the reason), so the chat says why after a restart too; the
    reply's notes are saved in its stats as ``notes``.
    """

    reply_started = Signal(int, str)
    token = Signal(object)
    noted = Signal(object)
    reply_finished = Signal(int, str)
    error = Signal(str)
    failed = Signal(object)  # Failure

    def __init__(self, history: HistoryStore, settings: Settings, pane: ChatPane, chat_list: ChatList,
                 engine: EngineThread, sampling: Callable[[], SamplingConfig], cache_mode: Callable[[], str],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.settings = settings
        self.pane = pane
        self.chat_list = chat_list
        self.engine = engine
        self._sampling = sampling
        self._cache_mode = cache_mode
        self.ready = False  # a model is loaded
        self.chat_id: int | None = None
        self.generation_id = 0
        self._next_generation = 0
        self.tokens_in_reply = 0
        self.modes: list[str] = []  # cache modes the current reply ran under, in order
        self.notes: list[str] = []  # what the engine told the user during the current reply
        self._failure: Failure | None = None  # what ended the current reply, if an error did
        self.last_stats: dict[str, Any] = {}
        self._reply_message_id: int | None = None
        self._pending = ""
        self.closed = False  # set at shutdown: signals still queued from the worker are ignored
        self._history_notice = ""  # the notice shown about a standing history problem
        history.on_change = self._on_history_change

        pane.send_requested.connect(self.send)
        pane.stop_requested.connect(self.stop)
        pane.regenerate_requested.connect(self.regenerate)
        pane.edit_requested.connect(self.edit_and_resend)
        pane.pin_requested.connect(self.set_pinned)
        pane.new_chat_requested.connect(self.new_chat)
        pane.system_prompt_changed.connect(self._on_system_prompt)
        chat_list.chat_selected.connect(self.open_chat)
        chat_list.rename_requested.connect(self.rename_chat)
        chat_list.delete_requested.connect(self.delete_chat)
        w = engine.worker
        w.token.connect(self._on_token)
        w.noted.connect(self._on_noted)
        w.failed.connect(self._on_failed)
        w.finished.connect(self._on_finished)

    # -- chats ----------------------------------------------------------------------------------------------
    def load_chats(self) -> None:
        """Show the chat list and open the last chat (or a new one)."""
        self._on_history_change()  # what opening the history file found
        chats = self.history.chats()
        last = self.settings.get("window/last_chat")
        chosen = next((c for c in chats if c.id == last), chats[0] if chats else None)
        if chosen is None:
            chosen = self.history.create_chat()
            chats = [chosen]
        self.chat_list.set_chats(chats, chosen.id)
        self.open_chat(chosen.id)

    def _refresh_list(self) -> None:
        self.chat_list.set_chats(self.history.chats(), self.chat_id)

    def open_chat(self, chat_id: int) -> None:
        if chat_id == self.chat_id:
            return
        self._abandon_reply()
        chat = self.history.chat(chat_id)
        if chat is None:
            return
        self.chat_id = chat_id
        self.settings.set("window/last_chat", chat_id)
        self.pane.set_chat(chat.title, chat.system_prompt)
        self.pane.set_messages(self.history.messages(chat_id))
        self._show_unsaved()

    def new_chat(self) -> None:
        self._abandon_reply()
        chat = self.history.create_chat()
        self.chat_id = None
        self.chat_list.set_chats(self.history.chats(), chat.id)
        self.open_chat(chat.id)

    def rename_chat(self, chat_id: int, title: str) -> None:
        self.history.rename_chat(chat_id, title)
        if chat_id == self.chat_id:
            self.pane.title.setText(title)
        self._refresh_list()

    def delete_chat(self, chat_id: int) -> None:
        if chat_id == self.chat_id:
            self._abandon_reply()
        self.history.delete_chat(chat_id)
        self.engine.forget_chat(chat_id)
        if chat_id == self.chat_id:
            self.chat_id = None
            self.load_chats()
        else:
            self._refresh_list()

    def _on_system_prompt(self, text: str) -> None:
        if self.chat_id is not None:
            self.history.set_system_prompt(self.chat_id, text)

    # -- requests ---------------------------------------------------------------------------------------------
    def engine_messages(self) -> list[dict]:
        """The chat as the engine sees it: the system prompt, then the stored user/assistant messages."""
        if self.chat_id is None:
            return []
        chat = self.history.chat(self.chat_id)
        out = []
        if chat is not None and chat.system_prompt.strip():
            out.append({"role": "system", "content": chat.system_prompt.strip()})
        for m in self.history.messages(self.chat_id):
            if m.role == "user" or (m.role == "assistant" and m.content):
                item = {"role": m.role, "content": m.content}
                if m.stats.get("pinned"):
                    item["pinned"] = True  # the priority policy never evicts it
                out.append(item)
        return out

    def set_pinned(self, position: int, pinned: bool) -> None:
        """Pin (or unpin) the stored message at ``position``; it takes effect from the next reply."""
        if self.chat_id is None:
            return
        for m in self.history.messages(self.chat_id):
            if m.position == position:
                stats = dict(m.stats)
                if pinned:
                    stats["pinned"] = True
                else:
                    stats.pop("pinned", None)
                self.history.set_stats(m.id, stats)
                return

    def send(self, text: str) -> None:
        """Add a user message and ask for a reply."""
        if not self.ready or self.generation_id:
            return
        if not (self.history.problem and self.pane.notice.text == self._history_notice):
            self.pane.notice.clear()  # the user moved on from whatever it said (a history problem stays)
        if self.chat_id is None:
            self.chat_id = self.history.create_chat().id
        msg = self.history.add_message(self.chat_id, "user", text)
        if sum(m.role == "user" for m in self.history.messages(self.chat_id)) == 1:
            self.history.rename_chat(self.chat_id, title_from(text))
            self.pane.title.setText(title_from(text))
            self._refresh_list()
        self.pane.add_message("user", text, msg.position)
        self._request_reply()

    def regenerate(self) -> None:
        """Drop the last reply and ask again (the engine reuses the cached prompt)."""
        if not self.ready or self.generation_id or self.chat_id is None:
            return
        users = [m for m in self.history.messages(self.chat_id) if m.role == "user"]
        if users:
            self.history.truncate_after(self.chat_id, users[-1].position)
            self.pane.truncate_after(users[-1].position)
            self._request_reply()

    def edit_and_resend(self, position: int, text: str) -> None:
        """Replace a past user message, drop what followed and ask again (the common prefix is reused)."""
        if not self.ready or self.chat_id is None:
            return
        self._abandon_reply()
        target = next((m for m in self.history.messages(self.chat_id) if m.position == position), None)
        if target is None or target.role != "user":
            return
        self.history.set_content(target.id, text)
        self.history.truncate_after(self.chat_id, position)
        self.pane.truncate_after(position)
        self.pane.set_text_at(position, text)
        self._request_reply()

    def stop(self) -> None:
        if self.generation_id:
            self.engine.cancel(self.generation_id)

    def note_mode(self, mode: str) -> None:
        """The cache mode changed; a reply in flight records it (its stats say "cache paged → off")."""
        if self.generation_id and mode != self.modes[-1]:
            self.modes.append(mode)

    def _request_reply(self) -> None:
        try:
            sampling = self._sampling()
        except ValueError as exc:
            self.error.emit(str(exc))
            return
        messages = self.engine_messages()
        reply = self.history.add_message(self.chat_id, "assistant", "")
        self._reply_message_id = reply.id
        self._pending = ""
        self._next_generation += 1
        self.generation_id = self._next_generation
        self.tokens_in_reply = 0
        self.modes = [self._cache_mode()]
        self.notes = []
        self._failure = None
        self.pane.begin_reply(reply.position)
        self.pane.set_generating(True)
        self.reply_started.emit(self.generation_id, self.modes[0])
        self.engine.submit(self.generation_id, messages, sampling, self.chat_id)

    # -- engine events ----------------------------------------------------------------------------------------
    def _on_token(self, event: TokenEvent) -> None:
        if self.closed or not self.generation_id or event.generation_id != self.generation_id:
            return
        self.tokens_in_reply += 1
        self.pane.append_delta(event.text_delta)
        self._pending += event.text_delta
        self.token.emit(event)

    def flush(self) -> None:
        """Append the streamed text received since the last flush to the reply's row; let the history
        notice a deleted file and retry failed writes (the window calls this every 250 ms)."""
        if self._pending and self._reply_message_id is not None:
            self.history.append_text(self._reply_message_id, self._pending)
            self._pending = ""
        self.history.tick()

    # -- the history file -------------------------------------------------------------------------------
    def _on_history_change(self) -> None:
        """Say what happened to the history file (``failed``, stage "history") and mark unsaved messages."""
        if self.closed:
            return
        notices = self.history.take_notices()
        problems = [n for n in notices if n.kind != "saved"]
        if problems:
            text = "\n".join(n.message for n in problems)
            self._history_notice = text if self.history.problem else ""
            kind = "".join(w.title() for w in problems[-1].kind.split("_"))
            self.failed.emit(Failure(0, "history", text, f"History{kind}"))
        elif notices and self._history_notice and self.pane.notice.text == self._history_notice:
            self._history_notice = ""
            self.pane.notice.show_message(notices[-1].message)  # "saved again" replaces the problem
        self._show_unsaved()

    def _show_unsaved(self) -> None:
        if self.chat_id is not None:
            self.pane.set_unsaved(self.history.unsaved_positions(self.chat_id))

    def _on_noted(self, generation_id: int, notes: list) -> None:
        if self.closed or not self.generation_id or generation_id != self.generation_id:
            return
        self.notes.extend(notes)
        self.pane.show_reply_notes(self.notes)
        self.noted.emit(list(notes))

    def _on_failed(self, failure: Failure) -> None:
        """Keep the failure that ends the current reply; ``_on_finished`` (always next) shows and saves it."""
        if not self.closed and failure.ends_reply and failure.generation_id == self.generation_id:
            self._failure = failure

    def _on_finished(self, generation_id: int, reason: str, stats: Any, text: str) -> None:
        if self.closed or not generation_id or generation_id != self.generation_id:
            return
        self.flush()
        info = asdict(stats) if stats is not None else {}
        info.update(mode=" → ".join(self.modes), stop_reason=reason)
        info.setdefault("generated_tokens", self.tokens_in_reply)
        if reason == "error" and self._failure is not None:
            info["error"] = self._failure.message
        if self.notes:
            info["notes"] = list(self.notes)
        self.last_stats = info
        streamed = self.pane.streaming.text if self.pane.streaming is not None else ""
        if self._reply_message_id is not None:
            if text and text != streamed:
                self.history.set_content(self._reply_message_id, text)
            self.history.set_stats(self._reply_message_id, info)
        self.pane.finish_reply(text or None, info)
        self._end_reply()
        self.reply_finished.emit(generation_id, reason)

    def _abandon_reply(self) -> None:
        """Stop the reply in flight and close it in the GUI now (switching chats, editing)."""
        if not self.generation_id:
            return
        self.stop()
        self.flush()
        self.pane.finish_reply(None, {"stop_reason": "cancelled", "generated_tokens": self.tokens_in_reply})
        self._end_reply()

    def _end_reply(self) -> None:
        self.generation_id = 0
        self._reply_message_id = None
        self.pane.set_generating(False)
