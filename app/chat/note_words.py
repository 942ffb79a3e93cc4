"""The engine's notes in the app's words, and the notes only the app can give.

The engine's notes are ``engine.core.vocab.Note``s: its own words for logs and the CLI (``paged/4 K:int8 V:auto``,
``h2o(budget=260, recent=32)``) with what each says as a kind and fields. The user set those things with
controls named "Paged", "8-bit (int8)", "Full precision", "Heavy hitters (H2O)", so every note shown (under the
cache controls, in the status bar, under a reply) is said here from its kind and fields in those names
(``glossary``) — never by reading the engine's text back. A note of a kind not listed is shown as written.

``precision_note`` says why 4-bit can hold as many bytes per token as 8-bit (stories260K: head dim 8, pages of 4
tokens), which the memory readouts otherwise show without a reason.
"""

from __future__ import annotations

from typing import Any, Callable

from app.shell.glossary import KV_DTYPES, OVERFLOWS, PARAMS, POLICIES, describe_cache
from engine.kv.paged import sizes
from engine.core.vocab import Note, NoteKind


def cache_words(cfg: Any, precision: bool = False) -> str:
    """A cache setting as the status bar says it ('paged cache, 4-token pages, keys 8-bit'), its policy left out
    (notes name it apart); ``precision``: say 'full precision' too (a switch from or to a quantized cache names
    both sides')."""
    words = describe_cache(cfg.replace(policy="none")).replace(" · ", ", ")
    full = precision and cfg.mode != "off" and cfg.k_dtype == cfg.v_dtype == "auto"
    return words + (f", {KV_DTYPES['auto'].short}" if full else "")


def _policy_name(name: str) -> str:
    """An eviction policy's name, or an overflow mode's (its evictions speak as it: "Drop the oldest …")."""
    term = POLICIES.get(name) or OVERFLOWS.get(name)
    return term.name if term else "the overflow setting"


def policy_words(name: str, params: dict) -> str:
    """'h2o', {budget: 260, recent: 32} → 'Heavy hitters (H2O) (tokens kept per layer 260, recent …)'."""
    said = ", ".join(f"{PARAMS[k][0].lower()} {v}" if k in PARAMS else f"{k} {v}" for k, v in params.items())
    return _policy_name(name) + (f" ({said})" if said else "")


def _switch(n: Note) -> str:
    old, new = n.fields["old"], n.fields["new"]
    quantized = any(d != "auto" for c in (old, new) if c.mode == "paged" for d in (c.k_dtype, c.v_dtype))
    return f"{cache_words(old, quantized)} → {cache_words(new, quantized)}: {n.fields['rest']}"


_WORDS: dict[NoteKind, Callable[[Note], str]] = {
    NoteKind.CACHE_SWITCH: _switch,
    NoteKind.POLICY_ON: lambda n: f"{policy_words(n.fields['policy'], n.fields['params'])} on",
    NoteKind.POLICY_EVICTED: lambda n: f"{policy_words(n.fields['policy'], n.fields['params'])}: {n.fields['rest']}",
    NoteKind.POLICY_SAYS: lambda n: f"{_policy_name(n.fields['policy'])}: {n.fields['rest']}",
    NoteKind.INT8_KEYS: lambda n: f"{KV_DTYPES['int8'].short} keys: {n.fields['rest']}",
}


def plain_note(note: str, cfg: Any = None) -> str:
    """``note`` in the controls' words (a plain string, or a kind said as written, as it is)."""
    words = _WORDS.get(note.kind) if isinstance(note, Note) else None
    return words(note) if words is not None else str(note)


def precision_note(cfg: Any, info: Any) -> str:
    """Why 4-bit holds no fewer bytes per token than 8-bit at this head dim and page size ("" when it does)."""
    if info is None or cfg.mode != "paged" or "int4" not in (cfg.k_dtype, cfg.v_dtype):
        return ""
    h, d, p = info.num_kv_heads, info.head_dim, cfg.page_size

    def per_token(kind: str) -> float:
        return sum(sizes.bytes_per_token(kind, role, h, d, p) for role in ("k", "v"))

    four, eight = per_token("int4"), per_token("int8")
    if four < eight:
        return ""
    keys4, keys8 = (sizes.bytes_per_token(k, "k", h, d, p) for k in ("int4", "int8"))
    smaller = next((q for q in (8, 16, 32, 64, 128, 256) if q > p and sum(
        sizes.bytes_per_token("int4", r, h, d, q) - sizes.bytes_per_token("int8", r, h, d, q) for r in "kv") < 0), 0)
    text = (f"4-bit holds {four / h:.0f} bytes per token per head here, {'as many as' if four == eight else 'more than'} "
            f"8-bit ({eight / h:.0f}): at head dim {d} with {p}-token pages, 4-bit keys keep a scale and a zero per "
            f"channel for each page, {keys4 / h:.0f} bytes per token against 8-bit's {keys8 / h:.0f}")
    return text + (f"; pages of {smaller} or more tokens make 4-bit the smaller" if smaller else "")
