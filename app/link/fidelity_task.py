"""A fidelity check (``engine.tools.fidelity``) in the app: on the engine's thread, a background task of the worker's
engine core, so the window never waits for it and the chat's reply goes on beside it.

``FidelityControl`` lives on the worker's thread (a child of ``EngineWorker``, as the disk tier's control is). One
check at a time: a new one replaces one running, a new model ends it. Its signals carry the check's id, so rows of a
replaced check never land in a view::

    row(int, dict)               one setting measured (``FidelityRow.as_dict``; the reference's first)
    progress(int, tuple)         (fraction done, seconds left or None, what runs now), a few times a second
    finished(int, str, object)   "done" | "cancelled" | why it failed, and the report (``fidelity_report.report``)
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QObject, Signal, Slot

from app.ground.failure import Failure, log

LABEL_SUFFIX = " (your setting)"


class FidelityControl(QObject):
    """The worker's fidelity check. Slots run on the worker's thread (``EngineThread.call``)."""

    row = Signal(int, object)
    progress = Signal(int, object)
    finished = Signal(int, str, object)

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.worker = worker
        self.check: Any = None
        self.check_id = 0
        self._messages: list[dict] | None = None
        self._t0 = 0.0
        self._sent = 0.0

    @Slot(int, object, object, bool)
    def start(self, check_id: int, messages: list[dict], cfg: Any = None, grid: bool = False) -> None:
        """Check ``messages`` (the whole chat, its replies included): the cache setting ``cfg`` (None: the chats'
        own) against the full-precision keep-everything cache over the last turn; with ``grid``, every precision
        × policy too."""
        self.close("cancelled")
        w = self.worker
        loaded = w.model
        if loaded is None:
            self.finished.emit(check_id, "no model is loaded", None)
            return
        self.check_id = check_id
        try:
            from engine.core.scheduler import Task
            from engine.tools.fidelity import FidelityCheck, chat_text, describe, grid_settings

            cfg = cfg if cfg is not None else w.cache_config
            chat = chat_text(loaded, messages, scope="last-turn")
            settings = [(describe(cfg) + LABEL_SUFFIX, cfg)]
            if grid:  # the grid's point of the user's own setting is that one
                twin = (cfg.k_dtype, cfg.v_dtype, cfg.policy, cfg.policy_params)
                settings += [(label, c) for label, c in grid_settings(cfg, len(chat.ids))
                             if (c.k_dtype, c.v_dtype, c.policy, c.policy_params) != twin]
            self.check = FidelityCheck(loaded, chat, settings)
        except BaseException as exc:  # noqa: BLE001 - a chat that cannot be checked says why, once
            self._fail(exc)
            return
        self._messages, self._t0 = list(messages), time.perf_counter()
        w.run_task(Task(self.check, self._on_step, self._fail))

    @Slot(int)
    def cancel(self, check_id: int = 0) -> None:
        """Stop check ``check_id`` (0: whichever runs) after its current forward; its rows so far stay."""
        if self.check is not None and check_id in (0, self.check_id):
            self.check.cancel()

    def _on_step(self, row: Any) -> None:
        check = self.check
        if check is None:
            return
        if row is not None:
            self.row.emit(self.check_id, row.as_dict())
        now = time.monotonic()
        if now - self._sent > 0.25 or row is not None:
            self._sent = now
            self.progress.emit(self.check_id, check.progress())
        if check.done:
            self.close("cancelled" if check.cancelled else "done")

    def _fail(self, exc: BaseException) -> None:
        log(exc)
        failure = Failure.from_exception(0, "fidelity", exc)
        self.close(failure.message)

    def close(self, reason: str = "cancelled") -> None:
        """End the check in flight (if any) with ``reason``, its report so far sent with ``finished``."""
        check, self.check = self.check, None
        if check is None:
            return
        self.worker.drop_task(check)
        report = None
        try:
            check.close()
            from engine.tools.fidelity_report import report as make_report

            report = make_report(self.worker.model, check, self._messages, "last-turn",
                                 time.perf_counter() - self._t0)
        except BaseException as exc:  # noqa: BLE001 - a report that cannot be written is said, not raised
            log(exc)
            reason = reason if reason != "done" else f"the report could not be made: {exc}"
        self.finished.emit(self.check_id, reason, report)
