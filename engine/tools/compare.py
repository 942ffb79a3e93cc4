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
from engine.core.verify import SpecConfig

DEFAULT_SETTINGS: tuple[tuple, ...] = (
    ("paged (reference)", CacheConfig(mode="paged")),
    # the same cache, decoding with prompt lookup: identical tokens (greedy), its speed and tokens per forward
    ("paged, speculative (prompt lookup)", CacheConfig(mode="paged"), SpecConfig(method="ngram")),
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
    speculative: str = ""  # the drafter ("" without speculation)
    tokens_per_forward: float = 1.0
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "ttft_ms": self.ttft_ms, "decode_tokens_per_s": self.decode_tokens_per_s, "kv_bytes": self.kv_bytes,
                "same_tokens": self.same_tokens, "stop_reason": self.stop_reason, "error": self.error,
                "speculative": self.speculative, "tokens_per_forward": self.tokens_per_forward,
                "accepted_draft_tokens": self.accepted_draft_tokens, "draft_tokens": self.draft_tokens}


class Comparison:
    """A comparison run as steps, a background task of an engine core (``engine.core.scheduler.Task``: the app's
    worker and ``compare_settings`` submit it), so its steps interleave with other work and each runs alone, its
    timing its own: every ``step()`` — called by ``EngineCore.round`` — runs at most one ``ChatSession.step()``
    (one model forward).

    Order of work: one untimed warm-up reply of one token in the first setting (one-off costs must not land
    on the first row), then each setting in turn in a fresh session. ``step()`` returns the setting's
    ``ComparisonRow`` on the step that finished it, else None; ``done`` is True once every setting ran or
    ``cancel()`` took effect. A setting that fails with an engine error (say, cache off past the context)
    gives a row with ``error`` and the comparison goes on; any other exception closes the comparison and
    propagates. Opening a setting and its prefill run in the same step, so its TTFT is not stretched by
    whatever the caller does between steps. ``close()`` frees the session in flight (idempotent).
    """

    def __init__(self, lm, messages: Sequence[dict], sampling: SamplingConfig,
                 settings: Sequence[tuple] = DEFAULT_SETTINGS) -> None:
        """``settings``: (label, CacheConfig) or (label, CacheConfig, SpecConfig) each."""
        self.lm = lm
        self.messages = list(messages)
        self.greedy = replace(sampling, temperature=0.0)
        self.settings = tuple(settings)
        self.rows: list[ComparisonRow] = []
        self._reference: list[int] | None = None  # the first row's token ids
        self._next = 0  # index of the next setting to open
        self._warming = bool(self.settings)
        self._session = None  # the session in flight (warm-up or a setting)
        self._current: tuple[str, CacheConfig] | None = None
        self._stopped = False  # cancelled or closed: no further setting opens

    @property
    def cancelled(self) -> bool:
        """``cancel()`` (or ``close()``) was called: the rows stop short of every setting."""
        return self._stopped

    @property
    def done(self) -> bool:
        return self._session is None and (self._stopped or (not self._warming and self._next >= len(self.settings)))

    def cancel(self) -> None:
        """Stop after the current step: the setting in flight ends as ``cancelled`` (its row still comes)."""
        self._stopped = True
        if self._session is not None:
            self._session.cancel()

    def close(self) -> None:
        """Free the session in flight; no row comes for it."""
        self._stopped = True
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def step(self) -> ComparisonRow | None:
        """Run one step; the finished setting's row, or None."""
        if self.done:
            return None
        try:
            if self._session is None:
                row = self._open()
                if row is not None or self._session is None:
                    return row
            try:
                result = self._session.step()
            except (EngineError, ValueError) as e:
                return self._end(None, str(e))
            return self._end(result, "") if result.done else None
        except BaseException:
            self.close()
            raise

    def _open(self) -> ComparisonRow | None:
        """Start the warm-up or the next setting; a row when the setting cannot even start."""
        from engine.core.session import ChatSession

        if self._warming:
            label, cfg, spec = _setting(self.settings[0])
            sampling = replace(self.greedy, max_new_tokens=1)
        else:
            label, cfg, spec = _setting(self.settings[self._next])
            self._next += 1
            sampling = self.greedy
        self._current = (label, cfg)
        try:
            # cold, as its own chat would be: no pages from the prefix cache (the chat's own are named there)
            self._session = ChatSession(self.lm, cfg.replace(prefix_reuse=False))
            if spec is not None and spec.method == "ngram":  # a draft model is the chat's own to load
                self._session.speculate(spec)
            self._session.start(list(self.messages), sampling)
        except (EngineError, ValueError) as e:
            return self._end(None, str(e))
        return None

    def _end(self, result, error: str) -> ComparisonRow | None:
        """Close the session in flight and measure its row (none for the warm-up)."""
        session, self._session = self._session, None
        label, cfg = self._current
        try:
            if self._warming:
                self._warming = False  # a failing warm-up is reported by the first row
                return None
            if error:
                row = ComparisonRow(label, cfg, 0, 0, 0.0, 0.0, 0, 0, "error", error=error)
            else:
                ids = list(session.generated_ids)
                stats = result.stats
                if self._reference is None:
                    self._reference = ids
                ref = self._reference
                same = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
                row = ComparisonRow(label, cfg, stats.prompt_tokens, stats.generated_tokens, stats.ttft_ms,
                                    stats.decode_tokens_per_s, int(session.snapshot().kv_bytes), same,
                                    stats.stop_reason, speculative=stats.speculative,
                                    tokens_per_forward=round(stats.generated_tokens / max(1, stats.forwards), 3),
                                    accepted_draft_tokens=stats.accepted_draft_tokens,
                                    draft_tokens=stats.draft_tokens)
        finally:
            if session is not None:
                session.close()
        self.rows.append(row)
        return row


def _setting(entry: tuple) -> tuple[str, CacheConfig, SpecConfig | None]:
    label, cfg, *rest = entry
    return label, cfg, (rest[0] if rest else None)


def compare_settings(lm, messages: Sequence[dict], sampling: SamplingConfig,
                     settings: Sequence[tuple] = DEFAULT_SETTINGS,
                     on_row: Callable[[ComparisonRow], None] | None = None,
                     cancel: threading.Event | None = None) -> list[ComparisonRow]:
    """Generate the reply to ``messages`` once per setting (greedy: ``sampling`` with temperature 0).

    ``on_row`` receives each row as soon as it is measured; setting ``cancel`` stops after the current
    step (the rows so far are returned). A setting that fails (say, cache off past the context) gives a
    row with ``error`` and the comparison goes on. A :class:`Comparison` run as a task of a core of its own, as
    the app's worker runs it; an exception that ended it is raised.
    """
    from engine.core.scheduler import EngineCore, Task

    comparison, failed = Comparison(lm, messages, sampling, settings), []
    core = EngineCore(lm)
    core.add_task(Task(comparison, lambda row: on_row(row) if row is not None and on_row is not None else None,
                       failed.append))
    try:
        while core.busy:
            if cancel is not None and cancel.is_set():
                comparison.cancel()
            core.round()
            if failed:
                raise failed[0]
    finally:
        comparison.close()
    return comparison.rows
