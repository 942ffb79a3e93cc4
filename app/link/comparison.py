"""A comparison whose rows are all timed warm, with its progress.

``engine.tools.compare.Comparison`` warms up only its first setting before timing the rows, so the first use of
a code path (contiguous buffers, int8 and int4 kernels, the no-cache path) landed in its row's time to
first token: 4 / 99 / 1448 / 1163 / 1192 ms for one 13-token prompt. ``WarmedComparison`` first runs a
one-token reply in every setting, each in a fresh session (so every row is measured the same way: warm),
then steps the comparison itself. Both phases run one model forward per ``step()``, so the chat's own
reply still goes on between them. The worker submits it to its engine core as a background task
(``engine.core.scheduler.Task``): every ``step()``, and so every step of its sessions, runs inside
``EngineCore.round``, alone (its timing its own).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable


class WarmedComparison:
    """Wraps a stepwise comparison (``step``, ``done``, ``cancel``, ``close``, ``cancelled``, ``rows``,
    ``settings``, ``greedy``); ``make_session(cfg)`` opens a fresh session of the loaded model."""

    def __init__(self, inner: Any, make_session: Callable[[Any], Any]) -> None:
        self.inner = inner
        self._make_session = make_session
        settings = getattr(inner, "settings", ())
        self._settings = list(settings) if isinstance(settings, (list, tuple)) else []
        self._greedy = getattr(inner, "greedy", None)
        self._warm_next = 0  # index of the next setting to warm up
        self._warm_session: Any = None
        self._steps_in_row = 0
        self._rows_seen = 0
        self._t_rows: float | None = None  # when the timed rows began

    @property
    def warming(self) -> bool:
        return self._warm_next < len(self._settings) and self._greedy is not None and not self.inner.cancelled

    @property
    def done(self) -> bool:
        return not self.warming and self._warm_session is None and self.inner.done

    @property
    def cancelled(self) -> bool:
        return self.inner.cancelled

    def cancel(self) -> None:
        self.inner.cancel()

    def close(self) -> None:
        self._close_warm()
        self.inner.close()

    def _close_warm(self) -> None:
        session, self._warm_session = self._warm_session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - a warm-up session is thrown away either way
                pass

    def step(self) -> Any:
        """One forward: of a warm-up reply while settings are left to warm, then of the comparison."""
        if self._warm_session is not None or self.warming:
            self._warm_step()
            return None
        if self._t_rows is None:
            self._t_rows = time.perf_counter()
        row = self.inner.step()
        self._steps_in_row += 1
        if row is not None:
            self._rows_seen += 1
            self._steps_in_row = 0
        return row

    def _warm_step(self) -> None:
        if self._warm_session is None:
            _label, cfg, *_spec = self._settings[self._warm_next]  # (label, cache[, speculation])
            self._warm_next += 1
            try:
                self._warm_session = self._make_session(cfg)
                self._warm_session.start(list(self.inner.messages), replace(self._greedy, max_new_tokens=1))
            except Exception:  # noqa: BLE001 - a setting that cannot start says so in its own row
                self._close_warm()
            return
        try:
            done = self._warm_session.step().done
        except Exception:  # noqa: BLE001 - likewise: its row reports the failure
            done = True
        if done:
            self._close_warm()

    def progress(self) -> tuple[float, float | None, str]:
        """(fraction done, seconds left or None while unknown, what runs now)."""
        n = max(len(self._settings), 1)
        if self.warming or self._warm_session is not None:
            return 0.0, None, f"warming up every setting ({self._warm_next} of {n})"
        per_row = max(getattr(self._greedy, "max_new_tokens", 1), 1) + 1
        fraction = min((self._rows_seen + min(self._steps_in_row / per_row, 0.99)) / n, 1.0)
        elapsed = time.perf_counter() - (self._t_rows or time.perf_counter())
        left = elapsed / fraction * (1.0 - fraction) if fraction > 0.02 else None
        label = self._settings[min(self._rows_seen, n - 1)][0] if self._settings else ""
        return fraction, left, f"timing {label} ({self._rows_seen + 1} of {n})"
