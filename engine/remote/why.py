"""Why a remote prompt was recomputed: a ``CacheAccount`` (``engine.snapshot``) for a chat with vLLM or KV Scope's
own server, from what this side knows — the chat's previous prompt and reply ids, the new prompt's ids, and the
blocks the server's KV events stored and removed (``RemoteView.history``). No vLLM dashboard can say this: the
server counts hits, it never says which block a prompt missed, or why.

``remote_account`` is the account: ``reused`` is the server's ``cached_tokens`` when it reports them (else what the
events say was held when the request was sent), and the misses cover the rest from the first token that was not
reused, each with one reason of the engine's vocabulary, the first that applies:

- ``evicted``: the server removed the block (a ``BlockRemoved`` for its hash, or ``AllBlocksCleared``);
- ``diverged``: the prompt differs from this chat's own previous prompt and reply at token N (said as text when
  the server can decode the tokens, ``/detokenize``: only this chat's tokens, never another's);
- ``partial_page``: the prompt's tail fills no whole block (blocks are reused whole);
- ``new``: the block was never stored (the previous reply ended inside it, or it was never sent before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from engine.snapshot import CacheAccount, Miss, MissReason

HELD, REMOVED, STORED, UNSEEN = "held", "removed", "stored", "unseen"  # a prompt block's fate
LAST_TOKEN = "the prompt's last token is always computed (its logits give the reply's first token)"
SHOWN_TOKENS = 3  # tokens said on each side of a divergence
TEXT_MAX = 40
CONTEXT_CHARS = 12  # characters of a changed message said on each side of the change


@dataclass(frozen=True)
class Before:
    """A chat's last request, as its next one's account needs it: the prompt + reply ids, the messages sent with
    the reply (API form), when the reply ended (monotonic)."""
    ids: tuple[int, ...] = ()
    messages: tuple = ()
    ended: float = 0.0


def fates(history: Sequence[tuple[float, float]], sent: float) -> list[str]:
    """Each block's fate from ``RemoteView.history`` and when the request was sent (monotonic): ``HELD`` (cached
    when it was sent), ``REMOVED`` (the server removed it, and did not hold it again before the request), ``STORED``
    (first stored by this request, or one beside it) or ``UNSEEN``."""
    out = []
    for stored_at, removed_at in history:
        if 0 <= stored_at < sent:
            out.append(HELD)
        elif removed_at >= 0:
            out.append(REMOVED)
        else:
            out.append(STORED if stored_at >= 0 else UNSEEN)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class _Prompt:
    """What the misses are found from (``remote_account``'s arguments, and the common prefix ``same``)."""
    ids: Sequence[int]
    previous: Sequence[int]
    block: int
    fates: Sequence[str]
    cleared: bool
    missed: bool
    change: str | None
    decode: Callable[[list[int]], str | None] | None
    same: int

    def fate(self, j: int) -> str:
        return self.fates[j] if j < len(self.fates) else UNSEEN

    def span(self, j: int) -> str:
        return f"block {j} (tokens {j * self.block}–{(j + 1) * self.block - 1})"


def remote_account(prompt: Sequence[int], previous: Sequence[int], block: int, block_fates: Sequence[str] = (),
                   cached: int | None = None, cleared: bool = False, missed: bool = False,
                   decode: Callable[[list[int]], str | None] | None = None,
                   change: str | None = None) -> CacheAccount:
    """The account of ``prompt`` (its token ids) sent to a server that caches whole blocks of ``block`` tokens.
    ``previous``: this chat's last prompt + reply ids ([] : none known); ``block_fates``: ``fates`` of the prompt's
    full blocks; ``cached``: the server's ``cached_tokens`` (None: not reported); ``cleared``: the server cleared
    its cache since ``previous``, ``missed``: the view started over since (events were lost); ``decode``: ids to
    text (None: the server cannot); ``change``: ``message_change`` of the chat's messages (None: not known), said
    of a divergence when the tokens cannot be decoded."""
    n, B = len(prompt), max(1, block)
    if cached is None:
        held = next((j for j, f in enumerate(block_fates) if f != HELD), len(block_fates))
        cached = min(held * B, (n - 1) // B * B if n else 0)  # the last token is always computed
    reused = max(0, min(cached, n))
    p = _Prompt(prompt, previous, B, block_fates, cleared, missed, change, decode, common_prefix(prompt, previous))
    misses, a = [], reused
    while a < n:
        m = _miss_at(p, a)
        misses.append(m)
        a = m.end
    return CacheAccount(n, reused, n - reused, 0, tuple(misses))


def _miss_at(p: _Prompt, a: int) -> Miss:
    """The miss that starts at token ``a``: the first reason that applies to its block, as far as it goes."""
    n, B, j = len(p.ids), p.block, a // p.block
    full = n // B * B
    own = len(p.previous)
    if p.same == a < own:  # the reuse stopped exactly where this chat's tokens part (a server that reuses by token)
        return _diverged(p, a)
    fate = p.fate(j) if a < full else UNSEEN
    if a == n - 1:
        return Miss(a, n, MissReason.NEW, LAST_TOKEN)
    if fate == HELD and j == (n - 1) // B:
        return Miss(a, n, MissReason.NEW, f"{LAST_TOKEN}, and the server reuses whole blocks: {p.span(j)} too")
    if fate == REMOVED:
        k = j
        while k < full // B and p.fate(k) == REMOVED:
            k += 1
        more = {1: "", 2: " and the block after it"}.get(k - j, f" and the {k - j - 1} blocks after it")
        return Miss(a, min(n, k * B), MissReason.EVICTED, f"the server removed {p.span(j)}{more} (BlockRemoved: "
                                                          "evicted to make room)")
    if a < full and fate == UNSEEN and p.cleared and min(p.same, own) >= (j + 1) * B:
        return Miss(a, min(n, max((j + 1) * B, min(p.same, own) // B * B)), MissReason.EVICTED,
                    "the server cleared its whole prefix cache (AllBlocksCleared) since this chat's last reply")
    if a <= p.same < min(own, (j + 1) * B, n) and (j + 1) * B <= own:
        return _diverged(p, a)
    if a >= full:
        last = f"last {n - a} tokens fill" if n - a > 1 else "last token fills"
        return Miss(a, n, MissReason.PARTIAL_PAGE, f"the prompt's {last} no whole block of {B} (the server reuses "
                                                   "whole blocks only)")
    if fate == HELD:
        return Miss(a, n, MissReason.NEW, f"the server did not reuse {p.span(j)} though its events had it cached when "
                                          "the prompt was sent (another of its engines may hold it)")
    why = f"{p.span(j)} was never stored on the server"
    if p.missed:
        why += " as far as its events tell (this view missed some and started over since this chat's last reply)"
    if own // B * B <= j * B < own and p.same >= own:
        why += f": this chat's last reply ended inside it, at token {own} (a block is stored once it is full)"
    return Miss(a, n, MissReason.NEW, why)


def _diverged(p: _Prompt, a: int) -> Miss:
    at, end = p.same, min(len(p.ids), max(len(p.previous), a + 1))
    head = f"the prompt differs from this chat's last prompt and reply at token {at}"
    if p.change:  # "your message 1 changed: 'a' → 'b'": the chat's own words, with their context; the pair last,
        who, sep, pair = p.change.partition(": ")  # as the footer quotes it
        return Miss(a, end, MissReason.DIVERGED, f"{head} ({who}): {pair}" if sep and " → " in pair else
                    f"{head}: {p.change}")
    was, now = _said(p, p.previous, at), _said(p, p.ids, at)  # else the server's tokens (its /detokenize)
    if was is not None and now is not None:
        what = f"{was} → {now}" + (" (the same text, as other tokens)" if was == now else "")
    elif p.change == "":  # the messages are what they were, as text
        what = ("this chat's messages are the same text: the server tokenized them otherwise (e.g. the last reply, "
                "tokenized again, is not the ids it was generated as)")
    else:
        what = f"token ids {_ids(p.previous, at)} → {_ids(p.ids, at)}"
    return Miss(a, end, MissReason.DIVERGED, f"{head}: {what}")


def _ids(ids: Sequence[int], at: int) -> str:
    return " ".join(str(i) for i in ids[at:at + SHOWN_TOKENS]) or "(none)"


def _said(p: _Prompt, ids: Sequence[int], at: int) -> str | None:
    part = list(ids[at:at + SHOWN_TOKENS])
    text = p.decode(part) if p.decode is not None and part else None
    return None if text is None else _quoted(text)


def _quoted(text: str) -> str:
    text = text.replace("\n", "\\n")
    return "'" + text[:TEXT_MAX] + ("…" if len(text) > TEXT_MAX else "") + "'"


def message_change(old: Sequence[dict], new: Sequence[dict]) -> str:
    """Where this chat's messages changed since its last request, as text ('your message 1 changed: '…named Lily'
    → '…named Anna''); '' when the new ones only add to the old (``old``: what was sent and the reply)."""
    for i, (o, m) in enumerate(zip(old, new)):
        if o == m:
            continue
        a, b = str(o.get("content", "")), str(m.get("content", ""))
        if o.get("role") != m.get("role"):
            return f"message {i + 1} is a {m.get('role')} message now, a {o.get('role')} one before"
        c = common_prefix(a, b)
        s = max(0, c - CONTEXT_CHARS)
        cut = "…" if s else ""
        return (f"{_who(o.get('role'), i, old)} changed: {_quoted(cut + a[s:c + CONTEXT_CHARS])} → "
                f"{_quoted(cut + b[s:c + CONTEXT_CHARS])}")
    if len(new) < len(old):
        return f"the messages after message {len(new)} were left out"
    return ""


def _who(role, i: int, messages: Sequence[dict]) -> str:
    if role == "system":
        return "the system prompt"
    k = sum(1 for m in messages[:i + 1] if m.get("role") == role)
    return f"your message {k}" if role == "user" else f"reply {k}" if role == "assistant" else f"message {i + 1}"


def account_line(account: CacheAccount | None) -> str:
    """The reply footer's line: 'recomputed 96 of 160 prompt tokens from token 64: the server removed block 2
    (tokens 64–95) …' ('' when nothing was recomputed or there is no account)."""
    if account is None or not account.misses:
        return ""
    first = account.misses[0]
    rest = {m.reason.value for m in account.misses[1:]} - {first.reason.value}
    then = f" (then: {', '.join(sorted(rest))})" if rest else ""
    return (f"recomputed {account.recomputed:,} of {account.prompt:,} prompt tokens from token {first.start:,} — "
            f"{first.reason.value}: {first.detail}{then}")


def account_dict(account: CacheAccount) -> dict:
    """The account as a reply's saved stats hold it (``CacheAccount.to_dict`` and its prompt size)."""
    return {"prompt": account.prompt, **account.to_dict()}
