"""``SeqCache``: one sequence's KV cache and the only code that writes it — the store (its K/V tensors), the
cache index (``engine.kv.paged.positions``), the attention scores and evictor (``engine.core.eviction``), the prefix-cache
names of its full pages (``engine.kv.paged.prefix``) and its copy in host memory while swapped out.

A forward goes through it as "can I?" then "do it"::

    plan = c.plan(todo, cx)         # how many tokens the next forward feeds (evicts first if a policy says so)
    c.reserve(plan.chunk, owner)    # room for them: a typed error, nothing changed, if there is none
    ... ModelRunner writes their K/V into the reserved slots ...
    c.commit(chunk, ids)            # count them as cached, name new full pages; or c.rollback()
    c.after_forward(cx)             # back under a policy's budget

What the last forward did is a frozen ``StepRecord`` (``engine.core.records``), kept as ``last`` for the snapshot.
"""

from __future__ import annotations

import dataclasses

from typing import Sequence

from engine.core import reconfigure
from engine.core.prefix_reuse import PrefixReuse, share_every
from engine.core.records import IDLE, ReuseRecord, StepRecord
from engine.config import CacheConfig
from engine.errors import CacheCapacityError
from engine.core.eviction import Eviction, EvictionContext, EvictionPlan, Evictor
from engine.kv.hf_cache import KVCache
from engine.kv.paged.positions import CacheIndex
from engine.kv.paged.prefix import ROOT
from engine.kv.store.grouped import GroupedKV
from engine.kv.store.contiguous import ContiguousKV
from engine.kv.store.storage import HostKV, KVStore, PagedKV, copy_kv
from engine.model.runner import Output, Work
from engine.core.vocab import StepPath


class SeqCache(PrefixReuse):
    """The KV cache of one sequence of ``lm``, under ``cfg``. Drive it from one thread."""

    def __init__(self, lm, cfg: CacheConfig, owner_id: int) -> None:
        self.lm, self.owner_id = lm, owner_id
        self.policy = reconfigure.validate(cfg, lm)
        self.cache_config = cfg
        self.store: KVStore | None = None
        self.reused = ReuseRecord()  # what the last prompt's reuse did (``reuse``: this class its only writer)
        self._swapped_in = 0  # pages the swap-in before the next reuse took back from the prefix cache
        self.kv: KVCache | None = None  # transformers' view of the store (``engine.kv.hf_cache``)
        self.set_store(reconfigure.make_store(lm, cfg, owner_id))
        info = lm.info
        L = info.num_layers  # the cache index and the scores follow the full-attention layers
        if info.layer_kinds:
            L = sum(1 for k in info.layer_kinds if k.split("+")[0] == "full")
        self.index = CacheIndex(L, heads=_index_heads(lm))
        self.evictor = Evictor(lm.model, L, info.num_kv_heads, lm.device)
        self.chain: list[bytes] = []  # prefix-cache names of the sequence's first full pages
        self.root = ROOT  # where those names start: a server tenant's own root keeps its pages its own
        self.host: HostKV | None = None  # swapped-out K/V (``swap_out`` / ``swap_in``)
        self.last: StepRecord = IDLE  # what the last forward did (this class its only writer)
        self._planned: list[Eviction] = []  # evicted for the forward being prepared (in its record at commit)
        self._checkpoint_at = -1  # the planned forward ends where the store keeps a checkpoint (``plan``)
        self._share_at = -1  # ... where the model's state shelf keeps the recurrent states (``plan``)
        self.mark = -1  # where this turn's prompt starts its last message: a checkpoint there serves a branch
        self.lost: tuple = (0, None, "")  # tokens held before a cut the next account names (``cut_back``)
        self.turn_starts: tuple[int, ...] = ()  # where each message of the chat starts (overflow "turns")

    # -- plumbing ----------------------------------------------------------------------------------------
    def set_store(self, store: KVStore | None) -> None:
        self.store = store
        self.kv = KVCache(store) if store is not None else None
        self.chain = []  # page names depend on the page size: a new store names its pages afresh
        self.reused = dataclasses.replace(self.reused, disk_pages=())  # page ids of the old store's arena

    @property
    def n(self) -> int:
        """Tokens per layer in the cache now."""
        return self.index.n if self.store is not None else 0

    @property
    def needs_scores(self) -> bool:
        """The policy reads per-token scores the evictor keeps (H2O's attention, Expected Attention's)."""
        return self.policy is not None and self.policy.scored

    def pending(self, seq_len: int) -> int:
        """Tokens of a ``seq_len``-token sequence still to feed (cache off: every one, every step)."""
        return seq_len - self.index.next_pos if self.store is not None else seq_len

    def can_share(self, seq_len: int) -> bool:
        """Tokens to feed on a store in memory, no policy reading scores: may join a batched forward."""
        return self.store is not None and self.host is None and not self.needs_scores and self.pending(seq_len) >= 1

    def can_overflow(self) -> bool:
        """Can this cache evict to go on past the context (a policy, or an evicting overflow setting)?"""
        return self.store is not None and self.cache_config.evicts_to_fit

    def context(self, protected: int, priorities, seq_len: int, max_chunk: int) -> EvictionContext:
        """What eviction needs to know of the conversation, for one step."""
        cfg = self.cache_config
        return EvictionContext(protected=protected, priorities=priorities,
                               page_size=cfg.page_size if cfg.mode == "paged" else 16, seq_len=seq_len,
                               overflow=cfg.overflow, context_length=self.lm.info.context_length, max_chunk=max_chunk,
                               turns=self.turn_starts)

    # -- a forward ---------------------------------------------------------------------------------------
    def next_forward(self, ids: Sequence[int], protected: int, priorities, max_chunk: int,
                     owner: int) -> tuple[Work, EvictionPlan | None]:
        """The next forward over the unfed tokens of ``ids``: planned (evicting first where a policy or the
        context says so) and its room reserved. A typed error, nothing reserved, if it cannot run."""
        if self.store is None:  # cache off: the whole text, every time
            return Work(tuple(ids), 0, None), None
        cx = self.context(protected, priorities, len(ids), max_chunk)
        plan = self.plan(len(ids) - self.index.next_pos, cx)
        start = self.index.next_pos
        self.reserve(plan.chunk, owner=owner)
        return Work(tuple(ids[start:start + plan.chunk]), self.index.next_rope, self.kv), plan

    def forward_done(self, work: Work, out: Output, plan: EvictionPlan | None, ids: Sequence[int],
                     written: tuple[int, ...] = ()) -> bool:
        """``work``'s forward ran (``out``): count its tokens as cached, evict back under a budget. True once
        every token of ``ids`` is fed (the logits then predict the next one)."""
        if self.store is None:
            self.last = StepRecord(path=out.path, evictions=self._take_planned())
            return True
        self.commit(work.q, ids, out.path, out.batch, written)
        self.after_forward(plan.context)
        return self.index.next_pos >= len(ids)

    # -- a speculative verification ----------------------------------------------------------------------
    def draft_room(self, seq_len: int) -> int:
        """How many draft tokens a verification may add after the one unfed token (0: decode plainly). Only where
        cutting the rejected slots back is exact: a plain store (full or quantized pages, or one buffer) whose
        index is intact (no policy, nothing evicted), and no overflow eviction within the k + 1 slots."""
        store = self.store
        if store is None or self.host is not None or type(store) not in (PagedKV, ContiguousKV):
            return 0
        if self.policy is not None or self.index.intact != self.index.n or self.pending(seq_len) != 1:
            return 0
        room = self.lm.info.context_length - 2 - self.index.next_rope
        if type(store) is PagedKV and store.arena.kinds != {"k": "auto", "v": "auto"}:
            # A quantized page is quantized when its last token is written, and a forward reads after it writes:
            # in a verification that completes a page with a draft, the earlier positions' queries would read
            # that page quantized where decoding token by token reads it in full precision (its tail). So a
            # draft never completes a page (the first token may: every query after it reads it quantized too).
            P, off = store.page_size, self.index.next_pos % store.page_size
            room = min(room, P - 2 - off if off < P - 1 else P - 1)
        return max(0, room)

    def next_verify(self, ids: Sequence[int], drafts: Sequence[int], owner: int) -> Work:
        """Reserve the last token of ``ids`` and ``drafts`` (k + 1 slots); their forward's ``Work``."""
        start = self.index.next_pos
        self.reserve(1 + len(drafts), owner=owner)
        return Work((*ids[start:], *drafts), self.index.next_rope, self.kv, all_logits=True)

    def commit_verify(self, work: Work, keep: int, ids: Sequence[int], batch: int = 1) -> int:
        """The verification wrote ``work.q`` slots; keep the first ``keep`` (the fed token and the drafts that
        stayed), cut the rest back (their pages freed, a quantized tail re-formed) and name the pages that are
        full with committed tokens (``ids``: the chat with the kept tokens); ``batch``: sequences its forward
        carried. Returns the slots rolled back."""
        before = self.index.n
        self.store.commit()
        self.index.append(work.q)
        written = self.pages_written(work.q)  # the provisional slots' pages, as the map draws them
        rolled = work.q - keep
        if rolled:
            self.truncate(before + keep)  # within the tail page of a quantized store (``draft_room``)
        self._register_pages(before, ids)
        self.last = StepRecord(StepPath.SPECULATIVE, batch, written, self._take_planned(), work.q, rolled)
        return rolled

    def wants_mark(self) -> bool:
        """Does a checkpoint where a prompt's last message starts serve this cache (one that cannot be cut back
        anywhere: sliding windows, recurrent states)?"""
        c = self.cache_config
        return self.store is not None and self.store.stateful and c.checkpoints > 0 and c.prefix_reuse

    def fills_context(self, seq_len: int, ahead: int = 0) -> bool:
        """Does the token just taken use the context's last position (and nothing can evict to go on)? ``ahead``: a
        verification's token that many places after the fed one (not yet written)."""
        ctx = self.lm.info.context_length
        if self.store is None:
            return seq_len >= ctx
        return self.index.next_rope + 1 + ahead >= ctx and not self.can_overflow()

    def plan(self, todo: int, cx: EvictionContext) -> EvictionPlan:
        """How many of the ``todo`` unfed tokens the next forward takes (evicting first where a policy says so).
        On a model whose cache can be cut back only to checkpoints, a prompt's last token is fed on its own, and
        the position before it kept: a regenerate then reuses the whole prompt (one more 1-token forward)."""
        plan = self.evictor.plan(self.store, self.index, self.policy, todo, cx)
        self._planned += plan.evictions
        ix, todo = self.index, todo - plan.dropped
        share = self._share_point(ix.next_pos, ix.next_pos + todo) if ix.intact == ix.n else -1
        mark = self.mark if self.store.stateful and ix.intact == ix.n and self.cache_config.checkpoints else -1
        if ix.next_pos < mark < ix.next_pos + plan.chunk and not ix.next_pos < share < mark:
            plan = dataclasses.replace(plan, chunk=mark - ix.next_pos)  # another message in its place goes on here
            self._checkpoint_at = mark
            self._share_at = share if share == mark else -1
        elif ix.next_pos < share < ix.next_pos + plan.chunk:
            plan = dataclasses.replace(plan, chunk=share - ix.next_pos)
            self._share_at = share
            if share == ix.next_pos + todo - 1 and self.store.stateful and self.cache_config.checkpoints:
                self._checkpoint_at = share  # the prompt's last token is fed on its own anyway
        elif (self.store.stateful and todo > 1 and plan.chunk == todo and ix.intact == ix.n
                and self.cache_config.checkpoints):
            plan = dataclasses.replace(plan, chunk=plan.chunk - 1)
            self._checkpoint_at = ix.next_pos + plan.chunk
        return plan

    def _share_point(self, start: int, end: int) -> int:
        """Where a prefill of ``[start, end)`` on a model with recurrent layers stops so the state shelf keeps the
        states at a named page boundary (another chat can then go on from it): the first multiple of
        ``SHARE_EVERY`` after ``start``, else the last page boundary before the prompt's last token; -1: none."""
        store = self.prefix_groups()
        if store is None or not store.states or not self.cache_config.prefix_reuse or end - start < 2:
            return -1
        P, every = store.prefix_page_size, share_every(store.prefix_page_size)
        step = (start // every + 1) * every
        if step < end - 1:
            return step
        last = (end - 1) // P * P
        return last if last > start else -1

    def begin_step(self) -> None:
        """A forward is being prepared: nothing evicted for it yet."""
        self._planned = []

    def settle(self) -> None:
        """The reply ended: the last record as an idle chat shows it (no page being written)."""
        self.last = self.last.settled()

    def record_evictions(self, done: "list[Eviction]") -> None:
        """Evictions made outside a forward (a policy switched on between two steps) join the last record."""
        self.last = self.last.evicted(done)

    def _take_planned(self) -> tuple[Eviction, ...]:
        planned, self._planned = tuple(self._planned), []
        return planned

    def can_reserve(self, q: int) -> bool:
        return self.store is not None and self.store.can_reserve(q)

    def reserve(self, q: int, owner: int) -> None:
        """Take room for ``q`` tokens before a forward (typed error, nothing changed, if there is none)."""
        scores, policy = self.evictor.scores, self.policy
        if self.needs_scores and not scores.tracking:
            scores.start(self.index.n)
        elif not self.needs_scores:
            scores.stop()
        self.kv.score_sink = scores.add if policy is not None and policy.needs_scores else None
        self.kv.query_sink = self._observe_queries(q) if policy is not None and policy.needs_queries else None
        self.store.reserve(q, owner=owner)
        try:
            scores.grow(q)
        except BaseException:
            self.store.rollback()
            raise

    def _observe_queries(self, q: int):
        """The attention's query observer for the next forward of ``q`` tokens (a policy that ``needs_queries``):
        it scores every key when the evictor trims the cache after this forward (``after_forward``)."""
        stats, p = self.evictor.queries, self.policy.params
        stats.configure(p.queries, p.sinks, getattr(self.store, "layout", None))
        stats.begin(self.index.next_rope, q, score=self.index.n + q >= self.policy.budget)
        return stats.observe

    def take_policy_ms(self) -> float:
        """What the policy's own work cost since the last call (observing queries, scoring, choosing), in ms."""
        ev = self.evictor
        ms = ev.select_ms + ev.queries.ms + ev.scores.ms
        ev.select_ms = ev.queries.ms = ev.scores.ms = 0.0
        return ms

    def rollback(self) -> None:
        """The forward failed: store, index and scores back to where ``reserve`` found them."""
        self.store.rollback()
        if self.store.num_tokens != self.index.n:  # the store could not undo it (a recurrent state): start over
            self.index.truncate(0)
        self.evictor.cut_back(self.index.n)

    def commit(self, q: int, ids: Sequence[int], path: str, batch: int = 1, written: tuple[int, ...] = ()) -> None:
        """The forward (``path``, with ``batch`` sequences) wrote ``q`` tokens' K/V: count them as cached."""
        grouped = isinstance(self.store, GroupedKV)
        self.store.commit(slide=False) if grouped else self.store.commit()
        self.index.append(q)
        if self._checkpoint_at == self.index.next_pos:
            self.store.checkpoint()
        self._checkpoint_at = -1
        self._register_pages(self.index.n - q, ids)  # before the windows give back their pages: named, they stay
        self._share_at = -1
        if grouped:
            self.store.slide()
        self.last = StepRecord(path, batch, written or self.pages_written(q), self._take_planned())

    def after_forward(self, cx: EvictionContext) -> None:
        last = self.last.evicted(self.evictor.after_forward(self.store, self.index, self.policy, cx))
        self.last = dataclasses.replace(last, policy_ms=self.take_policy_ms())

    def pages_written(self, q: int) -> tuple[int, ...]:
        """Pages holding the last ``q`` cached tokens (a plain paged store; else none)."""
        store, n = self.store, self.index.n
        if type(store) is not PagedKV or q <= 0 or n <= 0:
            return ()
        P = store.page_size
        return tuple(store.table.pages[(n - q) // P:(n - 1) // P + 1])

    def reserved_pages(self, q: int) -> tuple[int, tuple[int, ...]] | None:
        """(arena id, pages) the reserved ``q`` tokens' K/V go to, on a plain paged store; else None."""
        store = self.store
        if type(store) is not PagedKV:
            return None
        P, n = store.page_size, store.past_len
        return id(store.arena), tuple(store.table.pages[n // P:(n + q - 1) // P + 1])

    # -- the whole cache ---------------------------------------------------------------------------------
    def apply(self, cfg: CacheConfig, seq, max_chunk: int) -> list[str]:
        """Move to ``cfg`` between two steps (``engine.core.reconfigure`` does the moving, for this cache, its one
        writer): notes on what it did and cost; a refusal (typed error) leaves it on its old setting."""
        return reconfigure.apply(self, seq, cfg, max_chunk)

    def can_give_up(self) -> bool:  # every cached token can be dropped and recomputed exactly: nothing evicted
        return self.store is not None and self.policy is None and self.index.intact >= self.index.n > 0

    def pool_key(self) -> int | None:  # the arena its pages live in (None: no paged store)
        return id(self.store.arena) if getattr(self.store, "arena", None) is not None else None

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (within the intact prefix): store, index and scores together."""
        self.store.truncate(n)
        self.index.truncate(n)
        self.evictor.scores.truncate(n)

    def swap_out(self) -> int:
        """Move the K/V to host memory and give the pages back. Returns bytes moved (0: nothing to move)."""
        if self.store is None or self.host is not None or self.index.n == 0:
            return 0
        # Quantized pages travel as they are held (codes + scales), so a swapped int8 chat costs int8 bytes.
        host = self.store.to_host(pin=self.lm.device.type == "cuda")
        self.store.free()
        self.host = host
        return host.nbytes

    def swap_in(self, ids: Sequence[int]) -> None:
        """Bring swapped-out K/V back. A typed error and no change (they stay in host memory) without room."""
        if self.host is None:
            return
        adopt, chain = self._cached_pages_of_host(ids)  # only a plain paged store has any (others take one argument)
        if not (self.store.can_restore(self.host, adopt) if adopt else self.store.can_restore(self.host)):
            raise CacheCapacityError(f"no room to bring this chat's {self.host.n} cached tokens back: close other "
                                     "chats or raise the cache's limits")
        if adopt:
            self.store.from_host(self.host, adopt)
            self.chain = chain[:len(adopt)]
        else:
            self.store.from_host(self.host)
        self._swapped_in = len(adopt)  # the reuse that follows puts it in its record
        self.host = None

    def fork(self, owner_id: int, owner: int) -> "SeqCache":
        """A copy for a new sequence: paged stores share full pages (copy-on-write), others copy."""
        other = SeqCache(self.lm, CacheConfig(mode="off"), owner_id)
        if hasattr(self.store, "fork"):
            other.set_store(self.store.fork(owner_id))
        elif self.store is not None:
            store = reconfigure.make_store(self.lm, self.cache_config, owner_id)
            copy_kv(self.store, store, owner=owner)
            other.set_store(store)
        other.cache_config, other.policy, other.root = self.cache_config, self.policy, self.root
        other.index = self.index.copy()
        other.evictor.copy_from(self.evictor)
        return other

    def reset(self) -> None:
        """Empty, on the same setting (the pages go back)."""
        if self.store is not None:
            self.store.truncate(0)
        self.host = None
        self.index.reset()
        self.evictor.forget()
        self.chain, self._planned, self.last = [], [], IDLE

    def free(self) -> None:
        """Give everything back for good (the store's pages, the host copy)."""
        if self.store is not None:
            self.store.free()
        self.host = None
        self.index.reset()
        self.evictor.forget()


def _index_heads(lm) -> int:
    """KV heads whose cached tokens a per-head eviction may part (``CacheIndex``): every head of K and V alike;
    1 where K and V differ in heads (MLA's one latent and rotary key)."""
    info = lm.info
    hk, hv = info.k_heads or info.num_kv_heads, info.v_heads or info.k_heads or info.num_kv_heads
    return info.num_kv_heads if hk == hv == info.num_kv_heads else 1
