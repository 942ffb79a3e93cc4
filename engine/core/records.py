"""Frozen records of what the core did: ``StepRecord``, one per forward of a sequence's cache, and ``ReuseRecord``,
one per prompt's reuse of it; and ``Reprefill``, tokens a cache change left to read again during a reply (its only
writer: ``engine.core.reprefill``); and ``Demand``, what a reply asks of the scheduler's next round, with the
round's arithmetic over demands: the tokens it grants (``grants``) and the forwards they share (``forward_units``).

``SeqCache`` (``engine.core.seq_cache``) is the first two's only writer: each forward's commit returns one and keeps it as
``SeqCache.last`` until the next; ``engine.core.observe`` builds the step's ``CacheSnapshot`` from it. Nothing
else writes what a forward did, so the page map, the timing panel and the server's counters read the same facts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.core.vocab import StepPath
from engine.snapshot import CacheAccount

MAX_BATCH = 16  # sequences per batched forward: past this the attention loop, not the weights, dominates a step

if TYPE_CHECKING:
    from engine.config import CacheConfig
    from engine.core.eviction import Eviction


@dataclass(frozen=True)
class StepRecord:
    """One forward of one sequence's cache."""

    path: StepPath = StepPath.EAGER  # what ran it
    batch_size: int = 1  # sequences it decoded together
    written: tuple[int, ...] = ()  # pages it wrote (a batched forward: every sequence's in this pool)
    evictions: "tuple[Eviction, ...]" = ()  # what was evicted for it: planned before, trimmed after
    verified: int = 0  # a verification's slots written
    rolled_back: int = 0  # of them, cut back (drafts the model did not keep)
    policy_ms: float = 0.0  # the eviction policy's own work for it: queries observed, keys scored, tokens chosen

    def evicted(self, more: "list[Eviction] | tuple[Eviction, ...]") -> "StepRecord":
        """This record with ``more`` evictions after the ones it has."""
        return replace(self, evictions=self.evictions + tuple(more)) if more else self

    def settled(self) -> "StepRecord":
        """As an idle chat's picture shows it, once its reply ended: no page being written, nothing verified."""
        return replace(self, written=(), batch_size=1, verified=0, rolled_back=0)


IDLE = StepRecord()


@dataclass(frozen=True)
class ReuseRecord:
    """What one prompt's reuse of the cache did (``SeqCache.reuse``, its only writer; kept as ``SeqCache.reused``
    until the next): the prefix cache's and the disk tier's part, a stream that went on, a swap-in, the account."""

    disk_tokens: int = 0  # restored from the KV disk tier
    disk_ms: float = 0.0  # reading them
    disk_pages: tuple[int, ...] = ()  # the pages they went to (the page map marks them)
    continued: int = 0  # the prompt went on from an evicted cache: its tokens evicted earlier (never recomputed)
    swapped_in_pages: int = 0  # pages the swap-in before it took back from the prefix cache instead of copying
    account: CacheAccount = CacheAccount()  # why each prompt token was reused or computed


@dataclass(frozen=True)
class Reprefill:
    """Tokens of a running reply that a cache change left to be read again, and how far that got
    (``engine.core.reprefill``, its only writer). Positions ``[start, start + tokens)`` of the sequence."""

    tokens: int  # to read again in all
    start: int  # the first of them (where the change cut the cache back to)
    done: int = 0  # read again so far
    ms: float = 0.0  # spent reading them (never the reply's TTFT, prefill or decode time)
    estimate_ms: float = 0.0  # what it should take, at the model's measured prefill rate (before it began)
    old: "CacheConfig | None" = None  # the setting before the change
    new: "CacheConfig | None" = None  # the setting that needs them read again

    @property
    def running(self) -> bool:
        return self.done < self.tokens


@dataclass(frozen=True)
class Demand:
    """What a reply asks of the next round (``Stepping.demand``), asked once a round by the scheduler, which grants
    its tokens (``tokens`` while the round's prefill budget lasts; a verification's when the pool has room for them,
    else its one token) and forms the shared forwards from it."""

    pending: int  # tokens to feed before its next token (1 decoding; 0 handing out a verification's tokens)
    limit: int  # most tokens one forward of it feeds: the model's prefill chunk (a share of it while re-reading)
    shares: int  # tokens it would feed in a forward shared with others (0: it runs alone)
    runner: Any  # the model runner its forward runs on (requests of one runner may share a forward)
    drafts: tuple[int, ...] = ()  # a decode step's speculative drafts, proposed once: verified with its token

    @property
    def tokens(self) -> int:
        """The tokens one forward of it feeds: a prefill chunk, the one decode token, a verification's token and
        drafts; 0 while a verification's tokens are handed out (no forward)."""
        return len(self.drafts) + 1 if self.drafts else min(self.pending, self.limit)


def grants(demands: list[Demand], budget: int) -> list[int | None]:
    """Each demand's tokens this round, in priority order (None: not this round): every decoding one its token (or
    its verification's), and prefilling ones a chunk each while ``budget`` prefill tokens last (the first always:
    the highest-priority one goes first)."""
    out: list[int | None] = []
    for d in demands:
        first = len(out) == out.count(None)  # nothing granted yet
        out.append(d.tokens if d.pending <= 1 or first or budget > 0 else None)
        if d.pending > 1 and out[-1] is not None:
            budget -= out[-1]
    return out


def share_groups(items: list, demands: list[Demand]) -> list[list]:
    """The groups of ``items`` (sessions, or a round's ``Scheduled``) that would share a forward now, one per model
    runner: every one decoding one token, plus the first (the highest-priority) one with a prefill chunk to feed,
    as vLLM's chunked prefill mixes them; at least one decode and two members a group, at most ``MAX_BATCH``.
    ``demands``: each item's ``Demand``, in order."""
    groups: dict[int, tuple[list, list]] = {}
    for x, d in zip(items, demands):
        if d.shares and not d.runner.batch_refusal():
            decodes, prefills = groups.setdefault(id(d.runner), ([], []))
            (decodes if d.shares == 1 else prefills).append(x)
    order = {id(x): i for i, x in enumerate(items)}
    out = []
    for decodes, prefills in groups.values():
        group = prefills[:1] + decodes if decodes else []
        if len(group) > 1:
            out.append(sorted(group[:MAX_BATCH], key=lambda x: order[id(x)]))
    return out


def forward_units(items: list, demands: list[Demand]) -> list[list]:
    """``items`` (in priority order; ``demands``: each one's ``Demand``) as the forwards they run in, in order: a
    batchable group when its first member's turn comes (``share_groups``), every other one alone."""
    group_of = {id(x): g for g in share_groups(items, demands) for x in g}
    out, seen = [], set()
    for x in items:
        if id(x) in seen:
            continue
        unit = group_of.get(id(x), [x])
        seen.update(id(y) for y in unit)
        out.append(unit)
    return out
