"""``SessionPool``: the sessions of one model kept between their replies, so a conversation's next turn reuses
its cache instead of prefilling its history again. Its two owners make room in two ways (``evict``):

- ``SWAP`` (the app's chats): one session per chat, by key (``activate``). Only one chat generates at a time;
  when another becomes active the idle ones move their K/V to host memory (``ChatSession.swap_out``), giving
  their pages back to the shared pool, and the next turn of a swapped chat brings its K/V back (``swap_in``)
  before prefilling. A request that needs pages swaps every idle chat out (``reclaim``).
- ``CLOSE`` (the API server's conversations): idle conversations keep their KV on the device; a request that
  needs pages closes them (``reclaim``, each counted by ``on_evict``).

Either way at most ``max_sessions`` are kept; the least recently used is closed first (its pages go back).

A client of the OpenAI API sends the whole conversation every time: the previous messages, the reply it got,
and a new user message. ``take`` picks the idle session whose tokens share the longest prefix with the new
prompt; its ``start()`` then prefills only the rest (``TurnStats.reused_tokens``); ``put`` keeps it again when
its reply is done. A prompt that shares less than ``min_shared`` tokens, or less than half, with every idle
session (and does not extend one whole) gets a new session, so one conversation's cache is not thrown away
for another's.

Isolation (a client must not learn another conversation's prompt from ``cached_tokens`` or from timing): a
session belongs to one tenant (``tenant``: the API key's and the request's ``cache_salt``'s digest; the app's
chats are all tenant ``b""``) and only that tenant's requests take it; its pages are named from the tenant's
own prefix-cache root, so another tenant's request never finds them in the pool either. Within a tenant, a
request that does not go on with a whole idle conversation reuses it in whole pages only (``grain`` tokens):
matching one more token of a secret then changes nothing the client can see, as vLLM's block-granular prefix
caching.

Every session speculates as the pool's ``speculation`` says (``engine.core.speculation_setup``), put on it when it is
made and whenever it is handed out (``activate``, ``take``). Runs on the engine thread only (no locks).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Hashable, Iterator, Sequence

from engine.errors import CacheCapacityError
from engine.snapshot import MissReason
from engine.config import CacheConfig, SpecConfig
from engine.core.sequence import common_prefix
from engine.core.session import ChatSession
from engine.kv.paged.prefix import salted_root
from engine.model.loaded import LoadedModel
from engine.core.speculation_setup import Speculation

SWAP, CLOSE = "swap", "close"  # what idle sessions do to give their pages to a request that needs them


class SessionPool:
    """Sessions of ``loaded`` on ``cache`` settings, least recently used first. ``evict``: ``SWAP`` or
    ``CLOSE``; ``min_shared`` (default: ``grain``) for ``take``; ``on_evict`` called for each session closed to
    make room; ``speculation`` for every session (default: off)."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None, max_sessions: int = 32, *,
                 evict: str = SWAP, min_shared: int | None = None, on_evict: Callable[[], None] | None = None,
                 speculation: Speculation | None = None) -> None:
        if evict not in (SWAP, CLOSE):
            raise ValueError(f"evict: {evict!r} is not {SWAP!r} or {CLOSE!r}")
        self.lm = loaded
        self.cache = cache or CacheConfig()
        self.evict = evict
        self.max_sessions = max(0, max_sessions)
        self._min_shared = min_shared
        self.on_evict = on_evict or (lambda: None)
        self.speculation = speculation or Speculation()
        self._sessions: OrderedDict[Hashable, ChatSession] = OrderedDict()  # least recently used first
        self.tenant_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> its tenant
        self.active: Hashable | None = None  # the chat ``activate`` made current
        # the one user of a server without API keys (its unsalted requests' tenant): nothing is hidden from it, so
        # its prompts reuse another conversation to the token and the account says where they diverged (a changed
        # word read as ``partial_page`` at the page's start); None: every tenant in whole pages
        self.exact_tenant: bytes | None = None

    @property
    def grain(self) -> int:
        """Whole pages of the cache (16 tokens when not paged): the unit reused across conversations."""
        return self.cache.page_size if self.cache.mode == "paged" else 16

    @property
    def min_shared(self) -> int:
        return self._min_shared if self._min_shared is not None else self.grain

    @property
    def spec(self) -> SpecConfig:
        """The speculation every session has (or gets when it is handed out)."""
        return self.speculation.cfg

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sessions

    def __iter__(self) -> Iterator[ChatSession]:
        """The sessions kept, least recently used first (a copy: closing them while iterating is fine)."""
        return iter(list(self._sessions.values()))

    def get(self, key: Hashable) -> ChatSession | None:
        return self._sessions.get(key)

    # -- by key: the app's chats ----------------------------------------------------------------------------
    def activate(self, key: Hashable) -> tuple[ChatSession, list[str]]:
        """The session of chat ``key`` (made on first use), with the pool's cache settings and speculation;
        in ``SWAP`` mode every other idle session is swapped out. Returns the session and notes (what was
        swapped, what was dropped over ``max_sessions``)."""
        notes: list[str] = []
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = self.new_session()
        elif session.cache_config != self.cache:
            notes += session.apply(self.cache)
        note = self.speculation.onto(session)
        notes += [note] if note else []
        self._sessions.move_to_end(key)
        if self.evict == SWAP:
            for other_id, other in self._sessions.items():
                moved = self._swap_out(other) if other_id != key else 0
                if moved:
                    notes.append(f"chat {other_id}: {moved / 2**20:.1f} MiB of KV swapped to host memory")
        notes += self._trim(self.max_sessions)
        self.active = key
        return session, notes

    def drop(self, key: Hashable) -> None:
        """Forget a chat (deleted by the user): its pages and host copy are freed."""
        s = self._sessions.pop(key, None)
        if s is not None:
            s.close()
        if self.active == key:
            self.active = None

    # -- by prefix: the server's conversations --------------------------------------------------------------
    def take(self, ids: Sequence[int], tenant: bytes = b"") -> tuple[ChatSession, int]:
        """(session, shared): the idle session of ``tenant`` sharing the longest prefix with ``ids`` (removed
        from the pool until ``put`` back), cut back to whole pages unless ``ids`` goes on with all of it; or a
        new session and 0."""
        best, key, shared, whole = None, None, 0, False
        for k, s in self._sessions.items():
            if self.tenant_of.get(s) != tenant or s.generating or s.cache.host is not None or s.cache.store is None:
                continue
            cached = s.seq[:s.index.intact]
            n = common_prefix(cached, ids)
            if n > shared:
                best, key, shared, whole = s, k, n, n == len(cached)
        exact = self.exact_tenant is not None and tenant == self.exact_tenant
        if not whole and best is not None:  # the last prompt token is always fed: whole pages before it
            upto = min(shared, len(ids) - 1)
            shared = best.cache.store.reusable(upto if exact else upto // self.grain * self.grain)
        why = (MissReason.DIVERGED, f"the prompt differs from this conversation at token {shared}") if exact else (
            MissReason.PARTIAL_PAGE, f"reused in whole pages of {self.grain} tokens only: this prompt does not go on "
                                     "with the whole conversation")
        # a prompt that shares only a start (a chat template's header, a system prompt) with a conversation does
        # not take it over: cutting it back would lose that conversation's cache to an unrelated request (its
        # follow-up then found 8 of 111 tokens), and the new one gets the shared pages from the prefix cache anyway
        mostly = best is not None and 2 * shared >= best.index.intact
        if best is not None and shared >= self.min_shared and not whole and not mostly:
            branch = self._branch(best, shared, tenant, why)
            return branch, (shared if branch.cached_tokens else 0)
        if best is not None and shared > 0 and (whole or (shared >= self.min_shared and mostly)):
            del self._sessions[key]
            if not whole:
                best.cache.cut_back(shared, *why)  # past the last whole page (one user: the token) is not reused
            self.speculation.onto(best)
            return best, shared
        return self.new_session(tenant), 0

    def _branch(self, best: ChatSession, shared: int, tenant: bytes, why: tuple) -> ChatSession:
        """A new session going on from ``best``'s first ``shared`` tokens, ``best`` kept as it is: a branch of a
        conversation (another second message, an edit) reuses what it shares without taking the conversation's
        cache from it (paged pages are shared, copy-on-write). On a hybrid model ``shared`` is a checkpoint."""
        try:
            s = best.fork()  # a contiguous cache is copied: it may not fit
        except CacheCapacityError:
            return self.new_session(tenant)  # ``best`` is untouched; the request prefills as a new conversation
        s.cache.cut_back(shared, *why)
        self.speculation.onto(s)
        self.tenant_of[s] = tenant
        return s

    def put(self, session: ChatSession, key: Hashable | None = None) -> None:
        """Keep a finished session (most recently used; ``key``: the session itself unless given); close the
        oldest beyond ``max_sessions``."""
        if session.closed:
            return
        key = session if key is None else key
        self._sessions[key] = session
        self._sessions.move_to_end(key)
        self._trim(self.max_sessions)

    def new_session(self, tenant: bytes = b"") -> ChatSession:
        """A session of ``tenant`` (not kept yet): its full pages are named from the tenant's own prefix-cache
        root (the shared root for ``b""``), with the pool's speculation."""
        s = ChatSession(self.lm, self.cache)
        s.cache.root = salted_root(tenant)
        self.speculation.onto(s)  # a draft cache of its own; the draft model was checked when it was set
        self.tenant_of[s] = tenant
        return s

    # -- settings and room ----------------------------------------------------------------------------------
    def apply(self, cache: CacheConfig) -> list[str]:
        """New cache settings: applied to the active session now, to the others when they become active (new
        sessions are made with them)."""
        self.cache = cache
        s = self._sessions.get(self.active)
        return s.apply(cache) if s is not None else []

    def speculate(self, cfg: SpecConfig | None, make_drafter: Callable[[], object] | None = None) -> list[str]:
        """Speculative decoding for every session (``make_drafter``: a new drafter on the shared draft model,
        for method draft; see ``Speculation``): the active session now (also mid-reply), the others when they
        are handed out. Turning the draft model off frees every idle session's draft cache now. Returns notes;
        a refusal (raised) leaves the setting in force as it was."""
        before, self.speculation = self.speculation, Speculation.of(cfg, make_drafter)
        s = self._sessions.get(self.active)
        try:
            note = self.speculation.onto(s) if s is not None else ""
        except BaseException:
            self.speculation = before  # the setting in force stays what the sessions have
            raise
        if self.speculation.cfg.method != "draft":  # cheap: no session keeps a draft model's cache it will not use
            for other in self._sessions.values():
                if other is not s and other.spec is not None and other.spec.cfg.method == "draft":
                    self.speculation.onto(other)
        return [note] if note else []

    def reclaim(self) -> bool:
        """Idle sessions give their pages to a request that needs them: swapped to host memory (``SWAP``) or
        closed (``CLOSE``, each an eviction). True if any gave pages back."""
        if self.evict == SWAP:
            return sum(self._swap_out(s) for s in self._sessions.values()) > 0
        idle = [k for k, s in self._sessions.items() if not s.generating]
        for k in idle:
            self._sessions.pop(k).close()
            self.on_evict()
        return bool(idle)

    def close(self, evicted: bool = False) -> None:
        """Close every session kept (``evicted``: each counted as an eviction, to make room)."""
        for s in self._sessions.values():
            s.close()
            if evicted:
                self.on_evict()
        self._sessions.clear()
        self.active = None

    @staticmethod
    def _swap_out(s: ChatSession) -> int:
        """Bytes an idle session with a cache on the device moved to host memory (0: none to move)."""
        if s.generating or s.offloaded or not s.cached_tokens:
            return 0
        return s.swap_out()

    def _trim(self, limit: int) -> list[str]:
        """Close the least recently used sessions beyond ``limit``; a note for each."""
        notes = []
        while len(self._sessions) > limit:
            key, old = self._sessions.popitem(last=False)
            old.close()
            self.on_evict()
            if self.active == key:
                self.active = None
            notes.append(f"chat {key}: cache dropped (more than {limit} chats)")
        return notes
