"""The engine's notes in the app's words, and the notes only the app can give.

The engine writes its notes for logs and the CLI: cache settings as ``paged/4 K:int8 V:auto``, policies as
``h2o(budget=260, recent=32)``. The user set them with controls named "Paged", "8-bit (int8)", "Full precision",
"Heavy hitters (H2O)", so every note shown (under the cache controls, in the status bar, under a reply) is
rewritten in those names (``glossary``) before it is shown. StreamingLLM protects its attention sinks, not the
prompt: the engine's "smaller than the protected prompt" note is wrong for it and is said as what happens.

``precision_note`` says why 4-bit can hold as many bytes per token as 8-bit (stories260K: head dim 8, pages of 4
tokens), which the memory readouts otherwise show without a reason.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from app.shell.glossary import KV_DTYPES, PARAMS, POLICIES, describe_cache
from engine.kv.paged import sizes

_CACHE = r"paged/\d+(?: K:\w+ V:\w+)?|contiguous|off"
_SWITCH = re.compile(rf"^({_CACHE}) → ({_CACHE})(?=:)")
_CANNOT = re.compile(rf"^({_CACHE})(?= cannot hold)")
_ONE = re.compile(r"paged/(\d+)(?: K:(\w+) V:(\w+))?")
_POLICY_CALL = re.compile(r"\b(none|streaming|h2o|priority|overflow)\(([^)]*)\)")
_POLICY_LEAD = re.compile(r"^(none|streaming|h2o|priority|overflow): ")
_STREAMING_PROMPT = re.compile(r"^streaming: the budget \((\d+)\) is smaller than the protected prompt "
                               r"\(system \+ first message, (\d+) tokens\).*$")


def cache_words(desc: str, precision: bool = False) -> str:
    """'paged/4 K:int8 V:auto' → 'paged cache, 4-token pages, keys 8-bit' (the status bar's words);
    ``precision``: say 'full precision' too (a switch from or to a quantized cache names both sides')."""
    m = _ONE.fullmatch(desc)
    cfg = SimpleNamespace(mode=desc, page_size=0, k_dtype="auto", v_dtype="auto", policy="none")
    if m:
        cfg = SimpleNamespace(mode="paged", page_size=int(m[1]), k_dtype=m[2] or "auto", v_dtype=m[3] or "auto",
                              policy="none")
    words = describe_cache(cfg).replace(" · ", ", ")
    full = precision and desc != "off" and cfg.k_dtype == cfg.v_dtype == "auto"
    return words + (f", {KV_DTYPES['auto'].short}" if full else "")


def _policy_name(name: str) -> str:
    return POLICIES[name].name if name in POLICIES else "the overflow setting"


def _policy_words(m: re.Match) -> str:
    """'h2o(budget=260, recent=32)' → 'Heavy hitters (H2O): 260 tokens kept per layer, 32 recent tokens always
    kept'."""
    args = [a.split("=", 1) for a in m[2].split(", ") if "=" in a]
    said = ", ".join(f"{PARAMS[k][0].lower()} {v}" if k in PARAMS else f"{k} {v}" for k, v in args)
    return _policy_name(m[1]) + (f" ({said})" if said else "")


def _sinks(cfg: Any) -> int:
    from engine.policies.streaming import StreamingPolicy

    params = dict(getattr(cfg, "policy_params", None) or {})
    try:
        return StreamingPolicy.Params(**{k: v for k, v in params.items() if k in ("sinks", "window")}).sinks
    except (TypeError, ValueError):
        return StreamingPolicy.Params().sinks


def plain_note(note: str, cfg: Any = None) -> str:
    """``note`` in the controls' words (``cfg``: the cache setting in force, for StreamingLLM's sinks)."""
    m = _STREAMING_PROMPT.match(note)
    if m:
        return (f"{_policy_name('streaming')}: keeps the first {_sinks(cfg)} tokens (attention sinks) and the most "
                f"recent ones, {m[1]} in all; the rest of the prompt (system + first message, {m[2]} tokens) is "
                "dropped as the chat goes on")
    note = _SWITCH.sub(lambda s: " → ".join(cache_words(d, "K:" in s[0]) for d in (s[1], s[2])), note)
    note = _CANNOT.sub(lambda s: cache_words(s[1]), note)
    note = _POLICY_CALL.sub(_policy_words, note)
    note = _POLICY_LEAD.sub(lambda s: _policy_name(s[1]) + ": ", note)
    return re.sub(r"^int(8|4) keys:", lambda s: f"{KV_DTYPES['int' + s[1]].short} keys:", note)


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
