"""The plain-text lines under a bubble's text: stats, pin, error, notes, cache reuse (no Qt here)."""

from __future__ import annotations

from typing import Any

from app.ground.note_words import reprefill_footer
from app.ground.format import count
from app.ground.glossary import stop_mark
from app.ground.reuse_words import Counts, computed_words, counts_of


def stats_line(stats: dict[str, Any]) -> str:
    """'prefill 812 tok/s · decode 41.3 tok/s · TTFT 35 ms · 128 tokens · cache paged', then how it
    stopped when it did not simply end ('stopped: context full — ...'). Empty for a message that is not
    a finished reply (a pinned user message shows ``pin_line``)."""
    if not stats or ("stop_reason" not in stats and "generated_tokens" not in stats):
        return ""
    parts = []
    if stats.get("prefill_tokens_per_s"):
        parts.append(f"prefill {stats['prefill_tokens_per_s']:.0f} tok/s")
    if stats.get("decode_tokens_per_s"):
        parts.append(f"decode {stats['decode_tokens_per_s']:.1f} tok/s")
    if stats.get("ttft_ms") is not None:
        parts.append(f"TTFT {stats['ttft_ms']:.0f} ms")
    if stats.get("reprefills"):  # a cache change mid-reply had tokens read again: its time apart from TTFT
        parts.append(reprefill_footer(stats["reprefills"]))
    parts.append(count(stats.get("generated_tokens", 0)))
    if stats.get("mode"):
        parts.append(f"cache {stats['mode']}")
    if stats.get("switches"):  # precision / policy / page size changed while it was written
        parts.append("switched mid-reply: " + "; ".join(stats["switches"]))
    if stats.get("spec_note"):  # "speculative: 212 of 290 draft tokens accepted (73%), 2.1 tokens per forward"
        parts.append(stats["spec_note"])
    mark = stop_mark(stats.get("stop_reason", ""), stats.get("stop_detail", ""))
    if mark:
        parts.append(mark)
    return " · ".join(parts)


def pin_line(stats: dict[str, Any], priority: bool = True) -> str:
    """'pinned · 12 tokens kept by Priority pinning' for a pinned message ('' otherwise). ``priority``: that is
    the eviction policy now; under another one nothing keeps a pinned message, and the line says so."""
    if not stats or not stats.get("pinned"):
        return ""
    tokens = stats.get("tokens")
    size = f" · {count(tokens)}" if tokens is not None else ""
    if priority:
        return f"pinned{size} kept by Priority pinning" if size else "pinned · kept by Priority pinning"
    return f"pinned{size} · kept once the eviction policy is Priority pinning (it is not now)"


def error_line(stats: dict[str, Any]) -> str:
    """'Error: <why the reply stopped>' for a reply an error ended (saved with it), else ''."""
    return f"Error: {stats['error']}" if stats and stats.get("error") else ""


def note_lines(stats: dict[str, Any]) -> list[str]:
    """What the engine told the user during the reply ("the oldest 120 tokens were dropped ...")."""
    return [str(n) for n in (stats or {}).get("notes", ())]


def cache_line(stats: dict[str, Any]) -> str:
    """'reused N tokens, computed M (K recomputed, J new)', with 'dropped D unread to fit the context' when the prompt
    did not fit (never computed: in neither count) and where reused tokens came from. The numbers are the prompt's
    cache account's (``stats["cache"]``), the ones the Why readout and the timing caption say."""
    if not stats or "reused_tokens" not in stats:
        return ""
    account = stats.get("cache")
    if account:
        c = counts_of(account)
    else:  # a reply saved before replies kept their account
        n, dropped = int(stats.get("recomputed_tokens") or 0), int(stats.get("dropped_tokens") or 0)
        c = Counts(int(stats.get("prompt_tokens") or 0), int(stats["reused_tokens"]), n, 0, n, dropped)
    shared = int(stats.get("shared_tokens") or 0)  # pages another chat computed (automatic prefix cache)
    disk = min(int(stats.get("disk_restored_tokens") or 0), shared)  # of them, read from the KV disk tier
    where = []
    if disk:
        where.append(f"{disk:,} restored from disk{disk_time(stats)}")
    if shared - disk:
        where.append(f"{shared - disk:,} from another chat's cache")
    dropped = f", dropped {c.dropped:,} unread to fit the context" if c.dropped else ""
    return f"reused {count(c.reused)}, {computed_words(c)}{dropped}" + ("; " + ", ".join(where) if where else "")


def disk_time(stats: dict[str, Any]) -> str:
    """' in 19 ms (computing them again: ~185 ms at this chat's prefill rate)' for tokens restored from the KV disk
    tier ('' for a reply saved before the footer kept the times)."""
    ms, again = float(stats.get("disk_ms") or 0.0), float(stats.get("disk_again_ms") or 0.0)
    if not ms:
        return ""
    by = "at this chat's prefill rate" if stats.get("disk_rate") == "chat" else "estimated"
    return f" in {ms:,.0f} ms" + (f" (computing them again: ~{again:,.0f} ms, {by})" if again else "")
