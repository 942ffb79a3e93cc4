"""Eviction: overflow handling, policy choice, attention scores and re-rotation. Returns ``Eviction`` values.

Before every forward, ``Evictor.plan`` decides how many of the pending tokens the next forward may feed
(the *chunk*) and evicts first if a policy budget or the model's context requires it; after the forward,
``after_forward`` trims back under the budget. The session applies nothing itself: the evictor compacts the
store, and keeps the cache index and the scores in step with it.

Overflow without a policy (``CacheConfig.overflow``): ``stop`` raises ``ContextOverflowError``;
``truncate_middle`` and ``rolling`` evict like StreamingLLM with other sinks (``OverflowPolicy``) and
re-rotate the kept keys, so positions restart below the context. A prompt longer than the whole context is
not fed token by token into a cache that would evict it at once: the middle tokens are passed over (their
positions count as evicted) and only the last ``context / 2`` are fed, one chunk per step. ``turns`` passes over
what its rule drops (older whole messages, then the latest message's oldest part) and keeps the system prompt.
"""

from __future__ import annotations

import dataclasses
import time

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import OVERFLOW_EVICTS
from engine.errors import ContextOverflowError, InternalError
from engine.kv.store.attention import Rerotator
from engine.kv.store.rope import keyless_layers, shift_all
from engine.policies.layer_kinds import layer_kind_summary
from engine.kv.paged.positions import CacheIndex
from engine.policies import PINNED, EvictionPolicy, OverflowPolicy, PolicyState, turns
from engine.core.vocab import Note, NoteKind
from engine.core.expected import QueryStats
from engine.core.scores import Scores



@dataclass(frozen=True)
class Eviction:
    """What one eviction did."""

    reason: str  # the policy or overflow mode that evicted
    dropped: int  # slots dropped per layer
    positions: tuple[int, ...]  # logical positions no layer holds any more
    freed_pages: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvictionContext:
    """What the conversation says about its tokens (from the session, per step): read, never written."""

    protected: int = 0  # logical [0, protected): system prompt + first message
    priorities: np.ndarray | None = None  # [T] per logical position, -1: the policy's default
    page_size: int = 16
    seq_len: int = 0
    overflow: str = "stop"
    context_length: int = 0
    max_chunk: int = 512  # most tokens one prefill forward feeds (``engine.core.sequence.prefill_chunk``)
    turns: tuple[int, ...] = ()  # where each message starts (overflow "turns" drops whole ones)


@dataclass(frozen=True)
class EvictionPlan:
    """What the evictor decided for the next forward: the tokens it feeds (``chunk``), what was evicted for it,
    prompt tokens passed over unread to fit the context (``dropped``: never computed, so not "recomputed"), and
    the notes for the user. ``context``: what it was planned in (the forward's own eviction after it reads it)."""

    chunk: int
    evictions: tuple[Eviction, ...] = ()
    dropped: int = 0
    notes: tuple[str, ...] = ()
    context: EvictionContext | None = None
    runs: tuple[tuple[int, int], ...] = ()  # where the ``dropped`` tokens sit: ``[start, end)`` logical positions

    @property
    def all_notes(self) -> tuple[str, ...]:
        return self.notes + tuple(n for e in self.evictions for n in e.notes)


class Evictor:
    """Makes room in a session's cache, as its policy (or the overflow setting) says."""

    def __init__(self, model, num_layers: int, kv_heads: int, device) -> None:
        self.model = model
        self.scores = Scores(num_layers, kv_heads, device)
        self.queries = QueryStats(model, num_layers)  # the recent queries (a policy that ``needs_queries``)
        self.queries.scores = self.scores
        self._rerotator: Rerotator | None = None
        self.select_ms = 0.0  # the policy's choice at the evictions since ``take_ms`` (ranking and selecting)

    def forget(self) -> None:
        """The cache was emptied or given back: no scores tracked, no recent queries."""
        self.scores.stop()
        self.queries.clear()

    def cut_back(self, n: int) -> None:
        """The cache was cut back to ``n`` tokens: their scores kept (where tracked)."""
        self.scores.truncate(n)

    def copy_from(self, other: "Evictor") -> None:
        """What ``other`` tracked (a fork of its cache): its scores and recent queries."""
        if other.scores.tracking:
            self.scores.t = [s.clone() for s in other.scores.t]
        self.queries.copy_from(other.queries)

    # -- planning a forward ----------------------------------------------------------------------------
    def plan(self, store, index: CacheIndex, policy: EvictionPolicy | None, todo: int,
             cx: EvictionContext) -> EvictionPlan:
        """How many of the ``todo`` pending tokens the next forward feeds; evicts first where needed.
        Raises ``ContextOverflowError`` (overflow "stop") or ``CacheCapacityError`` (no room and nothing
        may be evicted) before anything changed."""
        done: list[Eviction] = []
        ctx = cx.context_length
        chunk = min(todo, cx.max_chunk)
        if policy is not None:
            if index.n >= policy.budget:
                done += self._evict(store, index, policy, policy.budget - policy.slack(cx.page_size), policy.name, cx)
            chunk = max(1, min(chunk, policy.budget - index.n))
        elif cx.overflow == "turns" and index.n + todo > ctx and (unread := self._unread(store, index, todo, cx)):
            return unread
        elif todo > ctx and cx.overflow in OVERFLOW_EVICTS:
            skip, first = todo - ctx // 2, index.next_pos
            index.skip(skip)  # these would be evicted before the reply starts: never fed
            note = (f"{skip:,} tokens of the prompt (positions {first:,}–{first + skip - 1:,}) were dropped to "
                    f"fit the context of {ctx:,} tokens, unread; the {todo - skip:,} after them were read")
            rest = self.plan(store, index, policy, todo - skip, cx)
            return dataclasses.replace(rest, dropped=rest.dropped + skip, notes=(note,) + rest.notes,
                                       runs=((first, first + skip),) + rest.runs)
        if index.next_rope + chunk > ctx:
            if policy is None and cx.overflow not in OVERFLOW_EVICTS:
                raise ContextOverflowError(f"the model's context of {ctx} tokens is full")
            done += self._evict(store, index, policy, self._overflow_target(policy, cx), self._reason(policy, cx),
                                cx, force_rotate=True)
            chunk = max(1, min(chunk, ctx - index.next_rope))
        while chunk > 1 and not store.can_reserve(chunk):
            chunk = (chunk + 1) // 2  # fewer tokens per forward before evicting for pages
        if not store.can_reserve(chunk):
            done += self._evict_for_pages(store, index, policy, cx)
        return EvictionPlan(chunk, tuple(done), context=cx)

    def _unread(self, store, index: CacheIndex, todo: int, cx: EvictionContext) -> EvictionPlan | None:
        """Overflow "turns" on a prompt the context cannot hold with the chat: the prompt's tokens the rule drops
        (whole older messages, then the latest message's oldest part: ``engine.policies.turns``) are passed over
        unread, the kept ones before them (the system prompt, a pin) fed first; the cached messages it drops go
        now. None: dropping cached messages makes the room (evicted as the forwards need it)."""
        first, ctx = index.next_pos, cx.context_length
        cached, runs = turns.unread_runs(np.flatnonzero(index.held(first)), first, todo, cx.turns, cx.priorities,
                                         self._overflow_target(None, cx))
        if not runs:
            return None
        done = self._evict(store, index, None, index.n - cached, "turns", cx, force_rotate=True) if cached else []
        a, b = runs[0]
        if a > first:  # kept tokens first (never more than the context holds: the rule keeps less)
            rest = self.plan(store, index, None, a - first, cx)
            return dataclasses.replace(rest, evictions=tuple(done) + rest.evictions)
        index.skip(b - a)  # never fed
        note = (f"{b - a:,} tokens of the prompt (positions {a:,}–{b - 1:,}: {turns.run_words(a, b, cx.turns)}) "
                f"were dropped to fit the context of {ctx:,} tokens, unread; the system prompt and pinned messages "
                "were kept")
        rest = self.plan(store, index, None, todo - (b - a), cx)
        return dataclasses.replace(rest, evictions=tuple(done) + rest.evictions, dropped=rest.dropped + b - a,
                                   notes=(note,) + rest.notes, runs=((a, b),) + rest.runs)

    def after_forward(self, store, index: CacheIndex, policy: EvictionPolicy | None,
                      cx: EvictionContext) -> list[Eviction]:
        # at the budget already: evict now, not before the next forward, so the pages given back are still
        # free (shown "just evicted") when this step's snapshot is taken
        if policy is not None and index.n >= policy.budget:
            return self._evict(store, index, policy, policy.budget - policy.slack(cx.page_size), policy.name, cx)
        return []

    def _evict_for_pages(self, store, index, policy, cx) -> list[Eviction]:
        """The page pool (its page limit, or the memory limit) is full: evict half the cache if a policy or the
        overflow setting allows it. If that is not allowed or not enough, ``store.reserve`` refuses next with
        the arena's typed error (which limit, and what to change) before anything is written."""
        if (policy is None and cx.overflow not in OVERFLOW_EVICTS) or index.n < 2:
            return []
        return self._evict(store, index, policy, index.n // 2, self._reason(policy, cx), cx,
                           force_rotate=policy is None)

    @staticmethod
    def _overflow_target(policy: EvictionPolicy | None, cx: EvictionContext) -> int:
        """Tokens to keep when the context (not a policy budget) is full. Dropping whole turns keeps all but an
        eighth of the context (the fewest turns that make that room: an overflow of 14 tokens dropped 256 with
        half of it); the other overflow settings keep half."""
        if policy is not None and policy.budget < cx.context_length:
            return policy.budget - policy.slack(cx.page_size)
        if policy is None and cx.overflow == "turns":
            return cx.context_length - max(1, cx.context_length // 8)
        return cx.context_length // 2

    @staticmethod
    def _reason(policy: EvictionPolicy | None, cx: EvictionContext) -> str:
        return policy.name if policy is not None else cx.overflow

    # -- evicting --------------------------------------------------------------------------------------
    def evict_now(self, store, index: CacheIndex, policy: EvictionPolicy, target: int,
                  cx: EvictionContext) -> list[Eviction]:
        """Evict down to ``target`` with ``policy`` (a policy switched on mid-chat)."""
        first = ()
        if policy.scored and not self.scores.tracking:
            self.scores.start(index.n)
        scored = policy.needs_queries and index.n > target and self.queries.score_store(store, index.next_rope)
        if policy.scored and index.n > target and not scored and not float(sum(s.sum() for s in self.scores.t)):
            what = "no query statistics yet to score" if policy.needs_queries else "no attention scores yet for"
            first = (_says(policy, f"{what} the {index.n} cached tokens; the oldest go first this time, "
                                   "scores count from now on"),)
        done = self._evict(store, index, policy, target, policy.name, cx)
        if done and first:  # the note goes with what it explains
            done[0] = dataclasses.replace(done[0], notes=first + done[0].notes)
        return done

    def _evict(self, store, index: CacheIndex, policy: EvictionPolicy | None, target: int, reason: str,
               cx: EvictionContext, force_rotate: bool = False) -> list[Eviction]:
        n = index.n
        target = max(1, target)
        if n <= target and not force_rotate:
            return []
        pol = policy if policy is not None else OverflowPolicy.for_mode(cx.overflow, target, cx.protected)
        t0 = time.perf_counter()
        by_head = index.heads > 1 and (pol.per_head or index.split)  # one row per layer and KV head
        positions = index.log.reshape(-1, n) if by_head else index.layer_log  # [L*H, n] or [L, n]
        state = PolicyState(positions=np.array(positions), scores=self._scores_for(pol, n, by_head),
                            protected=cx.protected, priorities=_priorities(pol, cx), page_size=cx.page_size,
                            seq_len=cx.seq_len, turns=tuple(cx.turns))
        drops = pol.select(state, target)
        self.select_ms += (time.perf_counter() - t0) * 1000.0
        keep = _keep_rows(drops, n, index.heads if by_head else 0)
        n_keep = np.shape(keep[0])[-1]
        if any(np.shape(k)[-1] != n_keep for k in keep) or n_keep > target:
            raise InternalError(f"policy {pol.name} chose an invalid eviction ({n} → {n_keep}, target {target})")
        rotate = pol.rope_in_cache or force_rotate
        old_rope, old_next = np.array(index.rope), index.next_rope  # [L, H, n]
        start = _unchanged_prefix(keep, old_rope if rotate else None)
        held_before = index.held(index.next_pos)
        try:
            freed = store.compact(keep, rotate=self._rotate_fn(store, old_rope, n_keep) if rotate else None,
                                  start=start)
        except BaseException:
            if store.num_tokens != index.n:  # the store dropped a half-compacted cache: so does the index
                index.truncate(0)
                self.scores.truncate(0)
            raise
        index.keep(keep)
        if rotate:
            index.rerotate()
        self.scores.keep(keep)
        if rotate:
            self._shift_windows(store, index, index.next_rope - old_next)
        gone = np.nonzero(held_before & ~index.held(index.next_pos))[0]
        notes = _protection_notes(gone, state, pol, reason) + self._layer_notes(store, pol, reason, rotate)
        return [Eviction(reason, n - n_keep, tuple(int(p) for p in gone), tuple(freed), tuple(notes))]

    def _scores_for(self, policy: EvictionPolicy, n: int, by_head: bool) -> np.ndarray | None:
        if not policy.scored:
            return None
        if not self.scores.tracking or self.scores.t[0].shape[1] != n:
            self.scores.start(n)  # cannot happen when every change went through the evictor; stay safe
        return self.scores.rows() if by_head else self.scores.numpy()

    def _rerotator_for(self, store) -> Rerotator:
        if self._rerotator is None:
            kinds = getattr(getattr(store, "layout", None), "kinds", ())  # a GroupedKV's layer kinds
            self._rerotator = Rerotator(self.model, keyless_layers(kinds))
        return self._rerotator

    def _rotate_fn(self, store, old_rope: np.ndarray, n_keep: int):
        rerotator = self._rerotator_for(store)
        layout = getattr(store, "layout", None)  # a GroupedKV compacts its full layers: row l is model layer full[l]
        to_model = layout.full if layout is not None else list(range(len(old_rope)))

        def rotate(layer: int, k: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
            # k: [H, m, D], the last m kept keys (old slots idx: [m], or [H, m] per head); after compaction
            # RoPE = slot index
            m = np.shape(idx)[-1]
            new = np.arange(n_keep - m, n_keep)
            rope = old_rope[layer]  # [Hi, n]: Hi the index's heads (1 where they cannot part)
            was = np.take_along_axis(rope, np.broadcast_to(idx, (rope.shape[0], m)), axis=1)  # [Hi, m]
            delta = new - (was[0] if (was == was[:1]).all() else was)  # [m], or [H, m] where the heads differ
            return rerotator(to_model[layer], k, torch.from_numpy(np.ascontiguousarray(delta)))

        rotate.role = rerotator.role  # MLA: the cached rotary key is the "value" (``KVStore.compact``)
        return rotate

    def _shift_windows(self, store, index: CacheIndex, delta: int) -> None:
        """The positions handed to the model just moved by ``delta`` (< 0): every key a sliding window holds moves
        by the same ``delta``, so each query still sees its window at its true distances. Those keys then sit at
        no position a cut-back could reuse: the index says so (``positions_moved``)."""
        windows = getattr(store, "windows", None)
        if not windows or delta == 0:
            return
        rerotator, groups = self._rerotator_for(store), store.layout.window_groups()
        try:
            for w, win in windows.items():
                shift_all(win.inner, groups[w], delta, rerotator)
        except BaseException:
            store.free()  # some windows shifted, some not: start again from the text rather than run skewed
            index.truncate(0)
            self.scores.truncate(0)
            raise
        if any(rerotator.layers[m] is not None for layers in groups.values() for m in layers):
            index.positions_moved()

    def _layer_notes(self, store, pol: EvictionPolicy, reason: str, rotated: bool) -> list[Note]:
        """What the eviction did on each kind of layer, where that is not simply the textbook method on every
        layer (a model whose layers differ, MLA's rotary key). The text is the same at every eviction, so a reply
        carries it once."""
        layout = getattr(store, "layout", None)
        rerotator = self._rerotator_for(store) if rotated else None
        rest = layer_kind_summary(layout, pol, rerotator)
        return [Note(f"{reason}: {rest}", NoteKind.POLICY_SAYS, policy=reason, rest=rest)] if rest else []


def _unchanged_prefix(keep: list[np.ndarray], rope: np.ndarray | None) -> int:
    """Leading slots every layer and head keeps in place (and, when re-rotating, already at RoPE = slot index).
    ``keep``: per layer ``[m]`` or ``[H, m]``; ``rope``: ``[L, H, n]``."""
    m = np.shape(keep[0])[-1]
    ident = np.arange(m)
    same = np.all(np.stack([np.all(np.atleast_2d(k) == ident, axis=0) for k in keep]), axis=0)
    if rope is not None:
        same &= np.all(rope[:, :, :m] == ident, axis=(0, 1))
    bad = np.nonzero(~same)[0]
    return int(bad[0]) if len(bad) else m


def _keep_rows(drops: list[np.ndarray], n: int, heads: int) -> list[np.ndarray]:
    """The slots each layer keeps: ``[m]`` from one drop list per layer (``heads`` 0), or ``[H, m]`` from one per
    layer and head (a layer whose heads all keep the same slots gets ``[m]``: compaction takes one gather)."""
    kept = [np.setdiff1d(np.arange(n), d, assume_unique=True) for d in drops]
    if not heads:
        return kept
    if any(len(k) != len(kept[0]) for k in kept):
        return kept  # the caller reports the invalid choice
    out = []
    for layer in range(len(kept) // heads):
        rows = np.stack(kept[layer * heads:(layer + 1) * heads])  # [H, m]
        out.append(rows[0] if (rows == rows[:1]).all() else rows)
    return out


def _priorities(policy: EvictionPolicy, cx: EvictionContext) -> np.ndarray | None:
    """Per logical position (the whole sequence), with the policy's default where no message set one."""
    default = policy.default_priority()
    if default is None or cx.priorities is None:
        return None
    pri = np.asarray(cx.priorities, dtype=np.int64).copy()
    pri[pri < 0] = default
    if len(pri) < cx.seq_len:
        pri = np.concatenate([pri, np.full(cx.seq_len - len(pri), default, dtype=np.int64)])
    return pri


def _says(policy: EvictionPolicy, rest: str) -> Note:
    """A policy's own note: its name, then what it reports."""
    return Note(f"{policy.name}: {rest}", NoteKind.POLICY_SAYS, policy=policy.name, rest=rest)


def _prompt_note(policy: EvictionPolicy, reason: str, protected: int) -> Note:
    """What became of the protected prompt (system + first message) that an eviction reached into. Only a budget
    that really is smaller than the prompt is called so; an overflow mode drops it by design."""
    prompt, budget = f"system + first message, {protected} tokens", getattr(policy, "budget", 0)
    if isinstance(policy, OverflowPolicy) and reason == "rolling":
        rest = f"drops the oldest tokens to make room, the start of the chat ({prompt}) included: the model no " \
               "longer reads them"
        return Note(f"{reason}: {rest}", NoteKind.POLICY_SAYS, policy=reason, rest=rest)
    if isinstance(policy, OverflowPolicy):  # truncate_middle: its sinks are the prompt, cut to the room there is
        rest = f"keeps the start of the chat ({prompt}), but only {policy.params.sinks} of its tokens fit with the " \
               "recent ones: the rest of it is dropped too"
        return Note(f"{reason}: {rest}", NoteKind.POLICY_SAYS, policy=reason, rest=rest)
    if policy.name == "streaming":  # it keeps sinks, not the prompt
        return _says(policy, f"keeps the first {policy.params.sinks} tokens (attention sinks) and the most recent "
                     f"ones, {budget} in all; the rest of the prompt ({prompt}) is dropped as the chat goes on")
    if budget < protected:
        return _says(policy, f"the budget ({budget}) is smaller than the protected prompt ({prompt}): its oldest "
                     "tokens are evicted too; raise the budget to keep it all")
    return _says(policy, f"the budget ({budget}) cannot hold the protected prompt ({prompt}) and the recent tokens "
                 "it keeps as well: the prompt's oldest tokens are evicted too; raise the budget to keep it all")


def _protection_notes(gone: np.ndarray, state: PolicyState, policy: EvictionPolicy, reason: str) -> list[str]:
    """Say so when what should have stayed went (the policy protected less), in words true of the policy that
    evicted (``reason``: its name, or the overflow mode). The text does not change from one eviction to the next,
    so a reply carries it once."""
    budget = getattr(policy, "budget", 0)
    if reason == "turns" and len(gone):  # whole messages by design: say what stays (the same words every time)
        rest = ("drops the oldest whole messages to make room; the system prompt, pinned messages and the latest "
                "message stay")
        return [Note(f"{reason}: {rest}", NoteKind.POLICY_SAYS, policy=reason, rest=rest)]
    notes = [_prompt_note(policy, reason, state.protected)] if np.count_nonzero(gone < state.protected) else []
    if state.priorities is not None:
        rest = gone[(gone >= state.protected) & (gone < len(state.priorities))]
        if np.count_nonzero(state.priorities[rest] >= PINNED):
            notes.append(_says(policy, f"the budget ({budget}) cannot hold every pinned message: some pinned "
                         "tokens were evicted; raise the budget or unpin some"))
    return notes
