"""What the panels, the trace and the status bar show of the chat on screen and its replies — the window's
side of the engine worker's snapshots (a reply in flight, an idle chat described, an API conversation selected).

Only the chat on screen's snapshots reach the panels, so panels, captions and the status bar always describe the
chat on screen — and one snapshot of it: the panel scheduler's frame sets every caption and the status bar's
context and speed in one call (``on_frame``), and a cache setting applied reaches the status bar's cache field
with the first frame taken under it (``unshown``), so no caption says the old page size beside the new setting.
Besides that setting and each chat's last reply (its timing comes back with it), ``ReplyReadouts`` holds no state:
it routes between the window's parts (``w``).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, QTimer

from app.shell.glossary import describe_switches
from app.shell.status_bar import context_counts
from engine.config import CacheConfig
from engine.snapshot import CacheSnapshot


class ReplyReadouts(QObject):
    """Connected by the window to the worker's, the conversation's, the cache controller's and the server's
    signals; ``describe_chat`` asks the worker for the chat on screen (after a load, a switch, a change).

    A ``QObject`` of the GUI thread on purpose: the worker's signals reach its methods queued, on this thread
    (a plain object's methods would run on the worker's thread and draw the panels from there)."""

    def __init__(self, window) -> None:
        super().__init__(window)
        self.w = window
        self.unshown: CacheConfig | None = None  # a setting applied, shown with the first frame under it
        self.last_replies: dict[Any, int] = {}  # chat id → its last reply's generation id (since the app started)

    def show_setting(self) -> None:
        """The status bar's cache field says the setting applied last (``on_cache_applied``)."""
        if self.unshown is not None:
            self.w.status.show_cache(self.unshown)
            self.unshown = None

    def on_chat_opened(self, chat_id: int) -> None:
        """Another chat is on screen: the panels, the trace and the context readout start over for it."""
        self.w.api_list.deselect()
        self.w.trace.open(chat_id)  # its replies' steps since the app started (kept while other chats were shown)
        self.w.controls.show_notes([])  # what the last change did was about the chat that left the screen
        self.w.scheduler.clear()
        self.show_setting()
        # its last reply's timing comes back (the one running in it: so far; it sends its own snapshots)
        self.w.timing.show_reply(self.w.generation_id or self.last_replies.get(chat_id, 0))
        if not self.w.generation_id:
            self.describe_chat()

    def describe_chat(self) -> bool:
        """Ask the worker for the chat on screen's cache and token count (``on_described``); False: none to ask."""
        if self.w.chat_id is None or self.w.info is None:
            return False
        self.w.engine.describe_chat(self.w.chat_id, self.w.conversation.engine_messages())
        return True

    def on_described(self, chat_id: Any, snap: CacheSnapshot | None, tokens: int) -> None:
        self.show_setting()  # the setting and the panels describing the chat under it change together
        if chat_id != self.w.chat_id or self.w.generation_id or self.w.api_list.selected:
            return  # another chat is on screen by now, or its own reply's snapshots describe it
        if snap is not None:
            self.w.scheduler.offer(snap)
            self.w.scheduler.refresh_all()
        else:
            self.w.scheduler.clear()
            total = self.w.info.context_length if self.w.info is not None else 0
            chat = max(tokens, 0)  # a reopened chat may be longer than the context: at most all of it is read
            self.w.status.show_context(min(chat, total) if total else chat, total, self.w.cache.applied.overflow,
                                       chat)
            self.w.conversation.check.chat_tokens = chat
            self.w.controls.set_chat_length(chat, total)

    def on_snapshot(self, snap: CacheSnapshot) -> None:
        """A snapshot of the reply in flight; only the chat on screen's reaches the panels (idle chats are
        described by ``on_described``)."""
        gen = self.w.conversation.generation_id
        if not gen or snap.generation_id != gen:
            return
        self.w.scheduler.offer(snap)
        self.w.trace.add(snap)
        self.w.conversation.check.chat_tokens = snap.seq_len - snap.evicted_total

    def on_frame(self, snap: CacheSnapshot) -> None:
        """The panels' new frame: the status bar describes the same moment."""
        used, chat = context_counts(snap)  # the definitions the occupancy caption uses too
        if self.unshown is not None and under(snap, self.unshown):
            self.show_setting()
        self.w.status.show_context(used, snap.context_length, self.w.cache.applied.overflow, chat)
        self.w.controls.set_chat_length(chat, snap.context_length)
        if not self.w.generation_id:
            self.w.conversation.check.chat_tokens = used
        if self.w.generation_id and snap.decode_tokens_per_s:
            self.w.status.show_speed(snap.decode_tokens_per_s)

    def on_reply_started(self, generation_id: int, mode: str) -> None:
        self.w.trace.begin(generation_id)
        self.last_replies[self.w.chat_id] = generation_id
        self.w.timing.begin_reply(generation_id, self.timing_label([mode]))

    def timing_label(self, modes: list[str]) -> str:
        """The timing caption's name of a reply: its cache mode(s) and, on a CPU, the threads it ran on."""
        info = self.w.info
        threads = f" · {info.threads} CPU thread{'s' if info.threads > 1 else ''}" if (
            info is not None and info.device == "cpu" and info.threads) else ""
        return "cache " + " → ".join(modes) + threads

    def on_reply_finished(self, generation_id: int, reason: str) -> None:
        QTimer.singleShot(0, self.w.scheduler.refresh_all)  # every panel shows the reply's final state
        self.w.disk.refresh()  # the pages this reply wrote to the KV disk tier
        self.show_setting()
        c = self.w.conversation
        last = c.last_reply
        if last is not None and last.generation_id == generation_id:  # its timing says what its footer says
            self.w.why.set_places(generation_id, last.places)  # where its recomputed tokens sit in the chat
            stats = c.last_stats if last.chat_id == c.chat_id else next(
                (m.stats for m in reversed(c.history.messages(last.chat_id)) if m.id == last.message_id), {})
            self.w.timing.finish_reply(generation_id, stats.get("ttft_ms") or 0.0,
                                       stats.get("decode_tokens_per_s") or 0.0)
        speed = c.last_stats.get("decode_tokens_per_s")
        if speed:
            self.w.status.show_speed(speed)
        self.w.reply_finished.emit(generation_id, reason)

    def show_why(self) -> None:
        """A reply footer's "Why?" (or View ▸ Why were tokens recomputed?): the readout in front, drawn now."""
        dock = self.w.docks["why"]
        dock.show()
        dock.raise_()
        self.w.scheduler.refresh_all()

    def on_reply_notes(self, notes: list) -> None:
        """Notes of the reply in flight (also shown under it): in the status bar and the trace."""
        self.w.trace.notes.extend(notes)
        self.w.status.message("; ".join(notes), 6000)

    def on_cache_applied(self, cfg: CacheConfig, notes: list) -> None:
        self.w.chat.set_priority(cfg.policy == "priority")
        self.w.model_card.set_reuse(cfg.checkpoints, cfg.page_size)  # what reuse costs on the model, under it
        if self.w.generation_id:
            # the reply's stats line shows e.g. "cache paged → off · switched mid-reply: keys full precision → 8-bit"
            self.w.conversation.note_mode(cfg.mode, describe_switches(self.w.cache.previous, cfg))
            self.w.timing.current.label = self.timing_label(self.w.conversation.modes)
        self.w.trace.notes.extend(notes)
        if notes:
            self.w.status.message("; ".join(notes), 6000)
        self.unshown = cfg  # shown in the frame that describes the chat under it
        if not self.w.generation_id and not self.describe_chat():  # the chat on screen under the new settings
            self.show_setting()

    def on_api_selected(self, session_id: int) -> None:
        """An API conversation was selected (0: none): it takes the chat's place on screen and the panels wait
        for its snapshot, or the chat comes back with its panels."""
        self.w.trace.open(("api", session_id) if session_id else self.w.chat_id)
        self.w.scheduler.clear()
        self.w.api_view.show(session_id)
        if not session_id and self.w.generation_id:
            self.w.timing.show_reply(self.w.generation_id)
        elif not session_id:
            self.describe_chat()

    def on_api_snapshot(self, session_id: int, snap: CacheSnapshot) -> None:
        """A snapshot of an API conversation (taken on the server's engine thread): drawn while selected."""
        if session_id and session_id == self.w.api_list.selected:
            self.w.scheduler.offer(snap)
            self.w.scheduler.refresh_all()
            self.w.api_snapshot_shown.emit(session_id, snap)


def under(snap: CacheSnapshot, cfg: CacheConfig) -> bool:
    """The snapshot was taken under ``cfg`` (its mode, page size, precision and policy)."""
    return (snap.mode, snap.page_size, snap.policy, snap.k_dtype, snap.v_dtype) == (
        cfg.mode, cfg.page_size if cfg.mode == "paged" else 0, cfg.policy, cfg.k_dtype, cfg.v_dtype)
