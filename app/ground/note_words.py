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

from app.ground.format import count
from app.ground.glossary import KV_DTYPES, OVERFLOWS, PARAMS, POLICIES, describe_cache
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


def _params_words(params: dict) -> str:
    """{budget: 260, recent: 32} → 'tokens kept per layer 260, recent tokens always kept 32'."""
    return ", ".join(f"{PARAMS[k][0].lower()} {v}" if k in PARAMS else f"{k} {v}" for k, v in params.items())


def policy_words(name: str, params: dict) -> str:
    """'h2o', {budget: 260, recent: 32} → 'Heavy hitters (H2O) (tokens kept per layer 260, recent …)'."""
    said = _params_words(params)
    return _policy_name(name) + (f" ({said})" if said else "")


def _policy_on(n: Note) -> str:
    """'Heavy hitters (H2O) on: tokens kept per layer 256, recent tokens always kept 64' (it read '… (H2O) (tokens
    kept per layer 256, …) on', the "on" left dangling after two brackets)."""
    said = _params_words(n.fields["params"])
    return f"{_policy_name(n.fields['policy'])} on" + (f": {said}" if said else "")


def _switch(n: Note) -> str:
    old, new = n.fields["old"], n.fields["new"]
    quantized = any(d != "auto" for c in (old, new) if c.mode == "paged" for d in (c.k_dtype, c.v_dtype))
    return f"{cache_words(old, quantized)} → {cache_words(new, quantized)}: {n.fields['rest']}"


_WORDS: dict[NoteKind, Callable[[Note], str]] = {
    NoteKind.CACHE_SWITCH: _switch,
    NoteKind.POLICY_ON: _policy_on,
    NoteKind.POLICY_EVICTED: lambda n: f"{policy_words(n.fields['policy'], n.fields['params'])}: {n.fields['rest']}",
    NoteKind.POLICY_SAYS: lambda n: f"{_policy_name(n.fields['policy'])}: {n.fields['rest']}",
    NoteKind.INT8_KEYS: lambda n: f"{KV_DTYPES['int8'].short} keys: {n.fields['rest']}",
}


SAID_ELSEWHERE = {NoteKind.DISK_RESTORED}  # good news the reply's cache line says (green), not a note (amber)


def reply_notes(notes: Any) -> list:
    """The engine's notes a reply shows as notes (amber): those not said in its other lines."""
    return [n for n in notes if not (isinstance(n, Note) and n.kind in SAID_ELSEWHERE)]


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


# -- re-prefill after a cache change (``engine.core.records.Reprefill``: live, or as saved with a reply: a dict) --
SHOW_AFTER_MS = 500.0  # a re-prefill expected (or found) to take longer than this is said in the reply's bubble


def _field(r: Any, name: str, default: Any = None) -> Any:
    return r.get(name, default) if isinstance(r, dict) else getattr(r, name, default)


def _config(c: Any) -> Any:
    """A setting as a ``CacheConfig`` (a saved reply holds it as a dict); None if it cannot be one."""
    from engine.config import CacheConfig

    if c is None or isinstance(c, CacheConfig):
        return c
    try:
        return CacheConfig(**{k: v for k, v in dict(c).items() if k in CacheConfig.__dataclass_fields__})
    except (TypeError, ValueError):
        return None


def reprefill_cause(r: Any) -> str:
    """Why the tokens are read again, in the controls' words: 'after switching to Heavy hitters (H2O)'."""
    old, new = _config(_field(r, "old")), _config(_field(r, "new"))
    if old is None or new is None:
        return "after the cache setting changed"
    if old.mode == "off" and new.mode != "off":
        return "after the cache was turned on"
    if old.policy != new.policy or old.policy_params != new.policy_params:
        if new.policy == "none":
            return f"after {POLICIES['none'].name} was chosen (the evicted tokens come back)"
        return f"after switching to {_policy_name(new.policy)}"
    return f"after switching to {cache_words(new, precision=True)}"


def _seconds(ms: float) -> str:
    return f"{ms / 1000.0:.1f} s" if ms >= 100 else f"{ms:.0f} ms"


def reprefill_shown(r: Any) -> bool:
    """Worth a line in the bubble: expected to take longer than ``SHOW_AFTER_MS``, or found to while it runs."""
    return _field(r, "estimate_ms", 0.0) > SHOW_AFTER_MS or _field(r, "ms", 0.0) > SHOW_AFTER_MS


def reprefill_progress(r: Any) -> str:
    """The bubble's line while it runs: 'Re-prefilling 916 tokens after switching to Heavy hitters (H2O): 312 of
    916 (34%), about 0.8 s left · Stop (Esc) cancels'."""
    tokens, done, ms = _field(r, "tokens", 0), _field(r, "done", 0), _field(r, "ms", 0.0)
    per_token = ms / done if done else _field(r, "estimate_ms", 0.0) / max(1, tokens)
    left = f", about {_seconds(per_token * (tokens - done))} left" if per_token > 0 else ""
    return (f"Re-prefilling {tokens:,} tokens {reprefill_cause(r)}: {done:,} of {tokens:,} "
            f"({100 * done // max(1, tokens)}%){left} · Stop (Esc) cancels")


def reprefill_footer(rs: Any) -> str:
    """The reply's footer part: 're-prefilled 916 tokens in 1.2 s after switching to Heavy hitters (H2O), not in
    TTFT' (one per change; '120 of 916' when the reply ended before they were all read)."""
    parts = []
    for r in rs or ():
        tokens, done = _field(r, "tokens", 0), _field(r, "done", 0)
        said = f"{done:,} of {count(tokens)}" if done < tokens else count(tokens)
        parts.append(f"re-prefilled {said} in {_seconds(_field(r, 'ms', 0.0))} {reprefill_cause(r)}")
    return "; ".join(parts) + (", not in TTFT" if parts else "")
