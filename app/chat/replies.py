"""One reply's bookkeeping, and what is saved with it.

A ``Reply`` lives from the request to the worker's ``finished``, whether or not its chat is on screen: a
reply goes on in the background when the user opens another chat, and its text and stats reach the
history store either way. Saved stats always carry ``stop_reason`` (and ``stop_detail`` when it was not
the user who stopped it), so every reply says how it ended — also one the app did not live to finish.

Versions: regenerating keeps the replies it replaces, and so does Edit & resend (each old one noting the
message it answered). The message's stats hold ``versions`` (every
version's content and stats, oldest first) and ``version`` (the one shown); the message's content is the
shown version's, so the engine continues the chat from the version on screen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from app.chat.draft_tint import add_span
from app.ground.failure import Failure

INTERRUPTED = {"stop_reason": "interrupted"}  # a reply the app closed (or crashed) before it finished
VERSION_KEYS = ("versions", "version")


@dataclass
class Reply:
    """A reply from ``submit`` to ``finished``. ``bubble`` is its bubble while its chat is on screen."""

    generation_id: int
    chat_id: int
    message_id: int
    position: int
    modes: list[str]
    versions: list[dict[str, Any]] = field(default_factory=list)  # the versions it will sit beside
    tokens: int = 0
    notes: list[str] = field(default_factory=list)
    pending: str = ""  # streamed text not yet in the history store
    streamed: str = ""
    failure: Failure | None = None
    stop_detail: str = ""  # why it was stopped when the user did not press Stop
    draft_spans: list[list[int]] = field(default_factory=list)  # characters of ``streamed`` from accepted drafts
    switches: list[str] = field(default_factory=list)  # cache changes made while it ran, besides the mode's
    places: list[dict] = field(default_factory=list)  # where its recomputed prompt tokens sit (app.link.places)
    context: dict[str, int] = field(default_factory=dict)  # its chat's context at its last snapshot: used, total, chat

    def add_text(self, delta: str, draft: bool) -> None:
        """A token's text arrived (``draft``: a draft token the model accepted)."""
        if draft:
            add_span(self.draft_spans, len(self.streamed), len(self.streamed) + len(delta))
        self.pending += delta
        self.streamed += delta

    def stats(self, reason: str, turn: Any, text: str) -> dict[str, Any]:
        """What is saved with the finished reply (``turn``: the engine's ``TurnStats`` or None)."""
        info = asdict(turn) if turn is not None else {}
        info.update(mode=" → ".join(self.modes), stop_reason=reason)
        if self.switches:
            info["switches"] = list(self.switches)
        if self.places:  # the footer's "the system prompt changed at token 12"
            info["cache_places"] = [dict(p) for p in self.places]
        if self.context:  # the chat's counts as it left them: shown again when it is reopened, after a restart too
            info["context"] = dict(self.context)
        info.setdefault("generated_tokens", self.tokens)
        if reason == "error" and self.failure is not None:
            info["error"] = self.failure.message
        if self.stop_detail and reason in ("cancelled", "error"):
            info["stop_detail"] = self.stop_detail
        if self.notes:
            info["notes"] = list(self.notes)
        if self.draft_spans:  # character ranges of the text (a stop string cut off at its end: clamped when drawn)
            info["draft_spans"] = [list(span) for span in self.draft_spans]
        if self.versions:
            info = with_version(self.versions, text, info)
        return info


def plain_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` without the version bookkeeping."""
    return {k: v for k, v in (stats or {}).items() if k not in VERSION_KEYS}


def versions_of(content: str, stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Every version of a stored reply (a reply that was never regenerated is its own only version)."""
    if stats.get("versions"):
        return [dict(v) for v in stats["versions"]]
    return [{"content": content, "stats": plain_stats(stats)}]


def edited_versions(reply: Any, asked: str) -> list[dict[str, Any]]:
    """Edit & resend: the versions of the stored ``reply`` to the message before its edit (``asked``), each
    saying what it answered, so the new reply sits beside them as Regenerate's does."""
    said = " ".join(asked.split())
    note = "a reply to the message before it was edited: “" + (said if len(said) <= 80 else said[:79] + "…") + "”"
    out = []
    for v in versions_of(reply.content, reply.stats):
        stats = dict(v.get("stats", {}))
        if note not in stats.get("notes", []):
            stats["notes"] = list(stats.get("notes", [])) + [note]
        out.append(dict(v, stats=stats))
    return out


def with_version(versions: list[dict[str, Any]], text: str, stats: dict[str, Any]) -> dict[str, Any]:
    """Stats of a new version ``text`` added after ``versions`` (and shown)."""
    plain = plain_stats(stats)
    allv = list(versions) + [{"content": text, "stats": plain}]
    return dict(plain, versions=allv, version=len(allv) - 1)


def pick_version(stats: dict[str, Any], index: int) -> tuple[str, dict[str, Any]] | None:
    """(content, stats) with version ``index`` shown, or None if there is no such version."""
    versions = stats.get("versions") or []
    if not 0 <= index < len(versions):
        return None
    chosen = versions[index]
    return chosen["content"], dict(plain_stats(chosen.get("stats", {})), versions=versions, version=index)


def interrupted(content: str, stats: dict[str, Any]) -> dict[str, Any]:
    """The stats of a reply found unfinished in the history (the app closed or crashed while it streamed):
    marked so, with the token count saved with its last streamed text, keeping its earlier versions."""
    stats = dict(stats)
    streamed = stats.pop("streamed_tokens", None)
    if streamed is not None:
        stats.setdefault("generated_tokens", streamed)
    if stats.get("versions") and stats.get("version", 0) >= len(stats["versions"]):
        return with_version(stats["versions"], content, dict(plain_stats(stats), **INTERRUPTED))
    return dict(stats, **INTERRUPTED)


MEASURED_PREFILL = 64  # a prefill of at least this many tokens says how fast this chat's model reads


def against_own_prefill(info: dict[str, Any], earlier: list) -> dict[str, Any]:
    """``info`` (a finished reply's stats) with the tokens it restored from the KV disk tier weighed against this
    chat's own prefill: the fastest earlier reply of the chat that computed at least ``MEASURED_PREFILL`` prompt
    tokens (its tokens per second, saved with it), instead of the engine's guess (after a restart the model has
    measured nothing yet; a guess from its size said 9 ms where this chat's prefill took 185 ms)."""
    disk = int(info.get("disk_restored_tokens") or 0)
    replies = [m.stats for m in earlier if m.role == "assistant"] + [v.get("stats", {}) for v in info.get("versions", ())]
    rates = [float(r.get("prefill_tokens_per_s") or 0) for r in replies  # the chat's replies, and those this one
             if int(r.get("recomputed_tokens") or 0) >= MEASURED_PREFILL]  # replaced (regenerate: its versions)
    rate = max(rates, default=0.0)
    if not disk or rate <= 0:
        return info
    return dict(info, disk_again_ms=disk / rate * 1000.0, disk_rate="chat")


def mark_unfinished(history: Any, chat_id: int, running: Reply | None) -> list:
    """The chat's messages; a reply left without a stop reason (the app closed or crashed while it was being
    written) is saved as interrupted, so it says why it stopped (``running``: the reply being written, left as is)."""
    out = []
    for m in history.messages(chat_id):
        if m.role == "assistant" and "stop_reason" not in m.stats and (running is None or m.id != running.message_id):
            m = replace(m, stats=interrupted(m.content, m.stats))
            history.set_stats(m.id, m.stats)
        out.append(m)
    return out
