"""Compare cache settings on one chat: the same next reply generated under each setting, side by side.

Each setting gets a fresh ``ChatSession`` of the already-loaded model (so every row pays its own prefill,
the way a new chat would) and the same greedy sampling, so the rows differ only by the cache: time to
first token, decode speed, KV bytes held at the end, and how many tokens stay identical to the first
row's reply (the reference; lossless settings match it exactly, lossy ones show where they diverge).
No other local-LLM chat app shows this on the user's own chat.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from engine.config import CacheConfig, SamplingConfig
from engine.errors import EngineError

DEFAULT_SETTINGS: tuple[tuple[str, CacheConfig], ...] = (
    ("paged (reference)", CacheConfig(mode="paged")),
    ("contiguous", CacheConfig(mode="contiguous")),
    ("paged, KV int8", CacheConfig(mode="paged", k_dtype="int8", v_dtype="int8")),
    ("paged, KV int4", CacheConfig(mode="paged", k_dtype="int4", v_dtype="int4")),
    ("cache off", CacheConfig(mode="off")),  # last: it recomputes the whole chat for every token
)


@dataclass(frozen=True)
class ComparisonRow:
    """One setting's reply to the same chat."""

    label: str
    config: CacheConfig
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float
    kv_bytes: int  # held at the end of the reply (codes + scales for quantized pages)
    same_tokens: int  # leading tokens identical to the reference row's reply
    stop_reason: str
    error: str = ""  # why this setting could not run (the other rows still do)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "ttft_ms": self.ttft_ms, "decode_tokens_per_s": self.decode_tokens_per_s, "kv_bytes": self.kv_bytes,
                "same_tokens": self.same_tokens, "stop_reason": self.stop_reason, "error": self.error}


def compare_settings(lm, messages: Sequence[dict], sampling: SamplingConfig,
                     settings: Sequence[tuple[str, CacheConfig]] = DEFAULT_SETTINGS,
                     on_row: Callable[[ComparisonRow], None] | None = None,
                     cancel: threading.Event | None = None) -> list[ComparisonRow]:
    """Generate the reply to ``messages`` once per setting (greedy: ``sampling`` with temperature 0).

    ``on_row`` receives each row as soon as it is measured; setting ``cancel`` stops after the current
    step (the rows so far are returned). A setting that fails (say, cache off past the context) gives a
    row with ``error`` and the comparison goes on.
    """
    from engine.session import ChatSession

    greedy = replace(sampling, temperature=0.0)
    rows: list[ComparisonRow] = []
    reference: list[int] | None = None
    if settings and not (cancel is not None and cancel.is_set()):
        _warm_up(lm, messages, greedy, settings[0][1])  # one-off costs must not land on the first row
    for label, cfg in settings:
        if cancel is not None and cancel.is_set():
            break
        session = None
        try:
            session = ChatSession(lm, cfg)
            stats = session.start(list(messages), greedy)
            result = session.step()
            while not result.done:
                if cancel is not None and cancel.is_set():
                    session.cancel()
                result = session.step()
            ids = list(session.generated_ids)
            stats = result.stats or stats
            snap = session.snapshot()
            if reference is None:
                reference = ids
            same = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))
            row = ComparisonRow(label, cfg, stats.prompt_tokens, stats.generated_tokens, stats.ttft_ms,
                                stats.decode_tokens_per_s, int(snap.kv_bytes), same, stats.stop_reason)
        except (EngineError, ValueError) as e:
            row = ComparisonRow(label, cfg, 0, 0, 0.0, 0.0, 0, 0, "error", error=str(e))
        finally:
            if session is not None:
                session.close()
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _warm_up(lm, messages: Sequence[dict], greedy: SamplingConfig, cfg: CacheConfig) -> None:
    """One untimed prefill + token in the first setting (kernels, allocator and page pool warmed)."""
    from engine.session import ChatSession

    session = None
    try:
        session = ChatSession(lm, cfg)
        session.start(list(messages), replace(greedy, max_new_tokens=1))
        while not session.step().done:
            pass
    except (EngineError, ValueError):
        pass  # the first row reports it
    finally:
        if session is not None:
            session.close()
