"""``SessionPool``: one ``ChatSession`` per chat of a model, idle chats swapped out to host memory.

The app keeps many chats; only one generates at a time. Each chat keeps its own session (so returning to
a chat reuses its cache instead of re-prefilling its history), and when another chat becomes active the
idle ones move their K/V to host memory (``ChatSession.swap_out``), giving their pages back to the shared
pool. The next turn of a swapped chat brings its K/V back (``swap_in``) before prefilling.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

from engine.config import CacheConfig, SpecConfig
from engine.model.loader import LoadedModel
from engine.core.session import ChatSession


class SessionPool:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None, max_sessions: int = 32) -> None:
        self.lm = loaded
        self.cache = cache or CacheConfig()
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[Hashable, ChatSession] = OrderedDict()  # least recently active first
        self.active: Hashable | None = None
        self.spec = SpecConfig()  # speculative decoding for every chat (off)
        self._make_drafter: Callable[[], object] | None = None  # a new draft-model drafter per chat

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, chat_id: Hashable) -> bool:
        return chat_id in self._sessions

    def get(self, chat_id: Hashable) -> ChatSession | None:
        return self._sessions.get(chat_id)

    def activate(self, chat_id: Hashable) -> tuple[ChatSession, list[str]]:
        """The session of ``chat_id`` (created on first use); every other idle session is swapped out.

        Returns the session and notes (what was swapped, what was dropped over ``max_sessions``).
        """
        notes: list[str] = []
        session = self._sessions.get(chat_id)
        if session is None:
            session = ChatSession(self.lm, self.cache)
            self._sessions[chat_id] = session
        elif session.cache_config != self.cache:
            notes += session.apply(self.cache)
        note = self._speculate(session)
        notes += [note] if note else []
        self._sessions.move_to_end(chat_id)
        for other_id, other in self._sessions.items():
            if other_id != chat_id and not other.generating and not other.offloaded and other.cached_tokens:
                moved = other.swap_out()
                if moved:
                    notes.append(f"chat {other_id}: {moved / 2**20:.1f} MiB of KV swapped to host memory")
        while len(self._sessions) > self.max_sessions:
            old_id, old = next(iter(self._sessions.items()))
            old.close()
            del self._sessions[old_id]
            notes.append(f"chat {old_id}: cache dropped (more than {self.max_sessions} chats)")
        self.active = chat_id
        return session, notes

    def reclaim(self) -> bool:
        """Swap every idle chat's cache to host memory (a request needs its pages). True if any moved."""
        moved = 0
        for s in self._sessions.values():
            if not s.generating and not s.offloaded and s.cached_tokens:
                moved += s.swap_out()
        return moved > 0

    def apply(self, cache: CacheConfig) -> list[str]:
        """New cache settings: applied to the active session now, to the others when they become active."""
        self.cache = cache
        s = self._sessions.get(self.active)
        return s.apply(cache) if s is not None else []

    def speculate(self, cfg: SpecConfig | None, make_drafter: Callable[[], object] | None = None) -> list[str]:
        """Speculative decoding for every chat (``make_drafter``: a new ``engine.speculation.draft_model.ModelDrafter`` on the
        shared draft model, for method draft): the active session now (also mid-reply), the others when they
        become active. Turning the draft model off frees every idle chat's draft cache now. Returns notes."""
        cfg = cfg or SpecConfig()
        if cfg.method == "draft" and make_drafter is None:
            raise ValueError("speculative decoding with a draft model needs the draft model loaded")
        before = self.spec, self._make_drafter
        self.spec, self._make_drafter = cfg, make_drafter if cfg.method == "draft" else None
        s = self._sessions.get(self.active)
        try:
            note = self._speculate(s) if s is not None else ""
        except BaseException:
            self.spec, self._make_drafter = before  # the setting in force stays what the chats have
            raise
        if cfg.method != "draft":  # cheap: no session keeps a draft model's cache it will not use
            for other in self._sessions.values():
                if other is not s and other.spec is not None and other.spec.cfg.method == "draft":
                    other.speculate(cfg)
        return [note] if note else []

    def _speculate(self, session: ChatSession) -> str:
        """The pool's speculation onto ``session`` if it differs ("" when nothing changed). A drafter is made
        first, so a failure leaves the session as it was."""
        cfg, old = self.spec, session.spec.cfg if session.spec is not None else None
        if old == cfg or (old is None and cfg.method == "off"):
            return ""
        same_model = old is not None and (old.method, old.draft_path) == ("draft", cfg.draft_path)
        drafter = self._make_drafter() if cfg.method == "draft" and not same_model else None
        return session.speculate(cfg, drafter)

    def drop(self, chat_id: Hashable) -> None:
        """Forget a chat (deleted by the user): its pages and host copy are freed."""
        s = self._sessions.pop(chat_id, None)
        if s is not None:
            s.close()
        if self.active == chat_id:
            self.active = None

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()
        self.active = None
