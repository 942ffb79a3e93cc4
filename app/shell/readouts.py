"""``ScreenWriter``: the news about the chat on screen, written into the one record of what the screen shows
(``app.ground.screen.Screen``) — the worker's snapshots and descriptions, the conversation's replies, the cache
controller's settings, the API server's snapshots.

It writes fields, never widgets: the status bar, the panels' scheduler, the trace, the timing panel, the Why dock,
the cache controls, the send check and the chat pane subscribe to the fields they show (``Screen.connect``). Only the
chat on screen's snapshots are written, so every surface describes the chat on screen — and one snapshot of it: the
panel scheduler's frame, its context counts, its speed and the setting it was taken under are set in one update
(``on_frame``), and a cache setting applied is named in the status bar with the first frame taken under it, so no
caption says the old page size beside the new setting.
"""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import QObject

from app.ground.glossary import describe_switches
from app.ground.screen import Context, OnScreen, ReplyView, Screen
from app.ground.status_bar import context_counts
from engine.config import CacheConfig
from engine.snapshot import CacheSnapshot


class ScreenWriter(QObject):
    """Connected by the window to the worker's, the conversation's, the cache controller's and the server's signals;
    ``describe_chat`` asks the worker for the chat on screen (after a load, a switch, a change).

    A ``QObject`` of the GUI thread on purpose: the worker's signals reach its methods queued, on this thread."""

    def __init__(self, screen: Screen, conversation, engine, cache, info: Callable[[], Any],
                 api_selected: Callable[[], int], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.screen = screen
        self.conversation = conversation
        self.engine = engine
        self.cache = cache  # the CacheController: the setting in force and the one before it
        self._info = info
        self._api_selected = api_selected
        self.unshown: CacheConfig | None = None  # a setting applied, named with the first frame under it
        self.replies: dict[Any, ReplyView] = {}  # chat id → its last reply begun since the app started
        self._saved_for: Any = None  # the chat whose context shown is its last reply's saved record

    # -- the chat on screen -------------------------------------------------------------------------------------
    def show_setting(self) -> None:
        """The status bar's cache field names the setting applied last (``on_cache_applied``)."""
        if self.unshown is not None:
            cfg, self.unshown = self.unshown, None
            self.screen.update(shown_settings=cfg)

    def on_chat_opened(self, chat_id: int) -> None:
        """Another local chat is on screen: its reply, its speed and its account; its cache is asked for."""
        c = self.conversation
        view = self.replies.get(chat_id) if c.generation_id else None
        view = view or self._saved_reply(chat_id)
        context = None if c.generation_id else self._saved_context(view)
        self._saved_for = chat_id if context is not None else None
        self.screen.update(chat=chat_id, generation=c.generation_id, latest=None, frame=None, reply=view,
                           speed=float(view.stats.get("decode_tokens_per_s") or 0.0) if not c.generation_id else 0.0,
                           account=self._account_of(view), context=context)
        self.show_setting()
        if not c.generation_id:
            self.describe_chat()

    def _saved_reply(self, chat_id: int) -> ReplyView:
        """The chat's last reply: the one begun in this run (its timing is kept), else the last saved one."""
        last = next((m for m in reversed(self.conversation.history.messages(chat_id)) if m.role == "assistant"), None)
        begun = self.replies.get(chat_id)
        stats = dict(last.stats) if last is not None else {}
        if begun is not None:
            return ReplyView(begun.generation_id, begun.label, False, stats)
        return ReplyView(0, "", False, stats)

    @staticmethod
    def _account_of(view: ReplyView) -> dict | None:
        account = view.stats.get("cache")
        if not account:
            return None
        return {**account, "places": view.stats.get("cache_places") or [], "generation_id": view.generation_id}

    def _saved_context(self, view: ReplyView) -> Context | None:
        """The chat's context as its last reply left it (saved with it): the same numbers after a restart."""
        saved = view.stats.get("context")
        if not isinstance(saved, dict):
            return None
        try:
            return Context(int(saved["used"]), int(saved["total"]), int(saved["chat"]), self.cache.applied.overflow)
        except (KeyError, TypeError, ValueError):
            return None

    def describe_chat(self) -> bool:
        """Ask the worker for the chat on screen's cache and token count (``on_described``); False: none to ask."""
        c = self.conversation
        if c.chat_id is None or self._info() is None:
            return False
        self.engine.describe_chat(c.chat_id, c.engine_messages())
        return True

    def on_described(self, chat_id: Any, snap: CacheSnapshot | None, tokens: int) -> None:
        self.show_setting()  # the setting and the panels describing the chat under it change together
        c = self.conversation
        if chat_id != c.chat_id or c.generation_id or self._api_selected():
            return  # another chat is on screen by now, or its own reply's snapshots describe it
        if snap is not None:
            self._saved_for = None
            self.screen.update(latest=snap)
            return
        info = self._info()
        total = info.context_length if info is not None else 0
        saved = self.screen.context
        if self._saved_for == chat_id and saved is not None and saved.total == total:
            return  # its last reply's record stands: counting the text again gives other numbers (its end tokens)
        chat = max(tokens, 0)  # a reopened chat may be longer than the context: at most all of it is read
        self.screen.update(latest=None, frame=None,
                           context=Context(min(chat, total) if total else chat, total, chat, self.cache.applied.overflow))

    def on_snapshot(self, snap: CacheSnapshot) -> None:
        """A snapshot of the reply in flight; only the chat on screen's is written (idle chats are described by
        ``on_described``)."""
        gen = self.conversation.generation_id
        if gen and snap.generation_id == gen:
            self.screen.update(latest=snap, **({"account": self._live_account(snap)} if snap.account else {}))

    def _live_account(self, snap: CacheSnapshot) -> dict:
        old = self.screen.account or {}
        places = old.get("places", []) if old.get("generation_id") == snap.generation_id else []
        return {**snap.account.to_dict(), "prompt": snap.account.prompt, "places": places,
                "generation_id": snap.generation_id}

    def on_frame(self, snap: CacheSnapshot) -> None:
        """The panels' new frame: its counts, speed and setting are written with it."""
        used, chat = context_counts(snap)  # the definitions the occupancy caption uses too
        if self.unshown is not None and under(snap, self.unshown):
            self.show_setting()
        changes: dict[str, Any] = {"frame": snap,
                                   "context": Context(used, snap.context_length, chat, self.cache.applied.overflow)}
        if self.conversation.generation_id and snap.decode_tokens_per_s:
            changes["speed"] = float(snap.decode_tokens_per_s)
        self.screen.update(**changes)

    # -- replies ------------------------------------------------------------------------------------------------
    def on_reply_started(self, generation_id: int, mode: str) -> None:
        view = ReplyView(generation_id, self.timing_label([mode]), True, {})
        self.replies[self.conversation.chat_id] = view
        self._saved_for = None
        self.screen.update(generation=generation_id, reply=view)

    def timing_label(self, modes: list[str]) -> str:
        """The timing caption's name of a reply: its cache mode(s) and, on a CPU, the threads it ran on."""
        info = self._info()
        threads = f" · {info.threads} CPU thread{'s' if info.threads > 1 else ''}" if (
            info is not None and info.device == "cpu" and info.threads) else ""
        return "cache " + " → ".join(modes) + threads

    def on_reply_finished(self, generation_id: int, reason: str) -> None:
        """Any reply finished (the chat on screen's or one in the background): its record, with what was saved."""
        self.show_setting()
        c = self.conversation
        last = c.last_reply
        if last is None or last.generation_id != generation_id:
            return
        stats = c.last_stats if last.chat_id == c.chat_id else next(
            (m.stats for m in reversed(c.history.messages(last.chat_id)) if m.id == last.message_id), {})
        begun = next((v for v in self.replies.values() if v.generation_id == generation_id), None)
        view = ReplyView(generation_id, begun.label if begun is not None else "", False, dict(stats))
        self.replies[last.chat_id] = view
        if last.chat_id != c.chat_id or self.screen.kind is not OnScreen.LOCAL:
            return
        changes: dict[str, Any] = {"generation": c.generation_id, "reply": view, "account": self._account_of(view)}
        if stats.get("decode_tokens_per_s"):
            changes["speed"] = float(stats["decode_tokens_per_s"])
        self.screen.update(**changes)

    def on_reply_notes(self, notes: list) -> None:
        """Notes of the reply in flight (also shown under it)."""
        if notes:
            self.screen.update(said=tuple(notes))

    def on_cache_applied(self, cfg: CacheConfig, notes: list) -> None:
        c = self.conversation
        if c.generation_id:
            # the reply's stats line shows e.g. "cache paged → off · switched mid-reply: keys full precision → 8-bit"
            c.note_mode(cfg.mode, describe_switches(self.cache.previous, cfg))
            view = self.screen.reply
            if view.running:
                view = ReplyView(view.generation_id, self.timing_label(c.modes), True, {})
                self.replies[c.chat_id] = view
                self.screen.update(reply=view)
        self.screen.update(settings=cfg, **({"said": tuple(notes)} if notes else {}))
        self.unshown = cfg  # named in the frame that describes the chat under it
        if not c.generation_id and not self.describe_chat():  # the chat on screen under the new settings
            self.show_setting()

    # -- API conversations ----------------------------------------------------------------------------------------
    def on_api_selected(self, session_id: int) -> None:
        """An API conversation was selected (0: none): the panels wait for its snapshot, or the chat comes back."""
        c = self.conversation
        if session_id:
            self.screen.update(chat=("api", session_id), generation=0, latest=None, frame=None, reply=ReplyView(),
                               account=None, speed=0.0)
            return
        if c.chat_id is None:
            return
        view = self.replies.get(c.chat_id) if c.generation_id else self._saved_reply(c.chat_id)
        self.screen.update(chat=c.chat_id, generation=c.generation_id, latest=None, frame=None,
                           reply=view or ReplyView(), account=self._account_of(view) if view else None)
        if not c.generation_id:
            self.describe_chat()

    def on_api_snapshot(self, session_id: int, snap: CacheSnapshot) -> None:
        """A snapshot of an API conversation (taken on the server's engine thread): written while selected."""
        if session_id and session_id == self._api_selected():
            self.screen.update(latest=snap)


def under(snap: CacheSnapshot, cfg: CacheConfig) -> bool:
    """The snapshot was taken under ``cfg`` (its mode, page size, precision and policy)."""
    return (snap.mode, snap.page_size, snap.policy, snap.k_dtype, snap.v_dtype) == (
        cfg.mode, cfg.page_size if cfg.mode == "paged" else 0, cfg.policy, cfg.k_dtype, cfg.v_dtype)
