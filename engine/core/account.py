"""The cache account of a prompt: which tokens were reused, which were computed, and why each computed one was.

``SeqCache.reuse`` (``engine.core.prefix_reuse``) collects the facts as it cuts the cache back (``Facts``);
``account`` turns them into a ``CacheAccount`` whose misses cover ``[reused, prompt)`` in order, each with one
reason of ``MissReason``. Misses are found from the front: the first limit that stopped the reuse names the
tokens up to the next limit, so every computed token has exactly one reason — the first one that applies.
A diverged token is named in this chat's own tokens only (its cache is its own: a server's sessions belong to one
tenant), so no other conversation's text is ever shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.snapshot import CacheAccount, Miss, MissReason

LAST_TOKEN = "the prompt's last token is always computed: its logits give the reply's first token"


@dataclass(frozen=True)
class Facts:
    """What a reuse found. Positions are prompt tokens; every field is a plain int or a short string."""

    prompt: int  # tokens of the new prompt
    reused: int  # tokens reused in the end (own cache and prefix cache)
    fed: int  # tokens this cache held at their own positions or after an eviction, before the reuse
    intact: int  # of them, the first ones still at their own positions (the rest evicted)
    seen: int  # common prefix of the new prompt with every token this chat's cache was fed (evicted ones too)
    wanted: int  # what could be reused from the cache itself (the common prefix, the last token aside)
    kept: int  # of it, what the store could go back to (sliding windows, recurrent states)
    limit: str = ""  # why ``kept < wanted``: "window" or "state"
    lost: int = 0  # the cache had held this many first tokens before something cut it back to ``fed``
    lost_why: MissReason | None = None  # that something
    lost_detail: str = ""
    policy: str = ""  # the eviction policy's name, "" without one
    dropped: int = 0  # evicted tokens a stream that goes on passes over (never computed)
    off: bool = False  # the cache is off
    reuse_off: bool = False  # prefix reuse is switched off
    window: int = 0  # the smallest sliding window (for the detail)
    diverged_at: str = ""  # "'You are' → 'You're'": the cached and the new tokens where they differ
    disk_at: int = -1  # the first token of a page the disk tier had but could not read (missing, damaged)
    page: int = 0  # its page size
    shared_to: int = 0  # the prefix cache held the full-attention pages of the prompt's first tokens up to here
    shared_limit: str = ""  # "state" / "window": what another chat's cache lacked to go on to ``shared_to``


def account(f: Facts) -> CacheAccount:
    """The ``CacheAccount`` of ``f``: ``reused + recomputed + dropped == prompt``."""
    n, r = f.prompt, f.reused
    if f.off:
        return CacheAccount(n, 0, n, 0, (Miss(0, n, MissReason.OFF, "the cache is off: every token is computed "
                                                                   "again at every step"),) if n else ())
    if f.reuse_off:
        return CacheAccount(n, 0, n, 0, (Miss(0, n, MissReason.SETTINGS, "prefix reuse is switched off"),)
                            if n else ())
    misses: list[Miss] = []
    a = r + f.dropped

    def add(end: int, reason: MissReason, detail: str) -> None:
        nonlocal a
        end = min(end, n)
        if end > a:
            misses.append(Miss(a, end, reason, detail))
            a = end

    if f.limit and f.kept < f.wanted:
        add(f.wanted, MissReason(f.limit), _limit_detail(f))
    if f.shared_limit:
        add(f.shared_to, MissReason(f.shared_limit), _shared_detail(f))
    if f.intact < min(f.seen, f.fed, n - 1):  # the cache held them, evicted since
        reason = MissReason.POLICY if f.policy else MissReason.EVICTED
        add(min(f.seen, f.fed, n - 1), reason, f"evicted by {f.policy}" if f.policy else "evicted to make room")
    if a == f.disk_at:
        add(f.disk_at + f.page, MissReason.DISK, "its page file in the KV disk tier was missing or damaged "
                                                 "(dropped)")
    if f.lost_why is not None and f.fed < min(f.lost, f.seen, n - 1):
        add(min(f.lost, f.seen, n - 1), f.lost_why, f.lost_detail)
    held = max(f.fed, f.lost if f.lost_why is not None else 0)
    if f.seen < min(held, n):
        add(min(held, n), MissReason.DIVERGED, f"the prompt differs from this chat's cache at token {f.seen}"
            + (f": {f.diverged_at}" if f.diverged_at else ""))
    if a == n - 1 and f.seen >= n - 1:
        add(n, MissReason.NEW, LAST_TOKEN)
    add(n, MissReason.NEW, "not in the cache before")
    return CacheAccount(n, r, n - r - f.dropped, f.dropped, tuple(misses))


def with_dropped(a: CacheAccount, dropped: int, runs: Sequence[tuple[int, int]] = ()) -> CacheAccount:
    """``a`` after planning passed over ``dropped`` prompt tokens unread in all (to fit the context), at ``runs``
    (``[start, end)`` each; none given: right after the reused ones): they leave the misses, which count only what
    was computed — what the reply's footer and the Why readout count (they said "dropped 558 unread" and "814
    computed" of one prompt). Overflow "turns" passes over tokens after the system prompt, which is computed."""
    runs = list(runs) or [(a.reused, min(a.reused + dropped, a.prompt))]
    misses = []
    for m in a.misses:
        pieces = [(m.start, m.end)]
        for lo, hi in runs:
            pieces = [p for s, e in pieces for p in ((s, min(e, lo)), (max(s, hi), e)) if p[1] > p[0]]
        misses += [Miss(s, e, m.reason, m.detail) for s, e in pieces]
    return CacheAccount(a.prompt, a.reused, a.prompt - a.reused - dropped, dropped, tuple(misses))


def _limit_detail(f: Facts) -> str:
    if f.limit == "state":
        return (f"the recurrent layers' state can go back only to a checkpoint: the latest at or before token "
                f"{f.wanted} is at {f.kept}")
    return (f"a sliding-window layer ({f.window} tokens) no longer holds the window before token {f.wanted}; "
            f"the latest point it can go back to is {f.kept}")


def _shared_detail(f: Facts) -> str:
    if f.shared_limit == "state":
        return (f"the prefix cache holds these tokens' attention pages, but no copy of the recurrent layers' state "
                f"at a page boundary between token {f.reused} and {f.shared_to}")
    return (f"the prefix cache no longer holds the sliding-window layers' pages ({f.window} tokens) before token "
            f"{f.shared_to}")


def token_change(tokenizer, cached: Sequence[int], new: Sequence[int], at: int, width: int = 3) -> str:
    """"'cached text' → 'new text'" of a few tokens from ``at`` (empty without a tokenizer)."""
    if tokenizer is None:
        return ""

    def text(ids: Sequence[int]) -> str:
        t = tokenizer.decode(list(ids[at:at + width]), skip_special_tokens=False).replace("\n", "\\n")
        return "'" + t[:40] + ("…" if len(t) > 40 else "") + "'"

    if at >= len(cached) or at >= len(new):
        return ""
    old, now = text(cached), text(new)
    if old == now:  # the same text from other tokens ("'t` n' → 't` n'"): the tokens say what differs
        return f"{pieces(tokenizer, cached[at:at + width])} → {pieces(tokenizer, new[at:at + width])} (the same text, " \
               "other tokens)"
    return f"{old} → {now}"


def pieces(tokenizer, ids: Sequence[int]) -> str:
    """'[▁t #260, ` #96]': each token's piece and id (a byte token's piece names its byte, <0x0A>)."""
    try:
        names = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    except Exception:  # noqa: BLE001 - a tokenizer without pieces: the ids alone
        names = [""] * len(ids)
    return "[" + ", ".join(f"{n} #{int(i)}" if n else f"#{int(i)}" for n, i in zip(names, ids)) + "]"
