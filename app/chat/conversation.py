"""The conversation controller: the chat on screen, its replies, and the three places they live — the
history store, the chat pane and the engine worker.

It turns user requests (send, regenerate, edit-and-resend, stop, switch chat) into engine submissions with
a fresh ``generation_id``, and engine events back into the pane and the store. A reply belongs to its chat,
not to the screen: opening another chat lets it finish in the background (the chat list says "replying…"),
and its text and stats are saved either way. The worker runs one reply at a time, so a message sent in
another chat stops a background reply — and that reply says so under it. Streamed text reaches SQLite in
batches (``flush``), never as a rewrite of the chat.

Over 400 lines on purpose: it is the one writer of the chat on screen and its reply in flight, so the store,
the pane and the worker are kept in step in one place; what stands alone is beside it (``replies``,
``send_check``, ``tool_messages``, ``chat_list``).
"""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

from app.chat.chat_list import ChatList, title_from
from app.chat.pane import ChatPane
from app.ground.failure import Failure
from app.ground.status_bar import context_counts
from app.history.store import HistoryStore
from app.history.notice import HistoryNotices
from app.ground.note_words import plain_note, reply_notes
from app.chat.replies import (Reply, against_own_prefill, edited_versions, mark_unfinished, pick_version,
                              versions_of)
from app.chat.send_check import SendCheck
from app.chat.tool_messages import engine_message
from app.chat.spec_demo import RepeatDemo
from app.settings.store import Settings
from app.link.engine_thread import EngineThread
from engine.config import CacheConfig, SamplingConfig
from engine.snapshot import TokenEvent


class Conversation(QObject):
    """Chats and replies. ``generation_id`` is the reply in flight in the chat on screen (0 when none).

    Signals: ``reply_started(generation_id, cache_mode)``, ``token(TokenEvent)`` (any reply's, in any chat),
    ``noted(list[str])`` (new notes of that reply), ``reply_finished(generation_id, stop_reason)`` (any
    reply), ``error(message)`` (a request that could not be made; nothing was saved), ``chat_opened(id)``,
    ``failed(Failure)`` (stage "history": the history file is damaged, read-only, gone or cannot be
    written; see ``app.history.store``). While the history file cannot be written, the messages not in it yet say
    so under them, and the notice about it stays above the chat until it is resolved or dismissed.
    """

    reply_started = Signal(int, str)
    user_sending = Signal()  # a user's message is about to join the chat (whatever waits on the last reply ends)
    token = Signal(object)
    noted = Signal(object)
    reply_finished = Signal(int, str)
    error = Signal(str)
    chat_opened = Signal(int)
    failed = Signal(object)  # Failure

    def __init__(self, history: HistoryStore, settings: Settings, pane: ChatPane, chat_list: ChatList,
                 engine: EngineThread, sampling: Callable[[], SamplingConfig], cache: Callable[[], CacheConfig],
                 parent: QObject | None = None, apply_cache: Callable[[CacheConfig], None] | None = None,
                 new_settings: Callable[[], str] = lambda: "") -> None:
        super().__init__(parent)
        self.history = history
        self.settings = settings
        self.pane = pane
        self.chat_list = chat_list
        self.engine = engine
        self._sampling = sampling
        self._cache = cache
        self._new_settings = new_settings  # a new chat's own settings: the user's defaults
        self.tool_use: Callable[[list[dict]], Any] = lambda _messages: None  # the MCP tools a reply may call (app.agent)
        self.apply_cache = apply_cache or (lambda cfg: engine.apply_cache_config(cfg))
        self.ready = False  # a model is loaded
        self.chat_id: int | None = None
        self.replies: dict[int, Reply] = {}  # by generation id, until the worker's ``finished``
        self.running: Reply | None = None  # the reply the worker is writing (in any chat)
        self.last_reply: Reply | None = None  # the last one that finished
        self._next_generation = 0
        self.last_stats: dict[str, Any] = {}
        self.closed = False  # set at shutdown: signals still queued from the worker are ignored
        self.check, self.demo = SendCheck(self, pane, engine, cache), RepeatDemo(self, pane)  # the repeat starter
        self.notices = HistoryNotices(history, pane, self.failed.emit, lambda: self.chat_id, lambda: self.closed)
        pane.new_chat_requested.connect(self.new_chat)  # the pane's other requests go to the chat on screen
        chat_list.chat_selected.connect(self.open_chat)
        chat_list.rename_requested.connect(self.rename_chat)
        chat_list.delete_requested.connect(self.delete_chat)
        w = engine.worker
        w.token.connect(self._on_token)
        w.snapshot.connect(self._on_snapshot)
        w.noted.connect(self._on_noted)
        w.placed.connect(self._on_placed)
        w.failed.connect(self._on_failed)
        w.finished.connect(self._on_finished)

    # -- the reply on screen ----------------------------------------------------------------------------------
    @property
    def reply(self) -> Reply | None:
        """The running reply if it belongs to the chat on screen."""
        r = self.running
        return r if r is not None and r.chat_id == self.chat_id else None

    @property
    def generation_id(self) -> int:
        r = self.reply
        return r.generation_id if r is not None else 0

    @property
    def tokens_in_reply(self) -> int:
        """Tokens of the running reply (of the last one once it finished)."""
        r = self.running or self.last_reply
        return r.tokens if r is not None else 0

    @property
    def modes(self) -> list[str]:
        r = self.running
        return r.modes if r is not None else []

    # -- chats ----------------------------------------------------------------------------------------------
    def load_chats(self) -> None:
        """Show the chat list and open the last chat (or a new one)."""
        self.notices.changed()  # what opening the history file found
        chats = self.history.chats()
        last = self.settings.get("window/last_chat")
        chosen = next((c for c in chats if c.id == last), chats[0] if chats else None)
        if chosen is None:
            chosen = self.history.create_chat(system_prompt=self.settings.get("chat/system_prompt"),
                                            settings=self._new_settings())
            chats = [chosen]
        self.chat_list.set_chats(chats, chosen.id)
        self.open_chat(chosen.id)

    def _refresh_list(self) -> None:
        self.chat_list.set_chats(self.history.chats(), self.chat_id)

    def open_chat(self, chat_id: int) -> None:
        """Show a chat. A reply running elsewhere goes on; one running in this chat streams into it again."""
        if chat_id == self.chat_id:
            return
        chat = self.history.chat(chat_id)
        if chat is None or chat.server:  # a remote chat opens in app.remote.chat
            return
        self.flush()
        self.chat_id = chat_id
        self.chat_list.select(chat_id)
        self.settings.set("window/last_chat", chat_id)
        self.notices.clear_notice()  # what it said was about the chat left behind (or the app): only a standing
        # history problem stays (a failed model load's banner followed into every new chat)
        self.pane.set_chat(chat.title, chat.system_prompt)
        self.pane.set_messages(mark_unfinished(self.history, chat_id, self.running))
        self.notices.show_unsaved()
        reply = self.reply
        if reply is not None:  # its bubble streams again from what is saved plus what is pending
            self.pane.resume_reply(reply.position, reply.pending, reply.notes, reply.draft_spans)
        self.pane.set_generating(reply is not None)
        self.chat_opened.emit(chat_id)

    def leave(self) -> None:
        """No chat on screen (an API conversation is): a reply running here goes on in the background."""
        self.flush()
        self.chat_id = None
        self.chat_list.deselect()
        self.pane.set_generating(False)

    def new_chat(self) -> None:
        chat = self.history.create_chat(system_prompt=self.settings.get("chat/system_prompt"),
                                            settings=self._new_settings())  # Settings ▸ New chats
        self.chat_list.set_chats(self.history.chats(), chat.id)
        self.open_chat(chat.id)

    def rename_chat(self, chat_id: int, title: str) -> None:
        self.history.rename_chat(chat_id, title)
        if chat_id == self.chat_id:
            self.pane.title.setText(title)
        self._refresh_list()

    def delete_chat(self, chat_id: int) -> None:
        if self.running is not None and self.running.chat_id == chat_id:
            self.running.stop_detail = "its chat was deleted"
        self.history.delete_chat(chat_id)
        self.engine.forget_chat(chat_id)  # stops its reply, frees its cache
        if chat_id == self.chat_id:
            self.chat_id = None
            self.load_chats()
        else:
            self._refresh_list()

    # the local chat's answers to the pane's requests (``app.ground.screen.ChatActions``), while it is on screen
    def edit(self, position: int, text: str) -> None:
        self.edit_and_resend(position, text)

    def pin(self, position: int, pinned: bool) -> None:
        self.set_pinned(position, pinned)

    def set_system_prompt(self, text: str) -> None:
        if self.chat_id is not None:
            self.history.set_system_prompt(self.chat_id, text)
            last = next((m for m in reversed(self.history.messages(self.chat_id)) if m.role == "assistant"), None)
            if last is not None and "context" in last.stats:  # its counts no longer describe the chat: counted anew
                self.history.set_stats(last.id, {k: v for k, v in last.stats.items() if k != "context"})

    def _retitle(self, old_first: str, new_first: str) -> None:
        """The chat's first message changed: a title made from it follows (a title the user gave stays)."""
        chat = self.history.chat(self.chat_id)
        if chat is not None and chat.title in ("New chat", title_from(old_first)):
            self.history.rename_chat(self.chat_id, title_from(new_first))
            self.pane.title.setText(title_from(new_first))
            self._refresh_list()

    # -- requests -------------------------------------------------------------------------------------------
    def engine_messages(self, chat_id: int | None = None) -> list[dict]:
        """The chat as the engine sees it: the system prompt, then the stored user/assistant messages."""
        chat_id = self.chat_id if chat_id is None else chat_id
        chat = self.history.chat(chat_id) if chat_id is not None else None
        if chat is None:
            return []
        out = [{"role": "system", "content": chat.system_prompt.strip()}] if chat.system_prompt.strip() else []
        for m in self.history.messages(chat_id):  # tool calls and their results too (``app.chat.tool_messages``)
            item = engine_message(m.role, m.content, m.stats)
            if item is not None:
                out.append(item)
        return out

    def engine_index(self, chat_id: int, message_id: int) -> int | None:
        """Where the stored message ``message_id`` sits in ``engine_messages(chat_id)`` (None: not there)."""
        chat = self.history.chat(chat_id)
        index = 1 if chat is not None and chat.system_prompt.strip() else 0
        for m in self.history.messages(chat_id):
            if engine_message(m.role, m.content, m.stats) is not None:
                if m.id == message_id:
                    return index
                index += 1
        return None

    def set_pinned(self, position: int, pinned: bool) -> None:
        """Pin (or unpin) the stored message at ``position``; it takes effect from the next reply. Its token
        count is asked for and saved with it (shown under it, also after the chat is reopened)."""
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
                if pinned:
                    self.check.count_pinned(self.chat_id, m.id, position)
                return

    def show_version(self, position: int, index: int) -> None:
        """Show version ``index`` of the reply at ``position``; the chat goes on from it."""
        if self.chat_id is None or self.running is not None and self.running.chat_id == self.chat_id:
            return
        m = next((m for m in self.history.messages(self.chat_id) if m.position == position), None)
        picked = pick_version(m.stats, index) if m is not None else None
        if picked is not None:
            self.history.set_content(m.id, picked[0])
            self.history.set_stats(m.id, picked[1])
            self.pane.show_version(position, *picked)

    def send(self, text: str, checked: bool = False) -> None:
        """Add a user message and ask for a reply (after ``SendCheck`` when the context may be nearly full)."""
        if not self.ready or self.generation_id:
            return
        if not checked and not self.check.fits(text):
            return  # the check sends it, or warns and gives the text back to the input
        self.notices.clear_notice()  # the user moved on from whatever it said
        if self.chat_id is None:
            self.chat_id = self.history.create_chat(system_prompt=self.settings.get("chat/system_prompt"),
                                            settings=self._new_settings()).id
        self.user_sending.emit()
        msg = self.history.add_message(self.chat_id, "user", text)
        if sum(m.role == "user" for m in self.history.messages(self.chat_id)) == 1:
            self._retitle("", text)
        self.pane.add_message("user", text, msg.position)
        self._request_reply()

    def regenerate(self) -> None:
        """Ask again for the last reply; the one it replaces stays as a version to switch back to."""
        if not self.ready or self.generation_id or self.chat_id is None:
            return
        messages = self.history.messages(self.chat_id)
        users = [m for m in messages if m.role == "user"]
        if not users:
            return
        last = messages[-1]
        versions = versions_of(last.content, last.stats) if last.role == "assistant" else []
        self.history.truncate_after(self.chat_id, users[-1].position)
        self.pane.truncate_after(users[-1].position)
        self._request_reply(versions)

    def edit_and_resend(self, position: int, text: str) -> None:
        """Replace a past user message, drop what followed and ask again (the common prefix is reused)."""
        if not self.ready or self.chat_id is None or self.generation_id:
            return
        messages = self.history.messages(self.chat_id)
        target = next((m for m in messages if m.position == position), None)
        if target is None or target.role != "user":
            return
        first = next(m for m in messages if m.role == "user")
        old = next((m for m in messages if m.position > position), None)  # the reply it had: kept as a version
        versions = edited_versions(old, target.content) if old is not None and old.role == "assistant" else []
        self.history.set_content(target.id, text)
        self.history.truncate_after(self.chat_id, position)
        self.pane.truncate_after(position)
        self.pane.set_text_at(position, text)
        if target.id == first.id:
            self._retitle(first.content, text)
        self._request_reply(versions)

    def stop(self) -> None:
        """Stop the reply on screen (Stop, Esc)."""
        if self.generation_id:
            self.engine.cancel(self.generation_id)

    def interrupt(self, why: str) -> None:
        """Something other than the user stops the running reply (another model loads): it will say why."""
        if self.running is not None:
            self.running.stop_detail = why

    def note_mode(self, mode: str, switches: list[str] = ()) -> None:
        """The cache setting changed; a reply in flight records it (its stats say "cache paged → off" and
        ``switches``: what else changed, in the controls' words)."""
        r = self.running
        if r is not None and mode != r.modes[-1]:
            r.modes.append(mode)
        if r is not None:
            r.switches.extend(switches)

    def _request_reply(self, versions: list | None = None) -> None:
        try:
            sampling = self._sampling()
        except ValueError as exc:
            self.error.emit(str(exc))
            return
        messages = self.engine_messages()
        reply_row = self.history.add_message(self.chat_id, "assistant", "")
        if versions:  # saved now: a crash during the new reply must not lose the earlier ones
            self.history.set_stats(reply_row.id, {"versions": versions, "version": len(versions)})
        if self.running is not None:  # the worker stops it to start this one
            self.running.stop_detail = self.running.stop_detail or "a message was sent in another chat"
        self._next_generation += 1
        reply = Reply(self._next_generation, self.chat_id, reply_row.id, reply_row.position,
                      [self._cache().mode], list(versions or []))
        self.replies[reply.generation_id] = reply
        self.running = reply
        self.chat_list.set_busy(reply.chat_id)
        self.pane.begin_reply(reply.position, len(reply.versions))
        self.pane.set_generating(True)
        self.reply_started.emit(reply.generation_id, reply.modes[0])
        self.engine.submit(reply.generation_id, messages, sampling, self.chat_id, self.tool_use(messages))

    def continue_reply(self) -> bool:
        """The model goes on after tool results were added (the agent loop: ``app.agent``); False when it cannot
        now (no model, a reply running, no chat)."""
        if not self.ready or self.generation_id or self.chat_id is None:
            return False
        self._request_reply()
        return True

    # -- engine events --------------------------------------------------------------------------------------
    def _on_token(self, event: TokenEvent) -> None:
        reply = self.replies.get(event.generation_id)
        if self.closed or reply is None:
            return
        reply.tokens += 1
        reply.add_text(event.text_delta, event.draft)
        if reply.chat_id == self.chat_id:
            self.pane.append_delta(event.text_delta, event.draft)
        self.token.emit(event)  # the timing panel counts a reply's tokens in the background too

    def _on_snapshot(self, snap) -> None:
        """A step of a reply: its chat's context then (the one saved with it is its last)."""
        reply = self.replies.get(snap.generation_id)
        if reply is not None and not self.closed:
            used, chat = context_counts(snap)
            reply.context = {"used": used, "total": int(snap.context_length), "chat": chat}

    def flush(self) -> None:
        """Append the streamed text received since the last flush to each reply's row; let the history
        notice a deleted file and retry failed writes (the window calls this every 250 ms)."""
        for reply in self.replies.values():
            self.flush_reply(reply)
        self.history.tick()

    def _on_noted(self, generation_id: int, notes: list) -> None:
        reply = self.replies.get(generation_id)
        if self.closed or reply is None:
            return
        notes = [plain_note(n, self._cache()) for n in reply_notes(notes)]  # the controls' words, not the engine's
        reply.notes.extend(notes)
        if reply.chat_id == self.chat_id:
            self.pane.show_reply_notes(reply.notes)
            self.noted.emit(list(notes))

    def _on_placed(self, generation_id: int, places: list) -> None:
        """Where the reply's recomputed prompt tokens sit in the chat (saved with it: its footer names the message)."""
        if generation_id in self.replies:
            self.replies[generation_id].places = list(places)

    def _on_failed(self, failure: Failure) -> None:
        """Keep the failure that ends a reply; ``_on_finished`` (always next) shows and saves it."""
        reply = self.replies.get(failure.generation_id)
        if not self.closed and failure.ends_reply and reply is not None:
            reply.failure = failure

    def _on_finished(self, generation_id: int, reason: str, stats: Any, text: str) -> None:
        reply = self.replies.pop(generation_id, None)
        if self.closed or reply is None:
            return
        self.flush_reply(reply)
        text = text or reply.streamed
        info = against_own_prefill(reply.stats(reason, stats, text), self.history.messages(reply.chat_id)[:-1])
        if text != reply.streamed:
            self.history.set_content(reply.message_id, text)
        self.history.set_stats(reply.message_id, info)
        self.last_reply = reply
        if self.running is reply:
            self.running = None
            self.chat_list.set_busy(None)
        if reply.chat_id == self.chat_id:
            self.last_stats = info
            self.pane.finish_reply(text or None, info)
            self.pane.set_generating(self.reply is not None)
        self.reply_finished.emit(generation_id, reason)

    def flush_reply(self, reply: Reply) -> None:
        if reply.pending:
            self.history.append_text(reply.message_id, reply.pending, tokens=reply.tokens)
            reply.pending = ""

    def close(self) -> None:
        """The app closes: what streamed is saved, and a reply still running says the app closed."""
        self.flush()
        for reply in self.replies.values():
            self.history.set_stats(reply.message_id, reply.stats("interrupted", None, reply.streamed)
                                   | {"stop_detail": "the app was closed"})
        self.replies.clear()
        self.running = None
        self.closed = True
