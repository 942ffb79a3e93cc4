"""Why prompt tokens were recomputed, and what reuse costs, in the app's words.

The engine gives every prompt a cache account (``engine.snapshot.CacheAccount``: reused, recomputed, and the
misses as ranges with a ``MissReason`` and a one-line detail). Here it is said for the user, in one place: the
reply footer's line ("recomputed 1,132 tokens: the system prompt changed at token 12 ('You are' → 'You're')"),
the token strip's legend and hover text, the "Why recomputed?" readout, and the model card's line on what reuse
costs on this model. A miss's position becomes a message of the chat when the reply knows where its messages
sit (``app.link.places``: ``places``); else it is "the prompt".

An account comes as the engine's object (a snapshot's) or as the dict saved with a reply (``TurnStats`` through
``asdict``): ``misses_of`` reads both.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from app.ground.format import human_bytes

REASONS: dict[str, tuple[str, str]] = {  # MissReason value -> (label, what it means, for legends and tooltips)
    "new": ("new", "not in the cache before"),
    "diverged": ("prompt changed", "the prompt differs from what this chat's cache holds from here on"),
    "evicted": ("evicted", "evicted earlier to make room"),
    "policy": ("evicted by policy", "evicted earlier by the eviction policy"),
    "partial_page": ("partial page", "the cache is reused in whole pages: these sat in a partly filled one"),
    "settings": ("settings", "a cache setting kept them from being reused"),
    "window": ("window passed", "a sliding-window layer no longer held them"),
    "state": ("no state checkpoint", "the recurrent layers' state could not go back this far"),
    "disk": ("disk page lost", "their page file in the KV disk cache was missing or damaged"),
    "off": ("cache off", "the cache is off: every token is computed at every step"),
}
NO_TURN = "No turn yet: send a message and this lists why each prompt token was computed instead of reused."
NO_ACCOUNT = ("This chat's cache tells no account of its prompts (a remote server's chat: the page map shows which "
              "of its blocks the server holds).")
ALL_REUSED = ("Every prompt token was reused (the last one is always computed: its logits give the reply's first "
              "token).")


class MissRow(NamedTuple):
    start: int
    end: int
    reason: str  # a MissReason value
    detail: str

    @property
    def tokens(self) -> int:
        return self.end - self.start


def misses_of(account: Any) -> list[MissRow]:
    """The misses of a ``CacheAccount`` or of its saved dict, in order."""
    if account is None:
        return []
    raw = account.get("misses", ()) if isinstance(account, dict) else getattr(account, "misses", ())
    out = []
    for m in raw or ():
        get = m.get if isinstance(m, dict) else lambda k, m=m: getattr(m, k)
        reason = get("reason")
        out.append(MissRow(int(get("start")), int(get("end")), str(getattr(reason, "value", reason)),
                           str(get("detail") or "")))
    return out


def recomputed_of(account: Any) -> int:
    """Tokens the prompt's model read this turn: the account's ``recomputed`` (new ones and ones read again)."""
    return int(account.get("recomputed", 0) if isinstance(account, dict) else getattr(account, "recomputed", 0))


class Counts(NamedTuple):
    """One prompt's numbers, as every surface says them: ``reused`` read from the cache, ``computed`` read by the
    model this turn — ``again`` of them had been cached before (a reason other than new), ``new`` never were —
    and ``dropped`` passed over unread."""

    prompt: int
    reused: int
    computed: int
    again: int
    new: int
    dropped: int


def counts_of(account: Any) -> Counts:
    get = account.get if isinstance(account, dict) else lambda k, d=0: getattr(account, k, d)
    misses = misses_of(account)
    again = sum(m.tokens for m in explained(misses))
    computed = recomputed_of(account)
    return Counts(int(get("prompt", 0)), int(get("reused", 0)), computed, again, max(computed - again, 0),
                  int(get("dropped", 0)))


def computed_words(c: Counts) -> str:
    """'computed 46 (45 recomputed, 1 new)', 'computed 1 (new)', 'computed 12 (recomputed)'."""
    if c.again and c.new:
        split = f"{c.again:,} recomputed, {c.new:,} new"
    else:
        split = "recomputed" if c.again else "new"
    return f"computed {c.computed:,} ({split})" if c.computed else "computed 0"


def explained(misses: list[MissRow]) -> list[MissRow]:
    """The misses worth a word: all but new tokens (a new message, the prompt's last token)."""
    return [m for m in misses if m.reason != "new"]


def reason_label(reason: str) -> str:
    return REASONS.get(reason, (reason, ""))[0]


KIND_NAMES = {"system": "system prompt", "user": "user", "assistant": "assistant", "tool_call": "tool call",
              "tool_result": "tool result", "reply": "the latest reply"}  # a message's kind, as legends name it


def kind_words(kind: str, n: int) -> str:
    """'tool result 3', 'user message 2', 'the system prompt', 'the latest reply': a message of an API
    conversation by its kind and number."""
    return {"system": "the system prompt", "user": f"user message {n}", "assistant": f"assistant message {n}",
            "tool_call": f"tool call {n}", "tool_result": f"tool result {n}", "reply": "the latest reply"}.get(
        kind, f"{kind} {n}")


def where(pos: int, places: list[dict] | None) -> str:
    """'the system prompt', 'your message 2', 'reply 1', "the reply's header" or (not known) 'the prompt'."""
    place = next((p for p in places or () if p.get("at") == pos), None)
    if place is None:
        return "the prompt"
    role, n = place.get("role"), place.get("number", 0)
    return {"system": "the system prompt", "user": f"your message {n}", "assistant": f"reply {n}",
            "tool_call": f"tool call {n}", "tool_result": f"tool result {n}",
            "header": "the reply's header"}.get(role, "the prompt")


def change_of(detail: str) -> str:
    """'“You are” → “You're”' from a diverged miss's detail ("...at token 12: 'You are' → 'You're'"; the
    engine's quotes become curly ones, so an apostrophe in the text reads as one); "" when it names none."""
    _head, sep, tail = detail.partition(": ")
    if not sep or " → " not in tail:
        return ""
    old, arrow, new = tail.partition("' → '")
    if arrow and old.startswith("'") and new.endswith("'"):
        return f"“{old[1:]}” → “{new[:-1]}”"
    return tail


def detail_words(m: MissRow) -> str:
    """The engine's one-line detail of a miss, its texts in curly quotes as the footer writes them."""
    change = change_of(m.detail) if m.reason == "diverged" else ""
    return f"{m.detail.partition(': ')[0]}: {change}" if change else m.detail


def cause(m: MissRow, places: list[dict] | None = None) -> str:
    """One miss in a sentence, with where it starts in the chat."""
    a, b, at = f"{m.start:,}", f"{max(m.start, m.end - 1):,}", where(m.start, places)
    span = f"tokens {a}–{b}" if m.tokens > 1 else f"token {a}"
    inside = f" (from {at})" if at != "the prompt" else ""
    if m.reason == "diverged":
        change = change_of(m.detail)
        return f"{at} changed at token {a}" + (f" ({change})" if change else "")
    return {
        "evicted": f"{span}{inside} had been evicted to make room",
        "policy": f"{span}{inside} had been evicted by the eviction policy",
        "partial_page": f"the cache is reused in whole pages: {span}{inside} sat in a partly filled one",
        "settings": f"a cache setting kept {span}{inside} from being reused",
        "window": f"a sliding-window layer no longer held the window before token {m.end:,}: it could go back "
                  f"to token {a}{inside}",
        "state": f"the recurrent state could go back only to a checkpoint: the nearest before token {m.end:,} "
                 f"was at token {a}{inside}",
        "disk": f"the page file on disk for {span}{inside} was missing or damaged",
        "off": "the cache is off",
        "new": f"not in the cache before: {span}{inside}",
    }.get(m.reason, f"{span}{inside}: {m.reason}")


def footer_line(stats: dict[str, Any]) -> str:
    """The reply footer's line on recomputed tokens ("" when only new tokens were computed: a new message, the
    prompt's last token): the largest miss with a reason (the first of them), and how many other reasons the
    readout lists."""
    account = (stats or {}).get("cache")
    why = explained(misses_of(account))
    if not why:
        return ""
    n = sum(m.tokens for m in why)  # read again: what the Why readout lists, not the new tokens beside them
    main = max(why, key=lambda m: m.tokens)  # the first of the largest: a changed prompt over the checkpoint before it
    line = f"recomputed {n:,} token{'s' if n != 1 else ''}: {cause(main, stats.get('cache_places'))}"
    others = len({m.reason for m in why} - {main.reason})
    return line + (f" · and {others} more reason{'s' if others > 1 else ''}" if others else "")


def hover_words(m: MissRow) -> str:
    """The token strip's hover text of a computed prompt token: 'recomputed: prompt changed — <detail>'."""
    verb = "computed" if m.reason == "new" else "recomputed"
    return f"{verb}: {reason_label(m.reason)}" + (f" — {m.detail}" if m.detail else "")


def checkpoint_words(pos: int, size: int, stateful: bool) -> str:
    """A checkpoint on the token strip: 'state snapshot at token 51 · 1.5 KiB' (a sliding-only model keeps
    windows, no state)."""
    what = "state snapshot" if stateful else "sliding windows kept"
    return f"checkpoint: {what} at token {pos:,} · {human_bytes(size)}"


def reuse_cost(info: Any, checkpoints: int, page_size: int) -> str:
    """The model card's line on reuse: where a later prompt can go back to on this model, and what it costs ('any
    token (full attention)', 'to checkpoints: 8 kept, ≤ 24 KiB each' — per chat; a checkpoint holds a copy of the
    recurrent states and the sliding windows' pages there: one line, the card has no room for more)."""
    kinds = tuple(getattr(info, "layer_kinds", ()) or ())
    sliding = [w for k, w in zip(kinds, getattr(info, "windows", ())) if k.startswith("sliding")]
    states = any(k == "state" or k.endswith("+state") for k in kinds)
    if not sliding and not states:
        return "any token (full attention)"
    if checkpoints <= 0:
        return "checkpoints off: only a follow-up goes on from the cache"
    per = int(getattr(info, "state_bytes", 0) or 0) + sum(
        (w + max(page_size, 1)) * info.layer_bytes_per_token for w in sliding)
    return f"to checkpoints: {checkpoints} kept, ≤ {human_bytes(per)} each"
