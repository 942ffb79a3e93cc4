"""``SessionPool``: one ``ChatSession`` per chat of a model, idle chats swapped out to host memory.

The app keeps many chats; only one generates at a time. Each chat keeps its own session (so returning to
a chat reuses its cache instead of re-prefilling its history), and when another chat becomes active the
idle ones move their K/V to host memory (``ChatSession.swap_out``), giving their pages back to the shared
pool. The next turn of a swapped chat brings its K/V back (``swap_in``) before prefilling.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from engine.config import CacheConfig
from engine.loader import LoadedModel
from engine.session import ChatSession


class SessionPool:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None, max_sessions: int = 32) -> None:
        self.lm = loaded
        self.cache = cache or CacheConfig()
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[Hashable, ChatSession] = OrderedDict()  # least recently active first
        self.active: Hashable | None = None

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
        else:
            if session.cache_config != self.cache:
                notes += session.apply(self.cache)
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
