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
import traceback
from dataclasses import replace
from typing import Any, Callable

from app.ground.failure import Failure, log
from engine.config import SamplingConfig
from engine.core.scheduler import Task


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


class Comparisons:
    """The worker's comparison, one at a time, on its thread: a ``WarmedComparison`` stepped as a background task
    of the worker's core, its rows, progress and end sent through the worker's ``compared``,
    ``compare_progress`` and ``compare_finished`` (a failure through ``failed`` too)."""

    def __init__(self, worker: Any, backend: Any) -> None:
        self.worker, self.backend = worker, backend
        self.comparison: WarmedComparison | None = None
        self.comparison_id = 0
        self._progress_sent = 0.0  # when compare_progress was last sent (monotonic seconds)

    def start(self, comparison_id: int, messages: list[dict], sampling: SamplingConfig) -> None:
        """A new comparison of the chat's next reply (one still running is cancelled)."""
        w = self.worker
        self.close("cancelled")
        loaded = w.model
        if loaded is None or self.backend.make_comparison is None:
            reason = "no model is loaded" if loaded is None else "comparing is not available"
            w.compare_finished.emit(comparison_id, reason)
            return
        self.comparison_id = comparison_id
        try:
            inner = self.backend.make_comparison(loaded, messages, sampling)
            make = self.backend.make_session
            self.comparison = WarmedComparison(inner, lambda cfg: make(loaded, cfg))
        except BaseException as exc:  # noqa: BLE001 - one that cannot start says why (it sat at "Running…")
            log(exc)
            failure = Failure.from_exception(0, "compare", exc)
            w.failed.emit(failure)
            w.compare_finished.emit(comparison_id, failure.message)
            return
        # one step per round after the replies, alone: its rows time each setting by itself
        w.run_task(Task(self.comparison, self._on_step, self._fail))

    def cancel(self, comparison_id: int = 0) -> None:
        """Stop comparison ``comparison_id`` (0: whichever runs) after its current step; its rows so far stay."""
        if self.comparison is not None and comparison_id in (0, self.comparison_id):
            self.comparison.cancel()

    def _on_step(self, row: Any) -> None:
        comparison = self.comparison
        if comparison is None:
            return
        if row is not None:
            self.worker.compared.emit(self.comparison_id, row.as_dict() if hasattr(row, "as_dict") else dict(row))
        now = time.monotonic()
        if now - self._progress_sent > 0.25 or row is not None:  # a few times a second is enough for a bar
            self._progress_sent = now
            self.worker.compare_progress.emit(self.comparison_id, comparison.progress())
        if comparison.done:
            self.close("cancelled" if comparison.cancelled else "done")

    def _fail(self, exc: BaseException) -> None:
        log(exc)
        failure = Failure.from_exception(0, "compare", exc)
        self.worker.failed.emit(failure)
        self.close(failure.message)

    def close(self, reason: str) -> None:
        """End the comparison in flight (if any) with ``reason``, said with ``compare_finished``."""
        comparison, self.comparison = self.comparison, None
        if comparison is None:
            return
        self.worker.drop_task(comparison)
        try:
            comparison.close()
        except BaseException:  # noqa: BLE001 - closing frees memory; a failure there changes no result
            traceback.print_exc()
        self.worker.compare_finished.emit(self.comparison_id, reason)
